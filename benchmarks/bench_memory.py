"""Resident memory of a pipeline against the documents of its store.

    python benchmarks/bench_memory.py [--docs 2000000 6000000] [--shards 1 64]

For each size and shard count, a forge-grain store of log-uniform short documents (2-200
tokens) is written, planned once, and then, in a fresh process, a `Pipeline` over it is
built, 20 batches are read and 1,000 documents opened at random. The growth of the
process's anonymous memory (`RssAnon`: what it holds beyond the page cache of the mapped
files) over that work is reported, and the growth per document between the sizes: what a
pipeline costs per document per process (every worker process pays it again).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from report import parser, publish

MEASURE = """
import sys
from forge_grain import DataConfig, Pipeline
cfg = DataConfig.from_dict(dict(sources=[dict(name="a", path=sys.argv[1], strategy="bos_bestfit")], seq_len=512,
                                global_batch_size=16, seed=0))
def anonymous():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
if sys.argv[2] == "plan":  # plan, and compile the kernels into numba's cache: not part of the measure
    next(Pipeline(cfg, 0, 1).iterator())
    sys.exit()
before = anonymous()
pipe = Pipeline(cfg, 0, 1, num_threads=0)
it = pipe.iterator()
for _ in range(20):
    next(it)
store = pipe.stores[0]
for i in range(0, len(store), max(1, len(store) // 1000)):
    store[i]
print(anonymous() - before)
"""


def write(path: Path, num_docs: int, shards: int) -> Path:
    from forge_grain.stores.manifest import MANIFEST_NAME
    from forge_grain.files import sha256_file
    from forge_grain.stores.writer import write_store

    path.mkdir(parents=True)
    rng = np.random.default_rng(0)
    manifest = json.loads((write_store(path / "template", [np.array([0, 5, 6])], vocab_size=1000, bos_id=0,
                                       eos_id=1) / MANIFEST_NAME).read_text())
    manifest["shards"], per = [], num_docs // shards
    for s in range(shards):
        offsets = np.concatenate([[0], np.cumsum(rng.integers(2, 200, per))]).astype(np.int64)
        tokens = rng.integers(2, 1000, int(offsets[-1])).astype(np.uint16)
        tokens[offsets[:-1]] = 0
        tokens.tofile(path / f"shard-{s:05d}.bin")
        np.save(path / f"shard-{s:05d}.idx.npy", offsets)
        manifest["shards"].append(dict(tokens=f"shard-{s:05d}.bin", index=f"shard-{s:05d}.idx.npy", num_documents=per,
                                       num_tokens=int(offsets[-1]), sha256=sha256_file(path / f"shard-{s:05d}.bin")))
    manifest["num_documents"] = per * shards
    manifest["num_tokens"] = sum(s["num_tokens"] for s in manifest["shards"])
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    return path


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--docs", type=int, nargs=2, default=[2_000_000, 6_000_000])
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 64])
    args = ap.parse_args()
    lines = ["anonymous memory a pipeline holds (build, 20 batches, 1,000 random documents), fresh process per run:"]
    with tempfile.TemporaryDirectory() as tmp:
        for shards in args.shards:
            grown = []
            for n in args.docs:
                store = write(Path(tmp) / f"{n}-{shards}", n, shards)
                subprocess.run([sys.executable, "-c", MEASURE, str(store), "plan"], check=True, capture_output=True)
                r = subprocess.run([sys.executable, "-c", MEASURE, str(store), "measure"], check=True,
                                   capture_output=True, text=True)
                grown.append(int(r.stdout.split()[-1]))
                lines.append(f"  {n:>11,} documents, {shards:>3} shard(s): {grown[-1] / 1e6:7.1f} MB")
                print(lines[-1], flush=True)
            per_doc = (grown[1] - grown[0]) / (args.docs[1] - args.docs[0])
            lines.append(f"  {shards:>3} shard(s): {per_doc:.1f} bytes per document")
    publish("memory", lines)


if __name__ == "__main__":
    main()
