"""Under torchrun (gloo): each rank changes the weights live at step 6 (rank 1 with other
weights when MISMATCH is 1), reads to step 10, and asks the tracker for the state. Writes
OUT + rank + ".json": the batches' inputs and steps, and the state or the error it raised."""

import json
import sys

import torch.distributed as dist
from torch.utils.data import DataLoader

from forge_grain.bridges.torch import GrainIterableDataset
from forge_grain import DataConfig, StateError


def main(config_path, out_prefix, mismatch):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = GrainIterableDataset(DataConfig.from_toml(config_path))
    tracker = ds.tracker()
    it = iter(DataLoader(ds, batch_size=None, num_workers=1))
    seen = []
    for step in range(10):
        if step == 2:
            ds.set_weights({"web": 1.0, "code": 3.0 if mismatch == "1" and rank == 1 else 2.0}, at_step=6)
        batch = next(it)
        tracker.update(batch)
        seen.append((int(batch["step"]), batch["inputs"].tolist()))
    try:
        result = {"state": tracker.state_dict()}
    except StateError as e:
        result = {"error": str(e)}
    with open(f"{out_prefix}{rank}.json", "w") as f:
        json.dump({"seen": seen, **result}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
