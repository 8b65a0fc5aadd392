"""The `arrayrecord` layout of forge-grain stores: one ArrayRecord record per document.

Records are read one at a time (no memory map), so these stores gather rows a document
at a time; each shard is checked against the manifest and index at open, so a truncated
or swapped shard is named there.

Forked processes: `prepare` writes records uncompressed. ArrayRecord decodes compressed
(zstd) records through riegeli, which parks each decompressor in a pool cleaned by a
background thread; a process forked while that thread waits (a DataLoader worker started
within a minute of its parent reading a compressed record) inherits the pool without the
thread, and its own first decode crashes the process (a segfault). Stores prepared before
the compression was recorded hold zstd records: in such a child they are refused with an
error that says what to do, instead of crashing.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.stores.manifest import MANIFEST_NAME
from forge_grain.stores import handles


class Records:
    """The records of a store's shards in order, each shard's reader opened on first use
    through the process's handle pool (`handles.POOL`), so a store of thousands of shards
    holds at most the pool's cap of descriptors (Grain's `ArrayRecordDataSource` keeps a
    reader per shard it has touched)."""

    def __init__(self, files: list[Path], counts: list[int], fetch=None, compressed: bool = False):
        self._files = [str(f) for f in files]
        self._compressed = compressed
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._fetch = fetch  # shard index -> local path, for shards fetched on demand (object storage)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def read(self, i: int) -> bytes:
        s = int(np.searchsorted(self._starts, i, side="right") - 1)
        key = ("arrayrecord", self._files[s])
        for attempt in range(3):
            opened = []  # the path this attempt's reader was opened at, if it opened one

            def open_reader():
                opened.append(self._path(s))
                return _reader(opened[-1], self._compressed)

            reader = handles.POOL.get(key, open_reader)
            try:
                return reader.read([i - int(self._starts[s])])[0]
            except RuntimeError:
                # a shard fetched on demand and evicted before the reader opened it (a small
                # cache_limit): fetch it again and reopen
                if self._fetch is None or attempt == 2 or not opened or Path(opened[-1]).exists():
                    raise
                handles.POOL.drop(key)

    def _path(self, s: int) -> str:
        return str(self._fetch(s)) if self._fetch else self._files[s]


_ZSTD_PID: int | None = None  # the process whose memory holds riegeli's zstd pool, once one decoded


def _reader(file: str, compressed: bool, options: str = "readahead_buffer_size:0"):
    """An ArrayRecord reader of `file` (by default for random access: no read-ahead), refused
    for a compressed file in a child forked after its parent decoded compressed records."""
    global _ZSTD_PID
    from array_record.python.array_record_module import ArrayRecordReader

    if compressed:
        if _ZSTD_PID not in (None, os.getpid()):
            raise StoreError(
                f"{file}: this store's records are zstd-compressed (it was prepared before forge-grain wrote "
                "them uncompressed), and ArrayRecord cannot decode compressed records in a process forked after "
                "its parent did (a DataLoader worker: it would crash with a segfault). Prepare the store again "
                "(`forge-grain prepare ... --layout arrayrecord --overwrite` writes uncompressed records), use the "
                "bin layout, or start the workers with DataLoader(..., multiprocessing_context='spawn')")
        _ZSTD_PID = os.getpid()
    return ArrayRecordReader(file, options)


def read_document(records: Records, i: int, dtype: np.dtype, file: Path) -> np.ndarray:
    try:
        return np.frombuffer(records.read(i), dtype=dtype)
    except RuntimeError as e:
        raise StoreError(f"{file}: cannot read document {i} ({e})") from None


def check_records(file: Path, shard, offsets: np.ndarray, dtype: np.dtype, compressed: bool) -> None:
    """The record count, the first and last records' sizes and the compression agree with
    the manifest and index: a truncated, damaged or swapped shard is named at open, not at
    gather time."""
    try:
        reader = _reader(str(file), compressed, "")
    except RuntimeError as e:
        raise StoreError(f"{file}: unreadable ArrayRecord shard ({e})") from None
    try:
        n = reader.num_records()
        if n != shard.num_documents:
            raise StoreError(
                f"{file}: holds {n} records, but {MANIFEST_NAME} lists {shard.num_documents} for this shard; "
                "the shard is truncated, damaged or another shard's (re-run `forge-grain prepare`)"
            )
        if compressed == ("uncompressed" in (reader.writer_options_string() or "").split(",")):
            raise StoreError(
                f"{file}: its records are {'not ' if compressed else ''}compressed, but {MANIFEST_NAME} says "
                f"{'they are' if compressed else 'not'}; the shard is another store's (re-run `forge-grain prepare`)")
        if n:
            # one record a call: a read of two far apart would hand work to ArrayRecord's thread
            # pool, whose threads a forked child does not have
            (first,), (last,) = reader.read([0]), reader.read([n - 1])
            item = dtype.itemsize
            sizes = (int(offsets[1] - offsets[0]) * item, int(offsets[-1] - offsets[-2]) * item)
            if (len(first), len(last)) != sizes:
                raise StoreError(
                    f"{file}: its records disagree with {shard.index} (first/last sizes {len(first)}/{len(last)} "
                    f"bytes, index says {sizes[0]}/{sizes[1]}); shards were swapped or replaced"
                )
    except RuntimeError as e:
        raise StoreError(f"{file}: damaged ArrayRecord shard ({e})") from None
    finally:
        try:
            reader.close()
        except RuntimeError:  # closing a damaged file reports the damage again
            pass
