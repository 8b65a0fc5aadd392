"""Bytes fetched per epoch under a bounded cache: forge-grain beside LitData and MosaicML Streaming.

    python benchmarks/bench_cache_limit.py [--docs 16000] [--peer-python PYTHON] [--out FILE]
        [--link ttfb_ms=30,mbps=10] [--readers TEXT] [--servers N] [--rounds N]

One corpus (synthetic documents of uint16 tokens, `corpora.sharded_synthetic_store`) is
uploaded to moto's S3 server (its own process) as a forge-grain store of 16 shards and a
Megatron file, and written by the peers' own writers (`--peer-python`: an environment with
`litdata` and `mosaicml-streaming`) as a LitData dataset of 16 chunks (`optimize`,
`TokensLoader`) and an MDS dataset of about 16 shards (`MDSWriter`). Every reader then reads
one epoch, shuffled, through a proxy that counts the bytes of the data files it serves (the
server's side: `tests/s3server.py`), under a cache limit of 2, 4 and 8 files' worth (a
sixteenth of the data each) and unbounded: forge-grain (its defaults, `cache_limit` only) over
its store, the Megatron file and the LitData dataset; LitData's `StreamingDataset`
(`max_cache_size`) and MosaicML's (`cache_limit`) over their own. Each cell is the bytes
fetched divided by the dataset's bytes; forge-grain's first open (which reads a LitData
chunk's documents out of it, and a Megatron index) is shown apart from its epoch. A reader
that fails, or hangs (no end of the epoch in `HUNG_S`), is recorded as such. Beside
forge-grain's figures: its epoch's rate against the unbounded one (from the request, the open
included: unbounded, an MDS dataset is copied at open), the shuffle it keeps (documents of at
most N files interleaved at a time), and on the link its first batch from the request. On 127.0.0.1 that rate measures the CPU the
server, the proxy and the loader share; with `--link` each epoch is read again through
`shaped_link.py` straight to the server, and the rates are that link's. The server is
`moto_server.py` (moto, its ranged GETs served at the cost of the range). Read flat out, a
reader is measured by its downloads alone; `--step-ms` adds a training step after each batch
(a sleep), and the rate says how much of the step time the reads could not hide. `--rounds N`
reads forge-grain's epochs on the link N times, the limits in turn, and gives the median rate
and its range: on two cores shared with the server and the link, one unbounded epoch took
1.8-2.8 s from one run to the next.

The server's own ceiling is measured too (ranged GETs of 512 KiB a second, 32 threads asking
straight to it), with each reader's GETs of data files (counted at the proxy; forge-grain's on
the link, counted by the reader, `count_gets`: it cuts its parts by the link): moto answers in
one Python process, about 400-500 GETs a second on one core whatever the machine, so an epoch
of G GETs spends at least G / that on the server, and a rate nearer the unbounded one than
that allows is not there to be had from this server. `--servers N` puts N moto servers
holding the same objects behind the link (`servers.py`: the first written as above, its
objects copied to the others with their ETags), which lifts that ceiling on a machine with
the cores to run them; on two cores the servers, the link and the loader share them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the counting proxy and the Megatron writer of the tests

from servers import mirror, start_servers  # noqa: E402
from corpora import sharded_synthetic_store  # noqa: E402
from report import parser

FILES, SEQ_LEN, BATCH = 16, 2048, 8
LIMITS = (2, 4, 8, None)  # files' worth of cache, None: unbounded
HUNG_S = 300  # a peer's epoch of this size takes seconds: one still running after this is stuck
DATA = (".bin", ".mds")  # data files' names end so (indices: .idx, .json)
PART = 1 << 19  # bytes of the ranged GETs the server's ceiling is measured with (forge-grain's parts ahead, at least)


def of_data(counts) -> int:
    """The sum of a proxy's counts (by path) over data files."""
    return sum(n for path, n in counts.items() if path.split("?")[0].endswith(DATA))


def served(proxy) -> int:
    return of_data(proxy.sent)


def asked(proxy) -> int:
    """GETs of data files the server answered."""
    return of_data(proxy.gets)


def server_ceiling(ports: list[int], name: str, size: int, part: int = PART, threads: int = 32,
                   seconds: float = 2.0) -> float:
    """Ranged GETs of `part` bytes a second that the servers at `ports` answer, asked for by
    `threads` threads at once (straight to them, spread evenly, through forge-grain's client):
    moto is one Python process, so each of its answers takes a share of one core whatever the
    machine's. An epoch of G GETs spends at least G / this on the servers."""
    import threading

    from forge_grain.stores.remote_dir import RemoteDir

    remotes = [RemoteDir(f"s3://bench/{name.rpartition('/')[0]}",
                         {"key": "bench", "secret": "bench", "endpoint_url": f"http://127.0.0.1:{port}"})
               for port in ports]
    leaf, done, stop = name.rpartition("/")[2], [0] * threads, time.perf_counter() + seconds

    def ask(k: int) -> None:
        at = k * part
        while time.perf_counter() < stop:
            at = (at + 7 * part) % (size - part)
            remotes[k % len(remotes)].read_range(leaf, at, at + part)
            done[k] += 1

    t = time.perf_counter()
    workers = [threading.Thread(target=ask, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(done) / (time.perf_counter() - t)


ASKED = [0]  # ranged GETs of data files this process asked (`count_gets`)


def count_gets() -> None:
    """Count this process's ranged GETs of data files (`ASKED`): forge-grain's epoch on the
    link goes straight to the server, not through the counting proxy, and cuts its parts by
    what a connection there carries (`request_pool.Carried`), so its GETs differ from its
    pass through the proxy."""
    from forge_grain.stores.remote_dir import RemoteDir

    read = RemoteDir.read_bounded

    def counted(self, name, *args, **kwargs):
        if str(name).endswith(DATA):
            ASKED[0] += 1
        return read(self, name, *args, **kwargs)

    RemoteDir.read_bounded = counted


def forge_grain(proxy, port: int, path: str, limit: int | None, work: Path, reach: int | None = None,
                step_s: float = 0.0, batch: int = BATCH) -> dict:
    """One epoch of a forge-grain source (defaults but `cache_limit`): the bytes its open and its
    epoch fetched, the epoch's seconds, and its order's shuffle. `reach`: the port it reads
    through (a shaped link to the server; default the proxy). `step_s`: a training step's
    seconds after each batch (a sleep: the GIL released, as a GPU step releases it). `batch`:
    rows a step."""
    from forge_grain import DataConfig, Pipeline

    options = {"key": "bench", "secret": "bench", "endpoint_url": f"http://127.0.0.1:{reach or proxy.port}"}
    cache = work / "objects"
    shutil.rmtree(cache, ignore_errors=True)
    src = dict(name="web", path=path, strategy="bestfit", storage_options=options, object_cache=str(cache),
               cache_limit=limit)
    config = DataConfig.from_dict(dict(sources=[src], seq_len=SEQ_LEN, global_batch_size=batch, seed=0,
                                       num_epochs=1))
    proxy.clear()
    shutil.rmtree(work / "plans", ignore_errors=True)
    ASKED[0] = 0
    try:
        t = time.perf_counter()
        pipe = Pipeline(config, 0, 1, cache_dir=work / "plans")
        opened, open_s = served(proxy), time.perf_counter() - t
        steps, first = 0, None
        for _ in pipe.iterator():
            steps += 1
            first = first or time.perf_counter() - t
            if step_s:
                time.sleep(step_s)
        seconds = time.perf_counter() - t  # (from the request: an unbounded peer's dataset is copied at open)
    except Exception as e:  # noqa: BLE001 (a failure is a result)
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    fit = pipe._sources[0].dataset.fitted
    return {"open": opened, "epoch": served(proxy) - opened, "seconds": seconds, "open_s": open_s, "first": first,
            "steps": steps,
            "gets": asked(proxy) if reach is None else ASKED[0],
            "files_together": fit.files_together if fit is not None else None}


def peer(proxy, port: int, name: str, python: str, limit: int | None, work: Path, part: int,
         reach: int | None = None) -> dict:
    """One epoch of a peer's own reader over its own dataset (written and uploaded on first use)."""
    script, cache = {"LitData": ("peer_litdata_s3.py", "litdata-cache"),
                     "MosaicML Streaming": ("peer_mds_s3.py", "mds-cache")}[name]
    shutil.rmtree(work / cache, ignore_errors=True)
    env = {**os.environ, "BENCH_REUSE": "1", "BENCH_CACHE_LIMIT": str(limit or "")}
    proxy.clear()
    try:
        done = subprocess.run([python, str(Path(__file__).with_name(script)), str(work / "tokens.npy"),
                               f"http://127.0.0.1:{port}", str(work), str(SEQ_LEN), str(BATCH), "0", str(part),
                               f"http://127.0.0.1:{reach or proxy.port}"], capture_output=True, text=True, env=env,
                              timeout=HUNG_S)
    except subprocess.TimeoutExpired:
        return {"error": f"no end of the epoch after {HUNG_S} s (hung)", "epoch": served(proxy)}
    if done.returncode:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line.split(":")[0] or "Exception" in line.split(":")[0]]
        return {"error": ((errors or lines or ["(no message)"])[-1])[:300], "epoch": served(proxy)}
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"epoch": served(proxy), "gets": asked(proxy), "seconds": (out["steps"] + 1) * BATCH * SEQ_LEN / out["whole"]}  # from the request


def median(values: list) -> float:
    return float(np.median(values))


def rate(results: dict, k: int) -> str:
    """The rate at limit `k` against the unbounded one: of the one round, or the median of the
    rounds' (each against the unbounded epoch of its own round), with their range."""
    base, bounded = results[None], results[k]
    if "rounds" not in bounded:
        return f"{base['seconds'] / bounded['seconds']:.2f}x"
    each = [b / s for b, s in zip(base["rounds"], bounded["rounds"])]
    return f"{median(each):.2f}x [{min(each):.2f}-{max(each):.2f}]"


def cell(result: dict, size: int) -> str:
    if "error" in result:
        return "failed"
    opened = f"{result['open'] / size:.2f} + " if result.get("open") else ""
    return f"{opened}{result['epoch'] / size:.2f}x"


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--docs", type=int, default=16_000, help="documents (median 600 tokens)")
    ap.add_argument("--peer-python", help="a Python with litdata and mosaicml-streaming installed")
    ap.add_argument("--work", default="/tmp/forge-grain-bench-cache")
    ap.add_argument("--out", help="also write the table here")
    ap.add_argument("--readers", help="only the readers whose label holds this text (or one of these, "
                                      "comma-separated: 'store,Megatron,LitData')")
    ap.add_argument("--step-ms", type=float, default=0.0, help="forge-grain's readers on the link sleep this long "
                    "after each batch, as a trainer's step (0: read flat out)")
    ap.add_argument("--rounds", type=int, default=1, help="forge-grain's epochs on the link are read this many times, "
                    "the limits taken in turn each round; the rates are the medians of the rounds' (an unbounded "
                    "epoch's time varied 1.8-2.8 s between runs on two cores)")
    ap.add_argument("--servers", type=int, default=1, help="moto servers holding the same objects behind the link "
                    "(servers.py: one answers about 450 ranged GETs a second on one core; on a machine of many cores, "
                    "more lift that ceiling)")
    ap.add_argument("--link", help="ttfb_ms=30,mbps=10: every reader reads each epoch twice, through the counting "
                                   "proxy (the bytes) and through a shaped link straight to the server "
                                   "(shaped_link.py: the rates are those of a link, not of this machine's CPU "
                                   "serving moto and the proxy)")
    a = ap.parse_args()
    count_gets()
    import s3fs
    from s3server import FaultProxy
    from test_formats import write_megatron

    work = Path(a.work)

    def chosen(label: str) -> bool:
        return not a.readers or any(text in label for text in a.readers.split(","))

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ports, procs = start_servers(work, a.servers)
    port = ports[0]  # (written first; the others are its mirrors)
    proxy = FaultProxy(port)
    link, reach = None, None
    if a.link:
        from link import parse_link, start_link
        reach, link = start_link(ports, *parse_link(a.link))  # (the counting proxy, in Python, would bind)
    try:
        store = sharded_synthetic_store(work / "store", a.docs, FILES)
        docs = [store[i] for i in range(len(store))]
        np.save(work / "tokens.npy", np.concatenate(docs))
        fs = s3fs.S3FileSystem(key="bench", secret="bench", endpoint_url=f"http://127.0.0.1:{port}")
        fs.mkdir("bench")
        fs.put(str(store.path), "bench/store", recursive=True)
        if chosen("forge-grain, a Megatron file"):  # (Megatron's own writer: torch and megatron-core)
            (work / "megatron").mkdir()
            write_megatron(work / "megatron" / "text_document", docs, dtype=np.uint16)
            fs.put(str(work / "megatron"), "bench/megatron", recursive=True)
        size = sum(f.stat().st_size for f in store.path.glob("*.bin"))
        unit = size // FILES
        readers = {"forge-grain, its store": ("fg", "s3://bench/store"),
                   "forge-grain, a Megatron file": ("fg", "s3://bench/megatron")}
        if a.peer_python:
            peer(proxy, port, "LitData", a.peer_python, None, work, store.num_tokens // FILES)  # writes, uploads
            peer(proxy, port, "MosaicML Streaming", a.peer_python, None, work, unit)
            readers.update({"forge-grain, the LitData dataset": ("fg", "s3://bench/litdata"),
                            "LitData StreamingDataset": ("LitData", None),
                            "MosaicML StreamingDataset": ("MosaicML Streaming", None)})
        header = (f"cache_limit and bytes fetched: {len(store):,} documents, {size / 1e6:.1f} MB of uint16 tokens "
                  f"({FILES} files of {unit / 1e6:.2f} MB); seq_len {SEQ_LEN}, batch {BATCH}, one shuffled epoch; "
                  "each cell: bytes of data files the server sent / the data's bytes (forge-grain: first open + "
                  "epoch)" + (f"; rates read through a shaped link to the server, {a.link}" if a.link else "")
                  + (f", a training step of {a.step_ms:g} ms after each batch" if a.link and a.step_ms else "")
                  + (f"; {a.servers} moto servers holding the same objects behind the link" if a.servers > 1 else ""))
        lines = [header, f"  {'reader':<36}" + "".join(f"{(f'{k} files' if k else 'unbounded'):>18}" for k in LIMITS)]
        print("\n".join(lines), flush=True)
        notes = []
        forge_grain(proxy, port, "s3://bench/store", None, work)  # (warm: numba's compiled kernels, the imports)
        shard = min(store.path.glob("*.bin"))
        if a.servers > 1:
            print(f"  the bucket's {mirror(ports)} objects copied to {a.servers - 1} more servers", flush=True)
        ceiling = server_ceiling(ports, f"store/{shard.name}", shard.stat().st_size)
        notes.append(f"  the server{'s' if a.servers > 1 else ''}: {ceiling:.0f} ranged GETs of {PART >> 10} KiB a second at "
                     f"most ({ceiling * PART / 1e6:.0f} MB/s; 32 threads asking straight to "
                     + (f"{a.servers} moto processes)" if a.servers > 1 else
                        "it); moto is one Python process, so this holds on any number of cores")
                     + "; a reader's GETs / it is the least time the server spends on its epoch")
        print(notes[-1], flush=True)
        for label, (kind, path) in readers.items():
            if not chosen(label):
                continue
            results = {}
            for k in LIMITS:
                limit = k * unit if k else None
                part = store.num_tokens // FILES if kind == "LitData" else unit
                for through in [None] + ([reach] if reach else []):  # bytes counted; then a rate on the link
                    got = forge_grain(proxy, port, path, limit, work, through, a.step_ms / 1e3 if through else 0.0) \
                        if kind == "fg" else \
                        peer(proxy, port, kind, a.peer_python, limit, work, part, through)
                    if through is None:
                        results[k] = got
                    elif "error" in got:  # (its bytes stand; the note says what the link run did)
                        results[k]["link_error"] = got["error"]
                    else:
                        results[k]["seconds"], results[k]["first"] = got["seconds"], got.get("first")
                        if kind == "fg":  # (its GETs on the link: counted by the reader)
                            results[k]["gets"] = got["gets"]
            if kind == "fg" and reach:  # more rounds on the link, the limits in turn
                for _ in range(a.rounds - 1):
                    for k in LIMITS:
                        got = forge_grain(proxy, port, path, k * unit if k else None, work, reach, a.step_ms / 1e3)
                        if "error" in got:  # (its note says what the link run did)
                            results[k]["link_error"] = got["error"]
                        results[k].setdefault("rounds", [results[k].get("seconds")]).append(got.get("seconds"))
                        results[k].setdefault("firsts", [results[k].get("first")]).append(got.get("first"))
            lines.append(f"  {label:<36}" + "".join(f"{cell(results[k], size):>18}" for k in LIMITS))
            print(lines[-1], flush=True)
            for k, r in results.items():
                for key, where in (("error", ""), ("link_error", "on the link: ")):
                    if key in r:
                        notes.append(f"  {label}, {k or 'unbounded'} files: {where}{r[key]}")
            if kind == "fg" and all("error" not in r and "link_error" not in r for r in results.values()):
                notes.append(f"  {label}: rate from the request (open and epoch) against the unbounded cache's "
                             + ", ".join(f"{rate(results, k)} at {k} files" for k in LIMITS if k)
                             + " (" + ", ".join(f"{median(r.get('rounds', [r['seconds']])):.2f} s"
                                               for r in results.values()) + ")"
                             + (f"; the medians of {a.rounds} rounds, their range in brackets" if a.rounds > 1 else "")
                             + "; documents of at most "
                             + ", ".join(f"{results[k]['files_together']} files" for k in LIMITS if k)
                             + " interleaved at a time")
                print(notes[-1], flush=True)  # (as soon as it is known: a peer's run may hang for minutes)
                if reach:
                    notes.append(f"  {label}: first batch from the request (the open included) " + ", ".join(
                        f"{median(r.get('firsts', [r['first']])):.2f} s {f'at {k} files' if k else 'unbounded'}"
                        for k, r in results.items()) + (" (medians)" if a.rounds > 1 else ""))
                    print(notes[-1], flush=True)
            elif kind != "fg" and reach and all("seconds" in r for r in results.values()):
                notes.append(f"  {label}: an epoch from the request, " + ", ".join(
                    f"{r['seconds']:.2f} s {f'at {k} files' if k else 'unbounded'}" for k, r in results.items()))
                print(notes[-1], flush=True)
            if all("gets" in r for r in results.values()):
                notes.append(f"  {label}: GETs of data files " + ", ".join(
                    f"{r['gets']} ({r['gets'] / ceiling:.2f} s of the server) {f'at {k} files' if k else 'unbounded'}"
                    for k, r in results.items()))
                print(notes[-1], flush=True)
        lines += ["", *notes]
        print("\n".join(["", *notes]), flush=True)
        if a.out:
            Path(a.out).write_text("\n".join(lines) + "\n")
    finally:
        proxy.stop()
        for proc in (link, *procs):
            if proc is not None:
                proc.terminate()
                proc.wait()


if __name__ == "__main__":
    main()
