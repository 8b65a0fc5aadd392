"""Shared fixtures: small corpora made on the spot, and the shipped tokenizer."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from forge_grain import DataConfig, write_store
from forge_grain.tokenizer import DEFAULT_TOKENIZER

# Fault-injection trials run a seeded subset by default and all of them with FORGE_GRAIN_SLOW=1;
# tests marked `slow` run only then.
SLOW = os.environ.get("FORGE_GRAIN_SLOW") == "1"


if sys.version_info < (3, 11, 8):
    _parse = ast.parse

    def _parse_again(*args, **kwargs):
        """`ast.parse`, once more where it raised CPython's spurious "AST constructor recursion
        depth mismatch" (gh-106905, fixed in 3.11.8; seen in threaded processes): `test_layout`
        hit it parsing a module of the package, in a worker whose earlier tests left threads."""
        try:
            return _parse(*args, **kwargs)
        except SystemError as e:
            if "recursion depth mismatch" not in str(e):
                raise
            return _parse(*args, **kwargs)

    ast.parse = _parse_again


def trials(default: int, slow: int) -> list[int]:
    """Seeds of randomized fault trials: the first `default` normally, `slow` in a slow run."""
    return list(range(slow if SLOW else default))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: fault injection and large cases (run with FORGE_GRAIN_SLOW=1)")
    # every cache lives under FORGE_GRAIN_CACHE: the run's own, not the user's (subprocesses inherit it)
    if "FORGE_GRAIN_CACHE" not in os.environ:
        os.environ["FORGE_GRAIN_CACHE"] = tempfile.mkdtemp(prefix="forge-grain-test-cache-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("FORGE_GRAIN_CACHE"), ignore_errors=True))


def pytest_collection_modifyitems(config, items):
    if SLOW:
        return
    skip = pytest.mark.skip(reason="slow: run with FORGE_GRAIN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


WORDS = (
    "the of and to in is that for it as with was on be by data token model train grain "
    "shard pack mix resume checkpoint def return class import self None True False 42 "
    "naïve café 数据 ∑ λ → 🙂"
).split()


_BAR = re.compile(r"\d+%\||\| *\d+/\d+ \[|(it|s|doc|chunk|step|B)/s\]|s/it\]")


def index_cache(data: Path) -> tuple[Path, Path]:
    """(offsets, record) of the one document-index cache of a raw token file, under the cache
    root (`forge_grain.stores.raw._cache_paths`)."""
    from forge_grain.paths import cache_root

    tag = hashlib.sha256(str(Path(data).resolve()).encode()).hexdigest()[:16]
    found = sorted((cache_root() / "index").glob(f"{tag}-{Path(data).name}.*.offsets"))
    assert len(found) == 1, found
    return found[0], found[0].with_suffix(".json")


def noise(stderr: str) -> list[str]:
    """The lines of `stderr` that are not progress bars (tqdm redraws with carriage returns):
    what a user would read as a message, a warning or a failure."""
    lines = re.split(r"[\r\n]", stderr)
    return [line for line in lines if line.strip() and not _BAR.search(line)]


def tree_bytes(path: Path) -> dict[str, bytes]:
    """Every file of a store by name, hidden temporaries included so leftovers show (the
    `.plans` cache directory is not the store's content)."""
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.is_file()}


def make_texts(n: int, seed: int = 0, empty_every: int = 0) -> list[str]:
    """Deterministic documents of log-normally varying length (and a few empty ones)."""
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        if empty_every and i % empty_every == empty_every - 1:
            texts.append("")
            continue
        k = max(1, int(rng.lognormvariate(3.0, 1.0)))
        texts.append(" ".join(rng.choice(WORDS) for _ in range(k)) + ("\n" if rng.random() < 0.3 else ""))
    return texts


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "n": i}) + "\n" for i, t in enumerate(texts)))
    return path


@pytest.fixture(scope="session")
def texts() -> list[str]:
    return make_texts(400, seed=1, empty_every=50)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, texts) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "corpus.jsonl", texts)


@pytest.fixture(scope="session")
def reference_tokenizer() -> Tokenizer:
    """The shipped tokenizer, loaded independently of forge-grain's code."""
    return Tokenizer.from_file(str(DEFAULT_TOKENIZER))


def expected_documents(tok: Tokenizer, texts: list[str], bos: int | None = 0, eos: int | None = 1) -> list[list[int]]:
    docs = []
    for t in texts:
        if not t:
            continue
        ids = tok.encode(t, add_special_tokens=False).ids
        docs.append(([bos] if bos is not None else []) + ids + ([eos] if eos is not None else []))
    return docs


@pytest.fixture(scope="session")
def bin_store(tmp_path_factory, corpus) -> Path:
    from forge_grain import prepare

    return prepare(corpus, tmp_path_factory.mktemp("stores") / "bin", num_shards=3, progress=False)


@pytest.fixture(scope="session")
def ar_store(tmp_path_factory, corpus) -> Path:
    from forge_grain import prepare

    return prepare(corpus, tmp_path_factory.mktemp("stores") / "ar", layout="arrayrecord", num_shards=2, progress=False)


@pytest.fixture
def store_copy(tmp_path, bin_store) -> Path:
    """A private copy of the bin store, to damage."""
    return Path(shutil.copytree(bin_store, tmp_path / "store", ignore=shutil.ignore_patterns(".plans")))


@pytest.fixture
def ar_copy(tmp_path, ar_store) -> Path:
    """A private copy of the ArrayRecord store, to damage."""
    return Path(shutil.copytree(ar_store, tmp_path / "ar", ignore=shutil.ignore_patterns(".plans")))


# -- pipeline fixtures: three small stores sharing one tokenizer identity ----------------------

TOKENIZER = {"path": "test", "sha256": "a" * 64, "vocab_size": 1000}


def store(path, n_docs, seed, tokenizer=TOKENIZER, vocab=1000):
    rng = np.random.default_rng(seed)
    docs = [np.concatenate([[0], rng.integers(2, vocab, rng.integers(5, 120))]) for _ in range(n_docs)]
    return write_store(path, docs, vocab_size=vocab, bos_id=0, eos_id=1, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    base = tmp_path_factory.mktemp("pipeline")
    return {"web": store(base / "web", 400, 1), "code": store(base / "code", 250, 2), "math": store(base / "math", 150, 3)}


def config(stores, **kw):
    d = dict(
        sources=[
            dict(name="web", path=str(stores["web"]), weight=0.6, strategy="bos_bestfit"),
            dict(name="code", path=str(stores["code"]), weight=0.3, strategy="bestfit"),
            dict(name="math", path=str(stores["math"]), weight=0.1, strategy="concat"),
        ],
        seq_len=64,
        global_batch_size=8,
        seed=7,
    )
    d.update(kw)
    return DataConfig.from_dict(d)


def write_toml(path, stores, extra=""):
    path.write_text(textwrap.dedent(f"""\
        seq_len = 64
        global_batch_size = 8
        seed = 7
        num_epochs = 2
        {extra}
        [[sources]]
        name = "web"
        path = "{stores['web']}"
        weight = 0.6
        strategy = "bos_bestfit"

        [[sources]]
        name = "code"
        path = "{stores['code']}"
        weight = 0.4

        [[phases]]
        start_step = 5
        weights = {{ web = 0.2, code = 0.8 }}
        """))
    return path


