"""The JAX bridge: global arrays across processes, device prefetch with exact state, Orbax, grain.DataLoader."""

from __future__ import annotations

from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import config, write_toml
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from multiproc import run_jax_processes

from forge_grain.bridges.jax import JaxIterator, to_global
from forge_grain import DataConfig, Pipeline, checkpoint, pack

SCRIPTS = Path(__file__).parent / "scripts"


def sharding():
    return NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))


def test_global_arrays_from_two_processes_equal_the_global_batch(tmp_path, stores):
    cfg_path = write_toml(tmp_path / "data.toml", stores)
    run_jax_processes(SCRIPTS / "jax_global.py", cfg_path, 4, tmp_path / "global.npz")
    got = np.load(tmp_path / "global.npz")
    whole = Pipeline(DataConfig.from_toml(cfg_path), 0, 1, num_threads=0)
    for step in range(4):
        g = whole.global_batch(step)
        for key in ("inputs", "loss_mask", "source_id"):
            assert np.array_equal(got[f"{key}_{step}"], g[key]), (step, key)


def test_prefetched_batches_are_not_counted_in_the_state(tmp_path, stores):
    cfg = config(stores)
    it = JaxIterator(Pipeline(cfg, 0, 1), sharding(), prefetch=3)
    first = [next(it) for _ in range(4)]
    assert [b["step"] for b in first] == [0, 1, 2, 3]
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")
    checkpoint.save(mngr, 4, it)
    mngr.wait_until_finished()
    expected = [next(it) for _ in range(3)]
    again = JaxIterator(Pipeline(cfg, 0, 1), sharding())
    checkpoint.restore(mngr, again)
    for e in expected:
        g = next(again)
        assert g["step"] == e["step"] and np.array_equal(np.asarray(g["inputs"]), np.asarray(e["inputs"]))
    it.close()
    again.close()


def test_classic_grain_data_loader_batches_become_global_arrays(tmp_path, stores):
    ds = pack(stores["web"], 64, "bos_bestfit", cache_dir=tmp_path / "c")
    loader = grain.DataLoader(
        data_source=ds,
        sampler=grain.samplers.IndexSampler(len(ds), shard_options=grain.sharding.ShardByJaxProcess(), shuffle=False,
                                            num_epochs=1),
        operations=[grain.transforms.Batch(batch_size=8, drop_remainder=True)],
    )
    batch = next(iter(loader))
    arrays = to_global(batch, sharding())  # the keys the batch has: no source_id without a mixture
    assert set(arrays) == {"inputs", "targets", "segment_ids", "positions", "loss_mask", "natural_stop"}
    assert arrays["inputs"].shape == (8, 64)
    expected = ds.get_batch(np.arange(8))
    assert all(np.array_equal(np.asarray(arrays[k]), expected[k]) for k in arrays)
    with pytest.raises(KeyError, match=r"the batch has no \['source_id'\]"):
        to_global(batch, sharding(), keys=("inputs", "source_id"))
