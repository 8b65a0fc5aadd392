"""The first batch of a Megatron dataset in object storage: forge-grain beside Megatron-core's own reader.

    python benchmarks/bench_megatron_s3.py [--tokens 200000000] [--link ttfb_ms=30,mbps=10] [--rounds 2]
        [--out FILE]

One Megatron dataset (documents of 500-3,500 synthetic uint16 tokens, written by Megatron's
`IndexedDatasetBuilder`: 400 MB by default) is uploaded to moto's S3 server (`moto_server.py`,
its own process) and read through `shaped_link.py` (a time to each answer's first byte and a
rate a connection) and a proxy that counts the bytes served. Each reader is timed from the
request to its first batch's tokens (16 rows of 2,048), with no cache left from before:
- forge-grain, its defaults (no `cache_limit`): a `Pipeline` over the URL, then its first
  batch of a global shuffle;
- Megatron-core's `IndexedDataset` over the same URL with its `ObjectStorageConfig` (the
  `.idx` downloaded, the `.bin` read in chunks of `bin_chunk_nbytes`, 256 MiB by default, one
  chunk held in memory), the documents of a shuffled order read until they hold as many
  tokens (its `GPTDataset` reads a shuffled order of samples the same way).
Each round is a cold process per reader (imports and compiled kernels are taken before the
clock starts: a local copy is read once first).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the counting proxy and the Megatron writer of the tests

from report import parser  # noqa: E402

SEQ_LEN, BATCH = 2048, 16
PREFIX = "web_text_document"


def write_dataset(out: Path, tokens: int) -> Path:
    """A Megatron prefix of about `tokens` uint16 tokens at `out` (kept: made once)."""
    import numpy as np
    from test_formats import write_megatron

    prefix = out / PREFIX
    if prefix.with_suffix(".idx").exists():
        return prefix
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)  # (synthetic data: its order is not forge-grain's)
    lens = rng.integers(500, 3500, max(1, tokens // 2000))
    data = rng.integers(2, 50000, int(lens.sum()), dtype=np.uint16)
    write_megatron(prefix, np.split(data, np.cumsum(lens)[:-1]), dtype=np.uint16)
    return prefix


def forge_grain(url: str, endpoint: str, work: Path, local: Path) -> dict:
    """Open and first batch of forge-grain's pipeline over `url` (in this process, cold cache)."""
    from forge_grain import DataConfig, Pipeline

    def config(src):
        return DataConfig.from_dict(dict(sources=[src], seq_len=SEQ_LEN, global_batch_size=BATCH, seed=0,
                                         num_epochs=1))

    warm = Pipeline(config(dict(name="web", path=str(local))), 0, 1, cache_dir=work / "warm").iterator()
    next(warm)
    warm.close()
    options = {"key": "bench", "secret": "bench", "endpoint_url": endpoint}
    src = dict(name="web", path=url, storage_options=options, object_cache=str(work / "objects"))
    t = time.perf_counter()
    pipe = Pipeline(config(src), 0, 1, cache_dir=work / "plans")
    opened = time.perf_counter() - t
    it = pipe.iterator()
    next(it)
    first = time.perf_counter() - t
    it.close()
    return {"open": opened, "first": first}


def megatron(url: str, endpoint: str, work: Path, local: Path) -> dict:
    """Open and the first batch's documents through Megatron-core's object-storage reader."""
    import warnings

    import numpy as np

    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.object_storage_utils import ObjectStorageConfig

    IndexedDataset(str(local / PREFIX))[0]  # (imports and the local reader's path warm)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)
    t = time.perf_counter()
    ds = IndexedDataset(f"{url}/{PREFIX}", mmap=False,
                        object_storage_config=ObjectStorageConfig(path_to_idx_cache=str(work / "idx")))
    opened = time.perf_counter() - t
    order = np.random.default_rng(0).permutation(len(ds))
    got = n = 0
    while got < SEQ_LEN * BATCH:
        got += len(ds[int(order[n])])
        n += 1
    return {"open": opened, "first": time.perf_counter() - t, "documents": n}


def child(which: str, url: str, endpoint: str, work: Path, local: Path) -> dict:
    """One reader in a cold process of its own: its figures."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    code = (f"import sys, json; sys.path[:0] = {[str(ROOT / 'benchmarks'), str(ROOT / 'tests')]!r}; "
            f"import bench_megatron_s3 as b; from pathlib import Path; "
            f"print(json.dumps(b.{which}({url!r}, {endpoint!r}, Path({str(work)!r}), Path({str(local)!r}))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if r.returncode:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1][:200]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tokens", type=int, default=200_000_000, help="tokens of the dataset (uint16)")
    ap.add_argument("--link", default="ttfb_ms=30,mbps=10", help="the shaped link (benchmarks/link.py)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", default="/tmp/forge-grain-bench-megatron-s3")
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args()

    import s3fs
    from bench_scale import start_server
    from link import parse_link, start_link
    from s3server import FaultProxy

    work = Path(args.work)
    local = write_dataset(work / "data", args.tokens).parent
    size = sum(f.stat().st_size for f in local.iterdir())
    ttfb_ms, mbps = parse_link(args.link)
    port, server = start_server(work)
    proxy = FaultProxy(port)
    link_port, link = start_link(proxy.port, ttfb_ms, mbps)
    lines = [f"a Megatron dataset of {size / 1e6:.0f} MB in moto, behind a link of {ttfb_ms:g} ms to the first byte "
             f"and {mbps:g} MB/s a connection; from the request to the first batch ({BATCH} x {SEQ_LEN} tokens), "
             "cold, each reader in a process of its own"]
    try:
        s3fs.S3FileSystem(key="bench", secret="bench", endpoint_url=f"http://127.0.0.1:{port}").put(
            str(local), "bench/meg", recursive=True)
        endpoint = f"http://127.0.0.1:{link_port}"
        for r in range(args.rounds):
            got = {}
            for name, which in (("forge-grain", "forge_grain"), ("Megatron-core", "megatron")):
                proxy.clear()
                got[name] = child(which, "s3://bench/meg", endpoint, work / "run", local)
                got[name]["MB"] = sum(proxy.sent.values()) / 1e6
                got[name]["GETs"] = sum(proxy.gets.values())
            for name, g in got.items():
                if "error" in g:
                    lines.append(f" round {r + 1}: {name:<14} failed: {g['error']}")
                else:
                    lines.append(f" round {r + 1}: {name:<14} open {g['open']:6.2f} s, first batch {g['first']:7.2f} s, "
                                 f"{g['MB']:7.1f} MB in {g['GETs']} GETs in its process's life")
                print(lines[-1], flush=True)
            a, b = got["forge-grain"], got["Megatron-core"]
            if "error" not in a and "error" not in b:
                lines.append(f" round {r + 1}: forge-grain's first batch came {b['first'] / a['first']:.1f}x sooner")
                print(lines[-1], flush=True)
    finally:
        for proc in (link, server):
            proc.terminate()
            proc.wait()
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
