"""Prepare throughput and random document access, each against a peer measured in the same run.

    python benchmarks/bench_prepare.py [--max-files 800] [--reads 200000]

1. `forge-grain prepare` at 1 and 2 processes against a plain
   `datasets.Dataset.map(batched=True)` tokenization of the same corpus with the
   same tokenizer (which stops at Arrow lists, not a token store).
2. Random document reads of `TokenStore` (bin layout, and ArrayRecord layout)
   against `grain.sources.ArrayRecordDataSource` over the same documents.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from forge_grain import TokenStore, prepare
from forge_grain.demo import write_demo_corpus
from forge_grain.tokenizer import load_tokenizer
from report import kept, parser


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def bench_prepare(corpus: Path, work: Path) -> list[tuple[str, float, float]]:
    import datasets

    datasets.disable_progress_bars()
    mb = corpus.stat().st_size / 1e6
    rows = []
    for nproc in (1, 2):
        out = work / f"store-{nproc}"
        shutil.rmtree(out, ignore_errors=True)
        store, dt = timed(lambda: TokenStore.open(prepare(corpus, out, num_shards=8, num_proc=nproc, progress=False)))
        rows.append((f"forge-grain prepare, {nproc} proc", store.num_tokens / dt, mb / dt))
    tok = load_tokenizer()
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train")

    def tokenize(batch):
        enc = tok.backend.encode_batch(batch["text"], add_special_tokens=False)
        return {"ids": [[tok.bos_id] + e.ids + [tok.eos_id] for e in enc]}

    mapped, dt = timed(lambda: ds.map(tokenize, batched=True, remove_columns=ds.column_names, new_fingerprint=str(time.time())))
    ntok = sum(len(x) for x in mapped["ids"])
    rows.append(("datasets.map(batched=True)", ntok / dt, mb / dt))
    return rows


def bench_access(corpus: Path, work: Path, reads: int) -> list[tuple[str, float]]:
    import grain

    bin_store = TokenStore.open(prepare(corpus, work / "store-1", num_shards=8, progress=False))
    ar_path = prepare(corpus, work / "store-ar", layout="arrayrecord", num_shards=8, progress=False)
    ar_store = TokenStore.open(ar_path)
    source = grain.sources.ArrayRecordDataSource([str(f) for f in ar_store.files])
    idx = np.random.default_rng(0).integers(0, len(bin_store), reads)
    rows = []
    for name, read in (
        ("TokenStore (bin, mmap)", lambda i: bin_store[i]),
        ("TokenStore (arrayrecord)", lambda i: ar_store[i]),
        ("grain ArrayRecordDataSource", lambda i: np.frombuffer(source[i], np.uint16)),
    ):
        _, dt = timed(lambda: [read(i) for i in idx])
        rows.append((name, reads / dt))
    return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--max-files", type=int, default=800)
    ap.add_argument("--reads", type=int, default=200_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, kept("prepare"):
        work = Path(tmp)
        corpus = write_demo_corpus(work / "corpus", args.max_files)["code"]
        print(f"corpus: {corpus.stat().st_size / 1e6:.1f} MB of Python source ({args.max_files} files)\n")
        rows = bench_prepare(corpus, work)
        base = rows[-1][1]
        print(f"{'prepare':<32}{'M tokens/s':>12}{'MB text/s':>12}{'vs datasets.map':>17}")
        for name, tps, mbs in rows:
            print(f"{name:<32}{tps / 1e6:>12.2f}{mbs:>12.2f}{tps / base:>16.2f}x")
        rows = bench_access(corpus, work, args.reads)
        base = rows[-1][1]
        print(f"\n{'random document reads':<32}{'reads/s':>12}{'vs ArrayRecordDataSource':>26}")
        for name, rps in rows:
            print(f"{name:<32}{rps:>12,.0f}{rps / base:>25.2f}x")


if __name__ == "__main__":
    main()
