"""Data changed under a saved state: a resume on it is refused naming the source and its file,
whatever the format, and a declared `eos_id` catches moved document boundaries at open.

Formats that carry no checksum (raw files, Megatron, LitData, MDS, Arrow) cannot tell a file
swapped for another of the same size at its first open; the state's content fingerprint (see
`forge_grain.stores.checks.content_fingerprint`) is what stops the resume."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import SLOW
from mds_writer import write_mds
from test_formats import EOS, LITDATA, make_docs, write_arrow, write_megatron

from forge_grain import DataConfig, Pipeline, StateError, StoreError, TokenStore
from forge_grain.stores import checks

TOKENS = 4_800_000  # uint16: 9.6 MB, above the size hashed whole, so the sampled fingerprint decides


def old_sampled_bytes(size: int) -> np.ndarray:
    """The bytes the fingerprint read before probes: 32 fixed blocks (what a rewrite that
    passed unseen left alone)."""
    mask = np.zeros(size, bool)
    for off in checks.sample_offsets(size):
        mask[off : off + checks.SAMPLE_BLOCK_BYTES] = True
    return mask


def raw_corpus(path, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, 50_000, TOKENS).astype(np.uint16)
    tokens[rng.integers(0, TOKENS, TOKENS // 300)] = EOS
    tokens[-1] = EOS
    tokens.tofile(path)
    return tokens


def raw_config(path, **kw):
    return DataConfig.from_dict(dict(sources=[dict(name="web", path=str(path), dtype="uint16", eos_id=EOS)],
                                     seq_len=128, global_batch_size=8, seed=1, **kw))


def test_a_rewrite_between_the_fixed_blocks_is_refused_at_resume(tmp_path):
    """98% of a raw file's tokens rewritten at the same size, every EOS kept in place and every
    byte the fixed blocks read left alone: the resume is refused naming the file (it was
    accepted, and the next 20 batches all differed from the uninterrupted run)."""
    path = tmp_path / "web.bin"
    tokens = raw_corpus(path)
    state = Pipeline(raw_config(path), 0, 1, num_threads=0).state_at(5)
    keep = old_sampled_bytes(tokens.nbytes).reshape(-1, 2).any(1) | (tokens == EOS)
    assert 0.97 < (~keep).mean() < 0.99
    rewritten = tokens.copy()
    rewritten[~keep] = np.random.default_rng(9).integers(2, 50_000, int((~keep).sum()))
    rewritten.tofile(path)
    for kw in ({}, {"allow_mixture_change": True}):
        with pytest.raises(StateError, match=rf"source 'web' \({path}\): the data is not what the state was saved "
                                             r"with|sources \['web'\] changed their data"):
            p = Pipeline(raw_config(path), 0, 1, num_threads=0, resume_from=state, **kw)
            p.iterator(state)


@pytest.mark.parametrize("seed", range(40 if SLOW else 8))
def test_changing_a_small_fraction_of_a_file_changes_its_fingerprint(tmp_path, seed):
    """1% to 5% of a 24 MB file changed, scattered or in one range, anywhere: the sampled
    fingerprint changes (each of 2,048 probes misses a change of a fraction f with probability
    1 - f; all of them, (1 - f)^2048 <= 1.3e-9 at f = 1%)."""
    rng = np.random.default_rng(seed)
    size = 24 << 20
    data = rng.integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "f.bin"
    data.tofile(path)
    before = checks.content_fingerprint(path)
    n = int(size * rng.uniform(0.01, 0.05))
    where = rng.choice(size, n, replace=False) if seed % 2 else rng.integers(0, size - n) + np.arange(n)
    data[where] ^= rng.integers(1, 256, n, dtype=np.uint8)  # every chosen byte really changes
    data.tofile(path)
    assert checks.content_fingerprint(path) != before
    assert checks.content_fingerprint(path) == checks.content_fingerprint(path)  # reproducible


def test_a_file_cut_short_while_its_fingerprint_is_taken_is_an_error_naming_it(tmp_path, monkeypatch):
    """A writer that truncates a file between the fingerprint's look at its size and its map
    (another process rewriting a shard in place): a StoreError naming the file, not a
    fingerprint of whatever bytes were left, nor a bare IndexError."""
    path = tmp_path / "f.bin"
    np.arange(12 << 20, dtype=np.uint8).tofile(path)  # (past 8 MiB: sampled)
    mapped = checks.mapping.map_bytes

    def cut_then_map(p, *args):
        with open(p, "r+b") as f:
            f.truncate(10 << 20)
        return mapped(p, *args)

    monkeypatch.setattr(checks.mapping, "map_bytes", cut_then_map)
    with pytest.raises(StoreError, match=rf"{path}: changed while its fingerprint was taken \(12582912 bytes"):
        checks.content_fingerprint(path)


# -- peers' formats: files swapped for others of the same size, boundaries moved ----------------


def same_lengths(docs, seed):
    """Other documents of the same lengths (so every file has the same size), each ending in EOS."""
    rng = np.random.default_rng(seed)
    out = [rng.integers(2, 1000, len(d)).astype(d.dtype) for d in docs]
    for d in out:
        d[-1] = EOS
    return out


def write_peer(fmt, out, docs):
    if fmt == "megatron":
        out.mkdir()
        return write_megatron(out / "c4_text_document", docs)
    if fmt == "arrow":
        return write_arrow(out, docs)
    return write_mds(out, {"tokens": "ndarray:int32"}, [{"tokens": d} for d in docs], samples_per_shard=70)


def data_files(fmt, path):
    if fmt == "megatron":
        return [path.parent / f"{path.name}.bin"]
    return sorted(path.glob("*.arrow" if fmt == "arrow" else "shard.*.mds"))


def peer_config(path, **options):
    return DataConfig.from_dict(dict(sources=[dict(name="peer", path=str(path), **options)], seq_len=64,
                                     global_batch_size=4, seed=3))


@pytest.mark.parametrize("fmt", ["megatron", "arrow", "mds"])
def test_a_peers_file_swapped_for_another_of_the_same_size_is_refused_at_resume(tmp_path, fmt):
    docs = make_docs(300, seed=4)
    path = write_peer(fmt, tmp_path / "a", docs)
    other = write_peer(fmt, tmp_path / "b", same_lengths(docs, seed=5))
    state = Pipeline(peer_config(path), 0, 1, num_threads=0).state_at(2)
    mine, theirs = data_files(fmt, path), data_files(fmt, other)
    assert [f.stat().st_size for f in mine] == [f.stat().st_size for f in theirs]
    shutil.copyfile(theirs[-1], mine[-1])
    store = TokenStore.open(path)  # no checksum in the format: it opens (and reads the other documents)
    assert len(store) == len(docs) and not np.array_equal(store[len(docs) - 1], docs[-1])
    with pytest.raises(StateError, match=rf"source 'peer' \({path}\): the data is not what the state"):
        Pipeline(peer_config(path), 0, 1, num_threads=0).iterator(state)


def move_megatron_boundary(prefix, doc: int, by: int) -> None:
    """Move the end of document `doc` by `by` tokens in the .idx (sizes and pointers stay
    consistent, so only the boundary is wrong)."""
    idx = prefix.parent / f"{prefix.name}.idx"
    raw = bytearray(idx.read_bytes())
    count = int(np.frombuffer(raw, np.uint64, 1, 18)[0])
    sizes = np.frombuffer(raw, np.int32, count, 34).copy()
    pointers = np.frombuffer(raw, np.int64, count, 34 + 4 * count).copy()
    sizes[doc] += by
    sizes[doc + 1] -= by
    pointers[doc + 1] += by * 4  # int32 tokens
    raw[34 : 34 + 4 * count] = sizes.tobytes()
    raw[34 + 4 * count : 34 + 12 * count] = pointers.tobytes()
    idx.write_bytes(bytes(raw))


def move_litdata_offset(directory, by: int) -> None:
    """Move the second item's start in the first chunk's offset table by `by` bytes."""
    chunk = sorted(directory.glob("chunk-*.bin"))[0]
    raw = bytearray(chunk.read_bytes())
    offsets = np.frombuffer(raw, np.uint32, 3, 4).copy()
    offsets[1] += by
    raw[4:16] = offsets.tobytes()
    chunk.write_bytes(bytes(raw))


@pytest.mark.parametrize("fmt", ["megatron", "litdata"])
def test_a_moved_boundary_is_caught_at_open_with_eos_and_at_resume_without(tmp_path, fmt):
    """An .idx boundary moved by 3 tokens, a LitData chunk offset moved by 8 bytes: the files
    stay self-consistent, so only a declared eos_id can see it at open (each document must end
    with it); without one the resume is refused."""
    if fmt == "megatron":
        path = write_megatron(tmp_path / "c4_text_document", make_docs(300, seed=6))
    else:
        path = shutil.copytree(LITDATA / "dataset", tmp_path / "lit")
    eos = {"megatron": EOS, "litdata": int(TokenStore.open(path)[0][-1])}[fmt]
    state = Pipeline(peer_config(path), 0, 1, num_threads=0).state_at(2)
    before = TokenStore.open(path, eos_id=eos)  # honest files: every document ends with the EOS
    assert len(before)
    if fmt == "megatron":
        move_megatron_boundary(path, 0, 3)
    else:
        move_litdata_offset(path, 8)
    with pytest.raises(StoreError, match=rf"{path.name}.*(end with|eos_id)"):
        TokenStore.open(path, eos_id=eos)
    with pytest.raises(StateError, match=rf"source 'peer' \({path}\): the data is not what the state"):
        Pipeline(peer_config(path), 0, 1, num_threads=0).iterator(state)


def test_the_litdata_fixture_ends_documents_with_one_id():
    """(The boundary test above takes the fixture's EOS from its first document.)"""
    store = TokenStore.open(LITDATA / "dataset")
    assert len({int(store[i][-1]) for i in range(len(store))}) == 1
    assert json.loads((LITDATA / "dataset" / "index.json").read_text())["chunks"]
