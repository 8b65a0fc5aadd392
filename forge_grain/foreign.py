"""Token files written by other tools: 1-D `.npy` / `.bin` arrays without a manifest.

This is the layout of nanoGPT (`train.bin`, uint16) and KempnerForge's
`MemoryMappedDataset` (`.npy` shards). Documents are found by scanning for an EOS
id (a document ends with it) or a BOS id (a document starts with it); with neither,
each file is one stream. The scan runs once: its offsets are cached beside the data
(or under ~/.cache/forge_grain when that directory is read-only) and reused while
the file's size and modification time stay the same.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from .errors import StoreError
from .manifest import save_npy_atomic, write_json_atomic

SUFFIXES = (".npy", ".bin")
_SCAN_CHUNK = 1 << 26  # tokens per scan step: bounds memory on huge files


def find_token_files(path: str | Path) -> list[Path]:
    """The `.npy`/`.bin` files named by a file, a directory or a glob, sorted."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        if list(p.glob("shard-*.idx.npy")):
            raise StoreError(f"{p}: a forge-grain store without manifest.json is incomplete (re-run `forge-grain prepare`)")
        files = sorted(f for f in p.iterdir() if _is_token_file(f))
    else:
        files = sorted(Path(f) for f in globlib.glob(str(path)) if _is_token_file(Path(f)))
    if not files:
        raise StoreError(f"{path}: no manifest.json and no .npy/.bin token files found")
    return files


def _is_token_file(f: Path) -> bool:
    """Token arrays, not our own index caches (hidden) or store indices (.idx.npy)."""
    return f.suffix in SUFFIXES and not f.name.startswith(".") and not f.name.endswith(".idx.npy") and f.is_file()


def map_tokens(path: Path, dtype: np.dtype | str | None) -> np.ndarray:
    """Memory-map one foreign file as a 1-D array of integer tokens."""
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except ValueError as e:
            raise StoreError(f"{path}: not a readable .npy array ({e})") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise StoreError(f"{path}: expected a 1-D integer token array, found {arr.ndim}-D {arr.dtype}")
        return arr
    dt = np.dtype(dtype or "<u2")
    size = path.stat().st_size
    if size % dt.itemsize:
        raise StoreError(
            f"{path}: {size} bytes is not a multiple of the {dt} item size ({dt.itemsize}); "
            "the file is truncated or the dtype is wrong"
        )
    if size == 0:
        return np.zeros(0, dt)
    return np.memmap(path, dtype=dt, mode="r")


def _cache_paths(path: Path, key: str) -> tuple[Path, Path]:
    stem = f".{path.name}.forge-grain-{key}"
    if os.access(path.parent, os.W_OK):
        base = path.parent
    else:
        base = Path(os.environ.get("FORGE_GRAIN_CACHE", Path.home() / ".cache" / "forge_grain")) / "index"
        base.mkdir(parents=True, exist_ok=True)
        stem = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16] + stem
    return base / f"{stem}.idx.npy", base / f"{stem}.json"


def document_offsets(
    path: Path, tokens: np.ndarray, *, eos_id: int | None, bos_id: int | None
) -> tuple[np.ndarray, int]:
    """Offsets (num_docs + 1) of the documents in one file, and its largest token id.

    Cached: a second call on an unchanged file reads the cache instead of scanning.
    """
    st = path.stat()
    ident = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns, str(tokens.dtype), eos_id, bos_id])
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    idx_path, meta_path = _cache_paths(path, key)
    if meta_path.exists() and idx_path.exists():
        meta = json.loads(meta_path.read_text())
        return np.load(idx_path), meta["max_token"]
    offsets, max_token = _scan(tokens, eos_id=eos_id, bos_id=bos_id)
    save_npy_atomic(idx_path, offsets)
    write_json_atomic(meta_path, {"ident": ident, "max_token": max_token})  # written last: marks it complete
    return offsets, max_token


def _scan(tokens: np.ndarray, *, eos_id: int | None, bos_id: int | None) -> tuple[np.ndarray, int]:
    n = len(tokens)
    cuts, max_token = [], -1
    for lo in range(0, n, _SCAN_CHUNK):
        chunk = np.asarray(tokens[lo : lo + _SCAN_CHUNK])
        max_token = max(max_token, int(chunk.max()))
        if eos_id is not None:
            cuts.append(np.flatnonzero(chunk == eos_id) + lo + 1)  # a document ends after its EOS
        elif bos_id is not None:
            cuts.append(np.flatnonzero(chunk == bos_id) + lo)  # a document starts at its BOS
    inner = np.concatenate(cuts) if cuts else np.zeros(0, np.int64)
    offsets = np.unique(np.concatenate([[0], inner, [n]]).astype(np.int64))  # drops empty documents
    return offsets, max_token
