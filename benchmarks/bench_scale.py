"""Scale: a pipeline of 10,000 sources, and a store read from object storage against disk.

    python benchmarks/bench_scale.py [--sources 10000] [--docs 20000] [--shards 128]

1. `--sources` tiny stores in one mixture: pipeline build with the plans cold, with the
   plans cached (every source opened), and from the record of the last build (sources
   opened when first read: `forge_grain.sources.deferred`, or ahead of the steps by a background
   opener: `forge_grain.pipeline.opening`); open file descriptors after the build, time to the
   first batch and to the next 100 (which open the sources they read), made back to back, with a
   10 ms training step after each, and after `--setup` seconds of a trainer's own setup.
2. A synthetic store (log-normal documents, as the other benchmarks) in `--shards` shards,
   uploaded to a local S3-compatible server (moto in server mode, as the tests use), read
   through s3fs with a cache limit of 10% of the store (at least 3 shards) and the locality order, against the
   same pipeline over the store on disk: time to the first batch and steady tokens/s, batches
   made in the consumer's thread (`num_threads=0`, the default, as LitData's loader with
   `num_workers=0` makes them) and, once more from S3, with 2 batch threads.
   The server runs in its own process; its own rate is measured too (every shard read once
   with s3fs, one at a time and on 8 connections, and with obstore on 8 connections), and the
   peers reading the same tokens from it (`--peer-python`: LitData; with `--mosaic`, MosaicML
   Streaming too). moto is a Python server on this 2-core machine,
   sharing the cores with the loader, so the ratios are a floor for a real object store.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from corpora import synthetic_store
from forge_grain import DataConfig, Pipeline
from forge_grain.stores.writer import write_store
from report import parser, publish

SEQ_LEN, BATCH = 2048, 16


def many_sources(n: int, work: Path, setup: float = 10) -> list[str]:
    rng = np.random.default_rng(0)
    sources = []
    for i in range(n):
        docs = [np.concatenate([[0], rng.integers(2, 1000, int(rng.integers(5, 50)))]) for _ in range(8)]
        path = write_store(work / f"s{i:05d}", docs, vocab_size=1000, bos_id=0, eos_id=1)
        sources.append(dict(name=f"s{i:05d}", path=str(path), weight=1 + i % 3))
    cfg = DataConfig.from_dict(dict(sources=sources, seq_len=32, global_batch_size=64, seed=5))
    os.environ["FORGE_GRAIN_CACHE"] = str(work / "cache")
    records = work / "cache" / "sources"  # where the build's record goes (plans are beside the stores)
    lines = [f"{n:,} sources (8 documents each), seq_len 32, global batch 64:"]
    for label, setup_s, step_s in (("plans cold", 0, 0), ("plans cached, no record", 0, 0), ("from the record", 0, 0),
                                   ("from the record, 10 ms steps", 0, 0.01),
                                   (f"from the record, {setup} s of setup", setup, 0)):
        if not label.startswith("from the record"):
            shutil.rmtree(records, ignore_errors=True)  # no record: every source opened in full
        t = time.perf_counter()
        pipe = Pipeline(cfg, 0, 1, num_threads=0)
        build = time.perf_counter() - t
        fds = len(os.listdir("/proc/self/fd"))
        time.sleep(setup_s)  # a trainer building its model: the sources of the first steps open meanwhile
        t = time.perf_counter()
        pipe.batch(0)
        first = time.perf_counter() - t
        t = time.perf_counter()
        for step in range(1, 101):
            pipe.batch(step)
            time.sleep(step_s)  # a training step: the opener works meanwhile
        rest = time.perf_counter() - t - 100 * step_s
        lines.append(f"  {label:<32} build {build:6.2f} s ({build / n * 1e3:.2f} ms a source), open descriptors "
                     f"{fds}, first batch {first:.3f} s, next 100 batches {rest:.2f} s"
                     + (" beyond their 1.00 s of steps" if step_s else ""))
        print(lines[-1], flush=True)
        del pipe
    return lines


def object_storage(num_docs: int, shards: int, work: Path, peer_python: str | None = None, mosaic: bool = False,
                   steps_wanted: int = 400) -> list[str]:
    import s3fs

    port, server = start_server(work)
    try:
        opts = {"key": "bench", "secret": "bench", "endpoint_url": f"http://127.0.0.1:{port}"}
        local = resharded(synthetic_store(work / "synthetic", num_docs).path, shards, work)
        fs = s3fs.S3FileSystem(**opts)
        fs.mkdir("bench")
        fs.put(str(local), "bench/store", recursive=True)
        size = sum(f.stat().st_size for f in local.iterdir() if f.suffix == ".bin")
        limit = max(size // 10, 3 * size // shards)  # 10%, or 3 shards where shards are larger than 3%
        common = dict(name="web", strategy="bos_bestfit", shuffle_window=1)
        # planning chunks of whole shards' documents (about 40 of them), as the scale guide advises for
        # object storage: a window then downloads only the shards it reads (LitData's chunk is its
        # unit of both download and shuffle); 2.5 shards a chunk downloaded a chunk's shards twice over
        per_chunk = max(1, round(shards / 40))
        chunk_docs = max(1, round(num_docs / shards * per_chunk))
        disk_cfg = config(dict(path=str(local), **common), chunk_docs)
        s3_cfg = config(dict(path="s3://bench/store", storage_options=opts, object_cache=str(work / "objects"),
                             cache_limit=limit, **common), chunk_docs)
        s3_all = config(dict(path="s3://bench/store", storage_options=opts, object_cache=str(work / "objects-all"),
                             **common), chunk_docs)
        lines = [f"object storage: {num_docs:,} documents, {size / 1e6:.1f} MB of tokens in {shards} shards; "
                 f"seq_len {SEQ_LEN}, batch {BATCH}, locality order (shuffle_window 1 of {-(-num_docs // chunk_docs)} "
                 f"chunks of {per_chunk} shard(s)' documents), "
                 f"cache_limit {limit / 1e6:.1f} MB ({100 * limit / size:.0f}%)"]
        rates, whole = {}, {}  # steady tokens/s; tokens/s from the request, the first batch included
        s3_threads = config(dict(path="s3://bench/store", storage_options=opts, object_cache=str(work / "objects-t"),
                                 **common), chunk_docs)
        # batches made in the consumer's thread (num_threads=0, the default), as LitData's loader with
        # num_workers=0 makes them: this loop of next() never releases the GIL, so batch threads (there
        # for a trainer whose step releases it for long) only hand batches across it
        for label, cfg, threads in (
                ("local disk", disk_cfg, 0), (f"S3 (moto), cache_limit {100 * limit / size:.0f}%", s3_cfg, 0),
                ("S3 (moto), unbounded cache", s3_all, 0), ("S3 (moto), unbounded, 2 batch threads", s3_threads, 2)):
            t = time.perf_counter()
            pipe = Pipeline(cfg, 0, 1, cache_dir=work / "plans" if label == "local disk" else None, num_threads=threads)
            it = pipe.iterator()
            next(it)
            first = time.perf_counter() - t
            steps = min(pipe.num_steps - 1, steps_wanted)
            t = time.perf_counter()
            peak = 0
            for k in range(steps):
                next(it)
                if "cache_limit" in label and k % 10 == 0:
                    peak = max(peak, pipe.stores[0].cache.used())
            elapsed = time.perf_counter() - t
            rate = steps * BATCH * SEQ_LEN / elapsed
            rates[label], whole[label] = rate, (steps + 1) * BATCH * SEQ_LEN / (first + elapsed)
            extra = (f", {pipe.stores[0].cache.downloads} downloads" if label != "local disk" else "")
            extra += f", cache peak {peak / 1e6:.2f} MB of {limit / 1e6:.2f}" if "cache_limit" in label else ""
            lines.append(f"  {label:<38} first batch {first:6.2f} s, steady {rate / 1e6:7.2f} M tok/s over {steps} "
                         f"steps ({whole[label] / 1e6:.2f} from the request){extra}")
            print(lines[-1], flush=True)
        objects = [f for f in fs.ls("bench/store") if f.endswith(".bin")]
        server_rates = {}
        for label, threads in (("sequential", 1), ("8 connections", 8)):
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)  # no connection or listing reused
            t = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                list(pool.map(fs.cat_file, objects))
            server_rates[label] = size / 2 / (time.perf_counter() - t)  # uint16 tokens/s
            lines.append(f"  the server alone, every shard read once with s3fs, {label}: "
                         f"{server_rates[label] / 1e6:.2f} M tok/s")
            print(lines[-1], flush=True)
        peers = {}  # name -> (steady, from the request)
        for name in (["LitData"] if peer_python else []) + (["MosaicML Streaming"] if mosaic else []):
            part = size // 2 // shards if name == "LitData" else size * 2 // shards  # as many parts as shards
            line, *peers[name], _, _ = peer(name, peer_python, local, port, part, work, steps_wanted)
            lines.append(line)
            print(lines[-1], flush=True)
        from forge_grain.stores.remote_dir import RemoteDir  # obstore, as forge-grain downloads shards

        remote = RemoteDir("s3://bench/store", opts)
        if remote._fast is not None:
            names = [f.rsplit("/", 1)[1] for f in objects]
            t = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda n: remote.read_range(n, 0, (local / n).stat().st_size), names))
            server_rates["obstore, 8 connections"] = size / 2 / (time.perf_counter() - t)
            lines.append(f"  the server alone, every shard read once with obstore (the Rust client forge-grain uses), "
                         f"8 connections: {server_rates['obstore, 8 connections'] / 1e6:.2f} M tok/s")
            print(lines[-1], flush=True)
        fastest = max(server_rates.values())
        for label in [k for k in rates if k.startswith("S3")]:
            lines.append(f"  {label}: {rates[label] / rates['local disk']:.2f}x local disk, "
                         f"{rates[label] / server_rates['sequential']:.2f}x the server read sequentially, "
                         f"{rates[label] / fastest:.2f}x the server's fastest rate above")
            print(lines[-1], flush=True)
        for name, (steady, from_request) in peers.items():
            if steady:
                lines.append(f"  {name}: {steady / fastest:.2f}x the server's fastest rate; forge-grain without a "
                             f"cache limit runs at {rates['S3 (moto), unbounded cache'] / steady:.2f}x {name} steady, "
                             f"{whole['S3 (moto), unbounded cache'] / from_request:.2f}x from the request")
        return lines
    finally:
        server.terminate()
        server.wait()


def shaped_link(num_docs: int, shard_counts: list[int], work: Path, link: str, peer_python: str | None = None,
                mosaic: bool = False) -> list[str]:
    """`link.py`'s measurement: the link's ceiling, forge-grain with its defaults and the peers,
    each reading a whole epoch of the same uint16 tokens through the shaped link."""
    import s3fs

    from corpora import sharded_synthetic_store
    from link import ceiling, cold_epoch

    with linked_server(work, link) as (port, link_port, direct, opts, ttfb_ms, mbps):
        s3fs.S3FileSystem(**direct).mkdir("bench")
        lines = [f"a shaped link: {ttfb_ms:g} ms to every answer's first byte, {mbps:g} MB/s a connection "
                 f"(benchmarks/shaped_link.py), moto behind it; {num_docs:,} documents of uint16 tokens; seq_len "
                 f"{SEQ_LEN}, batch {BATCH}; a whole epoch from the request (build and first batch included), each "
                 "reader in a cold process of its own; idle: the machine's idle CPU over the run"]
        for shards in shard_counts:
            local = sharded_synthetic_store(work / f"store-{shards}", num_docs, shards).path
            s3fs.S3FileSystem(**direct).put(str(local), f"bench/s{shards}", recursive=True)
            sizes = {f.name: f.stat().st_size for f in local.iterdir() if f.suffix == ".bin"}
            lines.append(f" {shards} shards, {sum(sizes.values()) / 1e6:.0f} MB:")
            ceil = {}
            for n in (8, 32):
                ceil[n], idle = ceiling(f"s3://bench/s{shards}", opts, sizes, n)
                lines.append(f"  the link's ceiling, obstore with {n} ranged GETs in flight: {ceil[n] / 1e6:7.2f} M "
                             f"tok/s (idle {idle:.0%})")
                print(lines[-1], flush=True)
            per_chunk = max(1, round(shards / 40))  # the locality order the scale guide advises for object storage
            chunk_docs = max(1, round(num_docs / shards * per_chunk))
            src = dict(name="web", path=f"s3://bench/s{shards}", storage_options=opts,
                       object_cache=str(work / f"objects-{shards}-global"))
            readers = {}
            got = cold_epoch(config_dict(src))
            readers["forge-grain, defaults"] = (got["rate"], got["first"], got["cpu_per_gb"],
                                                f"a global shuffle, idle {got['idle']:.0%}")
            src.update(shuffle_window=1, object_cache=str(work / f"objects-{shards}"))  # (downloaded afresh)
            got = cold_epoch(config_dict(src, chunk_docs))
            readers["forge-grain, docs' settings"] = (got["rate"], got["first"], got["cpu_per_gb"],
                                                      f"shuffle_window 1, idle {got['idle']:.0%}")
            for threads in (0, 2):
                src["object_cache"] = str(work / f"objects-{shards}-t{threads}")
                got = cold_epoch(config_dict(src, chunk_docs), num_threads=threads)
                readers[f"  the same, num_threads={threads}"] = (got["rate"], got["first"], got["cpu_per_gb"],
                                                                 f"idle {got['idle']:.0%}")
            disk = cold_epoch(config_dict(dict(name="web", path=str(local), shuffle_window=1), chunk_docs))
            readers["forge-grain, local disk"] = (disk["rate"], disk["first"], disk["cpu_per_gb"],
                                                  "the docs' settings, no network: what this machine's CPU allows, "
                                                  f"idle {disk['idle']:.0%}")
            for name in (["LitData"] if peer_python else []) + (["MosaicML Streaming"] if mosaic else []):
                part = sum(sizes.values()) // 2 // shards if name == "LitData" else sum(sizes.values()) // shards
                if (work / "tokens.npy").exists():
                    (work / "tokens.npy").unlink()
                _, _, whole, first, cpu = peer(name, peer_python, local, port, part, work, 0, link_port)
                readers[name] = (whole, first, cpu, "")
            for name, (rate, first, cpu, note) in readers.items():
                if rate is None:
                    lines.append(f"  {name:<24} failed in its own code")
                else:
                    lines.append(f"  {name:<24} {rate / 1e6:7.2f} M tok/s over the epoch from the request: "
                                 f"{rate / ceil[8]:.2f}x the 8-GET ceiling, {rate / ceil[32]:.2f}x the 32-GET "
                                 f"ceiling; first batch {first:.2f} s"
                                 + (f", {cpu:.1f} core-s/GB" if cpu is not None else "") + (f", {note}" if note else ""))
                print(lines[-1], flush=True)
        return lines


@contextlib.contextmanager
def linked_server(work: Path, link: str):
    """moto behind the shaped link `link` ("ttfb_ms=30,mbps=10"), stopped at the end:
    (server port, link port, storage options straight to the server, through the link,
    the link's ms to the first byte, its MB/s a connection)."""
    from link import parse_link, start_link

    ttfb_ms, mbps = parse_link(link)
    port, server = start_server(work)
    link_port, proxy = start_link(port, ttfb_ms, mbps)
    try:
        direct = {"key": "bench", "secret": "bench", "endpoint_url": f"http://127.0.0.1:{port}"}
        yield port, link_port, direct, {**direct, "endpoint_url": f"http://127.0.0.1:{link_port}"}, ttfb_ms, mbps
    finally:
        for proc in (proxy, server):
            proc.terminate()
            proc.wait()


def mixture_link(num_docs: int, sources: int, work: Path, link: str, peer_python: str | None, steps: int) -> list[str]:
    """A mixture of `sources` copies of a 16-shard store through the shaped link, equal
    weights: the first batch from the request (the build's part of it) and the rate over the
    first `steps` steps after it, beside one of them alone and LitData's
    `CombinedStreamingDataset` over as many copies of its own dataset."""
    import s3fs

    from corpora import sharded_synthetic_store
    from link import cold_epoch

    with linked_server(work, link) as (port, link_port, direct, opts, ttfb_ms, mbps):
        fs = s3fs.S3FileSystem(**direct)
        fs.mkdir("bench")
        local = sharded_synthetic_store(work / "store-16", num_docs, 16).path
        for i in range(sources):
            fs.put(str(local), f"bench/mix{i}", recursive=True)
        size = sum(f.stat().st_size for f in local.iterdir() if f.suffix == ".bin")
        lines = [f"a mixture of {sources} sources through a shaped link ({ttfb_ms:g} ms to every answer's first byte, "
                 f"{mbps:g} MB/s a connection), each a copy of a 16-shard store of {num_docs:,} documents "
                 f"({size / 1e6:.0f} MB), equal weights; seq_len {SEQ_LEN}, batch {BATCH}; the first batch from the "
                 f"request and the rate over the first {steps} steps after it, from the request; each reader in a "
                 f"cold process"]
        print(lines[0], flush=True)
        # each in a cold process, as the peer's own; the docs' settings for object storage:
        # shuffle_window 1 of chunks of one shard, each step reading a shard or two of a source
        for n, docs in ((sources, False), (sources, True), (1, False)):
            local_order = dict(shuffle_window=1) if docs else {}
            got = cold_epoch(dict(sources=[dict(name=f"mix{i}", path=f"s3://bench/mix{i}", storage_options=opts,
                                                object_cache=str(work / f"objects-{n}-{docs}"), **local_order)
                                           for i in range(n)],
                                  seq_len=SEQ_LEN, global_batch_size=BATCH, seed=0,
                                  **(dict(plan_chunk_docs=-(-num_docs // 16)) if docs else {})), steps)
            what = (f"{n} sources" if n > 1 else "one of them alone") + (", docs' settings" if docs else "")
            lines.append(f"  forge-grain, {what:<34} first batch {got['first']:5.2f} s "
                         f"(the build {got['build']:.2f} s), {got['rate'] / 1e6:6.2f} M tok/s, "
                         f"{got['cpu_per_gb']:.1f} core-s/GB")
            print(lines[-1], flush=True)
        if peer_python:
            part = size // 2 // 16  # (LitData's chunks: the tokens of a shard, as in `shaped_link`)
            line, _, whole, first, cpu = peer("LitData", peer_python, local, port, part, work, steps, link_port,
                                             sources=sources)
            lines.append(line if whole is None else
                         f"  LitData CombinedStreamingDataset, {sources} sources: first batch {first:5.2f} s, "
                         f"{whole / 1e6:6.2f} M tok/s" + (f", {cpu:.1f} core-s/GB" if cpu is not None else ""))
            print(lines[-1], flush=True)
        return lines


# the peers read by `peer`: their script, what they hold of the tokens, and the directories a retry clears
PEERS = {
    "LitData": ("peer_litdata_s3.py", lambda o: f"{o['chunks']} chunks written by its optimize(), TokensLoader, "
                                                "shuffled, its default cache", ("litdata", "litdata-cache")),
    "MosaicML Streaming": ("peer_mds_s3.py", lambda o: f"{o['shards']} shards written by its MDSWriter, samples of "
                                                       f"{SEQ_LEN} tokens, shuffled", ("mds", "mds-cache")),
}


def peer(name: str, python: str, local: Path, port: int, part: int, work: Path,
         steps: int, read_port: int | None = None, sources: int = 1) -> tuple:
    """A peer (`PEERS`) reading the same tokens from the same server (through `read_port`, a
    shaped link, where given), in parts of about `part` tokens (LitData's chunks) or bytes
    (Streaming's shards), run by `python`: the peers need an environment of their own here.
    `steps` 0: the whole epoch; `sources`: as many copies of it mixed (LitData's
    `CombinedStreamingDataset`). (line, steady rate, rate from the request, first batch s,
    core-seconds per GB delivered where the peer's script counts them)."""
    import json

    from forge_grain import TokenStore

    if not (work / "tokens.npy").exists():
        store = TokenStore.open(local)
        np.save(work / "tokens.npy", np.concatenate([store[i] for i in range(len(store))]))  # uint16, as stored
    script, what, dirs = PEERS[name]
    label = f"{name} StreamingDataset"
    for attempt in range(2):  # LitData's reader has failed now and then here (a KeyError closing a chunk)
        for d in dirs:
            for path in work.glob(f"{d}*"):  # (a mixture's caches: litdata-cache-0, ...)
                shutil.rmtree(path, ignore_errors=True)
        done = subprocess.run([python, str(Path(__file__).with_name(script)), str(work / "tokens.npy"),
                               f"http://127.0.0.1:{port}", str(work), str(SEQ_LEN), str(BATCH), str(steps), str(part),
                               f"http://127.0.0.1:{read_port or port}"],
                              capture_output=True, text=True, env={**os.environ, "BENCH_SOURCES": str(sources)})
        if not done.returncode:
            break
        print(f"{name} failed (attempt {attempt + 1}): {done.stderr[-3000:]}", file=sys.stderr)
    else:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        return f"  {label:<38} failed twice in its own code ({last})", None, None, None, None
    out = json.loads(done.stdout.strip().splitlines()[-1])
    whole = out["whole"]
    return (f"  {label:<38} first batch {out['first']:6.2f} s, steady {out['rate'] / 1e6:7.2f} "
            f"M tok/s over {out['steps']} steps ({whole / 1e6:.2f} from the request; {what(out)})"), out["rate"], \
        whole, out["first"], out.get("cpu_per_gb")


def start_server(work: Path):
    """moto's S3 server in its own process (as a real server would be: the loader does not share
    its interpreter), on a free port of 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AWS_DEFAULT_REGION": "us-east-1"}
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("moto_server.py")), "-H", "127.0.0.1", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=open(work / "moto.log", "w"))
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return port, server
        except OSError:
            time.sleep(0.05)
    server.terminate()
    raise RuntimeError(f"moto server did not start: {(work / 'moto.log').read_text()[-2000:]}")


def config(src: dict, chunk_docs: int) -> DataConfig:
    return DataConfig.from_dict(config_dict(src, chunk_docs))


def config_dict(src: dict, chunk_docs: int | None = None) -> dict:
    """One epoch of source `src` (planned in chunks of `chunk_docs` documents, if given)."""
    return dict(sources=[src], seq_len=SEQ_LEN, global_batch_size=BATCH, seed=0, num_epochs=1,
                **({"plan_chunk_docs": chunk_docs} if chunk_docs else {}))


def resharded(store: Path, shards: int, work: Path) -> Path:
    """The synthetic store's documents written again as `shards` shards (prepare's pre-tokenized path)."""
    import json

    from forge_grain import TokenStore, prepare

    src = TokenStore.open(store)
    with open(work / "docs.jsonl", "w") as f:
        for i in range(len(src)):
            f.write(json.dumps({"ids": src[i].tolist()}) + "\n")
    return prepare(work / "docs.jsonl", work / "sharded", token_field="ids", vocab_size=src.vocab_size,
                   bos_id=src.bos_id, num_shards=shards, progress=False)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--sources", type=int, default=10_000, help="0: skip the many-sources part")
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--shards", type=int, default=128, help="0: skip the object-storage part")
    ap.add_argument("--setup", type=float, default=10.0,
                    help="seconds between building from the record and the first batch, in its last run")
    ap.add_argument("--steps", type=int, default=400, help="steps measured after the first batch (object storage)")
    ap.add_argument("--peer-python", help="a Python with litdata installed (its own environment: litdata and "
                                          "mosaicml-streaming need torchvision): LitData reads the same data too")
    ap.add_argument("--mosaic", action="store_true", help="MosaicML Streaming reads the same data too, run by "
                                                              "--peer-python (where `streaming` imports)")
    ap.add_argument("--link", help="ttfb_ms=30,mbps=10: read whole epochs through a shaped link instead "
                                    "(benchmarks/link.py), at each of --link-shards")
    ap.add_argument("--link-shards", default="16,128", help="the shard counts read through --link")
    ap.add_argument("--link-mixture", type=int, default=0, help="N: instead, a mixture of N copies of a 16-shard "
                                                                  "store through --link (its first batch; --steps)")
    args = ap.parse_args()
    if args.link and args.link_mixture:
        with tempfile.TemporaryDirectory() as tmp:
            lines = mixture_link(args.docs, args.link_mixture, Path(tmp), args.link, args.peer_python, args.steps)
        spec = args.link.replace("_ms", "").replace("=", "").replace(",", "-")
        publish(f"scale-link-mixture-{args.link_mixture}-{spec}", lines)
        return
    if args.link:
        with tempfile.TemporaryDirectory() as tmp:
            counts = [int(n) for n in args.link_shards.split(",")]
            lines = shaped_link(args.docs, counts, Path(tmp), args.link, args.peer_python, args.mosaic)
        spec = args.link.replace("_ms", "").replace("=", "").replace(",", "-")
        publish("scale-link" if spec == "ttfb30-mbps10" else f"scale-link-{spec}", lines)
        return
    if args.mosaic and not args.peer_python:
        ap.error("--mosaic runs MosaicML Streaming with --peer-python: give that too")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "sources").mkdir()
        lines = (many_sources(args.sources, work / "sources", args.setup) + [""]) if args.sources else []
        if args.shards:
            lines += object_storage(args.docs, args.shards, work, args.peer_python, args.mosaic, args.steps)
    if not args.shards:
        name = "scale-sources"
    elif args.sources and args.shards == 128:
        name = "scale"
    else:
        name = f"scale-s3-{args.shards}-shards" + (f"-{args.docs // 1000}k-docs" if args.docs != 20_000 else "")
    publish(name, lines)


if __name__ == "__main__":
    main()
