"""Run under torchrun with the gloo backend: each rank reads its part of the global batches
through GrainIterableDataset (rank and world size from torch.distributed)."""

import sys

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader

from forge_grain.bridges.torch import GrainIterableDataset
from forge_grain import DataConfig


def main(config_path, steps, out_prefix):
    dist.init_process_group("gloo")
    ds = GrainIterableDataset(DataConfig.from_toml(config_path))
    assert (ds.pipeline.shard_index, ds.pipeline.shard_count) == (dist.get_rank(), 2)
    loader = DataLoader(ds, batch_size=None, num_workers=1)
    batches = [b for _, b in zip(range(int(steps)), loader)]
    np.savez(f"{out_prefix}{dist.get_rank()}.npz", **{f"inputs_{i}": b["inputs"].numpy() for i, b in enumerate(batches)},
             steps=np.array([int(b["step"]) for b in batches]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
