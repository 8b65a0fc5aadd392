"""One process of a real 2-process JAX run on CPU: its pipeline shard comes from jax.process_index()."""

import sys

import jax
import numpy as np

from forge_grain import DataConfig, Pipeline


def main(port, process_id, config_path, steps, out):
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=int(process_id))
    p = Pipeline(DataConfig.from_toml(config_path))  # shard index and count from JAX
    assert (p.shard_index, p.shard_count) == (jax.process_index(), 2), (p.shard_index, p.shard_count)
    it = iter(p)
    batches = [next(it) for _ in range(int(steps))]
    np.savez(out.format(process_id), **{f"inputs_{i}": b["inputs"] for i, b in enumerate(batches)}, shard=p.shard_index)
    it.close()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
