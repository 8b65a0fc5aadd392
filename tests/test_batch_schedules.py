"""Batch-size schedules: a schedule only regroups the row sequence. The same rows are
trained in the same order on any shard count, across resumes where the size changes, and
across a change of batch size at resume followed by mixture changes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SLOW, config, store, write_toml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge_grain import ConfigError, DataConfig, Pipeline, StateError
from forge_grain.pipeline.batches import BatchSchedule, ramp_segments

KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "source_id")
SCHEDULE = [[0, 4], [3, 8], [6, 16]]  # R(s): 0 4 8 12 20 28 36 52 68 ...


def sources(stores, strategy):
    return [dict(name="web", path=str(stores["web"]), weight=0.6, strategy=strategy),
            dict(name="code", path=str(stores["code"]), weight=0.4, strategy=strategy)]


def concat(batches: list[dict]) -> dict:
    return {k: np.concatenate([b[k] for b in batches]) for k in KEYS}


def global_batches(cfg, shards: int, steps: range, **kw) -> list[dict]:
    """Each global batch, joined from the batches every shard makes."""
    parts = [Pipeline(cfg, k, shards, num_threads=0, **kw) for k in range(shards)]
    return [concat([p.batch(s) for p in parts]) for s in steps]


@pytest.mark.parametrize("strategy", ["bestfit", "bos_bestfit", "concat"])
@pytest.mark.parametrize("shards", [1, 2, 4])
def test_scheduled_batches_concatenate_to_the_unscheduled_row_sequence(stores, strategy, shards):
    """Phases stay at steps: the scheduled run changes the mix at its step 7, row R(7) = 52;
    the unscheduled reference, at a fixed batch of 4, at its step 13, the same row."""
    phase = lambda step: [dict(start_step=step, weights={"web": 0.1, "code": 0.9})]  # noqa: E731
    scheduled = config(stores, sources=sources(stores, strategy), batch_sizes=SCHEDULE, global_batch_size=16,
                       phases=phase(7), num_epochs=None)
    plain = config(stores, sources=sources(stores, strategy), global_batch_size=4, phases=phase(13), num_epochs=None)
    got = global_batches(scheduled, shards, range(12))
    assert [len(b["inputs"]) for b in got] == [4, 4, 4, 8, 8, 8] + [16] * 6
    reference = Pipeline(plain, 0, 1, num_threads=0)
    rows = sum(len(b["inputs"]) for b in got)
    expected = concat([reference.batch(s) for s in range(rows // 4)])
    whole = concat(got)
    for k in KEYS:
        assert np.array_equal(whole[k], expected[k]), k
    # and the phase took effect at the scheduled step, as phase_at says
    p = Pipeline(scheduled, 0, 1, num_threads=0)
    assert p.phase_at(6)["start_step"] == 0 and p.phase_at(7)["start_step"] == 7


def test_four_shards_and_a_resume_where_the_size_changes_continue_the_same_rows(stores):
    cfg = config(stores, batch_sizes=[[0, 4], [3, 8], [5, 16]], global_batch_size=16, num_epochs=None)
    one = global_batches(cfg, 1, range(9))
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(one, global_batches(cfg, 4, range(9))) for k in KEYS)
    # a state saved on 2 shards at step 3 (where the size doubles) and at step 5 resumes on 4 and on 1
    for at in (3, 5):
        state = Pipeline(cfg, 1, 2, num_threads=0).state_at(at)
        parts = [Pipeline(cfg, k, 4, num_threads=0) for k in range(4)]
        its = [p.iterator(state) for p in parts]
        resumed = [concat([next(it) for it in its]) for _ in range(9 - at)]
        for a, b in zip(resumed, one[at:]):
            assert all(np.array_equal(a[k], b[k]) for k in KEYS)


def test_a_ramp_in_tokens_grows_to_the_full_batch_after_its_share_of_tokens(stores, tmp_path):
    toml = write_toml(tmp_path / "ramp.toml", stores, extra="batch_ramp = { start = 2, increment = 2, tokens = 6400 }")
    cfg = DataConfig.from_toml(toml)
    segments = cfg.batch_schedule()
    # 6400 tokens of 64 = 100 rows over the sizes 2, 4, 6: each trains at least its third (33.3 rows)
    assert [b for _, b in segments] == [2, 4, 6, 8]
    sched = BatchSchedule(segments)
    for k, (start, size) in enumerate(segments[:-1]):
        assert sched.row(segments[k + 1][0]) >= (k + 1) * 100 / 3 > sched.row(segments[k + 1][0] - 1)
    p = Pipeline(cfg, 0, 2, num_threads=0)
    assert [len(p.batch(s)["inputs"]) for s in (0, segments[1][0], segments[3][0])] == [1, 2, 4]
    # num_epochs under a schedule: every step whose rows fit in num_epochs x the rows
    assert p.batches.row(p.num_steps) <= 2 * p.rows_per_epoch < p.batches.row(p.num_steps + 1)
    assert ramp_segments(3072, 3072, 469 * 10**9, 15360, 4096)[-1][1] == 15360


def test_schedules_that_cannot_work_are_refused_by_name(stores):
    with pytest.raises(ConfigError, match=r"batch size 6 at step 4 must divide evenly among 4 shards"):
        Pipeline(config(stores, batch_sizes=[[0, 4], [4, 6], [8, 8]]), 0, 4, num_threads=0)
    with pytest.raises(ConfigError, match=r"last size must be global_batch_size \(8\)"):
        config(stores, batch_sizes=[[0, 4], [4, 16]])
    with pytest.raises(ConfigError, match=r"batch_sizes\[0\].*first at step 0"):
        config(stores, batch_sizes=[[2, 4], [4, 8]])
    with pytest.raises(ConfigError, match=r"increment 4 must reach global_batch_size 8"):
        config(stores, batch_ramp=dict(start=2, increment=4, tokens=1000))
    with pytest.raises(ConfigError, match="not both"):
        config(stores, batch_ramp=dict(start=2, increment=2, tokens=1000), batch_sizes=[[0, 4], [4, 8]])
    with pytest.raises(ConfigError, match="local_size"):
        Pipeline(config(stores, batch_sizes=[[0, 4], [4, 8]]), 0, 1, num_threads=0).local_batch_size


def test_a_ramp_resumes_on_more_shards_once_its_sizes_divide_among_them(stores):
    """Elastic as without a schedule: a state resumes on any shard count dividing every size
    from its step on, though the ramp's first sizes do not divide among that many."""
    cfg = config(stores, batch_sizes=[[0, 4], [3, 8], [6, 16]], global_batch_size=16, num_epochs=None)
    with pytest.raises(ConfigError, match=r"batch size 4 at step 0 must divide evenly among 8 shards"):
        Pipeline(cfg, 0, 8, num_threads=0)
    one = Pipeline(cfg, 0, 1, num_threads=0)
    for at, shards in ((3, 8), (6, 16)):
        state = one.state_at(at)
        parts = [Pipeline(cfg, k, shards, num_threads=0, resume_from=state) for k in range(shards)]
        its = [p.iterator(state) for p in parts]
        for s in range(at, at + 4):
            joined = concat([next(it) for it in its])
            assert all(np.array_equal(joined[k], one.global_batch(s)[k]) for k in KEYS), (at, s)
    late = Pipeline(cfg, 0, 8, num_threads=0, resume_from=one.state_at(3))
    with pytest.raises(StateError, match=r"batch size 4 at step 2 does not divide among 8 shards"):
        late.iterator(one.state_at(2))


def test_changing_the_batch_size_at_resume_continues_the_row_sequence(stores):
    cfg = config(stores, num_epochs=None)
    a = Pipeline(cfg, 0, 1, num_threads=0)
    uninterrupted = concat([a.batch(s) for s in range(12)])  # 96 rows
    state = a.state_at(4)  # 32 rows trained
    bigger = config(stores, num_epochs=None, global_batch_size=16)
    with pytest.raises(StateError, match="allow_batch_size_change=True"):
        Pipeline(bigger, 0, 1, num_threads=0, resume_from=state, allow_mixture_change=True)
    with pytest.raises(StateError, match="global_batch_size"):  # strict resume names what differs
        Pipeline(bigger, 0, 1, num_threads=0, resume_from=state).iterator(state)
    b = Pipeline(bigger, 0, 2, num_threads=0, resume_from=state, allow_batch_size_change=True)
    c = Pipeline(bigger, 1, 2, num_threads=0, resume_from=state, allow_batch_size_change=True)
    assert b.batches.to_list() == [[0, 8], [4, 16]]
    it_b, it_c = b.iterator(state), c.iterator(state)
    after = concat([concat([next(it_b), next(it_c)]) for _ in range(4)])  # 64 rows after the first 32
    for k in KEYS:
        assert np.array_equal(after[k], uninterrupted[k][32:96]), k
    # the steps before the change are rebuilt as trained, and the change travels in later states
    assert all(np.array_equal(b.global_batch(s)["inputs"], a.global_batch(s)["inputs"]) for s in range(4))
    later = b.state_at(6)
    assert later["config"]["batch_history"] == [{"until_step": 4, "batches": [[0, 8]]}]
    again = Pipeline(bigger, 0, 1, num_threads=0, resume_from=later)
    assert np.array_equal(again.iterator(later).__next__()["inputs"], uninterrupted["inputs"][64:80])
    assert again.consumed(6) == b.consumed(6)


def test_torch_bridge_length_and_batches_follow_the_schedule(stores):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from forge_grain.bridges.torch import GrainIterableDataset

    cfg = config(stores, batch_sizes=[[0, 4], [3, 8]], max_steps=7)
    ds = GrainIterableDataset(cfg, rank=1, world_size=2)
    assert len(ds) == 7
    for workers in (0, 2):
        got = list(DataLoader(GrainIterableDataset(cfg, rank=1, world_size=2), batch_size=None, num_workers=workers))
        assert [len(b["inputs"]) for b in got] == [2, 2, 2, 4, 4, 4, 4]
        p = Pipeline(cfg, 1, 2, num_threads=0)
        for b in got:
            assert torch.equal(b["inputs"], torch.from_numpy(p.batch(int(b["step"]))["inputs"]).long())
    with pytest.raises(ValueError, match="rows=False"):
        GrainIterableDataset(cfg, rank=0, world_size=1, rows=True)


def test_jax_global_arrays_follow_the_schedule_across_two_processes(tmp_path, stores):
    from multiproc import run_jax_processes

    toml = write_toml(tmp_path / "data.toml", stores, extra="batch_sizes = [[0, 4], [2, 8]]")
    run_jax_processes(Path(__file__).parent / "scripts" / "jax_global.py", toml, 4, tmp_path / "global.npz")
    got = np.load(tmp_path / "global.npz")
    whole = Pipeline(DataConfig.from_toml(toml), 0, 1, num_threads=0)
    for step in range(4):
        assert got[f"inputs_{step}"].shape == (whole.batches.size(step), 64)
        assert np.array_equal(got[f"inputs_{step}"], whole.global_batch(step)["inputs"]), step


def test_plan_preview_shows_the_schedule(stores, tmp_path):
    toml = write_toml(tmp_path / "data.toml", stores, extra="batch_sizes = [[0, 4], [3, 8]]")
    out = subprocess.run([sys.executable, "-m", "forge_grain", "plan", str(toml)], capture_output=True, text=True,
                         check=True).stdout
    assert "batch sizes (rows a step): 4 from step 0, 8 from step 3" in out
    p = Pipeline(DataConfig.from_toml(toml), 0, 1, num_threads=0)
    d = p.describe()
    assert d["tokens"] == p.batches.row(d["steps"]) * 64 and d["batch_sizes"] == [[0, 4], [3, 8]]


# -- streaming ----------------------------------------------------------------------------


def streaming_config(files, canonical, sizes):
    src = dict(name="web", hf_dataset="json", hf_data_files=files, hf_streaming=True, window=60, strategy="bestfit")
    return DataConfig(sources=[src], seq_len=48, global_batch_size=sizes[-1][1], seed=5, num_epochs=1,
                      canonical_streams=canonical, batch_sizes=sizes)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    from conftest import make_texts, write_jsonl

    d = tmp_path_factory.mktemp("sched-stream")
    texts = make_texts(600, seed=3)
    return [str(write_jsonl(d / "a.jsonl", texts[:300])), str(write_jsonl(d / "b.jsonl", texts[300:]))]


def test_streaming_batches_under_a_schedule_do_not_depend_on_the_shard_count(tmp_path, jsonl):
    cfg = streaming_config(jsonl, 2, [[0, 2], [4, 4]])
    one = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path)
    n = one.num_steps
    whole = [one.batch(s) for s in range(n)]
    assert [len(b["inputs"]) for b in whole[:6]] == [2, 2, 2, 2, 4, 4]
    parts = [Pipeline(cfg, k, 2, num_threads=0, cache_dir=tmp_path) for k in range(2)]
    for s in range(n):
        joined = concat([p.batch(s) for p in parts])
        assert all(np.array_equal(joined[k], whole[s][k]) for k in KEYS), s
    # exact resume from a 2-shard state on 1 shard, in the middle of the larger batches
    from forge_grain import merge_states

    a = [Pipeline(cfg, k, 2, num_threads=0, cache_dir=tmp_path) for k in range(2)]
    for s in range(6):
        for p in a:
            p.batch(s)
    state = merge_states([p.state_at(6) for p in a])
    resumed = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path).iterator(state)
    for s in range(6, n):
        b = next(resumed)
        assert all(np.array_equal(b[k], whole[s][k]) for k in KEYS), s
    # no canonical stream ran out before the counted steps' end: a single pass, no row twice
    rows = np.concatenate([b["inputs"] for b in whole])
    assert len({r.tobytes() for r in rows}) == len(rows)


def test_a_canonical_layout_that_does_not_divide_every_size_is_refused_naming_one_that_does(tmp_path, jsonl):
    with pytest.raises(ConfigError, match=r"every batch size \[4, 6\].*canonical_streams = 2"):
        Pipeline(streaming_config(jsonl, 4, [[0, 4], [3, 6]]), 0, 1, num_threads=0, cache_dir=tmp_path)


# -- batch-size edits among mixture changes, as a property ----------------------------------

NAMES = ["s0", "s1", "s2", "s3"]


@pytest.fixture(scope="module")
def four_stores(tmp_path_factory):
    base = tmp_path_factory.mktemp("batchedits")
    return {n: store(base / n, 20 + 15 * k, 30 + k) for k, n in enumerate(NAMES)}


def edit_config(stores, mix, batches) -> DataConfig:
    return DataConfig.from_dict(dict(
        sources=[dict(name=n, path=str(stores[n]), weight=w) for n, w in mix],
        seq_len=32, global_batch_size=batches[-1][1], batch_sizes=batches if len(batches) > 1 else None,
        seed=11, num_epochs=None))


sizes = st.sampled_from([4, 8, 16])
weight = st.sampled_from([0.25, 1.0, 3.0])


@st.composite
def edits(draw):
    """A first config, then 2-4 resumes, each changing the batch sizes, the mixture or both (or
    neither: a plain resume), at a later step, on a shard count dividing the sizes."""
    def schedule():
        if draw(st.booleans()):
            return [[0, draw(sizes)]]
        first, later = draw(sizes), draw(sizes)
        return [[0, first], [draw(st.integers(1, 6)), later]] if first != later else [[0, first]]

    mix = [(n, draw(weight)) for n in draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))]
    plan, step, batches = [(0, mix, schedule(), 1)], 0, None
    for _ in range(draw(st.integers(2, 4))):
        kind = draw(st.sampled_from(["batch", "mixture", "both", "plain"]))
        batches = schedule() if kind in ("batch", "both") else plan[-1][2]
        if kind in ("mixture", "both"):
            mix = [(n, draw(weight)) for n in draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3,
                                                            unique=True))]
        step += draw(st.integers(1, 8))
        plan.append((step, mix, batches, draw(st.sampled_from([1, 2, 4]))))
    return plan


def locate(p, steps):
    return [[(p.source_names[i], int(r)) for i, r in zip(*p.mixture.locate(p.global_rows(s)))] for s in steps]


@settings(max_examples=500 if SLOW else 40, deadline=None, derandomize=not SLOW,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(plan=edits())
def test_batch_size_and_mixture_changes_at_resume_repeat_and_skip_no_row(four_stores, plan):
    _, mix, batches, _ = plan[0]
    p = Pipeline(edit_config(four_stores, mix, batches), 0, 1, num_threads=0)
    trained: list[list[tuple[str, int]]] = []
    sizes_trained: list[int] = []
    for until, mix, batches, shards in plan[1:]:
        trained += locate(p, range(len(trained), until))
        sizes_trained += [p.batches.size(s) for s in range(len(sizes_trained), until)]
        state = p.state_at(until)
        shard = int(np.random.default_rng(until).integers(shards))
        p = Pipeline(edit_config(four_stores, mix, batches), shard, shards, num_threads=0, resume_from=state,
                     allow_mixture_change=True, allow_batch_size_change=True)
        assert locate(p, range(until)) == trained  # the steps before are rebuilt as trained
        assert [p.batches.size(s) for s in range(until)] == sizes_trained
        # this shard's batch is its slice of the global rows
        batch = p.batch(until)
        assert len(batch["inputs"]) == p.batches.size(until) // shards
    trained += locate(p, range(len(trained), len(trained) + 6))
    by_source: dict[str, list[int]] = {}
    for name, rank in (r for step in trained for r in step):
        by_source.setdefault(name, []).append(rank)
    for name, ranks in by_source.items():
        assert ranks == list(range(len(ranks))), name  # each source's rows once, in order
    for step in (len(trained) // 2, len(trained)):
        counted: dict[str, int] = {}
        for name, _ in (r for s in trained[:step] for r in s):
            counted[name] = counted.get(name, 0) + 1
        assert {n: c["rows"] for n, c in p.consumed(step).items() if c["rows"]} == counted


def test_skipping_steps_under_a_schedule_skips_exactly_those_steps_rows(stores):
    """skip_steps=2 at step 3 leaves out the rows of steps 3 and 4 (R(3) = 12 to R(5) = 28); the
    run goes on in its own sizes from the row after them."""
    cfg = config(stores, batch_sizes=SCHEDULE, global_batch_size=16, num_epochs=None)
    a = Pipeline(cfg, 0, 1, num_threads=0)
    uninterrupted = concat([a.batch(s) for s in range(10)])
    b = Pipeline(cfg, 0, 2, num_threads=0, resume_from=a.state_at(3), skip_steps=2)
    c = Pipeline(cfg, 1, 2, num_threads=0, resume_from=a.state_at(3), skip_steps=2)
    got = concat([concat([b.batch(s), c.batch(s)]) for s in range(3, 8)])  # sizes 8 8 8 16 16: 56 rows
    for k in KEYS:
        assert np.array_equal(got[k], uninterrupted[k][28:84]), k
    assert b.phase_at(3)["start_step"] == 0 and b.consumed(3) == a.consumed(3)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_the_prefetch_hints_blocks_of_steps_read_the_rows_each_step_reads(stores, shards):
    """The hints look rows up a block of steps at a time (`shard_rows_between`): the same rows
    as step by step, inside a segment of the schedule and across its changes, and with skipped
    steps (where it goes step by step)."""
    cfg = config(stores, batch_sizes=SCHEDULE, global_batch_size=16, num_epochs=None)
    plain = Pipeline(cfg, shards - 1, shards, num_threads=0)
    skipped = Pipeline(cfg, shards - 1, shards, num_threads=0, resume_from=plain.state_at(3), skip_steps=2)
    for p in (plain, skipped):
        o = p.order
        assert o.shard_rows_between(4, 4) == []
        for a, b in [(0, 1), (0, 3), (2, 5), (3, 6), (6, 22), (1, 17)]:
            got = o.shard_rows_between(a, b)
            assert len(got) == b - a
            for s, rows in zip(range(a, b), got):
                assert rows.dtype == np.int64 and np.array_equal(rows, o.shard_rows(s)), (a, b, s)
    assert not skipped.order.rowmap.empty and plain.order.rowmap.empty


def test_grain_worker_processes_follow_the_schedule(stores):
    """Worker processes rebuild the pipeline from its config: the schedule comes with it."""
    cfg = config(stores, batch_sizes=SCHEDULE, global_batch_size=16, max_steps=8)
    ref = Pipeline(cfg, 1, 2, num_threads=0)
    got = list(Pipeline(cfg, 1, 2, worker_count=2))
    assert [len(b["inputs"]) for b in got] == [2, 2, 2, 4, 4, 4, 8, 8]
    assert all(np.array_equal(b[k], ref.batch(s)[k]) for s, b in enumerate(got) for k in KEYS)
    # and after a batch-size change at resume (the workers rebuild it from the state and the flag)
    state = ref.state_at(4)
    bigger = config(stores, global_batch_size=32, max_steps=8)
    changed = Pipeline(bigger, 1, 2, num_threads=0, resume_from=state, allow_batch_size_change=True)
    workers = Pipeline(bigger, 1, 2, worker_count=2, resume_from=state, allow_batch_size_change=True)
    got = list(workers.iterator(state))
    assert [len(b["inputs"]) for b in got] == [16] * 4
    assert all(np.array_equal(b["inputs"], changed.batch(4 + i)["inputs"]) for i, b in enumerate(got))
