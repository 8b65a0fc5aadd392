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
