"""Peers' token formats read in place: each written by the peer's own writer (MDS from its
published layout, see mds_writer.py) and read token for token as the peer's reader reads it."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import TOKENIZER
from mds_writer import write_mds

from forge_grain.stores import mapping
from forge_grain import DataConfig, Pipeline, StoreError, TokenStore, pack, write_store

SCRIPTS = Path(__file__).parent / "scripts"
LITDATA = Path(__file__).parent / "data" / "litdata"  # written by litdata.optimize: see scripts/make_litdata_fixture.py
VOCAB, EOS = 1000, 1


def make_docs(n=300, seed=0, dtype=np.int32):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(2, VOCAB, rng.integers(1, 200)).astype(dtype) for _ in range(n)]
    for d in docs:
        d[-1] = EOS
    return docs


def same_docs(store, docs):
    return len(store) == len(docs) and all(np.array_equal(store[i], d) for i, d in enumerate(docs))


# -- writers: the peers' own where they install ---------------------------------------------------


def write_megatron(prefix: Path, docs, dtype=np.int32) -> Path:
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for d in docs:
        builder.add_item(torch.from_numpy(d.astype(dtype)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def write_litdata(out: Path, docs, dtype="int64", chunk_tokens=4000) -> Path:
    pytest.importorskip("litdata")
    npz = out.parent / f"{out.name}-docs.npz"
    np.savez(npz, **{f"doc_{i}": d for i, d in enumerate(docs)})
    r = subprocess.run([sys.executable, SCRIPTS / "write_litdata.py", npz, out, str(chunk_tokens), dtype],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def write_arrow(out: Path, docs, num_shards: int | None = None, **columns) -> Path:
    import datasets

    datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in docs], **columns}).save_to_disk(
        str(out), num_shards=num_shards)
    return out


@pytest.fixture(scope="module")
def docs():
    return make_docs()


@pytest.fixture(scope="module")
def peers(tmp_path_factory, docs):
    base = tmp_path_factory.mktemp("peers")
    (base / "megatron").mkdir()
    olmo = base / "olmo"
    olmo.mkdir()
    flat = np.concatenate(docs).astype(np.uint32)
    half = int(np.flatnonzero(flat == EOS)[len(docs) // 2]) + 1  # OLMo files hold whole documents
    for k, part in enumerate((flat[:half], flat[half:])):  # header-less memmaps, as OLMo-core writes them
        mm = np.memmap(olmo / f"part-{k}-00000.npy", dtype=np.uint32, mode="w+", shape=(len(part),))
        mm[:] = part
        mm.flush()
    return {
        "megatron": write_megatron(base / "megatron" / "c4_text_document", docs),
        "arrow": write_arrow(base / "arrow", docs, text=["x"] * len(docs)),
        "litdata": Path(shutil.copytree(LITDATA / "dataset", base / "litdata")),
        "mds": write_mds(base / "mds", {"tokens": "ndarray:int32", "id": "str"},
                         [{"tokens": d, "id": str(i)} for i, d in enumerate(docs)], samples_per_shard=70),
        "olmo": olmo,
    }


OPTIONS = {"megatron": {}, "arrow": {}, "litdata": {}, "mds": {}, "olmo": {"dtype": "uint32", "eos_id": EOS}}


# -- token for token as the peer reads it -------------------------------------------------------------


def test_megatron_documents_are_megatron_readers(peers, docs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    ref = IndexedDataset(str(peers["megatron"]))
    for path in (peers["megatron"], Path(f"{peers['megatron']}.bin"), peers["megatron"].parent):
        store = TokenStore.open(path, vocab_size=VOCAB, eos_id=EOS)
        assert store.format == "megatron" and store.dtype == np.int32
        assert len(store) == len(ref.document_indices) - 1 == len(docs)
        assert all(np.array_equal(store[i], ref[i]) for i in range(len(ref)))
        assert np.array_equal(store.lengths, ref.sequence_lengths)


def test_megatron_document_of_several_sequences_is_their_concatenation(tmp_path, docs):
    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for k in range(0, 30, 3):  # documents of three sequences each (sentence-split data)
        for d in docs[k : k + 3]:
            builder.add_item(torch.from_numpy(d.astype(np.int32)))
        builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    ref = IndexedDataset(str(tmp_path / "m"))
    store = TokenStore.open(tmp_path / "m", eos_id=EOS)
    bounds = ref.document_indices
    assert len(store) == len(bounds) - 1 == 10 and store.dtype == np.uint16
    for i in range(len(store)):
        assert np.array_equal(store[i], np.concatenate([ref[j] for j in range(bounds[i], bounds[i + 1])]))


def maps_a_file(a: np.ndarray) -> bool:
    """Whether `a` views a memory-mapped file (forge_grain.stores.mapping's regions, or an mmap)."""
    while isinstance(a, np.ndarray):
        a = a.base
    return type(a).__name__ in ("_Region", "mmap")


def test_arrow_documents_are_datasets_rows_without_a_copy(peers, docs):
    import datasets

    ref = datasets.load_from_disk(str(peers["arrow"]))
    store = TokenStore.open(peers["arrow"])
    assert store.format == "arrow" and all(np.array_equal(store[i], ref[i]["input_ids"]) for i in range(len(ref)))
    assert maps_a_file(store[5])  # a view of the file, not a copy
    with pytest.raises(StoreError, match=r"no column 'ids'.*\['input_ids'\].*token_field="):
        TokenStore.open(peers["arrow"], token_field="ids")
    with pytest.raises(StoreError, match=r"column 'text' is string, not a list of integer token ids"):
        TokenStore.open(peers["arrow"], token_field="text")


def test_arrow_null_rows_are_named(tmp_path, docs):
    import datasets

    rows = [d.tolist() for d in docs[:20]]
    rows[13] = None
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(StoreError, match=r"data-00000-of-00001\.arrow: row 13 of column 'input_ids' is null"):
        TokenStore.open(tmp_path / "ds")


def test_arrow_dataset_dict_split(tmp_path, docs):
    import datasets

    d = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": [x.tolist() for x in docs[:50]]}),
                              "validation": datasets.Dataset.from_dict({"input_ids": [x.tolist() for x in docs[50:60]]})})
    d.save_to_disk(str(tmp_path / "dd"))
    assert same_docs(TokenStore.open(tmp_path / "dd"), docs[:50])
    assert same_docs(TokenStore.open(tmp_path / "dd", split="validation"), docs[50:60])
    with pytest.raises(StoreError, match=r"splits \['train', 'validation'\], not 'test'; choose one with split="):
        TokenStore.open(tmp_path / "dd", split="test")


def litdata_docs():
    d = np.load(LITDATA / "docs.npz")
    return [d[f"doc_{i}"] for i in range(len(d.files))]


def tokensloader_blocks(store, block):
    """TokensLoader's items: each chunk's tokens cut into whole blocks, chunk by chunk."""
    blocks = []
    for s in range(len(store.files)):
        lo, hi = store._file_doc_starts[s], store._file_doc_starts[s + 1]
        tokens = np.concatenate([store[i] for i in range(lo, hi)])
        blocks += [tokens[k : k + block] for k in range(0, len(tokens) - block + 1, block)]
    return blocks


def test_litdata_documents_and_tokensloader_blocks(peers, monkeypatch, tmp_path):
    monkeypatch.setattr(mapping, "SMALL", 0)  # map these small chunks, as large ones are: at unaligned offsets
    store = TokenStore.open(peers["litdata"], eos_id=EOS)
    assert store.format == "litdata" and store.dtype == np.int64 and same_docs(store, litdata_docs())
    assert len(store.files) > 1 and not all(a.flags.aligned for a in store.pieces[0].arrays)  # int64 after 4-byte headers
    ref = np.load(LITDATA / "blocks16.npy")  # what StreamingDataset(TokensLoader(16)) returned for these files
    assert np.array_equal(np.stack(tokensloader_blocks(store, 16)), ref)
    # the compiled gather reads the unaligned chunks as a copy of the documents in an aligned store
    aligned = TokenStore.open(write_store(tmp_path / "aligned", litdata_docs(), vocab_size=1 << 20, eos_id=EOS))
    rows = np.arange(8)
    batches = [pack(s, 32, "bestfit", seed=3).get_batch(rows) for s in (store, aligned)]
    assert all(np.array_equal(batches[0][k], batches[1][k]) for k in batches[0])


def test_litdata_written_and_read_by_litdata_now(tmp_path, docs):
    """The same, live, where litdata imports (not in the test environment: see make_litdata_fixture.py)."""
    pytest.importorskip("litdata")
    from litdata import StreamingDataset, TokensLoader

    store = TokenStore.open(write_litdata(tmp_path / "lit", docs, dtype="int32"), eos_id=EOS)
    assert store.dtype == np.int32 and same_docs(store, docs)
    ref = StreamingDataset(str(tmp_path / "lit"), item_loader=TokensLoader(block_size=16), shuffle=False)
    assert [r.numpy().tolist() for r in ref] == [b.tolist() for b in tokensloader_blocks(store, 16)]


@pytest.mark.parametrize("encoding", ["ndarray:int32", "ndarray", "bytes"])
def test_mds_token_columns(tmp_path, docs, encoding):
    value = (lambda d: d.tobytes()) if encoding == "bytes" else (lambda d: d)
    write_mds(tmp_path / "mds", {"tokens": encoding, "text": "str"},
              [{"tokens": value(d), "text": "doc"} for d in docs], samples_per_shard=40)
    declared = {"dtype": "int32"} if encoding == "bytes" else {}
    store = TokenStore.open(tmp_path / "mds", eos_id=EOS, **declared)
    assert store.format == "mds" and same_docs(store, docs)
    store.verify()  # the shards' sha1 in index.json
    if encoding == "bytes":
        with pytest.raises(StoreError, match=r"shard\.00000\.mds: column 'tokens' is MDS 'bytes'.*declare it"):
            TokenStore.open(tmp_path / "mds")


@pytest.mark.parametrize("compression", ["gz", "zstd:3", "br:11", "snappy"])
def test_compressed_mds_is_decompressed_once_into_the_cache(tmp_path, docs, monkeypatch, compression):
    """Every compression MosaicML's writer offers but bz2 (gz, zstd, brotli, snappy; written
    with the libraries it uses), read as the uncompressed shards are."""
    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    write_mds(tmp_path / "mds", {"tokens": "ndarray:int32"}, [{"tokens": d} for d in docs], 100,
              compression=compression)
    assert not list((tmp_path / "mds").glob("*.mds"))  # only the compressed shards
    store = TokenStore.open(tmp_path / "mds", eos_id=EOS)
    assert same_docs(store, docs) and all(str(f).startswith(str(tmp_path / "cache")) for f in store.files)
    stamps = [f.stat().st_mtime_ns for f in store.files]
    assert [f.stat().st_mtime_ns for f in TokenStore.open(tmp_path / "mds").files] == stamps  # not again


def test_litdata_chunks_written_with_zstd_read_as_the_uncompressed_ones(tmp_path, monkeypatch):
    """litdata.optimize(..., compression="zstd") compresses each chunk whole with the `zstd`
    package (its ZSTDCompressor): the same dataset, its chunks so compressed, reads the same
    documents, and a truncated chunk is named."""
    import zstd

    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    plain = TokenStore.open(LITDATA / "dataset")
    packed = shutil.copytree(LITDATA / "dataset", tmp_path / "zstd")
    index = json.loads((packed / "index.json").read_text())
    index["config"]["compression"] = "zstd"
    for chunk in index["chunks"]:
        f = packed / chunk["filename"]
        f.write_bytes(zstd.compress(f.read_bytes(), 1))
    (packed / "index.json").write_text(json.dumps(index))
    store = TokenStore.open(packed)
    assert len(store) == len(plain) and all(np.array_equal(store[i], plain[i]) for i in range(len(plain)))
    first = packed / index["chunks"][0]["filename"]
    first.write_bytes(first.read_bytes()[:-20])
    with pytest.raises(StoreError, match=rf"{first.name}: cannot decompress this zstd file"):
        TokenStore.open(packed)


def test_nanogpt_split_picks_the_file(tmp_path, docs):
    np.concatenate(docs[:200]).astype(np.uint16).tofile(tmp_path / "train.bin")
    np.concatenate(docs[200:]).astype(np.uint16).tofile(tmp_path / "val.bin")
    assert same_docs(TokenStore.open(tmp_path, dtype="uint16", eos_id=EOS, split="train"), docs[:200])
    assert same_docs(TokenStore.open(tmp_path, dtype="uint16", eos_id=EOS, split="validation"), docs[200:])


def test_olmo_memmaps_split_at_eos_like_olmo_core(peers, docs):
    store = TokenStore.open(peers["olmo"], **OPTIONS["olmo"])
    assert store.format == "raw" and store.dtype == np.uint32 and same_docs(store, docs)
    # OLMo-core's document rule (olmo_core.data.utils.get_document_indices): a document ends after each EOS
    flat = np.concatenate([np.fromfile(f, np.uint32) for f in sorted(peers["olmo"].glob("part-*.npy"))])
    ends = np.flatnonzero(flat == EOS) + 1
    assert np.array_equal(store.offsets[1:], ends)


# -- one interface: pack, pickling, fingerprints, inspect ---------------------------------------------


@pytest.mark.parametrize("fmt", ["megatron", "arrow", "litdata", "mds", "olmo"])
def test_every_format_packs_pickles_and_fingerprints_its_data(peers, docs, fmt, tmp_path):
    docs = litdata_docs() if fmt == "litdata" else docs
    store = TokenStore.open(peers[fmt], **OPTIONS[fmt])
    ds = pack(store, 64, "bestfit", cache_dir=tmp_path)
    batch = ds.get_batch(np.arange(ds.num_rows))
    assert ds.num_rows >= sum(map(len, docs)) // 64 - 2
    p = ds.plan
    for k, r in enumerate(ds.rows_of(np.arange(ds.num_rows))):  # each row holds the documents' tokens its plan names
        for s in range(p.row_ptr[r], p.row_ptr[r + 1]):
            g, n = int(p.seg_start[s]), int(p.seg_len[s])
            doc = int(np.searchsorted(store.offsets, g, side="right") - 1)
            want = store[doc][g - store.offsets[doc] : g - store.offsets[doc] + n]
            row = batch["inputs"][k][batch["segment_ids"][k] == s - p.row_ptr[r] + 1]
            assert np.array_equal(row, want[: len(row)])
    again = pickle.loads(pickle.dumps(store))
    assert type(again) is type(store) and same_docs(again, docs) and again.fingerprint == store.fingerprint
    r = subprocess.run([sys.executable, "-m", "forge_grain", "inspect", str(peers[fmt]),
                        *[f"--{k.replace('_', '-')}={v}" for k, v in OPTIONS[fmt].items()]],
                       capture_output=True, text=True)
    assert r.returncode == 0 and f"documents  {len(docs)}".replace("  ", " ") in " ".join(r.stdout.split()), r.stderr


def test_changed_data_changes_the_fingerprint(tmp_path, docs):
    prefix = write_megatron(tmp_path / "m", docs)
    before = TokenStore.open(prefix).fingerprint
    with open(f"{prefix}.bin", "r+b") as f:
        f.seek(8)
        f.write(np.int32(7).tobytes())
    assert TokenStore.open(prefix).fingerprint != before


# -- wrong dtype, truncated files, ambiguity: clear errors naming the file --------------------------


def test_wrong_dtype_is_named(peers, tmp_path):
    cases = {
        "megatron": r"c4_text_document\.idx: dtype=uint16 was declared, but the Megatron index records int32",
        "arrow": r"\.arrow: dtype=uint16 was declared, but its Arrow schema records int\d+",
        "litdata": r"index\.json: dtype=uint16 was declared, but its data_format records int64",
        "mds": r"shard\.00000\.mds: dtype=uint16 was declared, but column 'tokens'.s encoding records int32",
    }
    for fmt, message in cases.items():
        with pytest.raises(StoreError, match=message):
            TokenStore.open(peers[fmt], dtype="uint16")
    with pytest.raises(StoreError, match=r"part-0-00000\.npy: .*(not a multiple of the int64|does not fit the int32)"):
        TokenStore.open(peers["olmo"], dtype="int64", eos_id=EOS, vocab_size=VOCAB)


def test_wrong_types_are_named(peers, tmp_path):
    """A column, encoding or recorded dtype that is not integer token ids is refused, naming the file."""
    with pytest.raises(StoreError, match=r"data-00000-of-00001\.arrow: column 'text' is string, not a list of integer"):
        TokenStore.open(peers["arrow"], token_field="text")
    with pytest.raises(StoreError, match=r"shard\.00000\.mds: column 'id' is encoded 'str'; token ids need"):
        TokenStore.open(peers["mds"], token_field="id")
    meg = Path(shutil.copytree(peers["megatron"].parent, tmp_path / "meg")) / "c4_text_document.idx"
    raw = bytearray(meg.read_bytes())
    raw[17] = 7  # Megatron's dtype code for float32
    meg.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match=r"c4_text_document\.idx: dtype float32 \(the Megatron index\) is not an integer"):
        TokenStore.open(meg.with_suffix(""))
    lit = Path(shutil.copytree(peers["litdata"], tmp_path / "lit"))
    index = json.loads((lit / "index.json").read_text())
    index["config"]["data_format"] = ["no_header_tensor:0"]  # float32 tensors
    (lit / "index.json").write_text(json.dumps(index))
    with pytest.raises(StoreError, match=r"lit/index\.json: data_format \['no_header_tensor:0'\] is not the one item"):
        TokenStore.open(lit)


def truncate(file: Path, nbytes: int = 6) -> None:
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - nbytes)


def test_truncated_files_are_named(peers, tmp_path):
    copies = {fmt: Path(shutil.copytree(peers[fmt].parent if fmt == "megatron" else peers[fmt], tmp_path / fmt))
              for fmt in ("megatron", "arrow", "litdata", "mds", "olmo")}
    truncate(copies["megatron"] / "c4_text_document.bin")
    truncate(next(copies["arrow"].glob("*.arrow")), 64)
    truncate(copies["litdata"] / json.loads((copies["litdata"] / "index.json").read_text())["chunks"][1]["filename"])
    truncate(copies["mds"] / "shard.00002.mds")
    truncate(copies["olmo"] / "part-1-00000.npy", 2)
    cases = {
        "megatron": r"c4_text_document\.bin: .* bytes, but its index describes .* tokens.*truncated",
        "arrow": r"\.arrow: .*(truncated|not a readable Arrow file)",
        "litdata": r"chunk-\d+-\d+\.bin: .* bytes, but its offset table ends at byte .*truncated",
        "mds": r"shard\.00002\.mds: .* bytes, but its sample offsets end at byte .*truncated",
        "olmo": r"part-1-00000\.npy: .* not a multiple of the uint32 item size.*truncated",
    }
    for fmt, message in cases.items():
        with pytest.raises(StoreError, match=message):
            TokenStore.open(copies[fmt], **OPTIONS[fmt])


def test_declared_eos_must_end_the_formats_documents(peers):
    with pytest.raises(StoreError, match=r"eos_id=2 was declared, but document 0 does not end with it"):
        TokenStore.open(peers["megatron"], eos_id=2)


def test_a_path_readable_two_ways_is_refused(peers, tmp_path):
    both = Path(shutil.copytree(peers["litdata"], tmp_path / "both"))
    write_store(both, make_docs(5), vocab_size=VOCAB, eos_id=EOS)
    with pytest.raises(StoreError, match=r"both\b.*forge-grain store.*LitData.*pass format= one of litdata, native"):
        TokenStore.open(both)
    assert TokenStore.open(both, format="native").format == "native"
    assert TokenStore.open(both, format="litdata").format == "litdata"
    with pytest.raises(StoreError, match=r"format='mds' was given, but this is a LitData dataset \(index\.json"):
        TokenStore.open(peers["litdata"], format="mds")
    with pytest.raises(StoreError, match=r"token_field= does not apply to a Megatron indexed dataset"):
        TokenStore.open(peers["megatron"], token_field="x")


# -- a mixture of peers' data with exact elastic resume -------------------------------------------------


def test_megatron_olmo_and_native_mix_with_exact_elastic_resume(peers, tmp_path):
    native = write_store(tmp_path / "native", make_docs(200, seed=5, dtype=np.uint16), vocab_size=VOCAB, eos_id=EOS,
                         tokenizer=TOKENIZER)
    toml = tmp_path / "data.toml"
    toml.write_text(f"""
seq_len = 32
global_batch_size = 8
num_epochs = 2
[[sources]]
name = "megatron"
path = "{peers['megatron']}"
vocab_size = {VOCAB}
eos_id = {EOS}
weight = 0.5
[[sources]]
name = "olmo"
path = "{peers['olmo']}"
dtype = "uint32"
eos_id = {EOS}
vocab_size = {VOCAB}
weight = 0.3
[[sources]]
name = "native"
path = "{native}"
weight = 0.2
""")
    cfg = DataConfig.from_toml(toml)
    reference = Pipeline(cfg, 0, 1, num_threads=0)
    assert [type(s).__name__ for s in reference.stores] == ["MegatronStore", "RawStore", "NativeStore"]
    k, after = 5, 4
    expected = [reference.global_batch(s) for s in range(k, k + after)]
    run = lambda *a: subprocess.run([sys.executable, SCRIPTS / "resume_worker.py", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    r = run("save", toml, tmp_path / "ckpt", 2, k, 0)
    assert r.returncode == 0, r.stderr
    for shards in (1, 4):
        out = tmp_path / f"restored-{shards}.npz"
        r = run("restore", toml, tmp_path / "ckpt", shards, after, 0, out)
        assert r.returncode == 0, r.stderr
        got = np.load(out)
        for i, e in enumerate(expected):
            for key in ("inputs", "targets", "loss_mask", "source_id"):
                assert np.array_equal(got[f"{key}_{i}"], e[key]), (shards, i, key)
    assert set(np.concatenate([e["source_id"].ravel() for e in expected]).tolist()) == {0, 1, 2}
