"""The pipeline: config, mixing and phases, sharding, exact and elastic resume (Orbax, JAX)."""

from __future__ import annotations

import hashlib
import re
import pickle
import subprocess
import sys
from pathlib import Path

import grain
import numpy as np
import pytest
from conftest import TOKENIZER, config, store, write_toml
from multiproc import run_jax_processes

from forge_grain import ConfigError, DataConfig, Pipeline, StateError, mix, pack, write_store

SCRIPTS = Path(__file__).parent / "scripts"
def collect(it, n):
    return [next(it) for _ in range(n)]


def same(a, b, keys=("inputs", "targets", "segment_ids", "loss_mask", "source_id")):
    return all(np.array_equal(a[k], b[k]) for k in keys)


# -- config -----------------------------------------------------------------------------------


def test_toml_flat_and_under_a_data_table(tmp_path, stores):
    flat = DataConfig.from_toml(write_toml(tmp_path / "flat.toml", stores))
    nested = tmp_path / "nested.toml"
    nested.write_text("[data]\n" + (tmp_path / "flat.toml").read_text().replace("[[sources]]", "[[data.sources]]")
                      .replace("[[phases]]", "[[data.phases]]"))
    assert DataConfig.from_toml(nested) == flat
    assert flat.sources[1].strategy == "bestfit" and flat.phases[0].weights == {"web": 0.2, "code": 0.8}
    assert flat.schedule() == [(0, [0.6, 0.4]), (5, [0.2, 0.8])]


def test_temperature_flattens_the_weights(stores):
    cfg = config(stores, mix_temperature=2.0)
    w = np.sqrt([0.6, 0.3, 0.1])
    assert np.allclose(cfg.schedule()[0][1], w / w.sum())


def test_anneal_shortcut_is_a_phase(stores):
    cfg = config(stores, anneal_start_step=20, anneal_weights={"code": 1.0})
    assert cfg.schedule()[-1] == (20, [0.0, 1.0, 0.0])


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(seqlen=5), r"unknown key\(s\) \['seqlen'\]"),
        (dict(sources=[dict(name="a", path="x", weight=-1)]), r"sources\[0\]\.weight: must be a finite number >= 0"),
        (dict(sources=[dict(name="a", path="x", weight=0), dict(name="b", path="y", weight=0)]), "weights are all zero"),
        (dict(sources=[dict(name="a", path="x", wieght=1)]), r"sources\[0\]: unknown key\(s\) \['wieght'\]"),
        (dict(sources=[dict(name="a", path="x", strategy="firstfit")]), r"sources\[0\]\.strategy"),
        (dict(phases=[dict(start_step=5, weights={"nope": 1})]), r"phases\[0\]\.weights: unknown source 'nope'"),
        (dict(phases=[dict(start_step=9, weights={"web": 1}), dict(start_step=5, weights={"web": 1})]),
         r"phases\[1\]\.start_step: .*increasing order"),
        (dict(phases=[dict(start_step=5, weights={"web": 0})]), r"phases\[0\]\.weights: the weights are all zero"),
        (dict(global_batch_size=0), "global_batch_size: must be a positive integer"),
        (dict(seq_len="64"), "seq_len: must be a positive integer"),
        (dict(mix_temperature=0), "mix_temperature: must be positive"),
        (dict(anneal_start_step=3), "anneal_start_step and anneal_weights"),
    ],
)
def test_invalid_configs_name_the_key(stores, change, message):
    with pytest.raises(ConfigError, match=message):
        config(stores, **change)


def test_missing_required_key_and_bad_toml(tmp_path):
    (tmp_path / "a.toml").write_text("seq_len = 8\nglobal_batch_size = 2\n")
    with pytest.raises(ConfigError, match=r"a\.toml: missing required key 'sources'"):
        DataConfig.from_toml(tmp_path / "a.toml")
    (tmp_path / "b.toml").write_text("seq_len = = 8\n")
    with pytest.raises(ConfigError, match=r"b\.toml: not valid TOML"):
        DataConfig.from_toml(tmp_path / "b.toml")


def test_sources_with_different_tokenizers_are_refused(tmp_path, stores):
    other = store(tmp_path / "other", 50, 4, tokenizer={**TOKENIZER, "sha256": "b" * 64})
    cfg = config(stores, sources=[dict(name="web", path=str(stores["web"])), dict(name="other", path=str(other))])
    with pytest.raises(ConfigError, match=r"'web'.*'other'.*tokenized differently"):
        Pipeline(cfg, 0, 1)
    bigger = store(tmp_path / "bigger", 50, 4, vocab=5000, tokenizer={**TOKENIZER, "vocab_size": 5000})
    cfg = config(stores, sources=[dict(name="web", path=str(stores["web"])), dict(name="big", path=str(bigger))])
    with pytest.raises(ConfigError, match="vocab_size 1000 vs 5000"):
        Pipeline(cfg, 0, 1)


# -- mixing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 2, 3, 7, 100])
def test_mixture_shares_track_weights_over_every_window(tmp_path, stores, m):
    ds = pack(stores["web"], 64, "bestfit", num_epochs=None, cache_dir=tmp_path / "c")
    rng = np.random.default_rng(m)
    w = rng.dirichlet(np.ones(m))
    mixture = mix([ds] * m, w)
    n = 20_000
    src, _ = mixture.locate(np.arange(n))
    depth = int(np.ceil(np.log2(m))) if m > 1 else 0
    onehot = np.zeros((n + 1, m))
    onehot[np.arange(1, n + 1), src] = 1
    cum = onehot.cumsum(0)  # cum[h, i]: rows of source i among the first h
    # every prefix is within the tree depth of exact (1e-9: float error of the check itself)
    assert np.abs(cum - np.arange(n + 1)[:, None] * w / w.sum()).max() <= depth + 1e-9
    # hence every window of n rows is within 2 depth rows of its weight
    for size in (50, 1000):
        window = cum[size:] - cum[:-size]
        assert np.abs(window - size * w / w.sum()).max() <= 2 * depth + 1e-9
    assert np.array_equal(mixture.counts(n), cum[n])


@pytest.mark.parametrize("weights", [[1 / 3, 2 / 3], [0.6, 0.4], [0.1, 0.2, 0.3, 0.4], [1e-3, 0.5, 0.25, 7.0, 1.0]])
def test_mixture_counts_hold_the_configured_weights_at_any_length(tmp_path, stores, weights):
    """Against the weights as configured (exact rationals), at up to 2^42 rows: no drift."""
    from fractions import Fraction

    ds = pack(stores["web"], 64, "bestfit", num_epochs=None, cache_dir=tmp_path / "c")
    mixture = mix([ds] * len(weights), weights)
    depth = int(np.ceil(np.log2(len(weights))))
    exact = [Fraction(w) / sum(map(Fraction, weights)) for w in weights]
    for n in (3 * 10**7, 2**30 + 12345, 2**36 + 1, 2**42 - 7):
        counts = mixture.counts(n)
        assert sum(counts) == n
        assert max(abs(c - n * e) for c, e in zip(counts.tolist(), exact)) <= depth, n
    # and the closed-form counts are what locating every row gives, at a far offset
    start = 2**40
    src, rank = mixture.locate(np.arange(start, start + 5000))
    before = mixture.counts(start)
    for i in range(len(weights)):
        mine = rank[src == i]
        assert np.array_equal(mine, before[i] + np.arange(len(mine)))  # each source's rows, in order, none skipped


def test_each_source_row_is_used_once_in_order_across_phases(tmp_path, stores):
    ds = pack(stores["web"], 64, "bestfit", num_epochs=None, cache_dir=tmp_path / "c")
    mixture = mix([ds, ds, ds], [0.5, 0.3, 0.2], phases=[(1000, [0, 1, 1]), (2500, [1, 0, 0])])
    src, rank = mixture.locate(np.arange(4000))
    for i in range(3):
        assert np.array_equal(rank[src == i], np.arange((src == i).sum()))  # no source row skipped or repeated
    assert set(src[1000:2500]) == {1, 2} and set(src[2500:]) == {0}


def test_phase_switch_takes_effect_exactly_at_its_step(stores):
    cfg = config(stores, phases=[dict(start_step=6, weights={"math": 1.0})])
    p = Pipeline(cfg, 0, 1, num_threads=0)
    it = iter(p)
    batches = collect(it, 8)
    assert all((b["source_id"] != 2).any() for b in batches[:6])
    assert all((b["source_id"] == 2).all() for b in batches[6:])


def test_hundred_sources_construct_and_iterate(tmp_path, stores):
    srcs = [dict(name=f"s{i}", path=str(stores[("web", "code", "math")[i % 3]]), weight=1 + i % 5) for i in range(100)]
    p = Pipeline(config(stores, sources=srcs, global_batch_size=200), 0, 1, num_threads=0)
    assert p.batch(3)["inputs"].shape == (200, 64)
    ids = np.concatenate([p.batch(s)["source_id"] for s in range(10)])
    w = np.array([1 + i % 5 for i in range(100)]) / 300
    assert np.abs(np.bincount(ids, minlength=100) - 2000 * w).max() <= 8  # tree depth 7, + 1 for rounding


# -- batches, sharding, iteration -------------------------------------------------------------


def test_num_steps_is_exact_and_batches_have_the_row_format(stores):
    p = Pipeline(config(stores, num_epochs=1), 0, 1)
    batches = list(iter(p))
    assert len(batches) == p.num_steps == p.rows_per_epoch // 8
    b = batches[0]
    assert b["inputs"].shape == (8, 64) and b["source_id"].shape == (8,) and int(b["step"]) == 0
    stats = p.batch_stats(b)
    assert sum(stats["tokens_per_source"].values()) == int(b["loss_mask"].sum())
    assert 0.9 < stats["fill"] <= 1 and stats["documents_per_row"] >= 1


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_shards_concatenate_to_the_global_batch(stores, shards):
    cfg = config(stores)
    whole = Pipeline(cfg, 0, 1, num_threads=0)
    parts = [Pipeline(cfg, k, shards, num_threads=0) for k in range(shards)]
    for step in (0, 3, 17):
        g = whole.global_batch(step)
        got = {k: np.concatenate([p.batch(step)[k] for p in parts]) for k in g if k != "step"}
        assert same(g, got)


def test_batch_size_must_divide_among_shards(stores):
    with pytest.raises(ConfigError, match="must divide evenly among 3 shards"):
        Pipeline(config(stores), 0, 3)


def test_threads_processes_and_inline_give_the_same_batches(stores):
    cfg = config(stores)
    ref = collect(iter(Pipeline(cfg, 0, 1, num_threads=0)), 12)
    for kw in (dict(num_threads=3, prefetch=5), dict(worker_count=2)):
        it = iter(Pipeline(cfg, 0, 1, **kw))
        got = collect(it, 12)
        it.close()
        assert all(same(a, b) for a, b in zip(ref, got)), kw


@pytest.mark.parametrize("cores", [1, 2, 16])
def test_batches_are_made_in_the_consumers_thread_by_default_on_any_cores(stores, monkeypatch, cores):
    """No batch threads by default, however many cores the process may use: making a batch
    mostly holds the GIL, so threads only hand batches across it to a consumer that does not
    release it (on 16 idle cores an epoch from object storage read flat out ran 0.72-0.89x as
    fast with the 2 threads that were the default there). A number given is kept; None, the
    default of earlier versions, is none."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert Pipeline(config(stores), 0, 1).num_threads == 0
    assert Pipeline(config(stores), 0, 1, num_threads=None).num_threads == 0  # (the old default's spelling)
    assert Pipeline(config(stores), 0, 1, num_threads=3).num_threads == 3


def test_the_cores_a_process_may_use_are_its_affinity_not_the_machines():
    """A process pinned to one core (as `taskset` or a scheduler pins it) counts one."""
    code = "import os; os.sched_setaffinity(0, {0}); from forge_grain.processes import usable_cores; print(usable_cores())"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == ["1"]


def test_grain_checkpoint_assertion_passes(stores):
    p = Pipeline(config(stores, num_epochs=0.3), 0, 1, num_threads=2)
    assert 0 < p.num_steps < 30
    grain.experimental.assert_equal_output_after_checkpoint(p)


def test_state_is_small_json_and_restores_in_place(stores):
    import json

    p = Pipeline(config(stores), 0, 1)
    it = iter(p)
    collect(it, 5)
    state = it.get_state()
    assert state["step"] == 5 and len(json.dumps(state)) < 4096
    expected = collect(it, 3)
    it.set_state(state)
    assert all(same(a, b) for a, b in zip(expected, collect(it, 3)))


def test_state_from_another_config_is_refused(stores):
    state = iter(Pipeline(config(stores), 0, 1)).get_state()
    for change in (dict(seed=8), dict(seq_len=32), dict(global_batch_size=16)):
        with pytest.raises(StateError, match="another config"):
            iter(Pipeline(config(stores, **change), 0, 1)).set_state(state)
    with pytest.raises(StateError, match="not a forge-grain pipeline state"):
        iter(Pipeline(config(stores), 0, 1)).set_state({"next_index": 3})


def test_state_from_changed_data_is_refused(tmp_path, stores):
    web2 = store(tmp_path / "web2", 400, 9)
    state = iter(Pipeline(config(stores), 0, 1)).get_state()
    changed = {**stores, "web": web2}
    with pytest.raises(StateError, match=rf"source 'web' \({web2}\): the data is not what the state was saved with"):
        iter(Pipeline(config(changed), 0, 1)).set_state(state)


# -- elastic resume in fresh processes, through Orbax ------------------------------------------


def run(*args, env=None):
    r = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def test_exact_and_elastic_resume_through_orbax(tmp_path, stores):
    cfg_path = write_toml(tmp_path / "data.toml", stores)
    cfg = DataConfig.from_toml(cfg_path)
    k, after = 4, 6
    reference = Pipeline(cfg, 0, 1, num_threads=0)
    expected = [reference.global_batch(s) for s in range(k, k + after)]  # crosses the phase switch at step 5
    run(SCRIPTS / "resume_worker.py", "save", cfg_path, tmp_path / "ckpt", 2, k, 0)
    for shards, workers in ((2, 0), (1, 0), (4, 0), (2, 2)):
        out = tmp_path / f"restored-{shards}-{workers}.npz"
        run(SCRIPTS / "resume_worker.py", "restore", cfg_path, tmp_path / "ckpt", shards, after, workers, out)
        got = np.load(out)
        for i, e in enumerate(expected):
            for key in ("inputs", "targets", "loss_mask", "source_id"):
                assert np.array_equal(got[f"{key}_{i}"], e[key]), (shards, workers, i, key)


def test_multiprocess_jax_shards_union_to_the_global_batch(tmp_path, stores):
    pytest.importorskip("jax")
    cfg_path = write_toml(tmp_path / "data.toml", stores)
    run_jax_processes(SCRIPTS / "jax_shard.py", cfg_path, 5, tmp_path / "jax{}.npz")
    parts = [np.load(tmp_path / f"jax{i}.npz") for i in range(2)]
    assert [int(p["shard"]) for p in parts] == [0, 1]
    whole = Pipeline(DataConfig.from_toml(cfg_path), 0, 1, num_threads=0)
    for step in range(5):
        union = np.concatenate([p[f"inputs_{step}"] for p in parts])
        assert np.array_equal(union, whole.global_batch(step)["inputs"])


def test_batches_still_held_are_never_overwritten_by_reused_buffers(stores):
    import torch

    p = Pipeline(config(stores), 0, 1, num_threads=2, prefetch=3)
    it = iter(p)
    held = next(it)
    as_tensor = torch.from_numpy(next(it)["inputs"])  # only a tensor keeps this batch's memory
    expected_held, expected_tensor = p.batch(0)["inputs"].copy(), p.batch(1)["inputs"].copy()
    for _ in range(20):  # far more batches than the pool has blocks
        next(it)
    assert np.array_equal(held["inputs"], expected_held)
    assert np.array_equal(as_tensor.numpy(), expected_tensor)


# -- the stream is pinned ----------------------------------------------------------------------


def pinned_config(tmp_path):
    """Two sources whose documents come from integer arithmetic alone (no random generator)."""
    paths = {}
    for k, (name, n) in enumerate((("a", 3000), ("b", 300))):  # a: > 4096 rows (Feistel); b: fewer (exact)
        docs = [np.array([0] + [(i * 31 + j * 17 + k) % 997 + 2 for j in range((i * 7919 + k) % 97)] + [1], np.uint16)
                for i in range(n)]
        paths[name] = write_store(tmp_path / name, docs, vocab_size=1000, bos_id=0, eos_id=1, tokenizer=TOKENIZER)
    return DataConfig(sources=[{"name": "a", "path": str(paths["a"]), "weight": 0.7},
                               {"name": "b", "path": str(paths["b"]), "strategy": "bos_bestfit", "weight": 0.3}],
                      seq_len=32, global_batch_size=8, seed=1234, num_epochs=None)


PINNED = {0: "cd6f7e39a9399e2e", 1: "f11453f50e9d4760", 57: "45d0f9f85dfa6dbb"}  # recorded 2026-11-22
# its states' fingerprint, recorded before batch-size schedules: states saved then still resume
PINNED_FINGERPRINT = "5312bbad61d3832b3989e367e2cb3141eb2012fd7f26cbdbda2f0ae4dbc1de11"


def test_the_stream_is_pinned_to_recorded_batches(tmp_path):
    """The batches of a fixed corpus, config and seed never change: not with numpy, not with a
    refactor. A change that moves them must be deliberate (and bump the plan version)."""
    p = Pipeline(pinned_config(tmp_path), 0, 1, num_threads=0, cache_dir=tmp_path / "plans")
    for step, want in PINNED.items():
        b = p.global_batch(step)
        h = hashlib.sha256(b"".join(np.ascontiguousarray(b[k]).tobytes() for k in sorted(b) if k != "step"))
        assert h.hexdigest()[:16] == want, step
    assert p.fingerprint == PINNED_FINGERPRINT


def test_a_different_plan_under_the_same_key_is_refused(tmp_path, monkeypatch):
    cfg = pinned_config(tmp_path)
    state = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "plans").state_at(5)
    from forge_grain.packing import kernels

    original = kernels.permutation
    monkeypatch.setattr(kernels, "permutation", lambda n, key: original(n, key + 1))  # as if the stream changed
    it = iter(Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "other-plans"))
    with pytest.raises(StateError, match="sources"):
        it.set_state(state)


# -- changing the mixture at resume ----------------------------------------------------------


def mix_config(stores, weights, phases=(), num_epochs=None):
    names = list(weights)
    return DataConfig.from_dict(dict(
        sources=[dict(name=n, path=str(stores[n]), weight=weights[n],
                      strategy={"web": "bos_bestfit", "code": "bestfit", "math": "concat"}[n]) for n in names],
        phases=[dict(start_step=s, weights=w) for s, w in phases],
        seq_len=64, global_batch_size=8, seed=7, num_epochs=num_epochs,
    ))


def rows_by_source(pipeline, steps):
    """(source name, rank) of every row of the given global steps, from the mixture's closed form."""
    out = []
    for step in steps:
        src, rank = pipeline.mixture.locate(pipeline.global_rows(step))
        out += [(pipeline.source_names[i], int(r)) for i, r in zip(src, rank)]
    return out


def test_a_changed_mixture_resumes_every_source_at_its_next_unseen_row(stores):
    before = Pipeline(mix_config(stores, {"web": 0.6, "code": 0.3, "math": 0.1}, phases=[(3, {"web": 1, "code": 1})]),
                      0, 1, num_threads=0)
    k = 7
    state = before.state_at(k)
    seen = {}  # rows each source gave before k, counted by iterating
    for step in range(k):
        for i in before.global_batch(step)["source_id"]:
            seen[before.source_names[i]] = seen.get(before.source_names[i], 0) + 1
    new = mix_config(stores, {"web": 0.2, "code": 0.5, "math": 0.3})
    with pytest.raises(StateError, match="allow_mixture_change=True"):
        iter(Pipeline(new, 0, 1, num_threads=0)).set_state(state)  # strict by default
    after = Pipeline(new, 0, 1, num_threads=0, resume_from=state, allow_mixture_change=True)
    it = after.iterator(state)
    nxt = dict(seen)
    for step in range(k, k + 6):
        batch = next(it)
        assert int(batch["step"]) == step
        for (name, rank), sid, inputs in zip(rows_by_source(after, [step]), batch["source_id"], batch["inputs"]):
            assert after.source_names[sid] == name and rank == nxt.get(name, 0)  # exactly the next unseen row
            nxt[name] = rank + 1
            d = after.datasets[after.source_names.index(name)]
            assert np.array_equal(inputs, d.get_batch([rank])["inputs"][0])
    # the new weights rule from k on (a closed form: every prefix within the tree depth)
    c = after.consumed(k + 400)
    got = {n: c[n]["rows"] - seen.get(n, 0) for n in c}
    assert all(abs(got[n] - 400 * 8 * w) <= 2 for n, w in {"web": 0.2, "code": 0.5, "math": 0.3}.items())
    # worker processes rebuild the changed pipeline, history included, and make the same batches
    workers = Pipeline(new, 0, 1, num_threads=0, worker_count=2, resume_from=state, allow_mixture_change=True)
    assert pickle.loads(pickle.dumps(workers)).fingerprint == after.fingerprint
    wit = workers.iterator(state)
    for step in range(k, k + 3):
        assert np.array_equal(next(wit)["inputs"], after.global_batch(step)["inputs"])
    wit.close()
    # elastic: 2 shards of the changed pipeline concatenate to its global batches
    halves = [Pipeline(new, r, 2, num_threads=0, resume_from=state, allow_mixture_change=True) for r in (0, 1)]
    its = [h.iterator(state) for h in halves]
    for step in range(k, k + 3):
        parts = [next(i) for i in its]
        assert np.array_equal(np.concatenate([p["inputs"] for p in parts]), after.global_batch(step)["inputs"])


def test_sources_added_and_removed_then_changed_again(stores):
    a = Pipeline(mix_config(stores, {"web": 0.5, "math": 0.5}), 0, 1, num_threads=0)
    k1 = 5
    s1 = a.state_at(k1)
    # remove math, add code
    b = Pipeline(mix_config(stores, {"web": 0.5, "code": 0.5}), 0, 1, num_threads=0, resume_from=s1,
                 allow_mixture_change=True)
    assert b.source_names == ["web", "code", "math"]
    rows = rows_by_source(b, range(k1, k1 + 4))
    assert not any(n == "math" for n, _ in rows)
    code_ranks = [r for n, r in rows if n == "code"]
    assert code_ranks == list(range(len(code_ranks))) and code_ranks  # a new source starts at its row 0
    web_before = a.consumed(k1)["web"]["rows"]
    web_ranks = [r for n, r in rows if n == "web"]
    assert web_ranks == list(range(web_before, web_before + len(web_ranks)))
    # a second resume, with yet other weights and math back, on another shard count
    k2 = 9
    s2 = b.state_at(k2)
    assert len(s2["config"]["history"]) == 1
    c_cfg = mix_config(stores, {"web": 0.1, "code": 0.3, "math": 0.6})
    c = Pipeline(c_cfg, 0, 1, num_threads=0, resume_from=s2, allow_mixture_change=True)
    consumed = b.consumed(k2)
    rows2 = rows_by_source(c, range(k2, k2 + 5))
    for name in ("web", "code", "math"):
        ranks = [r for n, r in rows2 if n == name]
        assert ranks == list(range(consumed[name]["rows"], consumed[name]["rows"] + len(ranks))), name
    shards = [Pipeline(c_cfg, r, 4, num_threads=0, resume_from=s2, allow_mixture_change=True) for r in range(4)]
    its = [p.iterator(s2) for p in shards]
    for step in range(k2, k2 + 2):
        assert np.array_equal(np.concatenate([next(i)["inputs"] for i in its]), c.global_batch(step)["inputs"])
    # a state saved after the second change resumes strictly, with the whole history
    s3 = c.state_at(k2 + 3)
    again = Pipeline(c_cfg, 0, 1, num_threads=0, resume_from=s3)
    assert again.fingerprint == c.fingerprint and len(s3["config"]["history"]) == 2
    assert np.array_equal(again.iterator(s3).__next__()["inputs"], c.global_batch(k2 + 3)["inputs"])


def test_a_mixture_change_may_not_change_a_sources_data_or_the_geometry(stores, tmp_path):
    a = Pipeline(mix_config(stores, {"web": 0.5, "code": 0.5}), 0, 1, num_threads=0)
    state = a.state_at(3)
    geometry = DataConfig.from_dict({**dict(sources=[dict(name="web", path=str(stores["web"]), strategy="bos_bestfit")]),
                                     "seq_len": 32, "global_batch_size": 8, "seed": 7, "num_epochs": None})
    with pytest.raises(StateError, match=r"sequence length differs .* pass allow_seq_len_change=True"):
        Pipeline(geometry, 0, 1, num_threads=0, resume_from=state, allow_mixture_change=True)
    with pytest.raises(StateError, match=r"may not change \['seed'\]"):
        Pipeline(DataConfig.from_dict({**geometry.to_dict(), "seq_len": 64, "seed": 8}), 0, 1, num_threads=0,
                 resume_from=state, allow_mixture_change=True)
    other = dict(mix_config(stores, {"web": 0.5, "code": 0.5}).sources[1].__dict__)
    other.update(path=str(stores["math"]))  # 'code' now names other data
    cfg = DataConfig.from_dict(dict(sources=[dict(name="web", path=str(stores["web"]), strategy="bos_bestfit"), other],
                                    seq_len=64, global_batch_size=8, seed=7, num_epochs=None))
    with pytest.raises(StateError, match=r"sources \['code'\] changed their data or packing"):
        Pipeline(cfg, 0, 1, num_threads=0, resume_from=state, allow_mixture_change=True)
    tampered = {**state, "config": {**state["config"], "seed": 8}}
    with pytest.raises(StateError, match="changed after it was saved"):
        Pipeline(mix_config(stores, {"web": 0.9, "code": 0.1}), 0, 1, num_threads=0, resume_from=tampered,
                 allow_mixture_change=True)


def test_consumed_equals_counting_the_batches(stores):
    rng = np.random.default_rng(3)
    a = Pipeline(mix_config(stores, {"web": 0.6, "code": 0.3, "math": 0.1}, phases=[(4, {"math": 1, "code": 1})]),
                 0, 1, num_threads=0)
    s = a.state_at(6)
    b = Pipeline(mix_config(stores, {"web": 0.3, "code": 0.7}, phases=[(12, {"web": 1})]), 0, 1, num_threads=0,
                 resume_from=s, allow_mixture_change=True)
    counted = {n: {"rows": 0, "trained_tokens": 0} for n in b.source_names}
    checks = set(rng.integers(0, 40, 6).tolist()) | {0, 6, 12, 40}
    for step in range(41):
        if step in checks:
            got = (a if step <= 6 else b).consumed(step)
            for n in counted:
                assert got.get(n, {"rows": 0})["rows"] == counted[n]["rows"], (step, n)
                if got.get(n, {}).get("trained_tokens") is not None:
                    assert got[n]["trained_tokens"] == counted[n]["trained_tokens"], (step, n)
        if step == 40:
            break
        batch = (a if step < 6 else b).global_batch(step)
        for i, mask in zip(batch["source_id"], batch["loss_mask"]):
            name = (a if step < 6 else b).source_names[i]
            counted[name]["rows"] += 1
            counted[name]["trained_tokens"] += int(mask.sum())
    web = b.consumed(40)["web"]
    assert web["epochs"] == web["rows"] / b.datasets[0].num_rows
    # the changed pipeline computes the steps before the change through its history
    assert {n: v["rows"] for n, v in b.consumed(6).items()} == {n: v["rows"] for n, v in a.consumed(6).items()}


@pytest.mark.parametrize("d, hint", [
    (dict(sources=[dict(name="a", path="x", wieght=1)], seq_len=8, global_batch_size=2), "'wieght': did you mean 'weight'?"),
    (dict(sources=[dict(name="a", path="x")], seq_len=8, global_batch_size=2, sede=1), "'sede': did you mean 'seed'?"),
    (dict(sources=[dict(name="a", path="x")], seq_len=8, global_batch_size=2, loader={"num_worker": 2}),
     "'num_worker': did you mean 'num_workers'?"),
])
def test_a_mistyped_key_suggests_the_close_match(d, hint):
    with pytest.raises(ConfigError, match=re.escape(hint)):
        DataConfig.from_dict(d)
