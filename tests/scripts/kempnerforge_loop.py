"""A KempnerForge-style training loop under torchrun (gloo): a map-style dataset from
forge_grain.bridges.kempnerforge through torch's DistributedSampler and torchdata's StatefulDataLoader.
Each rank takes 3 steps, saves the loader's state, takes 3 more; a fresh loader restored from
the state must give those same 3 steps. Writes what it saw for the test to check."""

import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from forge_grain.bridges.kempnerforge import HuggingFaceDataset, MemoryMappedDataset, MixtureDataset
from forge_grain.tokenizer import DEFAULT_TOKENIZER


def dataset(kind, a):
    if kind == "mm":
        return MemoryMappedDataset(a["npy"], seq_len=33, pack_sequences=True, eos_token_id=1)
    hf = HuggingFaceDataset(a["jsonl"], "train", "text", 32, str(DEFAULT_TOKENIZER), cache_dir=a["cache"])
    if kind == "hf":
        return hf
    return MixtureDataset([MemoryMappedDataset(a["npy"], seq_len=33), hf], names=["web", "books"])


def loader(ds):
    sampler = DistributedSampler(ds, shuffle=True, seed=7)  # rank and world size from torch.distributed
    return StatefulDataLoader(ds, batch_size=4, sampler=sampler, num_workers=1)


def main(kind, args_json, out):
    dist.init_process_group("gloo")
    a = json.loads(args_json)
    ds = dataset(kind, a)
    dl = loader(ds)
    it = iter(dl)
    first = [next(it) for _ in range(3)]
    state = dl.state_dict()
    after = [next(it) for _ in range(3)]
    again = loader(ds)
    again.load_state_dict(state)
    resumed = [b for _, b in zip(range(3), again)]
    b = first[0]
    report = {
        "keys": sorted(b), "shapes": {k: list(v.shape) for k, v in b.items()},
        "dtypes": {k: str(v.dtype) for k, v in b.items()}, "len": len(ds), "ds_state": sorted(ds.state_dict()),
        "resumed_equal": all(torch.equal(x[k], y[k]) for x, y in zip(after, resumed) for k in x),
        "first_ids": [t.tolist() for t in first[0]["input_ids"]],
    }
    with open(f"{out}{dist.get_rank()}.json", "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
