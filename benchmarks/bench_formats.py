"""Random document reads/s of each format read in place, against the peer's own reader on the same data.

    python benchmarks/bench_formats.py [--docs 100000] [--reads 20000]

One corpus of `--docs` documents (log-normal lengths, median 200 tokens, ids < 32,000) is
written in every format by the peer's own writer where it installs here: Megatron's
`IndexedDatasetBuilder`, `datasets.save_to_disk`, `litdata.optimize(TokensLoader)`; MDS
from its published layout (`mosaicml-streaming` cannot import here), nanoGPT's `.bin`
with `np.memmap`, and a forge-grain store. Each reader then reads the same random
documents (every format holds uint16 ids, and all reads of one run see the same page
cache), converts each to a numpy array
and sums it, so every token is touched:

- forge-grain: `TokenStore.open(path)[i]` for every format;
- Megatron: `IndexedDataset(prefix)[i]`;
- Hugging Face: `load_from_disk(dir).with_format("numpy")[i]["input_ids"]`;
- LitData: `StreamingDataset(dir, item_loader=TokensLoader(block_size))[i]`: TokensLoader reads
  fixed blocks, not documents, so it reads blocks of the median document length;
- MDS: streaming's `MDSReader.get_sample_data` (open the shard, seek, read, decode), as published;
- nanoGPT: a fresh `np.memmap` per read, as its `get_batch` does per batch.

A second table gives packed rows/s (`pack(store, 1024).get_batch`, 64 random rows per call)
per format against the native `bin` layout: the zero-copy formats feed the same compiled gather.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the MDS writer from the published layout

from corpora import lognormal_lengths  # noqa: E402
from mds_writer import write_mds  # noqa: E402
from report import parser, publish  # noqa: E402

from forge_grain import TokenStore, pack, write_store  # noqa: E402

VOCAB, EOS = 32000, 1


def corpus(num_docs: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    docs = [rng.integers(2, VOCAB, n).astype(np.uint16) for n in lognormal_lengths(num_docs, median=200, seed=0)]
    for d in docs:
        d[-1] = EOS
    return docs


def write_all(base: Path, docs: list[np.ndarray]) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    paths = {"native": write_store(base / "native", docs, vocab_size=VOCAB, eos_id=EOS)}
    flat = np.concatenate(docs)
    flat.tofile(base / "train.bin")
    paths["nanogpt"] = base / "train.bin"
    builder = IndexedDatasetBuilder(str(base / "meg.bin"), dtype=np.uint16)
    for d in docs:
        builder.add_item(torch.from_numpy(d.astype(np.int32)))
        builder.end_document()
    builder.finalize(str(base / "meg.idx"))
    paths["megatron"] = base / "meg"
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int32)
    ids = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    datasets.Dataset(pa.table({"input_ids": ids})).save_to_disk(str(base / "arrow"))
    paths["arrow"] = base / "arrow"
    npz = base / "docs.npz"
    np.savez(npz, **{f"doc_{i}": d for i, d in enumerate(docs)})
    subprocess.run([sys.executable, ROOT / "tests" / "scripts" / "write_litdata.py", npz, base / "litdata",
                    str(1 << 22), "uint16"], check=True, capture_output=True)
    paths["litdata"] = base / "litdata"
    paths["mds"] = write_mds(base / "mds", {"tokens": "ndarray:uint16"}, [{"tokens": d} for d in docs],
                             samples_per_shard=20000)
    return paths


def rate(read, picks, repeats: int = 3) -> float:
    """Best reads/s over `repeats` passes of `read(i)` for i in picks (each result summed)."""
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        for i in picks:
            np.asarray(read(int(i))).sum()
        best = max(best, len(picks) / (time.perf_counter() - t))
    return best


def peer_readers(paths: dict[str, Path], docs: list[np.ndarray], median: int):
    """The peers' own random-access readers, each checked against the documents first."""
    import datasets
    from litdata import StreamingDataset, TokensLoader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    meg = IndexedDataset(str(paths["megatron"]))
    hf = datasets.load_from_disk(str(paths["arrow"])).with_format("numpy")
    lit = StreamingDataset(str(paths["litdata"]), item_loader=TokensLoader(block_size=median), shuffle=False)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    mds = MDSSampleReader(paths["mds"])

    def nanogpt(i):
        data = np.memmap(paths["nanogpt"], dtype=np.uint16, mode="r")
        return data[offsets[i] : offsets[i + 1]]

    readers = {
        "megatron": ("Megatron IndexedDataset[i]", lambda i: meg[i], len(docs)),
        "arrow": ("datasets (numpy format)[i]", lambda i: hf[i]["input_ids"], len(docs)),
        "litdata": (f"LitData TokensLoader({median})[i]", lambda i: lit[i], len(lit)),
        "mds": ("MDS get_sample_data + decode", mds.read, len(docs)),
        "nanogpt": ("nanoGPT memmap per read", nanogpt, len(docs)),
    }
    for fmt in ("megatron", "arrow", "mds", "nanogpt"):
        assert np.array_equal(np.asarray(readers[fmt][1](7)), docs[7]), fmt
    return readers


class MDSSampleReader:
    """streaming.base.format.mds.MDSReader's sample read, as published: open the shard, read the
    sample's two offsets, read the sample, split off the column sizes, decode the ndarray."""

    def __init__(self, root: Path):
        import json

        index = json.loads((root / "index.json").read_text())
        self.files = [root / s["raw_data"]["basename"] for s in index["shards"]]
        self.starts = np.cumsum([0] + [s["samples"] for s in index["shards"]])

    def read(self, i: int) -> np.ndarray:
        shard = int(np.searchsorted(self.starts, i, side="right") - 1)
        idx = i - int(self.starts[shard])
        with open(self.files[shard], "rb", 0) as fp:
            fp.seek(4 + 4 * idx)
            begin, end = np.frombuffer(fp.read(8), np.uint32)
            fp.seek(begin)
            data = fp.read(end - begin)
        # one variable column: no size header before it but its own; ndarray:int32 with a dynamic shape
        body = data[4:]
        ndim_width = body[0]
        width = 1 << (ndim_width & 3)
        return np.frombuffer(body[1 + width :], np.uint16)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--reads", type=int, default=20_000)
    a = ap.parse_args()
    docs = corpus(a.docs)
    median = int(np.median([len(d) for d in docs]))
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        paths = write_all(Path(tmp), docs)
        lines = [f"{a.docs:,} documents, {sum(map(len, docs)):,} tokens, written in every format in "
                 f"{time.perf_counter() - t:.0f} s; {a.reads:,} random reads each, best of 3", ""]
        stores = {fmt: TokenStore.open(p, **({"dtype": "uint16", "eos_id": EOS} if fmt == "nanogpt" else {}))
                  for fmt, p in paths.items()}
        for fmt, s in stores.items():
            assert len(s) == len(docs) and np.array_equal(s[7], docs[7]), fmt
        readers = peer_readers(paths, docs, median)
        picks = np.random.default_rng(1).integers(0, len(docs), a.reads)
        native = rate(stores["native"].__getitem__, picks)
        lines.append(f"{'format':<10} {'forge-grain docs/s':>19} {'peer reader':<34} {'peer reads/s':>13} "
                     f"{'ratio':>7} {'vs native bin':>14}")
        lines.append(f"{'native':<10} {native:>19,.0f}")
        for fmt in ("megatron", "arrow", "litdata", "mds", "nanogpt"):
            ours = rate(stores[fmt].__getitem__, picks)
            name, read, n = readers[fmt]
            theirs = rate(read, picks % n)
            lines.append(f"{fmt:<10} {ours:>19,.0f} {name:<34} {theirs:>13,.0f} {ours / theirs:>6.1f}x "
                         f"{ours / native:>13.2f}")
        lines += ["", "packed rows/s, seq_len 1024, get_batch of 64 random rows (the compiled gather)"]
        rows = np.random.default_rng(2).integers(0, 1 << 30, (50, 64))
        base = None
        for fmt, s in stores.items():
            ds = pack(s, 1024, "bestfit", cache_dir=Path(tmp) / "plans")
            ds.get_batch(rows[0] % ds.num_rows)
            best = 0.0
            for _ in range(3):
                t = time.perf_counter()
                for r in rows:
                    ds.get_batch(r % ds.num_rows)
                best = max(best, rows.size / (time.perf_counter() - t))
            base = base or best
            lines.append(f"  {fmt:<10} {best:>10,.0f} rows/s   {best / base:.2f} of native bin")
    publish("formats", lines)


if __name__ == "__main__":
    main()
