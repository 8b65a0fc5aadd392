"""Planning at scale: time and peak memory of whole-corpus against chunked planning.

    python benchmarks/bench_planning.py [--docs 1000000 10000000 30000000] [--seq-len 2048]
                                        [--chunk-docs 4194304] [--strategies bestfit bos_bestfit concat]

Document lengths are log-normal (median 600 tokens, sigma 1), as in the other benchmarks;
offsets are written once per size and memory-mapped by each run. Every run is a fresh
process, so its peak RSS (`ru_maxrss`, offsets included) is its own; chunked runs with 2
workers report the parent's peak and the largest worker's (its VmRSS sampled every 50 ms:
a child's `ru_maxrss` starts at its parent's RSS when forked, which made workers look as
large as the corpus). Peak RSS counts the pages of
memory-mapped files a process touched (the offsets, the chunks' plans it joins), which the
kernel can drop; "anon" is the parent's peak anonymous memory (sampled every 20 ms), what
it really holds. "plan MB" is the plan's size on disk and "peak disk" the most the run's
directory held (the plan, its chunks, temporaries; sampled every 20 ms) as a multiple of it.
Then the per-core rate and what it predicts for 1 B documents.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from corpora import lognormal_lengths
from report import parser, publish

DISK = """
import os, signal, sys, time
def disk():
    total = 0
    for root, _, files in os.walk(sys.argv[1]):  # (os.walk passes over directories removed meanwhile)
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total
peak = now = 0
def stop(*_):
    print(peak, now, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    now = disk()
    peak = max(peak, now)
    time.sleep(0.01)
"""

RUN = "DISK = " + repr(DISK) + """
import json, resource, sys, time
from pathlib import Path
from forge_grain.stores.mapping import map_npy
from forge_grain.packing.plans import plan_offsets
from forge_grain.packing.chunked import plan_chunked
offsets_file, strategy, seq_len, mode, chunk_docs, out = sys.argv[1:]
import threading
def anonymous():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024
peak_anon, peak_worker = [0.0], [0.0]
def children_rss():
    # the largest VmRSS of this process's children (the planning workers); not ru_maxrss:
    # a child's high-water mark starts at its parent's RSS when it was forked
    import glob, os
    me, most = f"PPid:\\t{os.getpid()}\\n", 0.0
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            text = open(status).read()
        except OSError:
            continue
        if me in text:  # (the disk sampler too: a small process)
            for line in text.splitlines():
                if line.startswith("VmRSS"):
                    most = max(most, int(line.split()[1]) / 1024)
    return most
def sample():
    while True:
        peak_anon[0] = max(peak_anon[0], anonymous())
        peak_worker[0] = max(peak_worker[0], children_rss())
        time.sleep(0.05)
import subprocess
# the disk is sampled by another process: this one's threads wait on the GIL while the kernels plan
disk_sampler = subprocess.Popen([sys.executable, "-c", DISK, str(Path(out).parent)], stdout=subprocess.PIPE, text=True)
threading.Thread(target=sample, daemon=True).start()
offsets = map_npy(offsets_file)
import numpy as np
plan_offsets(np.arange(0, 50_000, 100), 512, strategy)  # compile or load the kernels first: planning is timed
t = time.perf_counter()
if mode == "whole":
    p = plan_offsets(offsets, int(seq_len), strategy)
else:
    p = plan_chunked(offsets, int(seq_len), strategy, Path(out), chunk_docs=int(chunk_docs), workers=int(mode),
                     progress=False)
seconds = time.perf_counter() - t
time.sleep(0.1)  # a last sample of the finished plan
disk_sampler.terminate()
peak_disk, final_disk = (int(x) for x in disk_sampler.communicate()[0].split())
mb = lambda who: resource.getrusage(who).ru_maxrss / 1024
print(json.dumps({"seconds": seconds, "rss_mb": mb(resource.RUSAGE_SELF), "worker_rss_mb": peak_worker[0],
                  "anon_mb": peak_anon[0], "disk_mb": peak_disk / 2**20, "plan_mb": final_disk / 2**20,
                  "fill": p.stats["fill"], "crop": p.stats["cropped_share"]}))
"""


def run(offsets_file: Path, strategy: str, seq_len: int, mode: str, chunk_docs: int, work: Path) -> dict:
    out = work / "run" / f"plan-{strategy}-{mode}-{offsets_file.stem}"  # alone in its directory: its disk is measured
    out.parent.mkdir(exist_ok=True)
    r = subprocess.run([sys.executable, "-c", RUN, str(offsets_file), strategy, str(seq_len), mode, str(chunk_docs),
                        str(out)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    subprocess.run(["rm", "-rf", str(out.parent)])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--docs", type=int, nargs="+", default=[1_000_000, 10_000_000, 30_000_000])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--chunk-docs", type=int, default=1 << 22)
    ap.add_argument("--strategies", nargs="+", default=["bestfit", "bos_bestfit", "concat"])
    ap.add_argument("--modes", nargs="+", default=["whole", "1", "2"], help="whole corpus, chunked on 1 or 2 processes")
    args = ap.parse_args()
    lines = [f"planning, seq_len {args.seq_len}, chunks of {args.chunk_docs:,} documents; "
             "peak RSS per process (offsets, 8 B/document, included)", "",
             f"{'documents':>12} {'strategy':<12} {'mode':<16} {'seconds':>8} {'M docs/s':>9} {'peak RSS MB':>12} "
             f"{'anon MB':>8} {'worker MB':>10} {'plan MB':>8} {'peak disk':>10} {'fill':>8} {'crop':>7}"]
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for n in args.docs:
            offsets_file = work / f"offsets-{n}.npy"
            np.save(offsets_file, np.concatenate([[0], np.cumsum(lognormal_lengths(n))]).astype(np.int64))
            for strategy in args.strategies:
                for mode in args.modes:
                    if mode != "whole" and n <= args.chunk_docs:
                        continue
                    r = run(offsets_file, strategy, args.seq_len, mode, args.chunk_docs, work)
                    label = "whole corpus" if mode == "whole" else f"chunked, {mode} proc"
                    worker = f"{r['worker_rss_mb']:10.0f}" if mode == "2" else f"{'':>10}"
                    lines.append(f"{n:>12,} {strategy:<12} {label:<16} {r['seconds']:8.2f} {n / r['seconds'] / 1e6:9.2f} "
                                 f"{r['rss_mb']:12.0f} {r['anon_mb']:8.0f} {worker} "
                                 + (f"{r['plan_mb']:8.0f} {r['disk_mb'] / r['plan_mb']:9.2f}x " if r["plan_mb"]
                                    else f"{'(memory)':>8} {'':>10} ")
                                 + f"{r['fill']:8.5f} {r['crop']:7.4f}")
                    rates[(n, strategy, mode)] = r
                    print(lines[-1], flush=True)
            offsets_file.unlink()
    lines += ["", "extrapolated to 1 B documents (from the largest size measured):"]
    n = max(args.docs)
    for strategy in args.strategies:
        whole, one, two = (rates.get((n, strategy, m)) for m in ("whole", "1", "2"))
        if whole:
            lines.append(f"  {strategy:<12} whole corpus: {whole['seconds'] * 1e9 / n / 60:6.1f} min on one core, "
                         f"peak {whole['rss_mb'] * 1e9 / n / 1024:6.1f} GB")
        if one and two:
            per_core = n / one["seconds"]
            lines.append(f"  {strategy:<12} chunked: {per_core / 1e6:.2f} M docs/s per core, {1e9 / per_core / 16:5.1f} s "
                         f"on 16 cores; 2 processes {one['seconds'] / two['seconds']:.2f}x one; peak per worker "
                         f"{two['worker_rss_mb'] / 1024:.2f} GB (bounded by the chunk); parent "
                         f"{two['anon_mb'] / 1024:.2f} GB anonymous at {n:,} documents")
    publish("planning", lines)


if __name__ == "__main__":
    main()
