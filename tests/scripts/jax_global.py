"""One process of a 2-process JAX run on CPU: assemble global jax.Arrays from each process's
shard, gather them back, and (process 0) save what the global arrays hold."""

import sys

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from forge_grain.bridges.jax import JaxIterator
from forge_grain import DataConfig, Pipeline


def main(port, process_id, config_path, steps, out):
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=int(process_id))
    mesh = Mesh(np.array(jax.devices()), ("data",))
    it = JaxIterator(Pipeline(DataConfig.from_toml(config_path)), NamedSharding(mesh, PartitionSpec("data")))
    saved = {}
    for i in range(int(steps)):
        batch = next(it)
        assert batch["inputs"].shape[0] == it.pipeline.batches.size(i)  # global, not local (a schedule's size)
        for key in ("inputs", "loss_mask", "source_id"):
            saved[f"{key}_{i}"] = multihost_utils.process_allgather(batch[key], tiled=True)
    if jax.process_index() == 0:
        np.savez(out, **saved)
    it.close()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
