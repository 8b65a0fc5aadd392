"""The ingestion promise, as a property over every way data enters.

A corpus generated at random is written with one meaning (its documents, dtype, BOS/EOS,
split, field) in each format forge-grain reads: a native store, raw `.bin`, `.npy` with its
header, header-less `.npy` (OLMo), Megatron (written by megatron-core), Hugging Face Arrow
(`save_to_disk`), LitData and MDS (from their published layouts), pre-tokenized JSON Lines
and Parquet, and text. Opened with the right declaration, it gives exactly the written
documents. Opened with one wrong declaration (dtype, eos_id, bos_id, vocab_size, split, or
the field), it gives either an error that names the file and the option to fix, or exactly
the written documents. Never a third outcome.

A seeded subset runs by default; FORGE_GRAIN_SLOW=1 runs many more corpora per way in.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import SLOW, TOKENIZER, expected_documents, make_texts, write_jsonl
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from mds_writer import write_mds

from forge_grain import PrepareError, StoreError, TokenStore, prepare, write_store
from forge_grain.stores.litdata import NUMPY_DTYPES

OPTION_NAMES = ("dtype", "eos_id", "bos_id", "vocab_size", "split", "token_field", "text_field", "format",
                "--eos", "--bos", "--vocab-size", "--token-field", "--text-field", "--split")
INDEXED = ["native", "megatron", "arrow", "litdata", "mds"]
RAW = ["raw_bin", "raw_npy", "olmo"]
PREPARED = ["jsonl_ids", "parquet_ids", "text"]
WRONG = ["dtype", "eos_id", "bos_id", "vocab_small", "vocab_large", "split", "field"]


@st.composite
def corpora(draw):
    """Documents of ids in [2, vocab) ending with EOS (some starting with BOS), and the width."""
    vocab = draw(st.sampled_from([300, 8192, 50_000, 70_000]))
    eos = draw(st.sampled_from([1, vocab - 1]))
    bos = draw(st.sampled_from([None, 0]))
    n = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        body = rng.integers(2, vocab - 1, int(rng.integers(1, 60)))
        docs.append(np.concatenate([[bos] if bos is not None else [], body, [eos]]).astype(np.int64))
    narrow = "uint16" if vocab <= 65_536 else "uint32"
    width = draw(st.sampled_from([narrow, "int32", "int64"]))
    return dict(docs=docs, vocab=vocab, eos=eos, bos=bos, dtype=width, seed=seed)


def write(fmt: str, c: dict, base: Path) -> tuple[Path, dict, list[list[int]]]:
    """The corpus in format `fmt` under `base`: (the path to open, the right declaration, the
    documents it holds)."""
    docs, vocab, eos, bos, dtype = c["docs"], c["vocab"], c["eos"], c["bos"], c["dtype"]
    expected = [d.tolist() for d in docs]
    specials = {"eos_id": eos, **({"bos_id": bos} if bos is not None else {})}
    if fmt == "native":
        return write_store(base / "store", docs, vocab_size=vocab, tokenizer={**TOKENIZER, "vocab_size": vocab},
                           **specials), {}, expected
    if fmt in RAW:
        flat = np.concatenate(docs).astype(dtype)
        if fmt == "raw_npy":
            np.save(base / "train.npy", flat)
            return base / "train.npy", dict(specials, vocab_size=vocab), expected
        name = "train.bin" if fmt == "raw_bin" else "part-0-00000.npy"  # OLMo: header-less .npy memmaps
        flat.tofile(base / name)
        return base / name, dict(specials, dtype=dtype, vocab_size=vocab), expected
    if fmt == "megatron":
        torch = pytest.importorskip("torch")
        pytest.importorskip("megatron.core")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        width = {"uint16": np.uint16, "uint32": np.int32, "int32": np.int32, "int64": np.int64}[dtype]  # its DTypes
        builder = IndexedDatasetBuilder(str(base / "c4_text_document.bin"), dtype=width)
        for d in docs:
            builder.add_item(torch.from_numpy(d.astype(np.int64)))
            builder.end_document()
        builder.finalize(str(base / "c4_text_document.idx"))
        return base / "c4_text_document", dict(vocab_size=vocab), expected
    if fmt == "arrow":
        import datasets

        datasets.Dataset.from_dict({"input_ids": expected, "text": ["x"] * len(docs)}).save_to_disk(str(base / "a"))
        return base / "a", dict(vocab_size=vocab), expected
    if fmt == "litdata":  # litdata's TokensLoader layout: uint32 n, n + 1 offsets, the items; index.json
        code = {v: k for k, v in NUMPY_DTYPES.items()}[dtype]
        items = [d.astype(dtype).tobytes() for d in docs]
        start = 4 * (len(items) + 2)
        offsets = np.concatenate([[0], np.cumsum([len(b) for b in items])]) + start
        (base / "lit").mkdir()
        (base / "lit" / "chunk-0-0.bin").write_bytes(np.uint32(len(items)).tobytes() + offsets.astype("<u4").tobytes()
                                                      + b"".join(items))
        (base / "lit" / "index.json").write_text(json.dumps({
            "chunks": [{"chunk_bytes": int(offsets[-1]) - start, "chunk_size": len(items), "dim": None,
                        "filename": "chunk-0-0.bin"}],
            "config": {"compression": None, "data_format": [f"no_header_numpy:{code}"], "chunk_size": len(items)}}))
        return base / "lit", dict(vocab_size=vocab), expected
    if fmt == "mds":
        write_mds(base / "mds", {"tokens": f"ndarray:{dtype}", "id": "str"},
                  [{"tokens": d.astype(dtype), "id": str(i)} for i, d in enumerate(docs)], samples_per_shard=16)
        return base / "mds", dict(token_field="tokens", vocab_size=vocab), expected
    raise AssertionError(fmt)


def declare_wrongly(what: str, c: dict, right: dict, fmt: str, max_id: int) -> dict | None:
    """`right` with one declaration wrong (None where this way in has no such declaration)."""
    if what == "dtype":
        others = [d for d in ("uint16", "uint32", "int32", "int64") if d != c["dtype"]]
        return {**right, "dtype": others[c["seed"] % len(others)]}
    if what == "eos_id":
        return {**right, "eos_id": [2, 5, c["vocab"] // 2, 0][c["seed"] % 4]} if c["eos"] not in (2, 5) else None
    if what == "bos_id":
        return {**right, "bos_id": 7 if c["bos"] is None else 3}
    if what == "vocab_small":
        return {**right, "vocab_size": max_id}  # the largest id is then outside the vocabulary
    if what == "vocab_large":
        return {**right, "vocab_size": c["vocab"] * 2}  # harmless: the ids are all inside it
    if what == "split":
        return {**right, "split": "validation"}
    if what == "field":
        return {**right, "token_field": "labels"} if fmt in ("arrow", "mds") else None
    raise AssertionError(what)


def outcome(path: Path, expected: list[list[int]], open_it) -> str:
    """'exact' or 'refused', asserting there is no third outcome."""
    try:
        store = open_it()
    except (StoreError, PrepareError) as e:
        message = str(e)
        assert str(path) in message or path.name in message, f"the error does not name the data: {message}"
        assert any(o in message for o in OPTION_NAMES), f"the error does not say what to declare: {message}"
        return "refused"
    got = [store[i].tolist() for i in range(len(store))]
    assert got == expected, f"opened without error but the documents differ (a silent misread) at {path}"
    return "exact"


COMMON = dict(deadline=None, derandomize=not SLOW, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("fmt", INDEXED + RAW)
@settings(max_examples=80 if SLOW else 15, **COMMON)
@given(c=corpora(), wrong=st.sampled_from(WRONG))
def test_a_stored_corpus_is_read_exactly_or_refused_by_name(fmt, c, wrong):
    with tempfile.TemporaryDirectory() as tmp:
        path, right, expected = write(fmt, c, Path(tmp))
        assert outcome(path, expected, lambda: TokenStore.open(path, **right)) == "exact"
        max_id = max(max(d) for d in expected)
        declared = declare_wrongly(wrong, c, right, fmt, max_id)
        assume(declared is not None)
        result = outcome(path, expected, lambda: TokenStore.open(path, **declared))
        if wrong in ("vocab_small", "split", "field") or (wrong == "eos_id" and fmt in RAW):
            assert result == "refused", (wrong, declared)


def write_prepared_input(fmt: str, c: dict, base: Path) -> tuple[Path, dict, list[list[int]]]:
    """Pre-tokenized rows (JSON Lines or Parquet) or text, and prepare's right arguments."""
    if fmt == "text":
        texts = make_texts(len(c["docs"]) + 1, seed=c["seed"] % 1000)
        src = write_jsonl(base / "train.jsonl", texts)
        from tokenizers import Tokenizer

        from forge_grain.tokenizer import DEFAULT_TOKENIZER

        return src, {}, expected_documents(Tokenizer.from_file(str(DEFAULT_TOKENIZER)), texts)
    rows = [d.tolist() for d in c["docs"]]
    if fmt == "jsonl_ids":
        src = base / "train.jsonl"
        src.write_text("".join(json.dumps({"ids": r, "n": i}) + "\n" for i, r in enumerate(rows)))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        src = base / "train.parquet"
        pq.write_table(pa.table({"ids": rows}), src)
    specials = {"eos_id": c["eos"], **({"bos_id": c["bos"]} if c["bos"] is not None else {})}
    return src, dict(token_field="ids", vocab_size=c["vocab"], **specials), rows


@pytest.mark.parametrize("fmt", PREPARED)
@settings(max_examples=40 if SLOW else 6, **COMMON)
@given(c=corpora(), wrong=st.sampled_from(["eos_id", "bos_id", "vocab_small", "split", "field"]))
def test_a_prepared_corpus_is_written_exactly_or_refused_by_name(fmt, c, wrong):
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        src, right, expected = write_prepared_input(fmt, c, base)
        run = lambda out, **kw: TokenStore.open(prepare(src, base / out, progress=False, **kw))  # noqa: E731
        assert outcome(src, expected, lambda: run("right", **right)) == "exact"
        if fmt == "text":
            declared = {"split": dict(split="validation"), "field": dict(text_field="body")}.get(wrong)
        elif wrong == "field":
            declared = {**right, "token_field": "labels"}
        elif wrong == "split":
            declared = {**right, "split": "validation"}
        else:
            max_id = max(max(r) for r in expected)
            declared = declare_wrongly(wrong, c, right, fmt, max_id)
        assume(declared is not None)
        result = outcome(src, expected, lambda: run("wrong", **declared))
        if wrong in ("vocab_small", "split", "field", "eos_id"):
            assert result == "refused", (wrong, declared)
        shutil.rmtree(base / "wrong", ignore_errors=True)


def test_the_property_sees_a_silent_misread(tmp_path):
    """The checker itself: a store opened with documents other than those written is caught."""
    docs = [np.array([5, 6, 1]), np.array([7, 1])]
    path = write_store(tmp_path / "written-store", docs, vocab_size=10, eos_id=1)
    with pytest.raises(AssertionError, match="silent misread"):
        outcome(path, [[5, 6, 1], [7, 7]], lambda: TokenStore.open(path))
    with pytest.raises(AssertionError, match="does not name the data"):
        outcome(path, [], lambda: (_ for _ in ()).throw(StoreError("something is wrong")))
