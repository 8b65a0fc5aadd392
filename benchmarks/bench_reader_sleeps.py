"""Where a bounded epoch's reader sleeps: the regime of a host of many cores, imitated on few.

    python benchmarks/bench_reader_sleeps.py [--docs 200000] [--readers megatron,store]
        [--limits 2,0] [--rounds 2] [--old PATH] [--files 16] [--batch 8]

On a host of 16 cores the bounded Megatron epoch of `bench_cache_limit.py --link` is bound
neither by the link nor by the reader's CPU but by the interpreter's lock: the reader sleeps
thousands of times an epoch to take it back from the download threads. On two cores the
server, the link and the loader share the cores and hide that. Here the same epoch runs with
each ranged GET of a data file answered in this process from the local file after the link's
delay (`--ttfb-ms` plus its bytes at `--mbps` a connection): no server or link process takes
a core, and what is left is the reader and its download threads sharing the lock. Listings,
the manifest and the indices still come from a moto server. This is an imitation, not a
measurement of a link: it leaves out the client's own work on each answer. Each epoch runs
in a process of its own after a warm-up epoch (the store, unbounded: imports, compiled
kernels, the request pool grown), and reports its seconds (the open included), the reader's
CPU, and the voluntary context switches (sleeps, from `/proc`) of the reader (taking the
lock back, or waiting for a block), of the download threads (a store's threads fetching
shards or blocks ahead) and of the request threads, and those threads' CPU (user and system),
counting the threads alive at its end; then its data GETs and how many were in flight on
average (the seconds they took over the epoch's, the open included).
`--files` and `--batch` shape the store and the steps: many small files read a row a step
make the most blocks of steps for the hints of object storage to look up.
`--old PATH` runs each epoch a second time with the `forge_grain` package at PATH (a copy
of an earlier version) in turn, for a comparison in the same run.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sleeps() -> dict:
    """Voluntary context switches so far of each of this process's threads: (its kind, its
    count) by thread id. The kind is its name less a number at its end: "reader" (the main
    thread), "download" (a store's threads fetching shards or blocks ahead: forge-grain-fetch,
    forge-grain-part), "get" (the request threads), or another."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    kinds = {"fetch": "download", "part": "download"}
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            status = open(f"/proc/self/task/{tid}/status").read()
        except OSError:  # (ended meanwhile)
            continue
        count = int(re.search(r"^voluntary_ctxt_switches:\s*(\d+)", status, re.M).group(1))
        try:  # (user and system CPU, in clock ticks: fields 14 and 15 of stat, after the name in parentheses)
            ticks = sum(int(x) for x in open(f"/proc/self/task/{tid}/stat").read().rpartition(")")[2].split()[11:13])
        except OSError:
            continue
        name = re.sub(r"^forge-grain-", "", re.sub(r"[_-]?\d+$", "", names.get(int(tid), "other")))
        kind = "reader" if int(tid) == threading.main_thread().native_id else kinds.get(name, name)
        out[int(tid)] = (kind, count, ticks / TICKS)
    return out


TICKS = os.sysconf("SC_CLK_TCK")


def _grown(before: dict, after: dict) -> tuple:
    """Sleeps and CPU seconds by kind between two `_sleeps`, of the threads alive at the second."""
    sleeps: collections.Counter = collections.Counter()
    cpu: collections.Counter = collections.Counter()
    for tid, (kind, count, seconds) in after.items():
        _, count0, seconds0 = before.get(tid, (kind, 0, 0.0))
        sleeps[kind] += count - count0
        cpu[kind] += seconds - seconds0
    return sleeps, cpu


def child(args) -> None:
    """The epochs, in this process (the package first on the path is the one measured)."""
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
    import bench_cache_limit as bench
    from forge_grain.stores import remote_dir

    local = json.loads(args.local)
    delay, rate = args.ttfb_ms / 1e3, args.mbps * 1e6
    read = remote_dir.RemoteDir.read_bounded
    busy = []  # (seconds each data GET took: their sum over the epoch's is the mean of those in flight)

    def imitated(self, name, start, end=None, if_match=None):
        path = local.get(f"{self.url}/{name}")
        if path is None or end is None:  # (listings, indices, a read of unknown size: the server)
            return read(self, name, start, end, if_match)
        began = time.perf_counter()
        time.sleep(delay + (end - start) / rate)
        fd = os.open(path, os.O_RDONLY)
        try:
            return memoryview(os.pread(fd, end - start, start))
        finally:
            os.close(fd)
            busy.append(time.perf_counter() - began)

    remote_dir.RemoteDir.read_bounded = imitated

    class Unseen:  # (no proxy: nothing counts bytes here)
        port, sent, gets = args.port, {}, {}

        def clear(self):
            pass

    work = Path(args.work)
    bench.forge_grain(Unseen(), args.port, "s3://bench/store", None, work)  # (warm: imports, compiled kernels)
    before, cpu, began = _sleeps(), time.thread_time(), time.perf_counter()
    busy.clear()
    got = bench.forge_grain(Unseen(), args.port, f"s3://bench/{args.readers}", int(args.limits) * args.unit or None,
                            work, batch=args.batch)
    slept, used = _grown(before, _sleeps())
    flying = sum(busy) / (time.perf_counter() - began)
    print(json.dumps({"seconds": got.get("seconds"), "error": got.get("error"), "cpu": time.thread_time() - cpu,
                      "gets": len(busy), "in_flight": flying,
                      "sleeps": {kind: slept[kind] for kind in ("reader", "download", "get")},
                      "threads_cpu": {kind: used[kind] for kind in ("download", "get")}}), flush=True)


def main() -> None:
    from report import parser

    ap = parser(__doc__)
    ap.add_argument("--docs", type=int, default=200_000, help="documents (median 600 tokens; 200,000: about 400 MB)")
    ap.add_argument("--readers", default="megatron,store", help="comma-separated: megatron, store")
    ap.add_argument("--limits", default="2,0", help="cache_limit in files' worth, comma-separated (0: unbounded)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ttfb-ms", type=float, default=30.0)
    ap.add_argument("--mbps", type=float, default=10.0, help="MB/s a connection")
    ap.add_argument("--files", type=int, default=16, help="the store's shards (a file's worth: the data / this)")
    ap.add_argument("--batch", type=int, default=8, help="rows of 2,048 tokens a step")
    ap.add_argument("--old", help="a directory holding an earlier `forge_grain` package, run in turn with this one")
    ap.add_argument("--work", default="/tmp/forge-grain-bench-sleeps")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--unit", type=int, help=argparse.SUPPRESS)  # (a file's worth of bytes)
    ap.add_argument("--local", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a)
    sys.path[:0] = [str(ROOT / "tests")]
    import numpy as np
    import s3fs
    from corpora import sharded_synthetic_store
    from servers import start_servers
    from test_formats import write_megatron

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    dirs = {name: work / f"{name}-{a.docs}-{a.files}" for name in ("store", "megatron")}  # (the data of these options)
    store = sharded_synthetic_store(dirs["store"], a.docs, a.files)
    if not (dirs["megatron"] / "text_document.bin").exists():
        dirs["megatron"].mkdir(exist_ok=True)
        write_megatron(dirs["megatron"] / "text_document", [store[i] for i in range(len(store))], dtype=np.uint16)
    ports, procs = start_servers(work, 1)
    try:
        fs = s3fs.S3FileSystem(key="bench", secret="bench", endpoint_url=f"http://127.0.0.1:{ports[0]}")
        fs.mkdir("bench")
        local = {}
        for name, path in dirs.items():
            fs.put(str(path), f"bench/{name}", recursive=True)
            local.update({f"s3://bench/{name}/{f.name}": str(f) for f in path.iterdir() if f.is_file()})
        size = sum(f.stat().st_size for f in store.path.glob("*.bin"))
        print(f"{len(store):,} documents, {size / 1e6:.1f} MB of uint16 tokens ({a.files} files' worth), "
              f"{a.batch} rows a step; GETs of data files answered in-process after {a.ttfb_ms:g} ms + bytes at "
              f"{a.mbps:g} MB/s a connection", flush=True)
        versions = [("this", None)] + ([("old", a.old)] if a.old else [])
        for _ in range(a.rounds):
            for reader in a.readers.split(","):
                for k in [int(k) for k in a.limits.split(",")]:
                    for label, path in versions:  # (each epoch in a process of its own, after a warm-up epoch)
                        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, str(ROOT)]))}
                        cmd = [sys.executable, "-W", "ignore", __file__, "--child", "--port", str(ports[0]),
                               "--unit", str(size // a.files), "--batch", str(a.batch), "--local", json.dumps(local),
                               "--readers", reader,
                               "--limits", str(k), "--work", str(work),
                               "--ttfb-ms", str(a.ttfb_ms), "--mbps", str(a.mbps)]
                        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
                        if out.returncode:
                            raise SystemExit(out.stderr[-3000:])
                        r = json.loads(out.stdout.splitlines()[-1])
                        s = r["sleeps"]
                        print(f"  {label:5} {reader:9} {f'{k} files' if k else 'unbounded':>10}"
                              + (f"  failed: {r['error']}" if r["error"] else
                                 f"  {r['seconds']:6.2f} s  reader CPU {r['cpu']:5.2f} s  sleeps: reader "
                                 f"{s['reader']:6,}  download {s['download']:6,}  get {s['get']:6,}  CPU: download "
                                 f"{r['threads_cpu']['download']:5.2f} s  get {r['threads_cpu']['get']:5.2f} s  "
                                 f"GETs {r['gets']:,}, {r['in_flight']:.0f} in flight"),
                              flush=True)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
