"""Compressed peers' files that lie: a small MDS or LitData file that expands to far more than
its index promises (a decompression bomb), or to less. Decompression is a stream that stops at
the promised size: an error naming the file, nothing left in the cache, and a peak memory of a
few MiB whatever the input (measured in a child process, whose high-water mark is its own)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from forge_grain import StoreError, TokenStore

BOMB = 256 << 20  # what each bomb expands to (the index promises a few KB)
ROOT = Path(__file__).resolve().parents[1]


def bomb(algorithm: str) -> bytes:
    """`BOMB` zero bytes compressed with `algorithm` as the peers' writers compress, made a
    block at a time (never the whole output in memory)."""
    zeros = bytes(1 << 20)
    if algorithm == "zstd":
        import zstandard

        c = zstandard.ZstdCompressor(level=3).compressobj()
        return b"".join(c.compress(zeros) for _ in range(BOMB >> 20)) + c.flush()
    if algorithm == "gz":
        c = __import__("zlib").compressobj(9, wbits=31)
        return b"".join(c.compress(zeros) for _ in range(BOMB >> 20)) + c.flush()
    if algorithm == "br":
        import brotli

        c = brotli.Compressor(quality=5)
        return b"".join(c.process(zeros) for _ in range(BOMB >> 20)) + c.finish()
    if algorithm == "snappy":
        import cramjam

        return bytes(cramjam.snappy.compress_raw(bytes(BOMB >> 4)))  # (one raw block: its header says 16 MiB)
    raise ValueError(algorithm)


def mds_with_bomb(tmp_path: Path, algorithm: str) -> tuple[Path, str]:
    from mds_writer import write_mds
    from test_formats import make_docs

    out = write_mds(tmp_path / f"mds-{algorithm}", {"tokens": "ndarray:int32"},
                    [{"tokens": d} for d in make_docs(40, seed=2)], samples_per_shard=20, compression=algorithm)
    shard = json.loads((out / "index.json").read_text())["shards"][0]["zip_data"]["basename"]
    (out / shard).write_bytes(bomb(algorithm))
    return out, shard


def litdata_with_bomb(tmp_path: Path) -> tuple[Path, str]:
    from test_formats import LITDATA

    out = shutil.copytree(LITDATA / "dataset", tmp_path / "litdata-zstd")
    index = json.loads((out / "index.json").read_text())
    index["config"]["compression"] = "zstd"
    (out / "index.json").write_text(json.dumps(index))
    for chunk in index["chunks"]:
        import zstd

        (out / chunk["filename"]).write_bytes(zstd.compress((out / chunk["filename"]).read_bytes(), 1))
    name = index["chunks"][0]["filename"]
    (out / name).write_bytes(bomb("zstd"))
    return out, name


def opened_in_a_child(path: Path, cache: Path) -> tuple[str, int]:
    """(the error opening `path` gives, the most memory the child's opening took, in bytes)."""
    code = textwrap.dedent(f"""
        import resource, sys
        sys.path[:0] = [{str(ROOT)!r}]
        from forge_grain import StoreError, TokenStore
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            TokenStore.open({str(path)!r})
            print("opened")
        except StoreError as e:
            print(e)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "FORGE_GRAIN_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr[-2000:]
    *message, grown = r.stdout.strip().split("\n")
    return "\n".join(message), int(grown)


@pytest.mark.parametrize("algorithm", ["zstd", "gz", "br", "snappy"])
def test_an_mds_shard_that_expands_past_its_promised_size_is_refused_in_bounded_memory(tmp_path, algorithm):
    """A zstd shard of a few KB that expands to 256 MiB took all of it in memory and left it in
    the cache; the same for gz, brotli (whole-file decompressors) and snappy (whose header says
    its length: refused before anything is written)."""
    path, shard = mds_with_bomb(tmp_path, algorithm)
    message, grown = opened_in_a_child(path, tmp_path / "cache")
    assert f"{shard}: this {algorithm} file expands past the" in message and "bytes its index promises" in message
    assert grown < 64 << 20, f"the opening took {grown >> 20} MiB"
    assert not [f for f in (tmp_path / "cache").rglob("*") if f.is_file() and f.stat().st_size > 1 << 20]


def test_a_litdata_chunk_that_expands_past_chunk_bytes_is_refused_in_bounded_memory(tmp_path):
    path, name = litdata_with_bomb(tmp_path)
    message, grown = opened_in_a_child(path, tmp_path / "cache")
    assert f"{name}: this zstd file expands past the" in message
    assert grown < 64 << 20, f"the opening took {grown >> 20} MiB"
    assert not [f for f in (tmp_path / "cache").rglob("*") if f.is_file() and f.stat().st_size > 1 << 20]


@pytest.mark.parametrize("algorithm", ["zstd", "gz", "br", "snappy"])
def test_an_mds_shard_holding_less_than_its_index_promises_is_refused(tmp_path, monkeypatch, algorithm):
    """A shard whose stream ends early (cut inside a zstd frame: zstandard's reader says nothing)
    or whose index promises more than it holds: named, never read as a shorter shard."""
    from mds_writer import write_mds
    from test_formats import make_docs

    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    out = write_mds(tmp_path / "mds", {"tokens": "ndarray:int32"}, [{"tokens": d} for d in make_docs(40, seed=2)],
                    samples_per_shard=20, compression=algorithm)
    index = json.loads((out / "index.json").read_text())
    index["shards"][1]["raw_data"]["bytes"] += 8
    (out / "index.json").write_text(json.dumps(index))
    with pytest.raises(StoreError, match=rf"{index['shards'][1]['zip_data']['basename']}: cannot decompress this "
                                         rf"{algorithm} file .*not the {index['shards'][1]['raw_data']['bytes']} its "
                                         "index promises.*truncated or damaged"):
        TokenStore.open(out)
    assert not list((tmp_path / "cache").rglob(f"*{index['shards'][1]['raw_data']['basename']}*"))


def test_a_compressed_shard_read_whole_equals_its_documents(tmp_path, monkeypatch):
    """The streamed decompression gives the shard byte for byte, for a gz stream of many blocks."""
    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    from mds_writer import write_mds

    rng = np.random.default_rng(3)
    docs = [rng.integers(2, 1000, 3000).astype(np.int32) for _ in range(800)]  # ~9.6 MB: several blocks
    out = write_mds(tmp_path / "mds", {"tokens": "ndarray:int32"}, [{"tokens": d} for d in docs],
                    samples_per_shard=800, compression="gz")
    store = TokenStore.open(out)
    assert len(store) == len(docs) and all(np.array_equal(store[i], d) for i, d in enumerate(docs))
