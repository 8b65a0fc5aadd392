"""LitData reading the same tokens from the same S3 server, for `bench_scale.py`.

Runs in a separate environment holding `litdata` (and torch), as `bench_scale.py
--peer-python PYTHON` starts it:

    PYTHON benchmarks/peer_litdata_s3.py TOKENS.npy ENDPOINT WORK SEQ_LEN BATCH STEPS CHUNK_TOKENS [READ_ENDPOINT]

TOKENS.npy: the corpus's documents back to back (as forge-grain's store holds them). They are
written by LitData's own `optimize(..., item_loader=TokensLoader())` in chunks of
CHUNK_TOKENS tokens, uploaded to `s3://bench/litdata`, and read by
`StreamingDataset(input_dir="s3://bench/litdata", item_loader=TokensLoader(block_size=SEQ_LEN))`
with a shuffle, in a `StreamingDataLoader` of BATCH rows, through READ_ENDPOINT where given (a
shaped link in front of ENDPOINT). `BENCH_SOURCES=N` (N > 1): N copies of the dataset, at
`s3://bench/litdata-0` ... `-N-1`, mixed by `CombinedStreamingDataset` with equal weights (a
mixture of sources). `BENCH_CACHE_LIMIT` (bytes) is its `max_cache_size`;
`BENCH_REUSE=1` reads the dataset a run before wrote and uploaded. The tokens keep the store's dtype (uint16: an int32 copy
would move twice the bytes). Prints one JSON line: time to the first batch, tokens/s over the
next STEPS batches (STEPS 0: the whole epoch), and tokens/s of the whole run from the request.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np


def pieces(k: int):
    """Input k of `optimize`: one slice of the corpus, as a torch tensor of ids."""
    import torch

    tokens = np.load(os.environ["BENCH_TOKENS"], mmap_mode="r")
    step = int(os.environ["BENCH_PIECE"])
    yield torch.from_numpy(np.array(tokens[k * step:(k + 1) * step], dtype=tokens.dtype))


def upload(fs, local: Path, prefix: str) -> None:
    """`local`'s files at `prefix`, in place of what an earlier run put there: a put into a
    prefix that exists nests the copy inside it (fsspec's `cp -r`), and the reader would read
    the earlier dataset (the 16-shard run's, where bench_scale.py reads 16 then 128)."""
    if fs.exists(prefix):
        fs.rm(prefix, recursive=True)
    fs.put(str(local), prefix, recursive=True)


def main() -> None:
    tokens_file, endpoint, work, seq_len, batch, steps, chunk_tokens = sys.argv[1:8]
    read_endpoint = sys.argv[8] if len(sys.argv) > 8 else endpoint
    seq_len, batch, steps, chunk_tokens = int(seq_len), int(batch), int(steps), int(chunk_tokens)
    work = Path(work)
    options = {"endpoint_url": endpoint, "key": "bench", "secret": "bench"}
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_ENDPOINT_URL=endpoint,
                      AWS_DEFAULT_REGION="us-east-1", BENCH_TOKENS=tokens_file, BENCH_PIECE=str(chunk_tokens))
    import s3fs
    from litdata import CombinedStreamingDataset, StreamingDataLoader, StreamingDataset, TokensLoader, optimize
    from litdata.streaming import downloader

    # LitData fetches chunks with obstore, which refuses plain http unless told: the test server
    # is http on 127.0.0.1 (a real bucket is https and needs no such option)
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"

    n = len(np.load(tokens_file, mmap_mode="r"))
    sources = int(os.environ.get("BENCH_SOURCES") or 1)
    prefixes = ["bench/litdata"] if sources == 1 else [f"bench/litdata-{i}" for i in range(sources)]
    if not (os.environ.get("BENCH_REUSE") and (work / "litdata").exists()):  # (written and uploaded already)
        optimize(fn=pieces, inputs=list(range((n + chunk_tokens - 1) // chunk_tokens)),
                 output_dir=str(work / "litdata"), chunk_size=chunk_tokens, item_loader=TokensLoader(), num_workers=1,
                 verbose=False)
        for prefix in prefixes:
            upload(s3fs.S3FileSystem(**options), work / "litdata", prefix)
    storage = {"endpoint_url": read_endpoint, "aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
    limit = {"max_cache_size": int(os.environ["BENCH_CACHE_LIMIT"])} if os.environ.get("BENCH_CACHE_LIMIT") else {}
    begin = start = time.perf_counter()
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    caches = ["litdata-cache"] if sources == 1 else [f"litdata-cache-{i}" for i in range(sources)]
    each = [StreamingDataset(input_dir=f"s3://{prefix}", cache_dir=str(work / caches[i]),
                             item_loader=TokensLoader(block_size=seq_len), shuffle=True, seed=0,
                             storage_options=storage, **limit) for i, prefix in enumerate(prefixes)]
    ds = each[0] if sources == 1 else CombinedStreamingDataset(each, seed=0, weights=[1 / sources] * sources,
                                                               iterate_over_all=False)
    it = iter(StreamingDataLoader(ds, batch_size=batch, num_workers=0))
    next(it)
    first = time.perf_counter() - start
    rows = sum(len(d) for d in each)
    steps, read = min(steps or rows, rows // batch - 1), 0
    start = time.perf_counter()
    for _ in range(steps):  # (a mixture ends when one of its sources does)
        if next(it, None) is None:
            break
        read += 1
    end = time.perf_counter()
    steps = read
    use = resource.getrusage(resource.RUSAGE_SELF)
    cpu = use.ru_utime + use.ru_stime - cpu.ru_utime - cpu.ru_stime
    rate, whole = steps * batch * seq_len / (end - start), (steps + 1) * batch * seq_len / (end - begin)
    print(json.dumps({"first": first, "rate": rate, "whole": whole, "steps": steps,
                      "cpu_per_gb": cpu / ((steps + 1) * batch * seq_len * 2 / 1e9),  # uint16 tokens delivered
                      "chunks": (n + chunk_tokens - 1) // chunk_tokens}))


if __name__ == "__main__":
    main()
