"""Sequence-length schedules (`seq_lens`), as a property and through what a trainer meets.

The stores' tokens are unique (document d's tokens are ids nobody else has), so what a batch
trains is known from the batch alone: the targets under its loss mask. With that, whatever
the schedule, batch-size schedule and resumes (on 1, 2 or 4 shards):

- a `bestfit` source trains every target exactly once per epoch across each change: when the
  last target of an epoch is trained, every target has been trained exactly that many times;
- no source trains a target twice in its first epoch (the `concat` and `bos_bestfit` sources
  are large enough not to finish one; they lose a partial row or crop at a change, as they
  do within an epoch, so their epochs' ends are not seen in the batches);
- the steps before each change are those of the run whose schedule ends before it (what a
  user who had not yet added the change trained), rows and all;
- `consumed` counts the targets trained; every batch is `[rows, the step's length]`.

A seeded subset of the property runs by default; FORGE_GRAIN_SLOW=1 runs many more.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SLOW
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge_grain import ConfigError, DataConfig, Pipeline, write_store

NAMES = ["a", "b", "c"]
STRATEGIES = {"a": "bestfit", "b": "concat", "c": "bos_bestfit"}
LENGTHS = [16, 24, 32, 48, 64]
STEPS = 90


def unique_store(path, n_docs, seed, first):
    """Documents of unique tokens (BOS first, then ids from `first` on); returns (path, end id)."""
    rng = np.random.default_rng(seed)
    docs, g = [], first
    for n in rng.integers(2, 160, n_docs).tolist():
        docs.append(np.concatenate([[0], np.arange(g, g + n - 1)]))
        g += n - 1
    return write_store(path, docs, vocab_size=1 << 24, bos_id=0, eos_id=1), g, np.array([d[-1] for d in docs])


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    base = tmp_path_factory.mktemp("seq_lens")
    out, first = {}, 2
    for k, n in enumerate(NAMES):  # the bestfit source runs through many epochs, the others not one
        path, end, ends = unique_store(base / n, 60 if k == 0 else 800, 40 + k, first)
        out[n] = (path, range(first, end), ends)
        first = end
    return out


def make_config(stores, seq_lens=None, batch_sizes=None, seq_len=None, weights=(0.6, 0.25, 0.15)) -> DataConfig:
    seq_len = seq_len or (seq_lens[-1][1] if seq_lens else 64)
    return DataConfig.from_dict(dict(
        sources=[dict(name=n, path=str(stores[n][0]), weight=w, strategy=STRATEGIES[n])
                 for n, w in zip(NAMES, weights)],
        seq_len=seq_len, global_batch_size=batch_sizes[-1][1] if batch_sizes else 8, seed=13, num_epochs=None, max_steps=STEPS,
        **({"seq_lens": seq_lens} if seq_lens else {}), **({"batch_sizes": batch_sizes} if batch_sizes else {})))


@st.composite
def schedules(draw):
    """A length schedule of 1-3 changes, a batch-size schedule or none, and resumes."""
    steps = sorted(draw(st.lists(st.integers(1, STEPS - 10), min_size=1, max_size=3, unique=True)))
    lengths = [draw(st.sampled_from(LENGTHS)) for _ in range(len(steps) + 1)]
    batch_sizes = draw(st.sampled_from([None, [[0, 4], [20, 8]], [[0, 8], [35, 16]]]))
    resumes = draw(st.lists(st.tuples(st.integers(1, STEPS - 1), st.sampled_from([1, 2, 4])), max_size=3))
    return [[0, lengths[0]], *([s, n] for s, n in zip(steps, lengths[1:]))], batch_sizes, resumes


class Trained:
    """Per source: how often each of its targets was trained, checked as rows come in order.
    `allowed`: the ids (as offsets from the first) that may be targets, for a source whose
    data marks its targets (tests/test_masks.py); an epoch ends when all of them trained."""

    def __init__(self, ids: range, ends: np.ndarray | None, exact: bool, allowed: np.ndarray | None = None):
        self.ids, self.exact = ids, exact
        self.last = None if ends is None else np.zeros(len(ids), np.bool_)  # the documents' last tokens
        if ends is not None:
            self.last[ends - ids.start] = True
        self.allowed = np.ones(len(ids), np.bool_) if allowed is None else allowed
        self.count = np.zeros(len(ids), np.int64)
        self.epoch = 0  # epochs completed: every target trained this many times at least
        self.total = 0

    def add(self, targets: np.ndarray, natural_stop: np.ndarray | None = None) -> None:
        i = targets - self.ids.start
        assert ((i >= 0) & (i < len(self.ids))).all(), "a target of another source"
        assert self.allowed[i].all(), "a token the data does not mark as a target was trained"
        if natural_stop is not None:
            assert np.array_equal(natural_stop, self.last[i]), "natural_stop where a document does not end, or not where it does"
        np.add.at(self.count, i, 1)
        self.total += len(i)
        assert self.count.max() <= self.epoch + 1, "a target trained twice in one epoch"
        if self.exact and self.count[self.allowed].min() > self.epoch:  # the epoch's last target: all trained alike
            assert self.count.max() == self.epoch + 1, "an epoch ended with targets trained twice"
            self.epoch += 1


def check_run(stores, seq_lens, batch_sizes, resumes):
    config = make_config(stores, seq_lens, batch_sizes)
    p = Pipeline(config, 0, 1, num_threads=0)
    trained = {n: Trained(stores[n][1], stores[n][2], STRATEGIES[n] == "bestfit") for n in NAMES}
    batches = train_all(p, seq_lens, [trained[n] for n in NAMES])
    assert {n: v["trained_tokens"] for n, v in p.consumed(STEPS).items()} == {n: t.total for n, t in trained.items()}
    assert trained["a"].epoch >= 1  # the oracle saw an epoch end
    for k in range(1, len(seq_lens)):  # the steps before each change: as the run without it trained them
        before = Pipeline(make_config(stores, seq_lens[:k] if k > 1 else None, batch_sizes, seq_lens[k - 1][1]),
                          0, 1, num_threads=0)
        for s in range(seq_lens[k][0]):
            assert all(np.array_equal(before.global_batch(s)[key], batches[s][key]) for key in batches[s])
    at_changes = [(start + d, shards) for start, _ in seq_lens[1:] for d, shards in ((-1, 4), (0, 2), (0, 4))]
    check_resumes(config, p, batches, [*resumes, *at_changes])  # plain and elastic resumes, at and across changes


def train_all(p, seq_lens, trained: list) -> list[dict]:
    """The run's global batches, each row's targets given to its source's `Trained` (by
    source id), each batch checked to be [rows, the step's length]."""
    batches = []
    for s in range(STEPS):
        b = p.global_batch(s)
        length = next(n for start, n in reversed(seq_lens) if start <= s)
        assert b["inputs"].shape == (p.batches.size(s), length)
        for row in range(len(b["inputs"])):
            mask = b["loss_mask"][row]
            trained[b["source_id"][row]].add(b["targets"][row][mask], b["natural_stop"][row][mask])
        batches.append(b)
    return batches


def check_resumes(config, p, batches: list, points) -> None:
    """A state of `p` at each (step, shards) of `points` resumes exactly on that many shards."""
    for step, shards in points:
        state = json.loads(json.dumps(p.state_at(step)))
        shard = step % shards
        q = Pipeline(config, shard, shards, num_threads=0, resume_from=state)
        for s in range(step, min(step + 3, STEPS)):
            n = p.batches.size(s) // shards
            assert np.array_equal(q.batch(s)["inputs"], batches[s]["inputs"][shard * n:(shard + 1) * n])


@settings(max_examples=150 if SLOW else 8, deadline=None, derandomize=not SLOW,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(plan=schedules())
def test_any_length_schedule_trains_each_target_once_per_epoch(three, plan):
    check_run(three, *plan)


@st.composite
def operations(draw):
    """1-4 operations at increasing steps: a change of length at resume (a new schedule from
    the state's step), a live mixture change, a change of the config's mixture at resume,
    skipping steps at resume, or a plain resume on 1, 2 or 4 shards."""
    ops, step = [], 0
    for _ in range(draw(st.integers(1, 4))):
        step += draw(st.integers(1, 15))
        kind = draw(st.sampled_from(["length", "length", "live", "mixture", "skip", "resume"]))
        later = draw(st.integers(step + 1, STEPS))
        lengths = [[0, draw(st.sampled_from(LENGTHS))]] + ([[later, draw(st.sampled_from(LENGTHS))]]
                                                           if draw(st.booleans()) else [])
        # (the concat and bos_bestfit sources kept light, so that they do not finish an epoch)
        weights = {"a": draw(st.sampled_from([1.0, 3.0])), **{n: draw(st.sampled_from([0.1, 0.2, 0.3])) for n in NAMES[1:]}}
        ops.append((kind, min(step, STEPS - 1), lengths if kind == "length" else weights, draw(st.sampled_from([1, 2, 4]))))
    return ops


def test_any_sequence_of_length_and_mixture_changes_and_resumes_trains_each_target_once(three):
    """Seeded sequences of changes of length at resume, live and at-resume mixture changes,
    skips and elastic resumes: the same checks as above (a run that skipped rows is not
    checked for whole epochs: it left targets out), and the steps before each change rebuilt
    as trained."""
    @settings(max_examples=100 if SLOW else 6, deadline=None, derandomize=not SLOW,
              suppress_health_check=[HealthCheck.too_slow])
    @given(ops=operations())
    def run(ops):
        lengths, weights = [[0, 32]], (0.6, 0.25, 0.15)
        config = make_config(three, lengths)
        p = Pipeline(config, 0, 1, num_threads=0)
        batches, skipped = [], False
        for kind, step, arg, shards in ops:
            step = min(step, p.num_steps - 1)
            batches += [p.global_batch(s) for s in range(len(batches), step)]
            state = json.loads(json.dumps(p.state_at(step)))
            if kind == "live":
                p = p.with_weights(arg, step)
            elif kind in ("length", "mixture"):
                lengths = arg if kind == "length" else lengths
                weights = tuple(arg.values()) if kind == "mixture" else weights
                config = make_config(three, lengths if len(lengths) > 1 else None, seq_len=lengths[-1][1],
                                     weights=weights)
                p = Pipeline(config, 0, 1, num_threads=0, resume_from=state, allow_seq_len_change=True,
                             allow_mixture_change=kind == "mixture")
            elif kind == "skip":
                p = Pipeline(config, 0, 1, num_threads=0, resume_from=state, skip_steps=shards)
                skipped = True
            else:
                shard = step % shards
                q = Pipeline(config, shard, shards, num_threads=0, resume_from=state)
                n = p.batches.size(step) // shards
                assert np.array_equal(q.batch(step)["inputs"], p.global_batch(step)["inputs"][shard * n:(shard + 1) * n])
                p = Pipeline(config, 0, 1, num_threads=0, resume_from=state)
            for s in range(step):  # the steps before: rebuilt as trained
                assert np.array_equal(p.global_batch(s)["inputs"], batches[s]["inputs"])
        batches += [p.global_batch(s) for s in range(len(batches), p.num_steps)]
        trained = {n: Trained(three[n][1], three[n][2], STRATEGIES[n] == "bestfit" and not skipped) for n in NAMES}
        if skipped:
            trained["a"].epoch = 10 ** 6  # (its epochs' ends are not seen with rows skipped)
        for b in batches:
            for row in range(len(b["inputs"])):
                mask = b["loss_mask"][row]
                trained[NAMES[b["source_id"][row]]].add(b["targets"][row][mask], b["natural_stop"][row][mask])
        assert {n: v["trained_tokens"] for n, v in p.consumed(p.num_steps).items()} == {
            n: t.total for n, t in trained.items()}

    run()


def test_rows_before_a_change_are_not_replanned_and_the_rest_is(three):
    """The mechanism each half of the property needs, shown apart: without the rest of the
    epoch, targets would be skipped; starting the epoch again would train them twice."""
    seq_lens = [[0, 32], [10, 48]]
    p = Pipeline(make_config(three, seq_lens), 0, 1, num_threads=0)
    a = p.mixture.datasets[0]
    a.get_batch(np.array([0]))
    changed = a.changes[1][0]
    pieces = a._pieces_to(changed + 1)
    assert [x.rest for x in pieces] == [False, True, False]
    assert pieces[1].start == changed and pieces[1].dataset.seq_len == 48
    assert pieces[2].base == pieces[2].dataset.num_rows  # the next epoch, whole, at the new length


def test_skip_steps_and_explain_follow_the_schedule(three):
    seq_lens = [[0, 24], [12, 48]]
    config = make_config(three, seq_lens)
    p = Pipeline(config, 0, 1, num_threads=0)
    state = p.state_at(20)
    q = Pipeline(config, 0, 1, num_threads=0, resume_from=state, skip_steps=5)
    for s in range(20, 40):  # after the change: step s trains what the run trained at s + 5
        assert np.array_equal(q.batch(s)["inputs"], p.batch(s + 5)["inputs"])
    early = Pipeline(config, 0, 1, num_threads=0, resume_from=p.state_at(6), skip_steps=3)
    assert early.batch(11)["inputs"].shape[1] == 24 and early.batch(12)["inputs"].shape[1] == 48
    for s in (3, 12, 13, 30):  # explain's documents are the batch's tokens, before and after the change
        b = p.global_batch(s)
        for row in p.explain(s):
            store = p.stores[NAMES.index(row["source"])]
            for seg in row["segments"]:
                lo, hi = seg["tokens"]
                got = b["inputs"][row["row"]][seg["slots"][0]:seg["slots"][1]]
                assert np.array_equal(got, store[seg["document"]][lo:hi])


def test_a_resumed_state_names_another_schedule(three):
    p = Pipeline(make_config(three, [[0, 24], [12, 48]]), 0, 1, num_threads=0)
    with pytest.raises(Exception, match="seq_lens"):
        Pipeline(make_config(three, [[0, 24], [14, 48]]), 0, 1, num_threads=0, resume_from=p.state_at(5))


def test_what_a_schedule_refuses_is_said(three, tmp_path):
    with pytest.raises(ConfigError, match="last length must be seq_len"):
        make_config(three, [[0, 16], [5, 32]], seq_len=64)
    with pytest.raises(ConfigError, match="first at step 0"):
        make_config(three, [[3, 16], [5, 64]])
    d = make_config(three, [[0, 16], [5, 64]]).to_dict()
    with pytest.raises(ConfigError, match="set max_steps and num_epochs = inf"):
        DataConfig.from_dict({**d, "num_epochs": 1})
    d["sources"][0]["stride"] = 8
    with pytest.raises(ConfigError, match=r"sources \['a'\] are streaming or set a stride"):
        DataConfig.from_dict(d)
    config = make_config(three, [[0, 16], [5, 64]])
    p = Pipeline(config, 0, 1, num_threads=0)
    with pytest.raises(ConfigError, match=r"skip_documents\['a'\]: document 60 is not in"):
        Pipeline(config, 0, 1, num_threads=0, resume_from=p.state_at(3), skip_documents={"a": [60]})


def test_skipped_documents_stay_out_across_changes(three):
    """Documents skipped before a change are in no row after the skip, at any length: the rows
    holding them are found in each piece's own plan (the rows go, with the other documents
    they hold, as without a schedule). No target is trained twice in the sources' first
    epoch; `consumed` counts what was trained; the skipped run resumes elastically."""
    seq_lens = [[0, 24], [12, 48], [40, 32]]
    config = make_config(three, seq_lens)
    p = Pipeline(config, 0, 1, num_threads=0)
    skip = {"a": [3, 7], "c": [11]}
    stores = p.stores
    gone = {n: np.concatenate([stores[NAMES.index(n)][d][1:] for d in docs]) for n, docs in skip.items()}
    q = Pipeline(config, 0, 1, num_threads=0, resume_from=p.state_at(8), skip_documents=skip)
    trained = {n: Trained(three[n][1], three[n][2], False) for n in NAMES[1:]}
    trained["a"] = Trained(three["a"][1], three["a"][2], False)
    trained["a"].epoch = 10 ** 6  # it runs through several epochs: their ends are not seen with rows skipped
    for s in range(q.num_steps):  # (fewer: the skipped rows are not made up)
        b = (p if s < 8 else q).global_batch(s)
        assert b["inputs"].shape[1] == next(n for start, n in reversed(seq_lens) if start <= s)
        for row in range(len(b["inputs"])):
            name = NAMES[b["source_id"][row]]
            if s >= 8 and name in gone:
                assert not np.isin(b["inputs"][row], gone[name]).any(), f"a skipped document at step {s}"
            mask = b["loss_mask"][row]
            trained[name].add(b["targets"][row][mask], b["natural_stop"][row][mask])
    assert {n: v["trained_tokens"] for n, v in q.consumed(q.num_steps).items()} == {
        n: t.total for n, t in trained.items()}
    state = json.loads(json.dumps(q.state_at(30)))
    r = Pipeline(config, 1, 2, num_threads=0, resume_from=state)
    assert np.array_equal(r.batch(45)["inputs"], q.global_batch(45)["inputs"][4:])


def test_plan_reports_the_lengths_and_the_tokens(three, tmp_path, capsys):
    from forge_grain.cli import main

    config = make_config(three, [[0, 16], [10, 64]], [[0, 4], [5, 8]])
    p = Pipeline(config, 0, 1, num_threads=0)
    d = p.describe(20)
    assert d["seq_lens"] == [[0, 16], [10, 64]]
    assert d["tokens"] == 5 * 4 * 16 + 5 * 8 * 16 + 10 * 8 * 64
    assert d["tokens"] == sum(p.global_batch(s)["inputs"].size for s in range(20))
    toml = tmp_path / "data.toml"
    sources = "".join(f'[[sources]]\nname = "{n}"\npath = "{three[n][0]}"\nstrategy = "{STRATEGIES[n]}"\n'
                      for n in NAMES)
    toml.write_text(f"seq_len = 64\nseq_lens = [[0, 16], [10, 64]]\nglobal_batch_size = 8\nnum_epochs = inf\n"
                    f"max_steps = 20\n{sources}")
    assert main(["plan", str(toml)]) == 0
    total = 10 * 8 * 16 + 10 * 8 * 64
    assert f"sequence lengths (tokens a row; each change plans the rest of the epoch at the new length): 16 from " \
           f"step 0, 64 from step 10; {total:,} tokens in all" in capsys.readouterr().out


@pytest.mark.parametrize("workers", [0, 2])
def test_the_torch_loader_changes_length_in_its_workers(three, workers):
    torch = pytest.importorskip("torch")
    from forge_grain.bridges.torch import GrainIterableDataset

    config = make_config(three, [[0, 16], [7, 48]])
    ds = GrainIterableDataset(config, rank=0, world_size=1)
    want = Pipeline(config, 0, 1, num_threads=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    for batch, s in zip(loader, range(14)):
        assert int(batch["step"]) == s
        assert torch.equal(batch["inputs"], torch.from_numpy(want.batch(s)["inputs"]).long())


def test_a_change_at_resume_is_the_schedule_with_that_change(three):
    """A run at 32 resumed at step 20 with seq_len 64 trains what `seq_lens = [[0, 32], [20, 64]]`
    trains; without allow_seq_len_change the state is refused with what to pass; the changed
    run's own states resume it, elastically too."""
    first = make_config(three, seq_len=32)
    p = Pipeline(first, 0, 1, num_threads=0)
    state = json.loads(json.dumps(p.state_at(20)))
    longer = make_config(three, seq_len=64)
    with pytest.raises(Exception, match="allow_seq_len_change=True"):
        Pipeline(longer, 0, 1, num_threads=0, resume_from=state)
    q = Pipeline(longer, 0, 1, num_threads=0, resume_from=state, allow_seq_len_change=True)
    want = Pipeline(make_config(three, [[0, 32], [20, 64]]), 0, 1, num_threads=0)
    for s in (0, 19, 20, 21, 60, STEPS - 1):
        assert np.array_equal(q.global_batch(s)["inputs"], want.global_batch(s)["inputs"])
    assert q.consumed(STEPS) == want.consumed(STEPS)
    later = json.loads(json.dumps(q.state_at(40)))
    assert later["config"]["seq_len_history"] == [{"until_step": 20, "seq_lens": [[0, 32]]}]
    r = Pipeline(longer, 1, 2, num_threads=0, resume_from=later)  # a plain resume: no flag needed
    assert np.array_equal(r.batch(40)["inputs"], want.global_batch(40)["inputs"][4:])
    back = Pipeline(first, 0, 1, num_threads=0, resume_from=later, allow_seq_len_change=True)
    assert back.batch(45)["inputs"].shape == (8, 32) and back.batch(39)["inputs"].shape == (8, 64)


def test_the_rest_of_an_epoch_is_planned_once_and_cached(three, tmp_path, monkeypatch):
    """DataLoader workers and ranks reaching a change together plan its rest once: the plan
    lands in the plan cache (not beside the data), and a later process reads it from there."""
    from forge_grain.packing import lengths

    config = make_config(three, [[0, 24], [10, 48]])
    first = Pipeline(config, 0, 1, num_threads=0, cache_dir=tmp_path / "cache").global_batch(30)
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "cache").glob("rest-*")) == ["48"] * 3  # one a source
    assert not any(p.name.startswith("rest-") for s in NAMES for p in three[s][0].rglob("*"))

    def planned_again(*args, **kwargs):
        raise AssertionError("the rest of the epoch was planned again")
    monkeypatch.setattr(lengths, "rest_plan", planned_again)
    again = Pipeline(config, 0, 1, num_threads=0, cache_dir=tmp_path / "cache").global_batch(30)
    assert all(np.array_equal(first[k], again[k]) for k in first)


def test_a_change_inside_an_epoch_of_an_order_fitted_to_a_cache_trains_each_target_once(three, tmp_path):
    """Under an order fitted to a bounded cache (`shuffle_bytes`, as a `cache_limit` sets it)
    the rest of an epoch after a change is planned by the order's chunks and read a window of
    chunks at a time, as the epoch was (`packing.rest`): every target is still trained exactly
    once per epoch across the changes, and a resume at and across each is exact. A Megatron
    file (written by Megatron's own writer) of the bestfit source's documents: its chunks are
    blocks of whole documents, several to a window."""
    from test_formats import write_megatron

    from forge_grain import TokenStore

    path, ids, ends = three["a"]
    store = TokenStore.open(path)
    (tmp_path / "m").mkdir()
    write_megatron(tmp_path / "m" / "a", [store[i] for i in range(len(store))], dtype=np.uint16)
    for seq_lens in ([[0, 24], [7, 48]], [[0, 48], [30, 16], [33, 64]]):
        config = DataConfig.from_dict(dict(
            sources=[dict(name="a", path=str(tmp_path / "m"), strategy="bestfit", shuffle_bytes=2000)],
            seq_len=seq_lens[-1][1], global_batch_size=8, seed=13, num_epochs=None, max_steps=STEPS, seq_lens=seq_lens))
        p = Pipeline(config, 0, 1, num_threads=0)
        d = p.mixture.datasets[0]
        rest = [piece for piece in d._pieces_to(8 * STEPS) if piece.rest]
        assert d.base.fitted.window >= 2 and rest and all(r.dataset.shuffle_window == d.base.fitted.window for r in rest)
        trained = Trained(ids, ends, True)
        batches = train_all(p, seq_lens, [trained])
        assert trained.epoch >= 1  # (the oracle saw an epoch end)
        check_resumes(config, p, batches, [(start + delta, n) for start, _ in seq_lens[1:]
                                           for delta, n in ((-1, 4), (0, 2), (1, 4))])


def test_the_jax_iterator_changes_length_on_the_devices(three):
    jax = pytest.importorskip("jax")
    from forge_grain.bridges.jax import JaxIterator

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    p = Pipeline(make_config(three, [[0, 16], [5, 32]]), 0, 1, num_threads=0)
    it = JaxIterator(p, sharding, prefetch=3)
    for s in range(9):
        b = next(it)
        assert int(b["step"]) == s and b["inputs"].shape == (8, 16 if s < 5 else 32)
        assert np.array_equal(np.asarray(b["inputs"]), p.global_batch(s)["inputs"])
    it.close()


def test_explain_and_plan_with_a_state_follow_a_change_at_resume(three, tmp_path, capsys):
    """A run changed from 32 to 64 at resume: `explain --state` names the rows as trained
    (the rest of the epoch at 64), `plan --state` lists both lengths."""
    from forge_grain.cli import main

    toml = tmp_path / "run.toml"
    toml.write_text("seq_len = 64\nglobal_batch_size = 8\nseed = 13\nnum_epochs = inf\nmax_steps = 90\n" + "".join(
        f'[[sources]]\nname = "{n}"\npath = "{three[n][0]}"\nweight = {w}\nstrategy = "{STRATEGIES[n]}"\n'
        for n, w in zip(NAMES, (0.6, 0.25, 0.15))))
    at_32 = make_config(three, seq_len=32)
    changed = Pipeline(DataConfig.from_toml(toml), 0, 1, num_threads=0, allow_seq_len_change=True,
                       resume_from=Pipeline(at_32, 0, 1, num_threads=0).state_at(10))
    (tmp_path / "state.json").write_text(json.dumps(changed.state_at(12)))
    for step in (5, 11):
        assert main(["explain", str(toml), "--state", str(tmp_path / "state.json"), "--step", str(step), "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(changed.explain(step), default=int))
    assert main(["plan", str(toml), "--state", str(tmp_path / "state.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_lens"] == [[0, 32], [10, 64]]


def test_a_fork_while_a_thread_plans_the_rest_waits_for_it(three, tmp_path, monkeypatch):
    """A DataLoader worker forked while a prefetch thread plans the rest of an epoch: the fork
    waits for the planning, and the child reads on (it inherited no lock held by a thread it
    does not have)."""
    import os
    import threading
    import time

    from multiproc import wait_forked

    from forge_grain.packing import lengths

    real, started = lengths.rest_plan, threading.Event()

    def slow(*args, **kwargs):
        started.set()
        time.sleep(1.0)
        return real(*args, **kwargs)
    monkeypatch.setattr(lengths, "rest_plan", slow)
    p = Pipeline(make_config(three, [[0, 24], [10, 48]]), 0, 1, num_threads=0, cache_dir=tmp_path)
    planning = threading.Thread(target=p.global_batch, args=(30,))
    planning.start()
    assert started.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: a batch past the change
        try:
            p.global_batch(31)
        finally:
            os._exit(0)
    code = wait_forked(pid)
    planning.join()
    assert code is not None, "the forked child hung on the planning lock"


def test_replay_plan_and_plot_across_a_length_change(three, tmp_path, capsys):
    """`replay` over steps on both sides of a change writes every row (flat, with the rows and the
    length of each step), the pipeline's batches exactly; `plan`'s first line gives the lengths the
    run trains, not only the last; `plan --plot` marks the change. (replay ended in "internal
    error: ValueError: all input arrays must have the same shape"; plan said "x 64 tokens".)"""
    from forge_grain.cli import main
    from forge_grain.pipeline.plot import changes

    sources = "".join(f'[[sources]]\nname = "{n}"\npath = "{three[n][0]}"\nstrategy = "{STRATEGIES[n]}"\n'
                      for n in NAMES)
    toml = tmp_path / "data.toml"
    toml.write_text(f"seq_len = 64\nseq_lens = [[0, 16], [10, 64]]\nglobal_batch_size = 8\nnum_epochs = inf\n"
                    f"max_steps = 20\n{sources}")
    p = Pipeline(DataConfig.from_toml(toml), 0, 1, num_threads=0)
    assert main(["replay", str(toml), "--steps", "8:12", "--out", str(tmp_path / "r.npz")]) == 0
    got = np.load(tmp_path / "r.npz")
    assert got["seq_len_per_step"].tolist() == [16, 16, 64, 64] and got["rows_per_step"].tolist() == [8] * 4
    at = 0
    for k, step in enumerate(range(8, 12)):
        want = p.batch(step)
        n = got["rows_per_step"][k] * got["seq_len_per_step"][k]
        for key in ("inputs", "targets", "segment_ids", "loss_mask"):
            assert np.array_equal(got[key][at : at + n].reshape(want[key].shape), want[key]), (step, key)
        at += n
    assert at == len(got["inputs"])
    assert main(["plan", str(toml), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "20 steps of 8 rows x 16 to 64 tokens (below) (up to 512 tokens a step;" in out
    assert (tmp_path / "p.png").stat().st_size > 0
    assert (10, "seq_len 64", ":") in changes(p.describe())
