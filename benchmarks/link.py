"""Readers of object storage behind a shaped link, for `bench_scale.py --link ttfb_ms=30,mbps=10`.

A store of uint16 tokens in `shards` shards is uploaded to moto (its own process), and read
through `shaped_link.py` (its own process: `ttfb_ms` to every answer's first byte, each
connection paced to `mbps` MB/s), so the link, not this 2-core machine, is the limit; the
machine's idle CPU is reported beside each figure so a reader can check that. Measured in
one run: the link's ceiling (obstore reading every shard once with 8 and with 32 ranged GETs
in flight, parts of at most 8 MiB), forge-grain with its defaults reading a whole epoch from
the request (pipeline build and first batch included; batches made in the consumer's thread,
`num_threads=0`, the default, as the peers' loaders with 0 workers make them, and with 2 batch
threads: a loop of bare `next()` never releases the GIL, so batch threads only hand batches
across it), and the peers reading the same uint16
tokens from the same link (LitData's `StreamingDataset` with `TokensLoader`, MosaicML
Streaming), each as a fraction of the 32-GET ceiling.
"""

from __future__ import annotations

import concurrent.futures
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

PART = 8 << 20


def parse_link(spec: str) -> tuple[float, float]:
    """`ttfb_ms=30,mbps=10` -> (30.0, 10.0)."""
    values = {"ttfb_ms": 30.0, "mbps": 10.0}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in values:
            raise SystemExit(f"--link: unknown key {key!r} (ttfb_ms, mbps)")
        values[key] = float(value)
    return values["ttfb_ms"], values["mbps"]


def start_link(upstream: int | list[int], ttfb_ms: float, mbps: float) -> tuple[int, subprocess.Popen]:
    """`shaped_link.py` in front of the server at `upstream` (or the servers holding the same
    objects at several ports); its port and process."""
    ports = ",".join(str(p) for p in ([upstream] if isinstance(upstream, int) else upstream))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("shaped_link.py")), ports,
                             "--ttfb-ms", str(ttfb_ms), "--mbps", str(mbps)], stdout=subprocess.PIPE, text=True)
    return int(proc.stdout.readline()), proc


class Idle:
    """The machine's idle CPU share over a block (from /proc/stat)."""

    def __enter__(self):
        self.start = _cpu()
        return self

    def __exit__(self, *exc):
        end = _cpu()
        total = sum(end) - sum(self.start)
        self.share = (end[3] + end[4] - self.start[3] - self.start[4]) / total if total else 0.0


def _cpu() -> list[int]:
    with open("/proc/stat") as f:
        return [int(v) for v in f.readline().split()[1:]]


def ceiling(url: str, opts: dict, sizes: dict[str, int], in_flight: int) -> tuple[float, float]:
    """(tokens/s, idle share): every object read once, `in_flight` ranged GETs of at most
    `PART` bytes at a time, through obstore (the client forge-grain reads with)."""
    from forge_grain.stores.remote_dir import RemoteDir

    remote = RemoteDir(url, opts)
    parts = [(n, a, min(a + PART, s)) for n, s in sizes.items() for a in range(0, s, PART)]
    with Idle() as idle:
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
            got = sum(len(b) for b in pool.map(lambda p: remote.read_range(*p), parts))
        elapsed = time.perf_counter() - t
    assert got == sum(sizes.values())
    return got / 2 / elapsed, idle.share


def cpu_seconds() -> float:
    """This process's CPU time, all its threads, user and system."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def cold_epoch(config: dict, steps: int | None = None, **pipeline_options) -> dict:
    """`forge_grain_epoch` of `config` (`DataConfig.from_dict`'s) in a cold process of its own,
    as a training job starts and as a peer's reader is measured (its library imported first,
    everything after counted). In one process, a pipeline read for part of an epoch left its
    downloads ahead running (up to 64 shards of each source), sharing the link with the next
    reader measured (one source after a mixture of 8 read 10.4 M tok/s, in its own process
    17.5-21.2); and the first reader alone paid the process's one-time setup (numba's, about
    half a second of a core here): a global shuffle read first spent 8.9 core-seconds a GB,
    read after another reader 3.9-4.4, as the docs' settings."""
    code = ("import json, sys; from link import forge_grain_epoch; from forge_grain import DataConfig; "
            "print(json.dumps(forge_grain_epoch(DataConfig.from_dict(json.loads(sys.argv[1])), json.loads(sys.argv[2]), "
            "**json.loads(sys.argv[3]))))")
    # run in this directory (`-c` puts the working directory first on the path: from a checkout's
    # root that is its package, ahead of a PYTHONPATH naming another version to compare)
    done = subprocess.run([sys.executable, "-c", code, json.dumps(config), json.dumps(steps),
                           json.dumps(pipeline_options)], cwd=Path(__file__).parent, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"forge-grain's epoch failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def forge_grain_epoch(cfg, steps: int | None = None, **pipeline_options) -> dict:
    """A whole epoch of `cfg` from the request (or its first batch and `steps` more): first
    batch s, the build's s, tokens/s delivered, idle share, and core-seconds per GB of tokens
    delivered (the loader's process only: the server and the link run in their own)."""
    import itertools

    from forge_grain import Pipeline

    with Idle() as idle:
        cpu = cpu_seconds()
        t = time.perf_counter()
        pipe = Pipeline(cfg, 0, 1, **pipeline_options)
        build = time.perf_counter() - t
        it = pipe.iterator()
        batch = next(it)
        first = time.perf_counter() - t
        tokens = batch["segment_ids"].size
        for batch in it if steps is None else itertools.islice(it, steps):
            tokens += batch["segment_ids"].size
        elapsed = time.perf_counter() - t
        cpu = cpu_seconds() - cpu
    return {"first": first, "build": build, "rate": tokens / elapsed, "idle": idle.share, "steps": pipe.num_steps,
            "cpu_per_gb": cpu / (tokens * 2 / 1e9)}  # the store's uint16 tokens
