"""Prepare on Apache Beam's local runner against local `prepare`, on the same corpus, in one run.

    python benchmarks/bench_beam.py [--max-files 800] [--shards 8]

The demo's Python-source corpus (JSON Lines, split into 4 files) is prepared into `--shards`
shards by local `prepare` at 1 and 2 processes and by `prepare --runner beam` on the
DirectRunner in this process and on 2 worker processes. Every output must be byte-identical
to local `prepare`'s (checked). Times include each runner's start-up and, for Beam, its
counting job. From the measured rate of one Beam worker, a worked estimate of the wall time
for 1 T tokens on N Dataflow workers (one SDK process per vCPU; shards are independent, so
the work divides until there are more workers than shards).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path

from forge_grain import TokenStore, prepare
from forge_grain.demo import write_demo_corpus
from report import parser, publish

RUNS = {
    "local prepare, 1 process": dict(num_proc=1),
    "local prepare, 2 processes": dict(num_proc=2),
    "beam DirectRunner, in process": dict(runner="beam", beam_options=["--direct_num_workers=1"]),
    "beam DirectRunner, 2 worker processes": dict(
        runner="beam", beam_options=["--direct_num_workers=2", "--direct_running_mode=multi_processing"]),
}


def split_corpus(corpus: Path, out: Path, parts: int) -> Path:
    lines = corpus.read_text().splitlines(keepends=True)
    out.mkdir()
    for k in range(parts):
        (out / f"part-{k}.jsonl").write_text("".join(lines[k * len(lines) // parts:(k + 1) * len(lines) // parts]))
    return out


def files_of(store: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(store.iterdir()) if f.is_file() and not f.name.startswith(".")}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--max-files", type=int, default=800)
    ap.add_argument("--shards", type=int, default=8)
    args = ap.parse_args()
    logging.getLogger("apache_beam").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = split_corpus(write_demo_corpus(work / "corpus", args.max_files)["code"], work / "in", 4)
        mb = sum(f.stat().st_size for f in corpus.iterdir()) / 1e6
        lines = [f"corpus: {mb:.1f} MB of Python source in 4 JSON Lines files, {args.shards} shards", "",
                 f"{'runner':<40}{'wall s':>8}{'M tokens/s':>12}{'vs local 1 proc':>17}  same bytes"]
        reference, rates = None, {}
        for name, kw in RUNS.items():
            out = work / name.replace(" ", "-").replace(",", "")
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            prepare(corpus, out, num_shards=args.shards, progress=False, **kw)
            wall = time.perf_counter() - t0
            tokens = TokenStore.open(out).num_tokens
            reference = reference or files_of(out)
            rates[name] = tokens / wall
            base = rates["local prepare, 1 process"]
            lines.append(f"{name:<40}{wall:>8.2f}{tokens / wall / 1e6:>12.2f}{tokens / wall / base:>16.2f}x  "
                         f"{files_of(out) == reference}")
            print(lines[-1], flush=True)
        worker = rates["beam DirectRunner, in process"]
        lines += ["", f"one Beam worker here: {worker / 1e6:.2f} M tokens/s (start-up and counting included)",
                  "1 T tokens at that rate per worker (one vCPU each), shards independent:"]
        for n in (100, 500, 2000):
            hours = 1e12 / (worker * n) / 3600
            lines.append(f"  {n:>5} workers: {hours:6.1f} h  (needs at least {n} shards: --num-shards >= {n})")
    publish("beam", lines)


if __name__ == "__main__":
    main()
