"""Trustworthy ingestion: every way data enters is explicit and validated, never guessed.

One section per case of the ingestion issue; each writes the real input files it needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import index_cache, write_jsonl

from forge_grain import DataConfig, Pipeline, PrepareError, StoreError, TokenStore, prepare
from forge_grain.pipeline.pipeline import StateError
from forge_grain.splits import SPLIT_KEYWORDS


def docs_of(store) -> list[list[int]]:
    return [store[i].tolist() for i in range(len(store))]


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


# -- 1. local splits ----------------------------------------------------------------------------


@pytest.fixture
def split_dir(tmp_path):
    d = tmp_path / "splits"
    d.mkdir()
    for split, n in (("train", 6), ("validation", 3), ("test", 2)):
        write_jsonl(d / f"{split}.jsonl", [f"{split} document number {i}" for i in range(n)])
    return d


def test_a_split_directory_gives_only_the_split_asked_for(split_dir, tmp_path, reference_tokenizer):
    val = TokenStore.open(prepare(split_dir, tmp_path / "val", split="validation", progress=False))
    assert docs_of(val) == [[0, *encode(reference_tokenizer, f"validation document number {i}"), 1] for i in range(3)]
    train = TokenStore.open(prepare(split_dir, tmp_path / "train", split="train", progress=False))
    assert len(train) == 6
    default = TokenStore.open(prepare(split_dir, tmp_path / "default", progress=False))
    assert docs_of(default) == docs_of(train)  # no --split: "train", as `datasets` reads such a directory


def test_split_errors_name_the_directory_and_the_splits(split_dir, tmp_path):
    with pytest.raises(PrepareError, match=r"splits: no files of split 'dev2'.*\['test', 'train', 'validation'\]"):
        prepare(split_dir, tmp_path / "x", split="dev2", progress=False)
    write_jsonl(split_dir / "extra.jsonl", ["stray"])
    with pytest.raises(PrepareError, match=r"named for splits.*others for none \(extra\.jsonl\)"):
        prepare(split_dir, tmp_path / "y", progress=False)
    with pytest.raises(PrepareError, match=r"named for split 'test'.*--split 'train'"):
        prepare(split_dir / "test.jsonl", tmp_path / "z", split="train", progress=False)


def test_split_keywords_follow_the_hugging_face_convention():
    assert {str(k): tuple(v) for k, v in datasets.data_files.SPLIT_KEYWORDS.items()} == SPLIT_KEYWORDS


def test_saved_dataset_dict_split(tmp_path):
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ["a train row", "another"]}),
        "validation": datasets.Dataset.from_dict({"text": ["held out"]}),
    })
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(TokenStore.open(prepare(tmp_path / "dd", tmp_path / "v", split="validation", progress=False))) == 1
    with pytest.raises(PrepareError, match=r"without split 'test'.*\['train', 'validation'\]"):
        prepare(tmp_path / "dd", tmp_path / "t", split="test", progress=False)


# -- 2. special-token text stays text -----------------------------------------------------------


def test_special_token_strings_in_text_are_text(tmp_path, reference_tokenizer):
    text = "see <|endoftext|> and <|bos|> here"
    src = write_jsonl(tmp_path / "c.jsonl", [text])
    doc = TokenStore.open(prepare(src, tmp_path / "s", progress=False))[0].tolist()
    assert doc[0] == 0 and doc[-1] == 1
    assert 0 not in doc[1:] and 1 not in doc[:-1]  # the only special ids are the ones prepare added
    reference_tokenizer.encode_special_tokens = True
    try:
        assert doc[1:-1] == encode(reference_tokenizer, text)
    finally:
        reference_tokenizer.encode_special_tokens = False
    meant = TokenStore.open(prepare(src, tmp_path / "m", special_tokens_in_text=True, progress=False))[0].tolist()
    assert meant[1:-1] == encode(reference_tokenizer, text) and 1 in meant[1:-1]  # the opt-in keeps them special


# -- 3. what a text field may hold --------------------------------------------------------------


def test_lists_of_strings_need_an_explicit_separator(tmp_path, reference_tokenizer):
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"text": ["para one", "para two"]}) + "\n")
    with pytest.raises(PrepareError, match=r"c\.jsonl.*lists of strings.*--join-lists"):
        prepare(src, tmp_path / "s", progress=False)
    doc = TokenStore.open(prepare(src, tmp_path / "j", list_separator="\n\n", progress=False))[0].tolist()
    assert doc == [0, *encode(reference_tokenizer, "para one\n\npara two"), 1]


@pytest.mark.parametrize("value, problem", [
    (None, "null"), (7, "int64|int"), ({"a": 1}, "struct|dict"), (True, "bool"),
])
def test_non_text_values_name_the_file_and_row(tmp_path, value, problem):
    d = tmp_path / "in"
    d.mkdir()
    write_jsonl(d / "part-a.jsonl", ["fine", "also fine"])
    (d / "part-b.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": value}) + "\n")
    with pytest.raises(PrepareError, match=rf"(part-b\.jsonl, row 1|in).*({problem})"):
        prepare(d, tmp_path / "s", progress=False)


def test_null_text_names_its_file_and_row_among_several_files(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write_jsonl(d / "part-a.jsonl", ["fine", "also fine", "third"])
    (d / "part-b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["ok", "ok", None]))
    with pytest.raises(PrepareError, match=r"part-b\.jsonl, row 2: the text is null"):
        prepare(d, tmp_path / "s", progress=False)


def test_bytes_that_are_not_utf8_name_the_file_and_row(tmp_path):
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "good"}\n{"text": "bad \xff\xfe bytes"}\n')
    with pytest.raises(PrepareError, match=r"c\.jsonl, row 1: .*not UTF-8"):
        prepare(tmp_path / "c.jsonl", tmp_path / "s", progress=False)
    (tmp_path / "t.txt").write_bytes(b"line one\nline two \xff\n")
    with pytest.raises(PrepareError, match=r"t\.txt, line 2 .*not UTF-8"):
        prepare(tmp_path / "t.txt", tmp_path / "t", progress=False)


def test_whitespace_only_documents_are_skipped_and_counted(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", ["real text", "   ", "\n\t\n", "", "more text"])
    store = TokenStore.open(prepare(src, tmp_path / "s", progress=False))
    assert len(store) == 2
    assert store.manifest.source["skipped_empty"] == 3


# -- 4. pre-tokenized input ---------------------------------------------------------------------


def token_rows(n=40, vocab=500, seed=0):
    rng = np.random.default_rng(seed)
    return [[0, *rng.integers(2, vocab, rng.integers(1, 30)).tolist(), 1] for _ in range(n)]


@pytest.mark.parametrize("kind", ["save_to_disk", "parquet", "jsonl"])
def test_pretokenized_columns_become_a_store_without_a_tokenizer(tmp_path, kind):
    rows = token_rows()
    if kind == "save_to_disk":
        datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "in"))
        src = tmp_path / "in"
    elif kind == "parquet":
        src = tmp_path / "in.parquet"
        pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), src)
    else:
        src = tmp_path / "in.jsonl"
        src.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    store = TokenStore.open(prepare(src, tmp_path / "s", token_field="input_ids", vocab_size=500, bos_id=0, eos_id=1,
                                    num_shards=3, progress=False), verify=True)
    assert docs_of(store) == rows
    assert (store.vocab_size, store.bos_id, store.eos_id, store.dtype) == (500, 0, 1, np.uint16)
    with pytest.raises(PrepareError, match=r"holds token ids.*--token-field input_ids"):
        prepare(src, tmp_path / "t", text_field="input_ids", progress=False)


def test_pretokenized_ids_are_validated_and_written_deterministically(tmp_path):
    rows = token_rows(n=60)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    with pytest.raises(PrepareError, match=r"--vocab-size N"):
        prepare(src, tmp_path / "a", token_field="input_ids", progress=False)
    with pytest.raises(PrepareError, match=r"in\.jsonl, row \d+: token id \d+ is outside the vocabulary \[0, 100\)"):
        prepare(src, tmp_path / "b", token_field="input_ids", vocab_size=100, progress=False)
    with pytest.raises(PrepareError, match=r"row 0: does not start with BOS id 7.*--bos \(add_bos=True\)"):
        prepare(src, tmp_path / "c", token_field="input_ids", vocab_size=500, bos_id=7, progress=False)
    added = TokenStore.open(prepare(src, tmp_path / "d", token_field="input_ids", vocab_size=500, eos_id=499,
                                    add_eos=True, progress=False))
    assert docs_of(added) == [r + [499] for r in rows] and added.eos_id == 499
    one = prepare(src, tmp_path / "one", token_field="input_ids", vocab_size=500, num_shards=4, progress=False)
    two = prepare(src, tmp_path / "two", token_field="input_ids", vocab_size=500, num_shards=4, num_proc=2,
                  progress=False)
    for f in sorted(os.listdir(one)):
        if f.startswith("shard-"):
            assert (one / f).read_bytes() == (two / f).read_bytes(), f
    assert not any(os.listdir(tmp_path / "b")) if (tmp_path / "b").exists() else True


# -- 5. foreign token files: declared, recognised, checked ---------------------------------------


def test_a_raw_bin_needs_a_declared_dtype(tmp_path):
    np.arange(2, 3000, dtype=np.int32).tofile(tmp_path / "t.bin")
    with pytest.raises(StoreError, match=r"t\.bin: a raw token file does not record its dtype.*dtype="):
        TokenStore.open(tmp_path / "t.bin", eos_id=1)
    with pytest.raises(StoreError, match=r"t\.bin: read as uint16, every other token is 0.*int32"):
        TokenStore.open(tmp_path / "t.bin", eos_id=1, vocab_size=50_000)  # vocab decides uint16: implausible
    store = TokenStore.open(tmp_path / "t.bin", dtype="int32", vocab_size=50_000)
    assert store[0].tolist() == list(range(2, 3000))


def test_header_less_npy_is_read_with_its_declared_dtype(tmp_path):
    docs = [[5, 70_000, 1], [9, 100_000, 3, 1]]
    np.concatenate(docs).astype(np.uint32).tofile(tmp_path / "part-0.npy")  # OLMo's memmap layout
    with pytest.raises(StoreError, match=r"part-0\.npy: a raw token file does not record its dtype"):
        TokenStore.open(tmp_path / "part-0.npy", eos_id=1)
    assert docs_of(TokenStore.open(tmp_path / "part-0.npy", eos_id=1, dtype="uint32")) == docs
    np.save(tmp_path / "h.npy", np.array([3, 1], np.uint16))
    with pytest.raises(StoreError, match=r"h\.npy: the \.npy header says uint16, but dtype=uint32"):
        TokenStore.open(tmp_path / "h.npy", dtype="uint32")


def test_negative_and_oversized_ids_are_refused(tmp_path):
    np.save(tmp_path / "neg.npy", np.array([5, -3, 1], np.int32))
    with pytest.raises(StoreError, match=r"neg\.npy: holds the negative token id -3"):
        TokenStore.open(tmp_path / "neg.npy", eos_id=1)
    np.save(tmp_path / "big.npy", np.array([5, 2**33 + 7, 1], np.int64))
    with pytest.raises(StoreError, match=r"big\.npy: holds token id 8589934599, which does not fit"):
        TokenStore.open(tmp_path / "big.npy", eos_id=1)


def write_sample_chunk(path, samples: list[bytes], prefix: bytes = b"") -> None:
    """uint32 count, uint32 offsets from the file start, optional bytes, then the samples:
    the chunk layout of LitData and (with a config prefix) of MosaicML MDS shards."""
    n = len(samples)
    start = 4 + 4 * (n + 1) + len(prefix)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in samples])]) + start
    path.write_bytes(np.uint32(n).tobytes() + offsets.astype("<u4").tobytes() + prefix + b"".join(samples))


def test_files_that_are_something_else_are_named(tmp_path):
    pq.write_table(pa.table({"text": ["x" * 100] * 50}), tmp_path / "corpus.parquet")
    from array_record.python.array_record_module import ArrayRecordWriter

    w = ArrayRecordWriter(str(tmp_path / "d.array_record"), "group_size:1")
    w.write(np.arange(10, dtype=np.uint16).tobytes())
    w.close()
    megatron = tmp_path / "meg"
    megatron.mkdir()
    np.arange(100, dtype=np.int32).tofile(megatron / "text_document.bin")
    (megatron / "text_document.idx").write_bytes(b"MMIDIDX\x00\x00" + b"\x01" * 40)
    lit = tmp_path / "lit"
    lit.mkdir()
    samples = [np.arange(k, k + 20, dtype=np.uint16).tobytes() for k in range(5)]
    write_sample_chunk(lit / "chunk-0-0.bin", samples)
    (lit / "index.json").write_text(json.dumps({"chunks": [{"filename": "chunk-0-0.bin", "chunk_size": 5}],
                                                "config": {"data_format": ["no_header_tensor:16"]}}))
    mds = tmp_path / "mds"
    mds.mkdir()
    sizes = [np.uint32(len(s)).tobytes() + s for s in samples]
    write_sample_chunk(mds / "shard.00000.bin", sizes, prefix=b'{"format": "mds"}')
    (mds / "index.json").write_text(json.dumps({"version": 2, "shards": [{"format": "mds", "raw_data": {
        "basename": "shard.00000.mds"}}]}))
    headerless_chunk = tmp_path / "chunk.bin"
    write_sample_chunk(headerless_chunk, samples)
    cases = [
        (tmp_path / "corpus.parquet", r"corpus\.parquet.*Parquet"),
        (tmp_path / "d.array_record", r"d\.array_record.*ArrayRecord"),
        (megatron / "text_document.bin", r"text_document\.idx: Megatron index version"),  # read by its index
        (lit / "chunk-0-0.bin", r"chunk-0-0\.bin.*LitData"),
        (mds / "shard.00000.bin", r"shard\.00000\.bin.*(offset table|MDS)"),
        (headerless_chunk, r"chunk\.bin.*offset table"),
        (mds, r"index\.json: not a readable MDS index"),  # read as MDS: this index lacks the columns
    ]
    for path, what in cases:
        with pytest.raises(StoreError, match=what):
            TokenStore.open(path, dtype="uint16")
    (tmp_path / "notes.bin").write_text("These are notes, not token ids. " * 20)
    with pytest.raises(StoreError, match=r"notes\.bin: this is text"):
        TokenStore.open(tmp_path / "notes.bin", dtype="uint16")


def test_inspect_says_what_a_file_appears_to_be(tmp_path):
    pq.write_table(pa.table({"text": ["x" * 100] * 50}), tmp_path / "corpus.parquet")
    r = subprocess.run([sys.executable, "-m", "forge_grain", "inspect", str(tmp_path / "corpus.parquet")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "corpus.parquet: this is a Parquet file" in r.stderr and "forge-grain prepare" in r.stderr


def test_a_directory_never_merges_splits(tmp_path):
    np.array([5, 6, 1] * 10, np.uint16).tofile(tmp_path / "train.bin")
    np.array([7, 1] * 4, np.uint16).tofile(tmp_path / "val.bin")
    with pytest.raises(StoreError, match=r"splits \['train', 'validation'\]; choose one with split="):
        TokenStore.open(tmp_path, eos_id=1, dtype="uint16")
    assert len(TokenStore.open(tmp_path, eos_id=1, dtype="uint16", split="train")) == 10
    assert docs_of(TokenStore.open(tmp_path, eos_id=1, dtype="uint16", split="validation")) == [[7, 1]] * 4


# -- 6. foreign stores as pipeline sources ------------------------------------------------------


def test_nanogpt_and_olmo_files_mix_with_a_prepared_store(tmp_path, stores):
    rng = np.random.default_rng(5)
    nano_docs = [np.append(rng.integers(2, 1000, rng.integers(5, 90)), 1) for _ in range(120)]
    (tmp_path / "nano").mkdir()
    np.concatenate(nano_docs).astype(np.uint16).tofile(tmp_path / "nano" / "train.bin")
    np.array([3, 1], np.uint16).tofile(tmp_path / "nano" / "val.bin")
    olmo_docs = [np.append(rng.integers(2, 1000, rng.integers(5, 90)), 1) for _ in range(80)]
    (tmp_path / "olmo").mkdir()
    np.concatenate(olmo_docs[:40]).astype(np.uint32).tofile(tmp_path / "olmo" / "part-00.npy")
    np.concatenate(olmo_docs[40:]).astype(np.uint32).tofile(tmp_path / "olmo" / "part-01.npy")
    (tmp_path / "data.toml").write_text(f"""
        seq_len = 64
        global_batch_size = 8
        [[sources]]
        name = "web"
        path = "{stores['web']}"
        [[sources]]
        name = "nano"
        path = "nano"
        split = "train"
        dtype = "uint16"
        eos_id = 1
        vocab_size = 1000
        [[sources]]
        name = "olmo"
        path = "olmo"
        file_pattern = "part-*.npy"
        dtype = "uint32"
        eos_id = 1
        vocab_size = 1000
        """.replace("\n        ", "\n"))
    cfg = DataConfig.from_toml(tmp_path / "data.toml")
    p = Pipeline(cfg, 0, 1, num_threads=0)
    nano, olmo = p.stores[1], p.stores[2]
    assert docs_of(nano) == [d.tolist() for d in nano_docs]
    assert docs_of(olmo) == [d.tolist() for d in olmo_docs]
    assert olmo.dtype == np.uint32
    batch = p.batch(0)
    assert batch["inputs"].shape == (8, 64) and batch["inputs"].max() < 1000
    undeclared = DataConfig.from_dict({**cfg.to_dict(), "sources": [cfg.sources[0].__dict__,
                                                                     {**cfg.sources[1].__dict__, "vocab_size": None}]})
    with pytest.raises(Exception, match=r"'nano'.*unknown vocabulary size.*declare its vocab_size"):
        Pipeline(undeclared, 0, 1, num_threads=0)


# -- 7. foreign data is fingerprinted by content ------------------------------------------------


def test_rewriting_foreign_data_in_place_is_detected_at_resume(tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(2, 1000, 40), 1) for _ in range(200)]
    data = tmp_path / "train.bin"
    np.concatenate(docs).astype(np.uint16).tofile(data)
    cfg = DataConfig.from_dict(dict(sources=[dict(name="nano", path=str(data), dtype="uint16", eos_id=1,
                                                  vocab_size=1000)], seq_len=32, global_batch_size=4))
    it = Pipeline(cfg, 0, 1, num_threads=0).iterator()
    next(it), next(it)
    state = it.get_state()
    stat = data.stat()
    other = [np.append(rng.integers(2, 1000, 40), 1) for _ in range(200)]  # same size, same EOS positions
    np.concatenate(other).astype(np.uint16).tofile(data)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old modification time
    with pytest.raises(StateError, match=rf"source 'nano' \({data}\): the data is not what the state was saved with"):
        Pipeline(cfg, 0, 1, num_threads=0).iterator(state)


def test_full_fingerprint_option_hashes_every_byte(tmp_path):
    data = tmp_path / "t.bin"
    tokens = np.tile(np.array([5, 6, 7, 1], np.uint16), 200_000)
    tokens.tofile(data)
    sampled = TokenStore.open(data, dtype="uint16", eos_id=1).fingerprint
    full = TokenStore.open(data, dtype="uint16", eos_id=1, fingerprint="full").fingerprint
    tokens[300_001] = 9  # one token, EOS positions unchanged
    tokens.tofile(data)
    assert TokenStore.open(data, dtype="uint16", eos_id=1, fingerprint="full").fingerprint != full
    # a file up to 8 MiB is hashed whole by the sampled fingerprint too (larger ones: tests/test_misreads.py)
    assert TokenStore.open(data, dtype="uint16", eos_id=1).fingerprint != sampled


# -- 8. caches are validated, never trusted ------------------------------------------------------


def cache_files(directory):
    return index_cache(directory / "t.bin")


def test_a_cache_made_from_other_content_is_rebuilt(tmp_path):
    data = tmp_path / "t.bin"
    np.array([5, 6, 1, 7, 1, 8, 9, 9, 1], np.uint16).tofile(data)
    TokenStore.open(data, dtype="uint16", eos_id=1)
    stat = data.stat()
    np.array([5, 1, 6, 7, 8, 1, 9, 9, 1], np.uint16).tofile(data)  # same size, other boundaries
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert docs_of(TokenStore.open(data, dtype="uint16", eos_id=1)) == [[5, 1], [6, 7, 8, 1], [9, 9, 1]]


def test_a_planted_index_with_other_boundaries_is_rebuilt(tmp_path):
    import hashlib

    data = tmp_path / "t.bin"
    np.array([5, 6, 1, 7, 1, 8, 9, 9, 1], np.uint16).tofile(data)
    TokenStore.open(data, dtype="uint16", eos_id=1)
    idx, meta = cache_files(tmp_path)
    planted = np.array([0, 4, 9], np.int64)  # a boundary after 7, not after an EOS
    with open(idx, "wb") as f:
        np.save(f, planted)
    m = json.loads(meta.read_text())
    m.update(num_documents=2, offsets_sha256=hashlib.sha256(planted.tobytes()).hexdigest())
    meta.write_text(json.dumps(m))
    assert docs_of(TokenStore.open(data, dtype="uint16", eos_id=1)) == [[5, 6, 1], [7, 1], [8, 9, 9, 1]]


def test_a_planted_token_range_cannot_bypass_the_vocabulary_check(tmp_path):
    data = tmp_path / "t.bin"
    np.array([3, 9000, 1, 4, 1], np.uint16).tofile(data)
    TokenStore.open(data, dtype="uint16", eos_id=1)
    _, meta = cache_files(tmp_path)
    m = json.loads(meta.read_text())
    m["max_token"] = 10
    meta.write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"t\.bin: token id 9000 is at or past vocab_size 8192"):
        TokenStore.open(data, dtype="uint16", eos_id=1, vocab_size=8192)


def test_pretokenized_input_of_the_wrong_type_dtype_or_truncated_names_the_file(tmp_path):
    rows = token_rows(n=30)
    floats = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[float(t) for t in r] for r in rows], pa.list_(pa.float32()))}),
                   floats)
    with pytest.raises(PrepareError, match=r"floats\.parquet: --token-field 'input_ids' must hold lists of integer ids"):
        prepare(floats, tmp_path / "a", token_field="input_ids", vocab_size=500, progress=False)
    text = write_jsonl(tmp_path / "text.jsonl", ["not ids", "either"])
    with pytest.raises(PrepareError, match=r"text\.jsonl: --token-field 'text' must hold lists of integer ids"):
        prepare(text, tmp_path / "b", token_field="text", vocab_size=500, progress=False)
    good = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"input_ids": rows}), good)
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(PrepareError, match=r"cut\.parquet: cannot load"):
        prepare(cut, tmp_path / "c", token_field="input_ids", vocab_size=500, progress=False)
    jsonl = tmp_path / "cut.jsonl"
    jsonl.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows)[:-25])  # cut inside the last row
    with pytest.raises(PrepareError, match=r"cut\.jsonl, row \d+: not a JSON value"):
        prepare(jsonl, tmp_path / "d", token_field="input_ids", vocab_size=500, progress=False)


def test_declared_options_on_a_prepared_store_must_agree_with_its_manifest(bin_store, tmp_path):
    assert TokenStore.open(bin_store, dtype="uint16", eos_id=1, vocab_size=8192).vocab_size == 8192
    with pytest.raises(StoreError, match=r"eos_id=7 was declared, but the store's manifest\.json records 1"):
        TokenStore.open(bin_store, eos_id=7)
    with pytest.raises(StoreError, match=r"split= does not apply to a forge-grain store"):
        TokenStore.open(bin_store, split="train")
    with pytest.raises(StoreError, match=r"dtype 'bogus' is not a numpy dtype"):
        TokenStore.open(bin_store, dtype="bogus")
    np.array([5, 1], np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(StoreError, match=r"t\.bin: dtype 'bogus' is not a numpy dtype"):
        TokenStore.open(tmp_path / "t.bin", dtype="bogus")
