"""Changing the mixture while training runs (`set_weights`), as a property and through each
way a trainer meets it: whatever the sequence of live changes, resumes (plain, elastic on 1,
2 or 4 shards, or with a change of the config's mixture), every source gives its rows in
order, none twice and none skipped, the steps before each change are rebuilt as trained, and
`consumed` counts what was trained. Then the iterator, the torch and JAX bridges, the Orbax
checkpoint, and the per-source loss helpers.

A seeded subset of the property runs by default; FORGE_GRAIN_SLOW=1 runs many more.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SLOW, store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge_grain import ConfigError, DataConfig, Pipeline, StateError, source_losses

NAMES = ["a", "b", "c", "d"]
B = 8


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    base = tmp_path_factory.mktemp("live")
    return {n: store(base / n, 25 + 12 * k, 30 + k) for k, n in enumerate(NAMES)}


def make_config(stores, weights=(1.0, 2.0, 1.0, 0.5), phase=None) -> DataConfig:
    return DataConfig.from_dict(dict(
        sources=[dict(name=n, path=str(stores[n]), weight=w, strategy=("bestfit", "concat")[k % 2])
                 for k, (n, w) in enumerate(zip(NAMES, weights))],
        phases=[] if phase is None else [dict(start_step=phase[0], weights=phase[1])],
        seq_len=32, global_batch_size=B, seed=5, num_epochs=None))


weight = st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0])


@st.composite
def operations(draw):
    """1-4 operations, each at a later step: a live change, a plain resume (JSON round trip)
    on 1, 2 or 4 shards, or a resume that changes the config's mixture."""
    ops, step = [], 0
    for _ in range(draw(st.integers(1, 4))):
        step += draw(st.integers(0, 9))
        kind = draw(st.sampled_from(["live", "live", "resume", "resume_change"]))
        weights = [draw(weight) for _ in NAMES]
        if not sum(weights):
            weights[draw(st.integers(0, 3))] = 1.0
        ops.append((kind, step, weights, draw(st.sampled_from([1, 2, 4]))))
    return ops


def rows_of(p: Pipeline, step: int) -> list[tuple[str, int]]:
    src, rank = p.mixture.locate(p.global_rows(step))
    return [(p.source_names[i], int(r)) for i, r in zip(src, rank)]


def check_run(stores, ops, phase):
    base = make_config(stores, phase=phase)
    p = Pipeline(base, 0, 1, num_threads=0)
    trained: list[list[tuple[str, int]]] = []
    for kind, step, weights, shards in ops:
        trained += [rows_of(p, s) for s in range(len(trained), step)]
        if kind == "live":
            p = p.with_weights(dict(zip(NAMES, weights)), step)
        else:
            state = json.loads(json.dumps(p.state_at(step)))
            shard = int(np.random.default_rng(step).integers(shards))
            if kind == "resume":  # the config file as it was: the weights set live carry over
                p = Pipeline(base, shard, shards, num_threads=0, resume_from=state)
            else:  # the config file edited
                base = make_config(stores, weights)
                p = Pipeline(base, shard, shards, num_threads=0, resume_from=state, allow_mixture_change=True)
        assert [rows_of(p, s) for s in range(step)] == trained  # the steps before, rebuilt as trained
        local = p.batch(step)  # and this shard's batch is its part of the global rows
        src, rank = p.mixture.locate(p.shard_rows(step))
        for j, (i, r) in enumerate(zip(src, rank)):
            assert np.array_equal(local["inputs"][j], p.mixture.datasets[i].get_batch([r])["inputs"][0])
    trained += [rows_of(p, s) for s in range(len(trained), len(trained) + 12)]
    by_source: dict[str, list[int]] = {}
    for name, r in (x for rows in trained for x in rows):
        by_source.setdefault(name, []).append(r)
    for name, ranks in by_source.items():  # each source's rows in order: none twice, none skipped
        assert ranks == list(range(len(ranks))), name
    for step in range(len(trained) + 1):
        counted: dict[str, int] = {}
        for name, _ in (x for rows in trained[:step] for x in rows):
            counted[name] = counted.get(name, 0) + 1
        assert {n: c["rows"] for n, c in p.consumed(step).items() if c["rows"]} == counted, step


@settings(max_examples=150 if SLOW else 10, deadline=None, derandomize=not SLOW,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=operations(), phase=st.sampled_from([None, (6, {"d": 1.0}), (30, {"a": 1.0, "c": 1.0})]))
def test_any_sequence_of_live_changes_and_resumes_trains_each_row_once(four, ops, phase):
    check_run(four, ops, phase)


def test_a_live_change_is_the_change_at_resume_and_a_resume_keeps_it(four):
    p = Pipeline(make_config(four), 0, 1, num_threads=0)
    live = p.with_weights({"c": 1.0}, 7)  # sources not named get 0
    at_resume = Pipeline(make_config(four, (0, 0, 1.0, 0)), 0, 1, num_threads=0, resume_from=p.state_at(7),
                         allow_mixture_change=True)
    for s in range(0, 20):
        assert np.array_equal(live.batch(s)["inputs"], at_resume.batch(s)["inputs"])
    assert set(live.batch(7)["source_id"].tolist()) == {2}
    state = live.state_at(12)
    assert state["config"]["live"] == {"a": 0.0, "b": 0.0, "c": 1.0, "d": 0.0}
    same = Pipeline(make_config(four), 0, 1, num_threads=0, resume_from=state)  # the config file unchanged
    assert same.fingerprint == live.fingerprint and same.phase_at(12)["weights"]["c"] == 1.0
    changed = Pipeline(make_config(four, (1, 1, 1, 1)), 0, 1, num_threads=0, resume_from=state,
                       allow_mixture_change=True)  # a deliberate change at resume wins from its step on
    assert "live" not in changed.state_at(12)["config"] and len(set(changed.batch(14)["source_id"].tolist())) > 1
    desc = same.describe(20)  # `forge-grain plan` with the state: the change is in its phases
    assert json.dumps(desc)  # (serializable)


def test_what_set_weights_refuses_is_said(four, tmp_path):
    p = Pipeline(make_config(four), 0, 1, num_threads=0)
    with pytest.raises(ConfigError, match=r"no source named \['z'\]"):
        p.with_weights({"z": 1.0}, 3)
    with pytest.raises(ConfigError, match="all zero"):
        p.with_weights([0, 0, 0, 0], 3)
    with pytest.raises(ConfigError, match="finite number >= 0"):
        p.with_weights({"a": -1.0}, 3)
    with pytest.raises(ConfigError, match="at_step must be a step"):
        p.with_weights({"a": 1.0}, -1)
    with pytest.raises(ConfigError, match="the weight of 'a': must be a finite number >= 0, got True"):
        p.with_weights({"a": True}, 3)
    # what a reweighting rule computes: numpy arrays and scalars, in source order or by name
    same = [p.with_weights(w, 3).fingerprint for w in (np.array([1, 2, 0, 0], np.float32),
                                                        {"a": np.float32(1), "b": np.float64(2)}, [1.0, 2.0, 0.0, 0.0])]
    assert same[0] == same[1] == same[2]
    it = iter(Pipeline(make_config(four), 0, 1, num_threads=0))
    for _ in range(4):
        next(it)
    with pytest.raises(ConfigError, match="already gave step 3"):
        it.set_weights({"a": 1.0}, at_step=2)


@pytest.mark.parametrize("threads", [0, 2])
def test_the_iterator_changes_at_its_step_and_drops_batches_made_ahead(four, threads):
    p = Pipeline(make_config(four), 0, 1, num_threads=threads, prefetch=4)
    want = p.with_weights({"a": 1.0, "d": 1.0}, 6)
    it = iter(p)
    got = [next(it) for _ in range(5)]  # threads have made steps 5.. ahead, with the old weights
    it.set_weights({"a": 1.0, "d": 1.0}, at_step=6)
    got += [next(it) for _ in range(10)]
    assert [int(b["step"]) for b in got] == list(range(15))
    for b in got:
        assert np.array_equal(b["inputs"], want.batch(int(b["step"]))["inputs"])
    assert it.get_state() == want.state_at(15)
    it.close()


def test_an_orbax_checkpoint_names_shards_that_set_other_weights(four, tmp_path):
    pytest.importorskip("orbax.checkpoint")
    from forge_grain import checkpoint

    its = [Pipeline(make_config(four), k, 2, num_threads=0).iterator() for k in range(2)]
    for k, it in enumerate(its):
        it.set_weights({"a": 1.0, "b": 1.0 + k}, at_step=0)  # rank 1 got other arguments
    handler = checkpoint.PipelineCheckpointHandler()
    d = tmp_path / "ckpt"
    d.mkdir()
    for it in its:
        handler.save(d, args=checkpoint.Save(it))
    fresh = Pipeline(make_config(four), 0, 1, num_threads=0).iterator()
    with pytest.raises(StateError, match=r"\['fingerprint-1-of-2.json'\] set other weights than shard 0"):
        handler.restore(d, args=checkpoint.Restore(fresh))
    alike = Pipeline(make_config(four), 1, 2, num_threads=0).iterator()
    alike.set_weights({"a": 1.0, "b": 1.0}, at_step=0)  # the same change as rank 0's: restores, on one shard
    handler.save(d, args=checkpoint.Save(alike))
    handler.restore(d, args=checkpoint.Restore(fresh))
    assert fresh.step == 0 and fresh.get_state()["config"]["live"] == {"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0}


@pytest.mark.parametrize("workers", [0, 2])
def test_the_torch_dataset_changes_in_its_workers_at_the_step(four, workers):
    torch = pytest.importorskip("torch")
    from forge_grain.bridges.torch import GrainIterableDataset

    ds = GrainIterableDataset(make_config(four), rank=0, world_size=1)
    want = ds.pipeline.with_weights({"b": 1.0, "c": 2.0}, 9)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    tracker = ds.tracker()
    it = iter(loader)
    for _ in range(3):
        tracker.update(next(it))
    ds.set_weights({"b": 1.0, "c": 2.0}, at_step=9)  # past the batches in flight (2 workers x 2 ahead)
    for _ in range(12):
        batch = next(it)
        tracker.update(batch)
        assert torch.equal(batch["inputs"], torch.from_numpy(want.batch(int(batch["step"]))["inputs"]).long())
    assert tracker.state_dict() == want.state_at(15)


def test_a_torch_worker_that_already_made_the_step_says_so(four):
    torch = pytest.importorskip("torch")
    from forge_grain.bridges.torch import GrainIterableDataset

    ds = GrainIterableDataset(make_config(four), rank=0, world_size=1)
    it = iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, prefetch_factor=4))
    next(it)
    ds.set_weights({"a": 1.0}, at_step=2)  # workers made steps 2.. already (4 ahead each)
    with pytest.raises(StateError, match=r"set_weights\(at_step=2\) reached a DataLoader worker after it made step"):
        for _ in range(20):
            next(it)


def test_source_losses_agree_in_numpy_torch_and_jax():
    rng = np.random.default_rng(0)
    losses = rng.random((6, 5)).astype(np.float32)
    mask = rng.random((6, 5)) > 0.3
    ids = np.array([0, 2, 2, 0, 1, 2])
    want = [losses[ids == k][mask[ids == k]].mean() for k in range(3)] + [np.nan]
    got = source_losses(losses, ids, mask, 4)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    torch = pytest.importorskip("torch")
    from forge_grain.bridges.torch import source_losses as torch_losses

    np.testing.assert_allclose(torch_losses(torch.from_numpy(losses), torch.from_numpy(ids), torch.from_numpy(mask),
                                            4).numpy(), want, rtol=1e-6)
    jax = pytest.importorskip("jax")
    from forge_grain.bridges.jax import source_losses as jax_losses

    got = jax.jit(jax_losses, static_argnums=3)(losses, ids, mask, 4)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_explain_with_the_state_follows_the_weights_set_live(four, tmp_path, capsys):
    from forge_grain.cli import main

    toml = tmp_path / "run.toml"
    toml.write_text("seq_len = 32\nglobal_batch_size = 8\nseed = 5\n" + "".join(
        f'[[sources]]\nname = "{n}"\npath = "{four[n]}"\nweight = {w}\nstrategy = "{("bestfit", "concat")[k % 2]}"\n'
        for k, (n, w) in enumerate(zip(NAMES, (1.0, 2.0, 1.0, 0.5)))))
    live = Pipeline(DataConfig.from_toml(toml), 0, 1, num_threads=0).with_weights({"d": 1.0}, 4)
    (tmp_path / "state.json").write_text(json.dumps(live.state_at(6)))
    assert main(["explain", str(toml), "--state", str(tmp_path / "state.json"), "--step", "9", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == json.loads(json.dumps(live.explain(9), default=int))
    assert {row["source"] for row in rows} == {"d"}
    # `plan --state` lists the mixture the run really had: the config's, then the weights set live
    png = tmp_path / "shares.png"
    assert main(["plan", str(toml), "--state", str(tmp_path / "state.json"), "--steps", "20", "--json",
                 "--plot", str(png)]) == 0
    phases = json.loads(capsys.readouterr().out)["phases"]
    assert [p["start_step"] for p in phases] == [0, 4]
    assert phases[1]["weights"] == {"a": 0.0, "b": 0.0, "c": 0.0, "d": 1.0} and phases[0]["weights"]["b"] > 0
    assert png.stat().st_size > 0
    assert live.phase_at(2)["weights"]["b"] > 0 and live.phase_at(5)["weights"]["d"] == 1.0


def test_jax_iterator_remakes_the_arrays_it_put_on_devices_ahead(four):
    jax = pytest.importorskip("jax")
    from forge_grain.bridges.jax import JaxIterator

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    p = Pipeline(make_config(four), 0, 1, num_threads=0)
    want = p.with_weights({"b": 1.0}, 4)
    it = JaxIterator(p, sharding, prefetch=3)
    got = [next(it) for _ in range(3)]  # steps 3, 4 and 5 are on the devices already, with the old weights
    it.set_weights({"b": 1.0}, at_step=4)
    got += [next(it) for _ in range(5)]
    assert [int(b["step"]) for b in got] == list(range(8))
    for b in got:
        assert np.array_equal(np.asarray(b["inputs"]), want.global_batch(int(b["step"]))["inputs"])
    assert it.get_state() == want.state_at(8)
    with pytest.raises(ConfigError, match="already returned"):
        it.set_weights({"a": 1.0}, at_step=7)
    it.close()


@pytest.mark.parametrize("mismatch", [False, True])
def test_two_torch_ranks_change_alike_or_the_tracker_names_the_rank(four, tmp_path, mismatch):
    """torchrun, 2 ranks (gloo), a DataLoader worker each: the ranks' batches after a live change
    are the changed run's global batch; ranks given other weights are named by the state."""
    pytest.importorskip("torch")
    import subprocess
    import sys
    from pathlib import Path

    from multiproc import free_port

    toml = tmp_path / "run.toml"
    toml.write_text("seq_len = 32\nglobal_batch_size = 8\nseed = 5\n"
                    f'[[sources]]\nname = "web"\npath = "{four["a"]}"\nweight = 1.0\n'
                    f'[[sources]]\nname = "code"\npath = "{four["b"]}"\nweight = 1.0\n')
    script = Path(__file__).parent / "scripts" / "torch_live.py"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", str(script), str(toml), str(tmp_path / "rank"),
                        "1" if mismatch else "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    if mismatch:
        assert all("ranks [1] set other weights than rank 0" in x["error"] for x in ranks)
        return
    want = Pipeline(DataConfig.from_toml(toml), 0, 1, num_threads=0).with_weights({"web": 1.0, "code": 2.0}, 6)
    for s in range(10):
        both = np.concatenate([np.array(x["seen"][s][1]) for x in ranks])
        assert [x["seen"][s][0] for x in ranks] == [s, s] and np.array_equal(both, want.global_batch(s)["inputs"])
    assert ranks[0]["state"] == ranks[1]["state"] == json.loads(json.dumps(want.state_at(10)))


def test_a_state_saved_before_a_change_it_already_holds_resumes_with_it(four):
    """Workers make batches ahead, so a trainer sets weights for a later step; a checkpoint in
    between holds the change on its way, and a resume from it makes the change at its step."""
    p = Pipeline(make_config(four), 0, 1, num_threads=0).with_weights({"a": 1.0, "c": 1.0}, 9)
    state = json.loads(json.dumps(p.state_at(6)))
    for shards in (1, 2):
        q = [Pipeline(make_config(four), k, shards, num_threads=0, resume_from=state) for k in range(shards)]
        for s in range(6, 14):
            assert np.array_equal(np.concatenate([x.batch(s)["inputs"] for x in q]), p.global_batch(s)["inputs"])
    with pytest.raises(ConfigError, match="a change at step 9 is already set"):
        p.with_weights({"b": 1.0}, 8)


def test_a_stateful_dataloader_state_after_a_live_change_resumes_in_a_fresh_process(four):
    """torchdata's per-worker states carry the changed run, so a loader built from the config
    file (which does not know the change) resumes them."""
    pytest.importorskip("torch")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from forge_grain.bridges.torch import GrainIterableDataset

    ds = GrainIterableDataset(make_config(four), rank=0, world_size=1)
    want = ds.pipeline.with_weights({"c": 1.0, "d": 1.0}, 7)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    it = iter(loader)
    next(it)
    ds.set_weights({"c": 1.0, "d": 1.0}, at_step=7)
    for _ in range(9):
        next(it)
    saved = loader.state_dict()
    fresh = StatefulDataLoader(GrainIterableDataset(make_config(four), rank=0, world_size=1), batch_size=None,
                               num_workers=2)
    fresh.load_state_dict(saved)
    got = [b for _, b in zip(range(6), fresh)]
    assert [int(b["step"]) for b in got] == list(range(10, 16))
    for b in got:
        assert np.array_equal(b["inputs"].numpy(), want.batch(int(b["step"]))["inputs"])
