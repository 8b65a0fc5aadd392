"""TokenStore: exact documents, layouts, foreign files, pickling, Grain, and corrupt shards."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import threading

import grain
import numpy as np
import pytest
from conftest import expected_documents, index_cache

from forge_grain import StoreError, TokenStore
from forge_grain.stores import raw as foreign


def docs_of(store) -> list[list[int]]:
    return [store[i].tolist() for i in range(len(store))]


def test_every_document_equals_the_tokenizer_run_independently(bin_store, texts, reference_tokenizer):
    store = TokenStore.open(bin_store, verify=True)
    expected = expected_documents(reference_tokenizer, texts)
    assert len(store) == len(expected)
    assert docs_of(store) == expected
    assert store.num_tokens == sum(map(len, expected))
    assert store.lengths.tolist() == [len(d) for d in expected]
    assert store.dtype == np.uint16 and store.vocab_size == 8192
    assert (store.bos_id, store.eos_id) == (0, 1)


def test_arrayrecord_and_bin_layouts_hold_identical_documents(bin_store, ar_store):
    a, b = TokenStore.open(bin_store), TokenStore.open(ar_store, verify=True)
    assert (a.layout, b.layout) == ("bin", "arrayrecord")
    assert docs_of(a) == docs_of(b)
    assert np.array_equal(a.lengths, b.lengths)


def test_documents_are_zero_copy_views_and_negative_indices_work(bin_store):
    store = TokenStore.open(bin_store)
    doc = store[5]
    assert not doc.flags.owndata and not doc.flags.writeable
    assert store[-1].tolist() == store[len(store) - 1].tolist()
    with pytest.raises(IndexError):
        store[len(store)]


def test_pickles_cheaply_and_reopens(bin_store, ar_store):
    for path in (bin_store, ar_store):
        store = TokenStore.open(path)
        blob = pickle.dumps(store)
        assert len(blob) < 1000  # the path and options, never the tokens
        again = pickle.loads(blob)
        assert docs_of(again) == docs_of(store)


@pytest.mark.parametrize("which", ["bin", "ar"])
def test_grain_map_dataset_source_with_worker_threads(which, bin_store, ar_store):
    store = TokenStore.open(bin_store if which == "bin" else ar_store)
    ds = grain.MapDataset.source(store).to_iter_dataset(grain.ReadOptions(num_threads=8, prefetch_buffer_size=64))
    got = [d.tolist() for d in ds]
    assert got == docs_of(store)


def test_concurrent_random_access_from_threads(bin_store):
    store = TokenStore.open(bin_store)
    expected = docs_of(store)
    errors = []

    def read(seed):
        rng = np.random.default_rng(seed)
        for i in rng.integers(0, len(store), 2000):
            if store[i].tolist() != expected[i]:
                errors.append(i)

    threads = [threading.Thread(target=read, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# -- foreign token files ----------------------------------------------------------------------


def foreign_docs(seed=0, n=50, eos=1):
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(2, 500, rng.integers(1, 40)), eos) for _ in range(n)]


def test_foreign_npy_and_bin_with_eos_scanning(tmp_path):
    docs = foreign_docs()
    half = len(docs) // 2
    np.save(tmp_path / "a.npy", np.concatenate(docs[:half]).astype(np.uint32))
    np.concatenate(docs[half:]).astype(np.uint16).tofile(tmp_path / "b.bin")
    npy = TokenStore.open(tmp_path / "a.npy", eos_id=1)
    assert docs_of(npy) == [d.tolist() for d in docs[:half]]
    binary = TokenStore.open(tmp_path / "b.bin", eos_id=1, dtype="uint16")
    assert docs_of(binary) == [d.tolist() for d in docs[half:]]


def test_foreign_directory_and_glob_join_files_in_order(tmp_path):
    docs = foreign_docs(seed=3)
    for k in range(3):
        np.concatenate(docs[k::3]).astype(np.uint16).tofile(tmp_path / f"part{k}.bin")
    expected = [d.tolist() for k in range(3) for d in docs[k::3]]
    assert docs_of(TokenStore.open(tmp_path, eos_id=1, dtype="uint16")) == expected
    assert docs_of(TokenStore.open(str(tmp_path / "part*.bin"), eos_id=1, dtype="uint16")) == expected


def test_foreign_bos_scanning_and_plain_stream(tmp_path):
    rng = np.random.default_rng(1)
    docs = [np.concatenate([[0], rng.integers(2, 100, rng.integers(1, 20))]) for _ in range(20)]
    np.concatenate([[5, 6]] + docs).astype(np.uint16).tofile(tmp_path / "t.bin")  # a head before the first BOS
    with pytest.raises(StoreError, match=r"t\.bin: bos_id=0 was declared, but document 0 does not start with it.*"
                                         r"whole_documents=False"):
        TokenStore.open(tmp_path / "t.bin", bos_id=0, dtype="uint16")
    store = TokenStore.open(tmp_path / "t.bin", bos_id=0, dtype="uint16", whole_documents=False)
    assert docs_of(store) == [[5, 6]] + [d.tolist() for d in docs]
    stream = TokenStore.open(tmp_path / "t.bin", dtype="uint16")
    assert len(stream) == 1 and stream.num_tokens == 2 + sum(map(len, docs))


def test_foreign_index_is_cached_and_reused(tmp_path, monkeypatch):
    np.concatenate(foreign_docs()).astype(np.uint16).tofile(tmp_path / "t.bin")
    first = TokenStore.open(tmp_path / "t.bin", eos_id=1, dtype="uint16")
    assert index_cache(tmp_path / "t.bin")[0].is_file() and sorted(tmp_path.iterdir()) == [tmp_path / "t.bin"]

    def no_scan(*a, **k):
        raise AssertionError("rescanned although the cached index is valid")

    monkeypatch.setattr(foreign, "_scan", no_scan)
    assert docs_of(TokenStore.open(tmp_path / "t.bin", eos_id=1, dtype="uint16")) == docs_of(first)
    with pytest.raises(AssertionError):  # another EOS id is another index
        TokenStore.open(tmp_path / "t.bin", eos_id=2, dtype="uint16")


def test_foreign_token_ids_past_vocab_size(tmp_path):
    np.array([3, 9000, 1], np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(StoreError, match=r"t\.bin.*9000.*vocab_size 8192"):
        TokenStore.open(tmp_path / "t.bin", eos_id=1, vocab_size=8192)


def test_foreign_bin_size_not_a_multiple_of_dtype(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\x01\x00\x02\x00\x03")
    with pytest.raises(StoreError, match=r"t\.bin.*5 bytes.*not a multiple"):
        TokenStore.open(tmp_path / "t.bin", dtype="uint16")


def test_foreign_npy_must_be_1d_integers(tmp_path):
    np.save(tmp_path / "t.npy", np.zeros((2, 3), np.float32))
    with pytest.raises(StoreError, match=r"t\.npy.*1-D integer"):
        TokenStore.open(tmp_path / "t.npy")


def test_nothing_to_open(tmp_path):
    with pytest.raises(StoreError, match="no manifest.json"):
        TokenStore.open(tmp_path)


# -- corrupt stores ---------------------------------------------------------------------------


def test_truncated_shard(store_copy):
    shard = store_copy / "shard-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(StoreError, match=r"shard-00001\.bin.*not a multiple"):
        TokenStore.open(store_copy)
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(StoreError, match=r"shard-00001\.bin.*truncated"):
        TokenStore.open(store_copy)


def test_missing_shard(store_copy):
    (store_copy / "shard-00002.bin").unlink()
    with pytest.raises(StoreError, match=r"shard-00002\.bin.*missing"):
        TokenStore.open(store_copy)


def test_index_disagreeing_with_its_shard(store_copy):
    idx_path = store_copy / "shard-00000.idx.npy"
    idx = np.load(idx_path)
    idx[-1] -= 1
    np.save(idx_path, idx)
    with pytest.raises(StoreError, match=r"shard-00000\.idx\.npy.*disagrees"):
        TokenStore.open(store_copy)


def test_checksum_mismatch(store_copy):
    shard = store_copy / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0x01
    shard.write_bytes(bytes(data))
    TokenStore.open(store_copy)  # sizes still agree: only verification reads the bytes
    with pytest.raises(StoreError, match=r"shard-00000\.bin.*checksum mismatch"):
        TokenStore.open(store_copy, verify=True)


def test_the_joined_index_is_checked_by_verify_and_its_entry_by_the_manifest_schema(store_copy):
    """`shards.idx.npy` (what a store in object storage opens from) holds every shard's offsets
    and is covered by verify; a malformed `indices` entry is named."""
    m = json.loads((store_copy / "manifest.json").read_text())
    joined = np.load(store_copy / m["indices"]["file"])
    assert np.array_equal(joined, np.concatenate([np.load(store_copy / s["index"]) for s in m["shards"]]))
    joined[1] += 1
    np.save(store_copy / "shards.idx.npy", joined)
    with pytest.raises(StoreError, match=r"shards\.idx\.npy: checksum mismatch"):
        TokenStore.open(store_copy, verify=True)
    for bad, problem in (({"file": "../x.npy", "sha256": "0" * 64}, r"indices\.file must name a file inside"),
                         ({"file": "shards.idx.npy"}, r"indices must have exactly the keys"),
                         ({"file": "shard-00000.bin", "sha256": "0" * 64}, r"more than once")):
        (store_copy / "manifest.json").write_text(json.dumps({**m, "indices": bad}))
        with pytest.raises(StoreError, match=problem):
            TokenStore.open(store_copy)


def test_token_ids_past_vocab_size_in_a_store(store_copy):
    m = json.loads((store_copy / "manifest.json").read_text())
    m["vocab_size"] = 100  # the shards hold larger ids
    (store_copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"shard-0000\d\.bin.*past vocab_size 100"):
        TokenStore.open(store_copy, verify=True)


def test_manifest_of_unknown_version(store_copy):
    m = json.loads((store_copy / "manifest.json").read_text())
    m["version"] = 99
    (store_copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"manifest\.json.*version 99.*not supported"):
        TokenStore.open(store_copy)


def test_importing_forge_grain_loads_neither_torch_nor_jax():
    code = (
        "import sys, forge_grain; from forge_grain import TokenStore, prepare; "
        "TokenStore, prepare; print(sorted(m for m in ('torch', 'jax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_reading_a_store_loads_no_scipy_blas_and_numbas_blas_still_works(tmp_path):
    """numba's first kernel in a process probed for BLAS by importing scipy.linalg, whose
    OpenBLAS starts a thread a core (spinning before they sleep): forge-grain's kernels use
    no BLAS, and a process reading batches loads none. The user's own numba code that uses
    BLAS still compiles and runs (it imports scipy's BLAS itself then)."""
    pytest.importorskip("scipy")
    store = tmp_path / "store"
    from forge_grain.stores.writer import write_store

    write_store(store, [np.arange(2, 300, dtype=np.int32) % 97 + 2] * 20, vocab_size=100, eos_id=1)
    code = (
        "import sys, json, numpy as np, numba\n"
        "from forge_grain import DataConfig, Pipeline\n"
        f"cfg = dict(sources=[dict(name='a', path={str(store)!r})], seq_len=64, global_batch_size=4, seed=0)\n"
        f"pipe = Pipeline(DataConfig.from_dict(cfg), 0, 1, cache_dir={str(tmp_path / 'plans')!r})\n"
        "batch = pipe.batch(0)\n"
        "before = 'scipy.linalg' in sys.modules\n"
        "from numba.np import arraymath\n"
        "dot = numba.njit(lambda a, b: np.dot(a, b))\n"
        "print(json.dumps([before, arraymath._HAVE_BLAS, float(dot(np.ones(3), np.arange(3.0))), int(batch['inputs'].sum() > 0)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, True, 3.0, 1]


# -- fingerprints and orders owe nothing to numpy's generators -------------------------------


def test_a_large_files_sampled_fingerprint_is_the_one_saved_states_recorded(tmp_path):
    """The sampled fingerprint of a file past 8 MiB (blocks and 2,048 probes) is the value states
    saved since the probes were introduced recorded: a moved probe would make every state over
    a large raw or Megatron file refuse to resume."""
    from forge_grain.stores.checks import content_fingerprint

    n = 9 * 2**20 + 12345
    data = ((np.arange(n, dtype=np.uint64) * np.uint64(2654435761)) >> np.uint64(13)).astype(np.uint8)
    (tmp_path / "big.bin").write_bytes(data.tobytes())
    assert content_fingerprint(tmp_path / "big.bin") == \
        "1282581c798f5443c5d731775a6e4185f22a2d332fc5b359e653d77283cc275e"


@pytest.mark.parametrize("block", [4095, 65536, 1_000_003])
def test_a_fingerprint_gathered_from_a_files_blocks_is_its_content_fingerprint(tmp_path, block):
    """A file read in blocks under a cache_limit gives its sampled fingerprint from the blocks
    (`stores.harvest`): whatever the cut (places across two blocks, blocks arriving twice and
    out of order), it is the local file's; before every place is seen it is refused."""
    from forge_grain.stores.checks import content_fingerprint
    from forge_grain.stores.harvest import Harvest

    n = 9 * 2**20 + 12345
    data = ((np.arange(n, dtype=np.uint64) * np.uint64(2654435761)) >> np.uint64(13)).astype(np.uint8)
    (tmp_path / "big.bin").write_bytes(data.tobytes())
    starts = list(range(0, n, block))
    order = starts[1::2] + starts[::2] + starts[:3]  # (out of order; the first three twice)
    h = Harvest(n)
    for a in order[: len(starts) // 2]:
        h.take(a, data[a : a + block])
    with pytest.raises(ValueError, match="not seen yet"):
        h.fingerprint()
    for a in order[len(starts) // 2 :]:
        h.take(a, data[a : a + block])
    assert h.complete and h.fingerprint() == content_fingerprint(tmp_path / "big.bin")


@pytest.mark.parametrize("block", [4095, 1_000_003])
def test_the_places_a_fingerprint_still_needs_are_read_whole_and_little_else(tmp_path, block):
    """Asked for before an epoch's blocks have all arrived, a fingerprint reads the places not
    seen yet (`Harvest.ranges`), those close together in one range while the bytes between add
    at most a fiftieth of the file (the epoch reads them anyway); read over places whose other
    part a block gave, the fingerprint is still the local file's (the version before counted
    such a place's bytes twice, never had it whole, and refused the fingerprint)."""
    from forge_grain.stores.checks import PROBES, content_fingerprint
    from forge_grain.stores.harvest import RANGE, Harvest

    n = 9 * 2**20 + 12345
    data = ((np.arange(n, dtype=np.uint64) * np.uint64(2654435761)) >> np.uint64(13)).astype(np.uint8)
    (tmp_path / "big.bin").write_bytes(data.tobytes())
    h = Harvest(n)
    for a in range(block, n, 2 * block):  # every other block: places cut at their edges are half seen
        h.take(a, data[a : a + block])
    missing, ranges = h.missing(), h.ranges()
    assert len(missing) > PROBES // 4 and len(ranges) <= len(missing)
    assert all(any(a <= p and q <= b for a, b in ranges) for p, q in missing)
    assert all(b - a <= RANGE for a, b in ranges)
    assert sum(b - a for a, b in ranges) <= sum(q - p for p, q in missing) + n // 50
    for a, b in ranges:
        h.take(a, data[a:b])
    assert h.complete and h.fingerprint() == content_fingerprint(tmp_path / "big.bin")


@pytest.mark.parametrize("size", [9, 10, 4096, 123457, 2**31, 2**32 - 1, 2**32 + 9, 2**40 + 7, 10**15])
def test_probe_offsets_are_the_stream_numpy_gave_them(size):
    """`probe_stream` spells out numpy's `default_rng(entropy).integers` (SeedSequence, PCG64,
    Lemire's bounded draws, 32- and 64-bit): while this numpy still gives that stream, the two
    agree; afterwards the spelled-out one keeps the offsets."""
    from forge_grain.stores import probe_stream
    from forge_grain.stores.checks import PROBE_BYTES, PROBES, probe_offsets

    want = np.sort(np.random.default_rng([size, 0x46475046]).integers(0, size - PROBE_BYTES + 1, PROBES,
                                                                      dtype=np.int64))
    assert np.array_equal(probe_offsets(size), want)
    assert probe_stream.integers([size, 7, 2**70], size, 3) == \
        np.random.default_rng([size, 7, 2**70]).integers(0, size, 3, dtype=np.int64).tolist()


def test_no_order_or_fingerprint_comes_from_numpys_generators():
    """NumPy does not promise its generators' streams across versions; every order, shuffle and
    fingerprint of forge-grain comes from its own seeded functions, so an upgrade moves nothing."""
    import ast
    from pathlib import Path

    def uses(tree) -> list[int]:
        """Lines of code (not text) that reach numpy's generators."""
        out = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (
                    node.attr in ("default_rng", "RandomState", "SeedSequence")
                    or node.attr == "random" and isinstance(node.value, ast.Name) and node.value.id in ("np", "numpy")):
                out.append(node.lineno)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("numpy") and (
                    "random" in (node.module or "") or any(a.name == "random" for a in node.names)):
                out.append(node.lineno)
            elif isinstance(node, ast.Import) and any(a.name.startswith("numpy.random") for a in node.names):
                out.append(node.lineno)
        return out

    root = Path(__file__).resolve().parents[1]
    found = [f"{f.relative_to(root)}:{line}" for package in ("forge_grain",)
             for f in sorted((root / package).rglob("*.py")) for line in uses(ast.parse(f.read_text()))]
    assert found == []
