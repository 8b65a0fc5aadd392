"""Changing the mixture at resume, as a property: whatever the edits (reweight, add anywhere,
remove any, reorder, re-add, several in a row), at whatever steps, on 1, 2 or 4 shards, every
source continues at its next unseen row, `consumed` counts what was really trained, and the
steps before each change are rebuilt as they were trained.

A seeded subset runs by default; FORGE_GRAIN_SLOW=1 runs many more random edit sequences.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SLOW, store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge_grain import DataConfig, Pipeline

NAMES = ["s0", "s1", "s2", "s3", "s4", "s5"]
STRATEGIES = ["bestfit", "bos_bestfit", "concat"]
B = 8


@pytest.fixture(scope="module")
def six_stores(tmp_path_factory):
    base = tmp_path_factory.mktemp("mixchange")
    return {n: store(base / n, 20 + 15 * k, 10 + k) for k, n in enumerate(NAMES)}


def make_config(stores, sources: list[tuple[str, float]], phase=None) -> DataConfig:
    return DataConfig.from_dict(dict(
        sources=[dict(name=n, path=str(stores[n]), weight=w, strategy=STRATEGIES[NAMES.index(n) % 3])
                 for n, w in sources],
        phases=[] if phase is None else [dict(start_step=phase[0], weights=phase[1])],
        seq_len=32, global_batch_size=B, seed=11, num_epochs=None,
    ))


weight = st.sampled_from([0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0])


@st.composite
def runs(draw):
    """A first mixture, then 1-3 edits, each at a later step and on a shard count."""
    first = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=5, unique=True))
    sources = [(n, draw(weight)) for n in first]
    plan = [(0, sources, None, 1)]
    step = 0
    for _ in range(draw(st.integers(1, 3))):
        names = [n for n, _ in sources]
        edit = draw(st.sampled_from(["reweight", "add", "remove", "reorder", "several"]))
        new = list(sources)
        if edit in ("reweight", "several"):
            new = [(n, draw(weight)) for n, _ in new]
        if edit in ("add", "several") and len(names) < len(NAMES):
            n = draw(st.sampled_from([x for x in NAMES if x not in names]))  # may be one removed earlier
            new.insert(draw(st.integers(0, len(new))), (n, draw(weight)))
        if edit in ("remove", "several") and len(new) > 1:
            new.pop(draw(st.integers(0, len(new) - 1)))
        if edit in ("reorder", "several"):
            new = draw(st.permutations(new))
        phase = None
        if draw(st.booleans()) and len(new) > 1:
            phase = (step + draw(st.integers(1, 12)), {new[0][0]: draw(weight)})
        step += draw(st.integers(1, 12))
        plan.append((step, list(new), phase, draw(st.sampled_from([1, 2, 4]))))
        sources = new
    return plan


def trained_rows(p: Pipeline, steps, names) -> list[list[tuple[str, int]]]:
    """(source, rank) of every row of each step, checked against the shard's real batch."""
    out = []
    for step in steps:
        src, rank = p.mixture.locate(p.global_rows(step))
        out.append([(names[i], int(r)) for i, r in zip(src, rank)])
        local = p.batch(step)
        mine = p.shard_rows(step)
        lsrc, lrank = p.mixture.locate(mine)
        for j, (i, r) in enumerate(zip(lsrc, lrank)):
            assert p.source_names[int(local["source_id"][j])] == names[i]
            assert np.array_equal(local["inputs"][j], p.mixture.datasets[i].get_batch([r])["inputs"][0])
    return out


def check_run(stores, plan):
    first_step, first_sources, first_phase, _ = plan[0]
    p = Pipeline(make_config(stores, first_sources, first_phase), 0, 1, num_threads=0)
    trained: list[list[tuple[str, int]]] = []
    for (until, sources, phase, shards) in plan[1:]:
        trained += trained_rows(p, range(len(trained), until), p.source_names)
        state = p.state_at(until)
        cfg = make_config(stores, sources, phase)
        shard = int(np.random.default_rng(until).integers(shards))
        p = Pipeline(cfg, shard, shards, num_threads=0, resume_from=state, allow_mixture_change=True)
        # the steps before the change are rebuilt exactly as they were trained
        rebuilt = [[(p.source_names[i], int(r)) for i, r in zip(*p.mixture.locate(p.global_rows(s)))]
                   for s in range(until)]
        assert rebuilt == trained
    trained += trained_rows(p, range(len(trained), len(trained) + 10), p.source_names)
    # no source gives a row twice or skips one: its ranks are exactly 0, 1, 2, ...
    by_source: dict[str, list[int]] = {}
    for row in (r for step in trained for r in step):
        by_source.setdefault(row[0], []).append(row[1])
    for name, ranks in by_source.items():
        assert ranks == list(range(len(ranks))), name
    # consumed(step) equals counting what was trained, at every step
    for step in range(len(trained) + 1):
        counted = {}
        for n, _ in (r for s in trained[:step] for r in s):
            counted[n] = counted.get(n, 0) + 1
        got = p.consumed(step)
        assert {n: c["rows"] for n, c in got.items() if c["rows"]} == counted, step


@settings(max_examples=200 if SLOW else 12, deadline=None, derandomize=not SLOW,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(plan=runs())
def test_any_sequence_of_mixture_changes_trains_each_row_once(six_stores, plan):
    check_run(six_stores, plan)


def test_reordering_a_hundred_sources_repeats_and_skips_nothing(tmp_path):
    """The audit's case: 100 sources reordered at resume moved ~70 rows under the old tree."""
    stores = {f"d{k}": store(tmp_path / f"d{k}", 6, 100 + k) for k in range(100)}
    names = list(stores)
    rng = np.random.default_rng(0)
    weights = {n: float(w) for n, w in zip(names, rng.integers(1, 9, len(names)))}
    cfg = lambda order: DataConfig.from_dict(dict(  # noqa: E731
        sources=[dict(name=n, path=str(stores[n]), weight=weights[n]) for n in order],
        seq_len=32, global_batch_size=B, seed=3, num_epochs=None))
    a = Pipeline(cfg(names), 0, 1, num_threads=0)
    k = 37
    before = a.consumed(k)
    order = [str(n) for n in rng.permutation(names)]
    b = Pipeline(cfg(order), 0, 1, num_threads=0, resume_from=a.state_at(k), allow_mixture_change=True)
    assert {n: c["rows"] for n, c in b.consumed(k).items()} == {n: c["rows"] for n, c in before.items()}
    nxt = {n: c["rows"] for n, c in before.items()}
    for step in range(k, k + 20):
        src, rank = b.mixture.locate(b.global_rows(step))
        for i, r in zip(src, rank):
            name = b.source_names[i]
            assert r == nxt[name], (step, name)
            nxt[name] += 1


def test_a_state_saved_before_trees_were_recorded_continues_as_it_was_mixed(six_stores):
    """Such a history (no `tree` in its segments) was mixed with one tree over every source
    the pipeline knew; a plain resume keeps doing exactly that, and a new change continues
    from the counts that mixing gave."""
    from forge_grain.pipeline import history
    from forge_grain.pipeline.mixture import Mixture

    a = Pipeline(make_config(six_stores, [("s0", 1.0), ("s1", 2.0), ("s2", 3.0)]), 0, 1, num_threads=0)
    new = make_config(six_stores, [("s2", 1.0), ("s0", 2.0), ("s3", 1.0)])
    b = Pipeline(new, 0, 1, num_threads=0, resume_from=a.state_at(5), allow_mixture_change=True)
    state = b.state_at(9)
    config = {**state["config"], "history": [{k: v for k, v in seg.items() if k != "tree"}
                                             for seg in state["config"]["history"]]}
    legacy = {**state, "config": config, "fingerprint": history.digest(config)}
    resumed = Pipeline(new, 0, 1, num_threads=0, resume_from=legacy)
    assert resumed.source_names == ["s2", "s0", "s3", "s1"]
    union = resumed.source_names  # the earlier version's one tree: all four sources, weights 0 where unnamed
    old_way = Mixture(resumed.mixture.datasets, [3, 1, 0, 2], phases=[(5 * B, [1, 2, 1, 0])])
    for step in range(0, 20):
        rows = resumed.global_rows(step)
        assert [x.tolist() for x in resumed.mixture.locate(rows)] == [x.tolist() for x in old_way.locate(rows)], step
    changed = Pipeline(make_config(six_stores, [("s1", 1.0), ("s3", 1.0)]), 0, 1, num_threads=0, resume_from=
                       resumed.state_at(12), allow_mixture_change=True)
    assert {n: c["rows"] for n, c in changed.consumed(12).items()} == \
        {n: c["rows"] for n, c in resumed.consumed(12).items()}
    assert all(seg["tree"] == union for seg in changed.history)


@pytest.mark.parametrize("phases", [(), [(40, [2.0])], [(40, [2.0]), (90, [0.5])]])
def test_a_single_source_mixture_gives_each_row_to_its_source_unchanged(six_stores, phases):
    """A mixture of one source finds no tree (`Mixture.locate` answers at once: a step asks it
    twice from object storage): every row is the source's row of the same number, across weight
    phases too, as the mixing kernel says."""
    from forge_grain.packing import kernels
    from forge_grain.pipeline.mixture import Mixture

    p = Pipeline(make_config(six_stores, [("s0", 1.0)]), 0, 1, num_threads=0)
    m = Mixture(p.mixture.datasets, [1.0], phases=phases)
    rows = np.concatenate([np.arange(200), [10**12]])
    src, rank = m.locate(rows)
    want = kernels.mix_locate(rows, m.phase_rows, m._root, m._left, m._right, m._leaf, m._node_weight, m._base)
    assert src.tolist() == want[0].tolist() == [0] * len(rows)
    assert rank.tolist() == want[1].tolist() == rows.tolist() and rank is not rows
