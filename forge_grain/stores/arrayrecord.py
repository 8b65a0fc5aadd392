"""The `arrayrecord` layout of forge-grain stores: one ArrayRecord record per document.

Records are read one at a time through Grain's `ArrayRecordDataSource` (no memory map),
so these stores gather rows a document at a time; each shard is checked against the
manifest and index at open, so a truncated or swapped shard is named there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import StoreError
from ..manifest import MANIFEST_NAME


def open_records(store: Path, files: list[Path], num_documents: int):
    import grain  # lazy: only this layout needs it at open time

    records = grain.sources.ArrayRecordDataSource([str(f) for f in files])
    if len(records) != num_documents:
        raise StoreError(
            f"{store}: ArrayRecord shards hold {len(records)} records, manifest says {num_documents} documents"
        )
    return records


def read_document(records, i: int, dtype: np.dtype, file: Path) -> np.ndarray:
    try:
        return np.frombuffer(records[i], dtype=dtype)
    except RuntimeError as e:
        raise StoreError(f"{file}: cannot read document {i} ({e})") from None


def check_records(file: Path, shard, offsets: np.ndarray, dtype: np.dtype) -> None:
    """The record count, and the first and last records' sizes, agree with the manifest and
    index: a truncated, damaged or swapped shard is named at open, not at gather time."""
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(str(file))
    except RuntimeError as e:
        raise StoreError(f"{file}: unreadable ArrayRecord shard ({e})") from None
    try:
        n = reader.num_records()
        if n != shard.num_documents:
            raise StoreError(
                f"{file}: holds {n} records, but {MANIFEST_NAME} lists {shard.num_documents} for this shard; "
                "the shard is truncated, damaged or another shard's (re-run `forge-grain prepare`)"
            )
        if n:
            first, last = reader.read([0, n - 1])
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
