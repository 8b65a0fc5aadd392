"""Hugging Face `datasets` saved with `save_to_disk`, read in place from their Arrow files.

A column of token-id lists (`input_ids` by default) is an Arrow list array: one values
buffer of ids per record batch and the list offsets that cut it into rows. The store maps
each data file once and its documents are views into those values buffers (Arrow aligns
buffers to 8 bytes), so nothing is copied and `offsets` come from the list offsets alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.stores import checks
from forge_grain.stores.base import TokenStore

DEFAULT_FIELD = "input_ids"


class ArrowStore(TokenStore):
    """A `save_to_disk` dataset directory (a `DatasetDict`'s split with `split=`), or one `.arrow` file."""

    format = "arrow"
    description = "a Hugging Face Arrow dataset"
    OPTIONS = frozenset({"token_field", "split", "dtype", "eos_id", "bos_id", "vocab_size", "tokenizer"})

    def _open(self, token_field=None, split=None, dtype=None) -> None:
        field = token_field or DEFAULT_FIELD
        self._files, dataset_fingerprint = data_files(self.path, split)
        starts, array, base, lengths, dtypes = [0], [], [], [], set()
        for k, f in enumerate(self._files):
            file_dtype, pieces = _read_file(f, field)
            checks.check_declared_dtype(f, dtype, file_dtype, "its Arrow schema")
            dtypes.add(file_dtype)
            self._arrays.append(checks.map_array(f, file_dtype, count=f.stat().st_size // file_dtype.itemsize))
            docs = 0
            for at, row_lengths in pieces:
                array.append(k)
                base.append(at)
                starts.append(starts[-1] + int(row_lengths.sum()))
                lengths.append(row_lengths)
                docs += len(row_lengths)
            self._file_docs.append(docs)
        self.dtype = self._one_dtype(dtypes, f"its Arrow files' '{field}' columns")
        all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(all_lengths)]).astype(np.int64)
        self._pieces = (np.array(starts, np.int64), np.array(array, np.int64), np.array(base, np.int64))
        self._fingerprint = self._fingerprint_files([field, dataset_fingerprint])

    _validate = TokenStore._check_indexed_documents


def data_files(path: Path, split: str | None) -> tuple[list[Path], str | None]:
    """(the Arrow data files in order, the dataset's own fingerprint) of a `save_to_disk`
    directory, a `DatasetDict` directory's split, or one `.arrow` file."""
    if path.is_file():
        if split is not None:
            raise StoreError(f"{path}: split={split!r} applies to a DatasetDict directory, and this is one file")
        return [path], None
    if (path / "dataset_dict.json").exists():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        chosen = split or "train"
        if chosen not in splits:
            raise StoreError(
                f"{path}: this DatasetDict has the splits {splits}, not {chosen!r}; choose one with split="
            )
        path = path / chosen
    elif split is not None:
        raise StoreError(f"{path}: split={split!r} was given, but this is a single dataset, not a DatasetDict")
    try:
        state = json.loads((path / "state.json").read_text())
        files = [checks.inside(path, d["filename"], "state.json") for d in state["_data_files"]]
    except StoreError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StoreError(f"{path / 'state.json'}: not a readable save_to_disk state ({e})") from None
    for f in files:
        checks.require_regular(f, f"Arrow file listed in {path / 'state.json'}")
    if not files:
        raise StoreError(f"{path / 'state.json'}: lists no data files")
    return files, state.get("_fingerprint")


def _read_file(f: Path, field: str) -> tuple[np.dtype, list[tuple[int, np.ndarray]]]:
    """The id dtype of column `field` in Arrow file `f`, and per record batch: where its ids
    start in the file (in items) and each row's length. Reads metadata only."""
    import pyarrow as pa

    with pa.memory_map(str(f), "r") as source:
        whole = source.read_buffer()
        try:
            reader = _open_ipc(pa, whole)
        except pa.ArrowInvalid as e:
            raise StoreError(f"{f}: not a readable Arrow file ({e})") from None
        return _read_column(reader, whole, f, field)


def _read_column(reader, whole, f: Path, field: str):
    """`_read_file`'s answer from an open IPC reader over the mapped file `whole`."""
    import pyarrow as pa

    schema = reader.schema
    if field not in schema.names:
        lists = [n for n in schema.names if _id_list(pa, schema.field(n).type)]
        raise StoreError(
            f"{f}: no column {field!r}; columns of token-id lists here: {lists or 'none'} (pass token_field=)"
        )
    kind = schema.field(field).type
    if not _id_list(pa, kind):
        raise StoreError(f"{f}: column {field!r} is {kind}, not a list of integer token ids")
    dtype = np.dtype(kind.value_type.to_pandas_dtype())
    pieces, row = [], 0
    for batch in _batches(reader, f):
        col = batch.column(field)
        if col.null_count:
            bad = row + int(np.flatnonzero(np.asarray(col.is_null()))[0])
            raise StoreError(f"{f}: row {bad} of column {field!r} is null, not a list of token ids")
        if col.values.null_count:
            raise StoreError(f"{f}: column {field!r} holds null token ids (near row {row})")
        offsets = np.asarray(col.offsets).astype(np.int64)
        values = col.values
        address = values.buffers()[1].address + values.offset * dtype.itemsize - whole.address
        if address % dtype.itemsize:
            raise StoreError(f"{f}: the ids of column {field!r} are not aligned to their {dtype} size in the file")
        pieces.append((address // dtype.itemsize + int(offsets[0]), np.diff(offsets)))
        row += len(col)
    return dtype, pieces


def _open_ipc(pa, buffer):
    """`save_to_disk` writes the Arrow stream format; a `.arrow` file may also be the file format."""
    try:
        return pa.ipc.open_stream(buffer)
    except pa.ArrowInvalid:
        return pa.ipc.open_file(buffer)


def _batches(reader, f: Path):
    import pyarrow as pa

    try:
        if hasattr(reader, "num_record_batches"):  # file format
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
            return
        yield from reader
    except (OSError, pa.ArrowException) as e:  # a cut stream: an OSError, or ArrowInvalid when the cut is in metadata
        raise StoreError(f"{f}: the Arrow stream is truncated or damaged ({e})") from None


def _id_list(pa, kind) -> bool:
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type)
