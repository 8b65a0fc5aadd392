"""Run under torchrun with the gloo backend: each rank reads its part of a streaming
pipeline's global batches with 2 DataLoader workers, and after `steps` batches saves its
batches and its tracker's state (which gathers every rank's stream positions)."""

import json
import sys

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader

from forge_grain.bridges.torch import GrainIterableDataset
from forge_grain import DataConfig


def main(config_path, cache_dir, steps, out_prefix):
    dist.init_process_group("gloo")
    cfg = DataConfig.from_dict(json.loads(open(config_path).read()))
    ds = GrainIterableDataset(cfg, cache_dir=cache_dir)
    tracker = ds.tracker()
    inputs = []
    for b in DataLoader(ds, batch_size=None, num_workers=2):
        tracker.update(b)
        inputs.append(b["inputs"].numpy())
        if len(inputs) == int(steps):
            break
    state = tracker.state_dict()
    rank = dist.get_rank()
    np.savez(f"{out_prefix}{rank}.npz", *inputs)
    with open(f"{out_prefix}{rank}.json", "w") as f:
        json.dump(state, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
