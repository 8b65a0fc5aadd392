"""The bridges on a real accelerator: torch `DeviceLoader` (CUDA) and JAX device placement.

    python benchmarks/bench_device.py [--steps 200] [--batch 64] [--seq-len 2048]

Needs a CUDA GPU (torch) and a JAX GPU backend; run it where one is. On a synthetic store:

1. torch: batches from `GrainIterableDataset` through a `DataLoader(pin_memory=True)`,
   placed on the GPU by `DeviceLoader` (side-stream copies from pinned memory, double
   buffers) against the plain loop every tutorial writes (`.to(device)` per tensor), each
   followed by the same GPU work per step (a bf16 matrix product chain standing in for a
   model). Every batch placed on the GPU is checked equal to the host batch, bit for bit.
2. torch: `DeviceLoader` over a batch-size schedule (batches that grow and shrink), each
   batch checked equal to the host's.
3. JAX: `JaxIterator` global arrays on the GPU against `jax.device_put` of each host
   batch, with the same check.

Ratios are within this run; the figures are this machine's.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from forge_grain import DataConfig, Pipeline, write_store
from report import parser, publish

VOCAB = 32000


def synthetic(path: Path, docs: int) -> Path:
    rng = np.random.default_rng(0)
    lengths = np.maximum(2, rng.lognormal(np.log(600), 1.0, docs).astype(np.int64))
    return write_store(path, (np.concatenate([[0], rng.integers(2, VOCAB, n - 1)]) for n in lengths),
                       vocab_size=VOCAB, bos_id=0, eos_id=1)


def torch_part(cfg: DataConfig, steps: int, work: int) -> list[str]:
    import torch
    from torch.utils.data import DataLoader

    from forge_grain.bridges.torch import DeviceLoader, GrainIterableDataset

    dev = torch.device("cuda")
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) / 64

    def compute(batch):  # stands in for a model step: depends on the batch, runs on the GPU
        x = w + batch["inputs"][0, 0].to(torch.bfloat16)
        for _ in range(work):
            x = x @ w
        return x.float().sum()

    def loader():
        ds = GrainIterableDataset(Pipeline(cfg, 0, 1, num_threads=2))
        return DataLoader(ds, batch_size=None, num_workers=0, pin_memory=True)

    host = [b for _, b in zip(range(steps), loader())]
    rows = []
    for name in ("plain .to(device)", "DeviceLoader"):
        it = iter(loader()) if name.startswith("plain") else iter(DeviceLoader(loader(), dev))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        equal = True
        for i in range(steps):
            batch = next(it)
            if name.startswith("plain"):
                batch = {k: v.to(dev, non_blocking=False) for k, v in batch.items()}
            compute(batch)
            if i % 25 == 0:
                equal &= all(torch.equal(batch[k].cpu(), host[i][k]) for k in host[i])
        torch.cuda.synchronize()
        rows.append((name, time.perf_counter() - t0, equal))
    base = rows[0][1]
    out = [f"torch {torch.__version__} on {torch.cuda.get_device_name()}: {steps} steps, batch "
           f"{cfg.global_batch_size} x {cfg.seq_len}, GPU work per step: {work} bf16 4096^3 products"]
    for name, secs, equal in rows:
        out.append(f"  {name:<20} {steps / secs:8.1f} steps/s  {base / secs:5.2f}x  batches equal the host's: {equal}")
    return out


def schedule_part(cfg: DataConfig) -> list[str]:
    """`DeviceLoader` over a batch-size schedule: its device buffers are sized for the batch
    it gets, so a batch that grows (or shrinks) must arrive whole and equal to the host's."""
    import torch
    from torch.utils.data import DataLoader

    from forge_grain.bridges.torch import DeviceLoader, GrainIterableDataset

    sizes = [[0, 16], [10, 64], [20, 32], [30, cfg.global_batch_size]]
    sched = DataConfig.from_dict({**cfg.to_dict(), "batch_sizes": sizes})
    steps = 40

    def loader():
        return DataLoader(GrainIterableDataset(Pipeline(sched, 0, 1, num_threads=2)), batch_size=None,
                          num_workers=0, pin_memory=True)

    host = [b for _, b in zip(range(steps), loader())]
    seen, equal = [], True
    for i, batch in zip(range(steps), DeviceLoader(loader(), torch.device("cuda"))):
        seen.append(len(batch["inputs"]))
        equal &= all(torch.equal(batch[k].cpu(), host[i][k]) for k in host[i])
    want = [next(b for s, b in reversed(sizes) if s <= i) for i in range(steps)]
    return [f"  DeviceLoader over batch_sizes {sizes}: {steps} steps, sizes as scheduled: {seen == want}, "
            f"every batch equal to the host's: {equal}"]


def jax_part(cfg: DataConfig, steps: int) -> list[str]:
    import jax

    from forge_grain.bridges.jax import JaxIterator

    dev = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    p = Pipeline(cfg, 0, 1, num_threads=2)
    host = [p.batch(s) for s in range(steps)]
    rows = []
    for name in ("jax.device_put", "JaxIterator"):
        t0 = time.perf_counter()
        equal = True
        if name == "JaxIterator":
            it = JaxIterator(Pipeline(cfg, 0, 1, num_threads=2), sharding)
            for i in range(steps):
                b = next(it)
                if i % 25 == 0:
                    equal &= all(np.array_equal(np.asarray(b[k]), host[i][k]) for k in b if k in host[i])
                b["inputs"].block_until_ready()
        else:
            for i in range(steps):
                b = {k: jax.device_put(v, dev) for k, v in p.batch(i).items() if k != "step"}
                if i % 25 == 0:
                    equal &= all(np.array_equal(np.asarray(b[k]), host[i][k]) for k in b)
                b["inputs"].block_until_ready()
        rows.append((name, time.perf_counter() - t0, equal))
    out = [f"jax {jax.__version__} on {dev.device_kind} ({dev.platform}): {steps} steps"]
    for name, secs, equal in rows:
        out.append(f"  {name:<20} {steps / secs:8.1f} steps/s  {rows[0][1] / secs:5.2f}x  batches equal the host's: {equal}")
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--work", type=int, default=20, help="bf16 4096^3 matrix products per step")
    ap.add_argument("--docs", type=int, default=60_000)
    a = ap.parse_args()
    store = synthetic(Path(tempfile.mkdtemp(prefix="forge-grain-device-")) / "s", a.docs)
    cfg = DataConfig.from_dict(dict(sources=[dict(name="s", path=str(store), strategy="bos_bestfit")],
                                    seq_len=a.seq_len, global_batch_size=a.batch, num_epochs=None))
    lines = torch_part(cfg, a.steps, a.work) + schedule_part(cfg) + jax_part(cfg, a.steps)
    publish("device", lines)


if __name__ == "__main__":
    main()
