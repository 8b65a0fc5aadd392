"""Benchmark corpora: synthetic log-normal documents, and the demo corpus."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from forge_grain import TokenStore, prepare, write_store
from forge_grain.demo import write_demo_corpus

BOS, EOS, VOCAB = 0, 1, 32000


def lognormal_lengths(num_docs: int, median: float = 600, sigma: float = 1.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(2, rng.lognormal(np.log(median), sigma, num_docs).astype(np.int64))


def synthetic_store(path: Path, num_docs: int, seed: int = 0) -> TokenStore:
    """Documents of log-normal length (median 600, sigma 1.0), each starting with BOS."""
    if (path / "manifest.json").exists():
        return TokenStore.open(path)
    lengths = lognormal_lengths(num_docs, seed=seed)
    rng = np.random.default_rng(seed + 1)

    def docs():
        for n in lengths:
            doc = rng.integers(2, VOCAB, n, dtype=np.uint16)
            doc[0] = BOS
            yield doc

    return TokenStore.open(write_store(path, docs(), vocab_size=VOCAB, bos_id=BOS, eos_id=EOS))


def demo_store(path: Path, max_files: int = 800) -> TokenStore:
    corpus = write_demo_corpus(path / "corpus", max_files)["code"]
    return TokenStore.open(prepare(corpus, path / "store", progress=False))


def sharded_synthetic_store(path: Path, num_docs: int, shards: int, seed: int = 0) -> TokenStore:
    """`synthetic_store`'s documents in `shards` shards of about equal tokens, written directly
    (each shard's tokens and index, the joined index, the manifest last), without the JSON
    round trip through `prepare` that a corpus of 400 MB would take minutes for."""
    from forge_grain.stores.manifest import Manifest, ShardInfo, write_joined_index
    from forge_grain.files import save_npy_atomic, sha256_file

    if (path / "manifest.json").exists():
        return TokenStore.open(path)
    path.mkdir(parents=True, exist_ok=True)
    lengths = lognormal_lengths(num_docs, seed=seed)
    rng = np.random.default_rng(seed + 1)
    cuts = np.searchsorted(np.cumsum(lengths), np.linspace(0, lengths.sum(), shards + 1)[1:-1])
    infos = []
    for k, part in enumerate(np.split(lengths, cuts)):
        tokens = rng.integers(2, VOCAB, int(part.sum()), dtype=np.uint16)
        offsets = np.concatenate([[0], np.cumsum(part)]).astype(np.int64)
        tokens[offsets[:-1]] = BOS
        name = f"shard-{k:05d}"
        tokens.tofile(path / f"{name}.bin")
        save_npy_atomic(path / f"{name}.idx.npy", offsets)
        infos.append(ShardInfo(f"{name}.bin", f"{name}.idx.npy", len(part), int(offsets[-1]),
                               sha256_file(path / f"{name}.bin"), sha256_file(path / f"{name}.idx.npy")))
    Manifest(indices=write_joined_index(path, infos), layout="bin", dtype=np.dtype(np.uint16).str, vocab_size=VOCAB,
             bos_id=BOS, eos_id=EOS, tokenizer={"path": None, "sha256": None, "vocab_size": VOCAB},
             num_documents=num_docs, num_tokens=int(lengths.sum()), shards=tuple(infos),
             source={"writer": "benchmarks/corpora.py"}).save(path)
    return TokenStore.open(path)
