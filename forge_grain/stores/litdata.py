"""LitData `optimize(...)` output for `TokensLoader`, read in place.

A chunk file is `uint32 n`, then `n + 1` uint32 byte offsets of its items, then the items'
bytes back to back; `TokensLoader` writes each item (one document's token ids) with no
header of its own (data format `no_header_numpy:K` or `no_header_tensor:K`, K naming the
dtype). So a chunk's tokens are one contiguous array after its header: the store maps each
chunk once, zero-copy, and takes the documents from the offset table. `index.json` lists
the chunks in order; each chunk's table must agree with it and with the file's size.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.stores import checks, decompress
from forge_grain.stores.base import TokenStore, join_offsets

# litdata.constants: _NUMPY_DTYPES_MAPPING (index into its list of numpy scalar types) and
# _TORCH_DTYPES_MAPPING, for the integer types token ids use
NUMPY_DTYPES = {0: "int8", 1: "int16", 2: "int32", 3: "int64", 4: "uint8", 5: "uint16", 6: "uint32", 7: "uint64"}
TORCH_DTYPES = {11: "uint8", 12: "int8", 13: "int16", 14: "int16", 15: "int32", 16: "int32", 17: "int64",
                18: "int64", 20: "uint16"}


class LitDataStore(TokenStore):
    """A directory written by `litdata.optimize(..., item_loader=TokensLoader())`."""

    format = "litdata"
    description = "a LitData dataset"
    OPTIONS = frozenset({"dtype", "eos_id", "bos_id", "vocab_size", "tokenizer"})

    def _open(self, dtype=None) -> None:
        index_file = self.path / "index.json"
        index = _read_index(index_file)
        self.dtype = _token_dtype(index_file, index["config"])
        checks.check_declared_dtype(index_file, dtype, self.dtype, "its data_format")
        offsets = []
        compression = index["config"].get("compression")
        for chunk in index["chunks"]:
            file = checks.inside(self.path, chunk["filename"], "index.json")
            if compression:  # a compressed chunk cannot be mapped: read from its decompressed copy in the cache
                checks.require_regular(file, "chunk listed in index.json")
                file = decompress.cached_copy(file, compression, chunk["filename"], "litdata", chunk.get("chunk_bytes"))
            header, item_offsets = _chunk_table(file, chunk, self.dtype)
            count = (int(item_offsets[-1]) - header) // self.dtype.itemsize
            self._arrays.append(checks.map_array(file, self.dtype, offset=header, count=count))
            self._files.append(file)
            offsets.append((item_offsets - header) // self.dtype.itemsize)
        self._file_docs = [len(o) - 1 for o in offsets]
        self._offsets = join_offsets(offsets)
        self._fingerprint = self._fingerprint_files(checks.content_fingerprint(index_file, self._full))

    _validate = TokenStore._check_indexed_documents


def _read_index(index_file: Path) -> dict:
    try:
        index = json.loads(index_file.read_text())
        chunks, config = index["chunks"], index["config"]
        assert isinstance(chunks, list) and isinstance(config, dict)
        for c in chunks:
            assert isinstance(c["filename"], str) and isinstance(c["chunk_size"], int)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise StoreError(f"{index_file}: not a readable LitData index ({type(e).__name__}: {e})") from None
    return index


def _token_dtype(index_file: Path, config: dict) -> np.dtype:
    """The dtype `TokensLoader` reads, from the index's single data format."""
    formats = config.get("data_format") or []
    kind, _, code = (formats[0] if len(formats) == 1 else "").partition(":")
    table = {"no_header_numpy": NUMPY_DTYPES, "no_header_tensor": TORCH_DTYPES}.get(kind)
    if table is None or not code.isdigit() or int(code) not in table:
        raise StoreError(
            f"{index_file}: data_format {formats} is not the one item of integer token ids that TokensLoader "
            "reads (no_header_numpy:K or no_header_tensor:K); write the dataset with "
            "optimize(..., item_loader=TokensLoader()) yielding one 1-D token array per document"
        )
    return np.dtype(table[int(code)])


def _chunk_table(file: Path, chunk: dict, dtype: np.dtype) -> tuple[int, np.ndarray]:
    """The header size and item byte offsets of one chunk, checked against the index and file size."""
    checks.require_regular(file, "chunk listed in index.json")
    size = file.stat().st_size
    header = header_bytes(file, chunk, size)
    with open(file, "rb") as f:
        return header, check_table(file, f.read(header), chunk, size, dtype)


def header_bytes(where, chunk: dict, size: int) -> int:
    """The bytes of a chunk's header (its count and offset table) by the index's item count,
    refused where the file of `size` bytes cannot hold them."""
    n = int(chunk["chunk_size"])
    header = 4 * (n + 2)
    if n < 0:
        raise StoreError(f"{where}: index.json lists {n} items in it; a chunk holds zero or more")
    if size < header:
        raise StoreError(f"{where}: {size} bytes cannot hold the header of {n} items that index.json lists")
    return header


def check_table(where, head: bytes, chunk: dict, size: int, dtype: np.dtype) -> np.ndarray:
    """The item byte offsets in a chunk's header (`head`, `header_bytes` long) of a file of
    `size` bytes, checked against the index and the size: all that says where its documents
    are (read from a local file, or from a ranged GET of an object's head)."""
    n, header = int(chunk["chunk_size"]), len(head)
    table = np.frombuffer(head, "<u4").astype(np.int64)
    offsets = table[1:]
    if table[0] != n:
        raise StoreError(f"{where}: its header (n={int(table[0])}) disagrees with index.json ({n} items)")
    if offsets[0] != header:
        raise StoreError(f"{where}: its first item starts at byte {int(offsets[0])}, not right after the {header}-byte "
                         "header; the chunk's offset table is damaged")
    bad = np.flatnonzero(np.diff(offsets) < 0)
    if len(bad):
        k = int(bad[0])
        raise StoreError(f"{where}: item {k} ends at byte {int(offsets[k + 1])}, before it starts (byte "
                         f"{int(offsets[k])}); the chunk's offset table is damaged")
    if offsets[-1] != size or chunk.get("chunk_bytes") not in (None, size - header, size):
        raise StoreError(
            f"{where}: {size} bytes, but its offset table ends at byte {int(offsets[-1])}; the chunk is truncated "
            "or was replaced"
        )
    if np.any((offsets - header) % dtype.itemsize):
        raise StoreError(f"{where}: an item's size is not a whole number of {dtype} tokens; the dtype is wrong")
    return offsets
