"""The torch bridge's cost, and a nanochat-style map-style dataset under StatefulDataLoader.

    python benchmarks/bench_torch.py [--docs 20000] [--seq-len 2048] [--batch 64] [--steps 200]

In one run, over the same two synthetic sources:
  - the raw pipeline (`Pipeline.batch`, numpy) as the reference;
  - `DataLoader(GrainIterableDataset(...), batch_size=None)` with 0, 1 and 2 workers
    (the bridge should cost under 10% of the raw pipeline);
  - a training loop whose step takes 10 ms, with the bridge on 0, 1 and 2 workers and the
    DataLoader's own floor (a dataset of one scalar a batch on 2 workers);
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
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, str(Path(__file__).parent))
from bench_pipeline import forge_config, parse_args, two_sources  # noqa: E402
from report import kept  # noqa: E402

from forge_grain.bridges.torch import GrainIterableDataset  # noqa: E402
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
    """Best of `repeats` timings of `steps` batches (this 2-core machine is noisy). Each batch is
    held while the next is made, as `for batch in loader:` holds it."""
    best = 0.0
    for _ in range(repeats):
        it = iter(make())
        batch = next(it)
        t0 = time.perf_counter()
        for _ in range(steps):
            batch = next(it)
        best = max(best, steps / (time.perf_counter() - t0))
        del it, batch
    return best


class Repeat(IterableDataset):
    """The DataLoader's own work a batch: the same batch object, yielded again and again."""

    def __init__(self, batch):
        self.batch = batch

    def __iter__(self):
        while True:
            yield self.batch


class Scalars(IterableDataset):
    """The DataLoader's own floor: a dataset whose batches are one scalar tensor."""

    def __iter__(self):
        while True:
            yield {"step": torch.tensor(0)}


def training_loop(loader, steps, step_ms):
    """steps/s and the 99th percentile of `next()` (ms) when each step also takes `step_ms` of
    training (a sleep: the host waits on the accelerator), with the batch held through it."""
    it = iter(loader)
    for _ in range(5):
        batch = next(it)
    waits, t0 = [], time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        batch = next(it)
        waits.append(time.perf_counter() - t)
        time.sleep(step_ms / 1000)
    del it, batch
    return steps / (time.perf_counter() - t0), float(np.percentile(waits, 99)) * 1000


def interleaved(makers: dict, rounds: int = 30, per_round: int = 50) -> dict:
    """Batches/s of each iterator, as the median of `rounds` rounds taken in turn: on this
    noisy 2-core machine, back-to-back runs of one method drift more than the methods differ."""
    its = {name: iter(make()) for name, make in makers.items()}
    times = {name: [] for name in its}
    for _ in range(rounds):
        for name, it in its.items():
            batch = next(it)
            t0 = time.perf_counter()
            for _ in range(per_round):
                batch = next(it)  # held while the next is made, as `for batch in loader:` does
            times[name].append((time.perf_counter() - t0) / per_round)
            del batch
    return {name: 1 / float(np.median(t)) for name, t in times.items()}


def main():
    args = parse_args(__doc__)
    with tempfile.TemporaryDirectory() as tmp:
        paths = two_sources(tmp, args.docs)
        cfg = forge_config(paths, args.seq_len, args.batch)
        rows, costs = [], []
        for np_dtype, dtype in ((np.int64, torch.int64), (np.int32, torch.int32)):
            name = np.dtype(np_dtype).name
            raw = Pipeline(cfg, 0, 1, num_threads=0, dtype=np_dtype)
            ds = GrainIterableDataset(cfg, rank=0, world_size=1, dtype=dtype)
            held = next(iter(ds))  # a batch of the bridge, for the DataLoader floor
            one = interleaved({
                f"raw pipeline, {name} (numpy, one process)": lambda: (raw.batch(s) for s in range(10**9)),
                f"GrainIterableDataset, {name}, iterated directly": lambda: ds,
                f"DataLoader(GrainIterableDataset), {name}, 0 workers":
                    lambda: DataLoader(ds, batch_size=None, num_workers=0),
                f"DataLoader floor: the same batch object again, {name}, 0 workers":
                    lambda: DataLoader(Repeat(held), batch_size=None, num_workers=0),
            })
            rows += list(one.items())
            rates = list(one.values())
            costs.append((name, 1 - rates[1] / rates[0], 1 - rates[2] / rates[0], 1 / rates[3]))
            for workers in (1, 2):
                rows.append((f"DataLoader(GrainIterableDataset), {name}, {workers} workers",
                             rate(lambda: DataLoader(ds, batch_size=None, num_workers=workers), args.steps)))
        loops = []
        for workers in (0, 1, 2):
            ds = GrainIterableDataset(cfg, rank=0, world_size=1)
            loops.append((f"DataLoader(GrainIterableDataset), int64, {workers} workers",
                          training_loop(DataLoader(ds, batch_size=None, num_workers=workers), args.steps, 10)))
        loops.append(("DataLoader floor: one scalar a batch, 2 workers",
                      training_loop(DataLoader(Scalars(), batch_size=None, num_workers=2), args.steps, 10)))
        for workers in (0, 1, 2):
            ds = NanochatRows(paths[0], args.seq_len)
            loader = StatefulDataLoader(ds, batch_size=args.batch, num_workers=workers, shuffle=False)
            rows.append((f"StatefulDataLoader(nanochat-style map dataset), {workers} workers",
                         rate(lambda: loader, max(3, args.steps // 50), repeats=1)))
    with kept("torch"):
        tokens = args.batch * args.seq_len
        print(f"\nseq_len {args.seq_len}, batch {args.batch} (per rank); 'vs raw': against the raw pipeline of the same dtype;")
        print("one-process rows are medians of 30 interleaved rounds of 50 batches, worker rows best of 3 runs")
        print(f"{'loader':<68}{'batches/s':>11}{'M tok/s':>10}{'vs raw':>9}")
        base = rows[0][1]
        for name, bps in rows:
            base = bps if name.startswith("raw") else base
            print(f"{name:<68}{bps:>11.1f}{bps * tokens / 1e6:>10.1f}{bps / base:>8.2f}x")
        for name, direct, loader, floor in costs:
            print(f"bridge cost, {name}, one process: {direct:.1%} iterated directly, {loader:.1%} through a 0-worker "
                  f"DataLoader (whose own work is {floor * 1e6:.0f} us a batch)")
        print(f"\na training loop whose step takes 10 ms (a sleep), {args.steps} steps; at most 100 steps/s")
        print(f"{'loader':<68}{'steps/s':>11}{'p99 next()':>12}")
        for name, (sps, p99) in loops:
            print(f"{name:<68}{sps:>11.1f}{p99:>9.2f} ms")
        nano = max(r[1] for r in rows if r[0].startswith("Stateful"))
        print(f"best bridge vs best nanochat-style loader: {max(r[1] for r in rows if 'Grain' in r[0]) / nano:.0f}x")


if __name__ == "__main__":
    main()
