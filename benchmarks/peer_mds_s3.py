"""MosaicML Streaming reading the same tokens from the same S3 server, for `bench_scale.py`.

Runs in an environment where `mosaicml-streaming` imports (it needs torchvision built for the
installed torch: not this project's test environment), as `bench_scale.py --peer-python
PYTHON --mosaic` starts it:

    PYTHON benchmarks/peer_mds_s3.py TOKENS.npy ENDPOINT WORK SEQ_LEN BATCH STEPS SHARD_BYTES [READ_ENDPOINT]

TOKENS.npy: the corpus's documents back to back. They are cut into samples of SEQ_LEN tokens
(in the store's dtype, uint16: the same bytes as the other readers), as LLM Foundry's `concat_tokens` conversion stores a pre-training corpus, written by
Streaming's own `MDSWriter` in shards of about SHARD_BYTES, uploaded to `s3://bench/mds`, and
read by `StreamingDataset(remote="s3://bench/mds", local=..., shuffle=True)` in a
`StreamingDataLoader` of BATCH samples, through READ_ENDPOINT where given (a shaped link in front
of ENDPOINT). `BENCH_CACHE_LIMIT` (bytes) is its `cache_limit`; `BENCH_REUSE=1` reads the dataset
a run before wrote and uploaded. Prints one JSON line: time to the first batch, tokens/s over the next STEPS
batches (STEPS 0: the whole epoch), and tokens/s of the whole run from the request.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from peer_litdata_s3 import upload  # (the scripts' directory is on the path)


def stub_vision() -> None:
    """`streaming` imports its image datasets (`streaming.vision`, through torchvision) at
    import; a torchvision not built for the installed torch fails there. Nothing here reads
    images: an empty module stands in for it."""
    import types

    try:
        import torchvision  # noqa: F401
    except Exception:  # (a RuntimeError of torch's operator registry, not an ImportError)
        sys.modules["streaming.vision"] = types.ModuleType("streaming.vision")


def main() -> None:
    tokens_file, endpoint, work, seq_len, batch, steps, shard_bytes = sys.argv[1:8]
    read_endpoint = sys.argv[8] if len(sys.argv) > 8 else endpoint
    seq_len, batch, steps, shard_bytes = int(seq_len), int(batch), int(steps), int(shard_bytes)
    work = Path(work)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", S3_ENDPOINT_URL=read_endpoint,
                      AWS_DEFAULT_REGION="us-east-1")
    import s3fs

    stub_vision()
    from streaming import MDSWriter, StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    tokens = np.load(tokens_file, mmap_mode="r")
    samples = len(tokens) // seq_len
    if not (os.environ.get("BENCH_REUSE") and (work / "mds").exists()):  # (written and uploaded already)
        columns = {"tokens": f"ndarray:{tokens.dtype.name}"}
        with MDSWriter(out=str(work / "mds"), columns=columns, size_limit=shard_bytes) as out:
            for i in range(samples):
                out.write({"tokens": np.asarray(tokens[i * seq_len:(i + 1) * seq_len])})
        upload(s3fs.S3FileSystem(key="bench", secret="bench", endpoint_url=endpoint), work / "mds", "bench/mds")
    shards = len(list((work / "mds").glob("shard.*.mds")))
    clean_stale_shared_memory()
    begin = start = time.perf_counter()
    limit = {"cache_limit": int(os.environ["BENCH_CACHE_LIMIT"])} if os.environ.get("BENCH_CACHE_LIMIT") else {}
    ds = StreamingDataset(remote="s3://bench/mds", local=str(work / "mds-cache"), shuffle=True, shuffle_seed=0,
                          batch_size=batch, **limit)
    it = iter(StreamingDataLoader(ds, batch_size=batch, num_workers=0))
    next(it)
    first = time.perf_counter() - start
    steps = min(steps or samples, samples // batch - 1)
    start = time.perf_counter()
    for _ in range(steps):
        next(it)
    end = time.perf_counter()
    rate, whole = steps * batch * seq_len / (end - start), (steps + 1) * batch * seq_len / (end - begin)
    print(json.dumps({"first": first, "rate": rate, "whole": whole, "steps": steps, "shards": shards}))


if __name__ == "__main__":
    main()
