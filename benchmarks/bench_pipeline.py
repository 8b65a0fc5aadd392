"""The pipeline against a Grain-native pipeline over the same sources, in one run.

    python benchmarks/bench_pipeline.py [--docs 20000] [--seq-len 2048] [--batch 64] [--steps 200]

1. Throughput (steps/s, tokens/s): forge-grain's Pipeline (two sources, bos_bestfit and
   bestfit, weights 0.7/0.3) with 1 and 2 prefetch threads and with 1 and 2 `mp_prefetch`
   worker processes, against `IterDataset.mix` of two `BestFitPackIterDataset`s followed by
   `batch`, Grain's own way to build the same stream.
2. Restore at step 10^6: `set_state` plus the first batch, against the Grain pipeline
   restored at a comparable position (its packers re-pack the current window).
3. A 100-source mixture: construction time, time to the first batch and peak memory of the
   process, against `grain.IterDataset.mix` over 100 `BestFitPackIterDataset`s, each in a
   fresh process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from corpora import synthetic_store  # noqa: E402
from report import kept, parser  # noqa: E402


def forge_config(paths, seq_len, batch, num_sources=2):
    from forge_grain import DataConfig

    strategies = ["bos_bestfit", "bestfit"]
    weights = [0.7, 0.3] if num_sources == 2 else [1.0 + i % 5 for i in range(num_sources)]
    return DataConfig(
        sources=[dict(name=f"s{i}", path=str(paths[i % len(paths)]), weight=weights[i], strategy=strategies[i % 2])
                 for i in range(num_sources)],
        seq_len=seq_len, global_batch_size=batch, seed=0, num_epochs=None,
    )


def grain_pipeline(paths, seq_len, batch, num_sources=2):
    import grain
    from grain.experimental import BestFitPackIterDataset

    from forge_grain import TokenStore

    weights = [0.7, 0.3] if num_sources == 2 else [1.0 + i % 5 for i in range(num_sources)]
    packed = []
    for i in range(num_sources):
        store = TokenStore.open(paths[i % len(paths)])
        docs = (grain.MapDataset.source(store).shuffle(seed=i).repeat(None)
                .map(lambda d: {"inputs": d[:seq_len].astype(np.int32)}).to_iter_dataset())
        packed.append(BestFitPackIterDataset(docs, length_struct={"inputs": seq_len}, num_packing_bins=512,
                                             shuffle_bins=False))
    return grain.IterDataset.mix(packed, weights).batch(batch)


def timed_steps(it, steps):
    next(it)  # warm up: first plans, compilation, worker start
    t0 = time.perf_counter()
    for _ in range(steps):
        next(it)
    return steps / (time.perf_counter() - t0)


def throughput(paths, args):
    from forge_grain import Pipeline
    from forge_grain.absl_flags import ensure_absl_flags_parsed

    ensure_absl_flags_parsed()
    cfg = forge_config(paths, args.seq_len, args.batch)
    tokens = args.batch * args.seq_len
    rows = []
    for label, kw in (("1 thread", dict(num_threads=1)), ("2 threads", dict(num_threads=2)),
                      ("1 worker process", dict(worker_count=1)), ("2 worker processes", dict(worker_count=2))):
        it = iter(Pipeline(cfg, 0, 1, **kw))
        sps = timed_steps(it, args.steps)
        it.close()
        rows.append((f"forge-grain Pipeline, {label}", sps))
    it = iter(grain_pipeline(paths, args.seq_len, args.batch))
    # enough steps to span many of the packers' 512-bin windows (each is packed at once, then emitted)
    rows.append(("Grain IterDataset.mix(BestFitPack) + batch", timed_steps(it, 100)))
    base = rows[-1][1]
    print(f"\nthroughput, seq_len {args.seq_len}, global batch {args.batch}, 2 sources")
    print(f"{'pipeline':<48}{'steps/s':>10}{'M tok/s':>10}{'vs Grain':>10}")
    for name, sps in rows:
        print(f"{name:<48}{sps:>10.1f}{sps * tokens / 1e6:>10.1f}{sps / base:>9.0f}x")


def restore(paths, args, step=10**6):
    from forge_grain import Pipeline

    p = Pipeline(forge_config(paths, args.seq_len, args.batch), 0, 1)
    state = p.state_at(step)
    it = p.iterator()
    next(it)
    t0 = time.perf_counter()
    it.set_state(state)
    batch = next(it)
    ours = time.perf_counter() - t0
    assert int(batch["step"]) == step
    it.close()

    git = iter(grain_pipeline(paths, args.seq_len, args.batch))
    next(git)
    gstate = git.get_state()
    for parent in gstate["parents"]:  # a position about 10^6 batches in, mid-window
        parent["parent"]["next_index"] = step * args.batch
        parent["next_row"] = 300
        parent["counter"] = step * args.batch
    gstate["index"] = step * args.batch
    t0 = time.perf_counter()
    git.set_state(gstate)
    next(git)
    theirs = time.perf_counter() - t0
    print(f"\nrestore at step {step:,} (set_state + first batch)")
    print(f"  forge-grain Pipeline          {ours * 1e3:>9.1f} ms")
    print(f"  Grain mix(BestFitPack)        {theirs * 1e3:>9.1f} ms   ({theirs / ours:.0f}x forge-grain's)")


CHILD = """
import json, resource, sys, time
sys.path.insert(0, {bench!r})
import numpy as np
from bench_pipeline import forge_config, grain_pipeline
paths, seq_len, batch, kind = {paths!r}, {seq_len}, {batch}, {kind!r}
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
if kind == "forge":
    from forge_grain import Pipeline
    it = iter(Pipeline(forge_config(paths, seq_len, batch, 100), 0, 1, num_threads=0))
else:
    it = iter(grain_pipeline(paths, seq_len, batch, 100))
built = time.perf_counter() - t0
next(it)
first = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(dict(built=built, first=first, mem_mb=(peak - base) / 1024)))
"""


def hundred_sources(paths, args):
    out = {}
    for kind in ("forge", "grain"):
        code = CHILD.format(bench=str(Path(__file__).parent), paths=[str(p) for p in paths], seq_len=args.seq_len,
                            batch=args.batch, kind=kind)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        out[kind] = json.loads(r.stdout.strip().splitlines()[-1])
    print("\n100-source mixture (fresh process each; memory = peak RSS growth while building and reading a batch)")
    print(f"{'':<32}{'build s':>9}{'first batch s':>15}{'memory MB':>11}")
    for kind, label in (("forge", "forge-grain Pipeline"), ("grain", "Grain IterDataset.mix")):
        d = out[kind]
        print(f"{label:<32}{d['built']:>9.2f}{d['first']:>15.2f}{d['mem_mb']:>11.0f}")
    f, g = out["forge"], out["grain"]
    print(f"{'ratio Grain / forge-grain':<32}{g['built'] / f['built']:>8.1f}x{g['first'] / f['first']:>14.1f}x"
          f"{g['mem_mb'] / max(f['mem_mb'], 1):>10.1f}x")


def parse_args(doc: str):
    """The options both pipeline-level benchmarks take."""
    ap = parser(doc)
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    return ap.parse_args()


def two_sources(tmp: str, docs: int) -> list[Path]:
    return [synthetic_store(Path(tmp) / f"src{i}", docs, seed=i).path for i in range(2)]


def main():
    args = parse_args(__doc__)
    with tempfile.TemporaryDirectory() as tmp, kept("pipeline"):
        paths = two_sources(tmp, args.docs)
        throughput(paths, args)
        restore(paths, args)
        hundred_sources(paths, args)


if __name__ == "__main__":
    main()
