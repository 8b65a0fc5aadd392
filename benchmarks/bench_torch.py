"""The torch bridge's cost, and a nanochat-style map-style dataset under StatefulDataLoader.

    python benchmarks/bench_torch.py [--docs 20000] [--seq-len 2048] [--batch 64] [--steps 200]

In one run, over the same two synthetic sources:
  - the raw pipeline (`Pipeline.batch`, numpy) as the reference;
  - `DataLoader(GrainIterableDataset(...), batch_size=None)` with 0, 1 and 2 workers
    (the bridge should cost under 10% of the raw pipeline);
  - torchdata's `StatefulDataLoader` over a map-style dataset that packs each row in the
    nanochat manner (BOS-aligned best-fit with cropping from a 1000-document window), with
    0, 1 and 2 workers.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, str(Path(__file__).parent))
from bench_pipeline import forge_config, parse_args, two_sources  # noqa: E402

from bridges.torch import GrainIterableDataset  # noqa: E402
from forge_grain import Pipeline, TokenStore  # noqa: E402


class NanochatRows(Dataset):
    """Row i: BOS-aligned best-fit-crop over the 1000 documents after i * 3."""

    def __init__(self, path, seq_len):
        self.path, self.cap = path, seq_len + 1
        self.store = TokenStore.open(path)

    def __len__(self):
        return len(self.store) // 3

    def __getitem__(self, i):
        docs = [self.store[(i * 3 + k) % len(self.store)] for k in range(1000)]
        lens = np.array([len(d) for d in docs])
        row, pos = np.empty(self.cap, np.int64), 0
        while pos < self.cap:
            room = self.cap - pos
            fits = np.where(lens <= room, lens, -1)
            k = int(fits.argmax())
            if fits[k] < 0:
                k = int(lens.argmin())
                row[pos:] = docs[k][:room]
                break
            row[pos : pos + lens[k]] = docs[k]
            pos += int(lens[k])
            lens[k] = 1 << 40  # used
        t = torch.from_numpy(row)
        return {"inputs": t[:-1], "targets": t[1:]}


def rate(make, steps, repeats=3):
    """Best of `repeats` timings of `steps` batches (this 2-core machine is noisy)."""
    best = 0.0
    for _ in range(repeats):
        it = iter(make())
        next(it)
        t0 = time.perf_counter()
        for _ in range(steps):
            next(it)
        best = max(best, steps / (time.perf_counter() - t0))
        del it
    return best


def main():
    args = parse_args(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        paths = two_sources(tmp, args.docs)
        cfg = forge_config(paths, args.seq_len, args.batch)
        rows = []
        for np_dtype, dtype in ((np.int64, torch.int64), (np.int32, torch.int32)):
            raw = Pipeline(cfg, 0, 1, num_threads=0, dtype=np_dtype)
            name = np.dtype(np_dtype).name
            rows.append((f"raw pipeline, {name} (numpy, one process)", rate(lambda: (raw.batch(s) for s in range(10**9)), args.steps)))
            for workers in (0, 1, 2):
                ds = GrainIterableDataset(cfg, rank=0, world_size=1, dtype=dtype)
                rows.append((f"DataLoader(GrainIterableDataset), {name}, {workers} workers",
                             rate(lambda: DataLoader(ds, batch_size=None, num_workers=workers), args.steps)))
        for workers in (0, 1, 2):
            ds = NanochatRows(paths[0], args.seq_len)
            loader = StatefulDataLoader(ds, batch_size=args.batch, num_workers=workers, shuffle=False)
            rows.append((f"StatefulDataLoader(nanochat-style map dataset), {workers} workers",
                         rate(lambda: loader, max(3, args.steps // 50), repeats=1)))
    tokens = args.batch * args.seq_len
    print(f"\nseq_len {args.seq_len}, batch {args.batch} (per rank); 'vs raw': against the raw pipeline of the same dtype")
    print(f"{'loader':<62}{'batches/s':>11}{'M tok/s':>10}{'vs raw':>9}")
    base = rows[0][1]
    for name, bps in rows:
        base = bps if name.startswith("raw") else base
        print(f"{name:<62}{bps:>11.1f}{bps * tokens / 1e6:>10.1f}{bps / base:>8.2f}x")
    nano = max(r[1] for r in rows if r[0].startswith("Stateful"))
    for raw_i, name in ((0, "int64"), (4, "int32")):
        print(f"bridge cost, {name}, 0 workers: {1 - rows[raw_i + 1][1] / rows[raw_i][1]:.1%} of the raw pipeline's rate")
    print(f"best bridge vs best nanochat-style loader: {max(r[1] for r in rows if 'Grain' in r[0]) / nano:.0f}x")


if __name__ == "__main__":
    main()
