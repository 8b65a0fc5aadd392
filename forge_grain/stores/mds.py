"""MosaicML Streaming MDS datasets with a token column, read in place.

An MDS shard is `uint32 n`, `n + 1` uint32 byte offsets of its samples, the shard's JSON
config, then the samples. A sample is the uint32 sizes of its variable-size columns, then
each column's bytes in column-name order. A token column is `bytes` (ids back to back; the
dtype must be declared), `ndarray:DTYPE[:SHAPE]`, or `ndarray` (a dtype byte first); a
dynamic shape puts a byte (ndim << 2 | shape width) and the shape before the ids.

Samples sit at arbitrary byte offsets, so each shard is mapped once and viewed at every byte
alignment; every document is a view (possibly unaligned) into one of those views: no copy. A shard
written compressed (`zip_data`) cannot be mapped: it is decompressed once into the cache,
keyed by its content fingerprint, and read from there.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from forge_grain.stores import mapping
from forge_grain.errors import StoreError
from forge_grain.stores import checks, decompress
from forge_grain.stores.base import TokenStore

FIELDS = ("tokens", "input_ids")  # token columns looked for when token_field is not given
VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 32: "uint32", 33: "int32", 64: "uint64", 65: "int64"}


class MDSStore(TokenStore):
    """A directory with an MDS `index.json` and its shards."""

    format = "mds"
    description = "a MosaicML MDS dataset"
    OPTIONS = frozenset({"token_field", "dtype", "eos_id", "bos_id", "vocab_size", "tokenizer"})

    def _open(self, token_field=None, dtype=None) -> None:
        shards = _read_index(self.path / "index.json")
        field = token_field or _default_field(self.path / "index.json", shards[0])
        self._shards = shards
        dtypes, starts, array, base, lengths = set(), [0], [], [], []
        for s, shard in enumerate(shards):
            file = self._shard_file(shard)
            shard_dtype, at, count = _token_column(file, shard, field, dtype)
            dtypes.add(shard_dtype)
            first_array = len(self._arrays)
            self._arrays += checks.map_alignments(file, shard_dtype)  # samples start at any byte
            for a, c in zip(at, count):
                array.append(first_array + a % shard_dtype.itemsize)
                base.append(a // shard_dtype.itemsize)
                starts.append(starts[-1] + c)
            self._files.append(file)
            self._file_docs.append(len(at))
            lengths.append(count)
        self.dtype = self._one_dtype(dtypes, f"its shards' '{field}' columns")
        self._offsets = np.array(starts, np.int64)
        self._pieces = (self._offsets, np.array(array, np.int64), np.array(base, np.int64))
        self._fingerprint = self._fingerprint_files([field, checks.content_fingerprint(self.path / "index.json",
                                                                                       self._full)])

    _validate = TokenStore._check_indexed_documents

    def _shard_file(self, shard: dict) -> Path:
        """The shard's raw file, decompressing a compressed one into the cache once."""
        raw = shard.get("raw_data") or {}
        file = checks.inside(self.path, raw["basename"], "index.json") if raw.get("basename") else self.path
        if raw.get("basename") and file.exists():
            checks.require_regular(file, "shard listed in index.json")
            return file
        zipped = shard.get("zip_data") or {}
        if not zipped.get("basename"):
            raise StoreError(f"{file}: shard listed in {self.path / 'index.json'} is missing")
        source = checks.inside(self.path, zipped["basename"], "index.json")
        checks.require_regular(source, "compressed shard listed in index.json")
        return decompress.cached_copy(source, shard.get("compression"), raw.get("basename", source.name), "mds",
                                      raw.get("bytes"))

    def _verify_files(self) -> None:
        """The checksums MDS records for raw shards (those hashlib computes)."""
        for shard, file in zip(self._shards, self._files):
            for algorithm, expected in ((shard.get("raw_data") or {}).get("hashes") or {}).items():
                if algorithm in hashlib.algorithms_available:
                    h = hashlib.new(algorithm)
                    with open(file, "rb") as f:
                        while block := f.read(1 << 24):
                            h.update(block)
                    if h.hexdigest() != expected:
                        raise StoreError(f"{file}: {algorithm} checksum mismatch with index.json; the shard is corrupt")


def _read_index(index_file: Path) -> list[dict]:
    try:
        index = json.loads(index_file.read_text())
        shards = index["shards"]
        assert isinstance(shards, list) and shards
        for shard in shards:
            assert shard["format"] == "mds" and isinstance(shard["column_names"], list)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise StoreError(f"{index_file}: not a readable MDS index with shards of format 'mds' ({e!r})") from None
    return shards


def _default_field(index_file: Path, shard: dict) -> str:
    for name in FIELDS:
        if name in shard["column_names"]:
            return name
    raise StoreError(f"{index_file}: no 'tokens' or 'input_ids' column (columns {shard['column_names']}); pass token_field=")


def _token_column(file: Path, shard: dict, field: str, declared) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """The ids' dtype, and for each sample of the shard the byte offset of its ids and their count."""
    names, encodings, sizes = shard["column_names"], shard["column_encodings"], shard["column_sizes"]
    if field not in names:
        raise StoreError(f"{file}: MDS columns are {names}, not {field!r}; pass token_field=")
    raw = mapping.map_bytes(file)
    starts = _sample_offsets(file, raw, shard)
    n = len(starts) - 1
    variable = [k for k, size in enumerate(sizes) if size is None]
    head = np.zeros((n, len(variable)), np.int64)
    for j in range(len(variable)):
        head[:, j] = _u32_at(raw, starts[:-1] + 4 * j)
    col_start = starts[:-1] + 4 * len(variable)
    col_size = None
    for k in range(len(names)):
        size = head[:, variable.index(k)] if sizes[k] is None else np.full(n, sizes[k], np.int64)
        if names[k] == field:
            col_size = size
            break
        col_start = col_start + size
    if np.any(col_start + col_size > starts[1:]):
        raise StoreError(f"{file}: a sample's column sizes run past the sample; the shard is damaged")
    dtype, header = _ids_layout(file, raw, col_start, encodings[names.index(field)], field, declared)
    count_bytes = col_size - header
    if np.any(count_bytes < 0) or np.any(count_bytes % dtype.itemsize):
        raise StoreError(f"{file}: column {field!r} is not a whole number of {dtype} ids in every sample; wrong dtype?")
    checks.check_declared_dtype(file, declared, dtype, f"column {field!r}'s encoding")
    return dtype, col_start + header, count_bytes // dtype.itemsize


def _sample_offsets(file: Path, raw: np.ndarray, shard: dict) -> np.ndarray:
    n = int(shard.get("samples", -1))
    if len(raw) < 4 or int(_u32_at(raw, np.zeros(1, np.int64))[0]) != n:
        raise StoreError(f"{file}: its sample count disagrees with index.json ({n}); the shard is damaged or replaced")
    table_end = 4 * (n + 2)
    if len(raw) < table_end:
        raise StoreError(f"{file}: {len(raw)} bytes cannot hold the offsets of {n} samples; the shard is truncated")
    starts = _u32_at(raw, 4 + 4 * np.arange(n + 1, dtype=np.int64))
    if starts[0] < table_end or np.any(np.diff(starts) < 0):
        raise StoreError(f"{file}: its sample offsets are not increasing after the header; the shard is damaged")
    if starts[-1] != len(raw):
        raise StoreError(
            f"{file}: {len(raw)} bytes, but its sample offsets end at byte {int(starts[-1])}; the shard is truncated "
            "or was replaced"
        )
    return starts


def _ids_layout(file, raw, col_start, encoding: str, field: str, declared) -> tuple[np.dtype, np.ndarray]:
    """The dtype of the ids and the bytes before them in each sample's column."""
    kind, _, rest = encoding.partition(":")
    if kind == "bytes":
        if declared is None:
            raise StoreError(
                f"{file}: column {field!r} is MDS 'bytes', which does not record the dtype of its ids; declare it: "
                "dtype='int64' (LLM Foundry's ConcatTokensDataset), 'uint16', 'int32', ..."
            )
        dt = checks.integer_dtype(file, checks.declared_dtype(file, declared), "declared")
        return dt, np.zeros(len(col_start), np.int64)
    if kind != "ndarray":
        raise StoreError(f"{file}: column {field!r} is encoded {encoding!r}; token ids need 'bytes' or 'ndarray'")
    header = np.zeros(len(col_start), np.int64)
    dtype_name, _, shape = rest.partition(":")
    if not dtype_name:  # a dtype byte leads every sample
        codes = np.unique(raw[col_start]) if len(col_start) else np.zeros(0, np.uint8)
        if len(codes) > 1 or (len(codes) and int(codes[0]) not in VALUE_DTYPES):
            raise StoreError(f"{file}: column {field!r} mixes dtypes or holds non-integer ids (codes {codes.tolist()})")
        dtype_name = VALUE_DTYPES[int(codes[0])] if len(codes) else "int64"
        header += 1
    dt = checks.integer_dtype(file, np.dtype(dtype_name), f"column {field!r}'s encoding")
    if not shape:  # a dynamic shape: (ndim << 2 | width code), then the shape
        byte = raw[col_start + header].astype(np.int64) if len(col_start) else np.zeros(0, np.int64)
        if np.any(byte >> 2 != 1):
            raise StoreError(f"{file}: column {field!r} holds arrays that are not 1-D; token ids are one row per sample")
        header += 1 + (1 << (byte & 3))
    elif "," in shape:
        raise StoreError(f"{file}: column {field!r} has the fixed shape {shape}; token ids are 1-D")
    return dt, header


def _u32_at(raw: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Little-endian uint32 values at arbitrary byte positions of a byte array."""
    b = raw[positions[:, None] + np.arange(4)].astype(np.int64)
    return b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24
