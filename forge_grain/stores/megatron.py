"""Megatron-LM / Megatron-core indexed datasets, read in place: `prefix.bin` + `prefix.idx`.

The `.idx` file (written by `megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`)
holds, after the `MMIDIDX\\x00\\x00` magic, version 1 and a dtype code: the sequence count,
the document count, each sequence's length (int32), each sequence's byte pointer into
`.bin` (int64), and the document index (int64 sequence indices, from 0 to the sequence
count). A document is the run of sequences between two entries of that index. The `.bin`
is the tokens of all sequences back to back, so the store maps it once, zero-copy, and
its documents are slices of it. The dtype comes from the index; a declared one must agree.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from forge_grain.stores import mapping
from forge_grain.errors import StoreError
from forge_grain.stores import checks
from forge_grain.stores import identify
from forge_grain.stores.base import TokenStore, join_offsets

# Megatron's DType codes (megatron.core.datasets.indexed_dataset.DType)
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_HEADER = len(identify.MEGATRON_IDX_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, two counts


class MegatronStore(TokenStore):
    """One Megatron dataset prefix (or a directory of several, in name order)."""

    format = "megatron"
    description = "a Megatron indexed dataset"
    OPTIONS = frozenset({"dtype", "eos_id", "bos_id", "vocab_size", "tokenizer"})

    def _open(self, dtype=None) -> None:
        prefixes = self._prefixes()
        offsets, dtypes = [], set()
        for prefix in prefixes:
            idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
            file_dtype, doc_offsets = read_index(idx)
            checks.check_declared_dtype(idx, dtype, file_dtype, "the Megatron index")
            tokens = self._map_bin(bin_, file_dtype, int(doc_offsets[-1]))
            self._files += [bin_]
            self._arrays.append(tokens)
            offsets.append(doc_offsets)
            dtypes.add(file_dtype)
        self.dtype = self._one_dtype(dtypes, "its Megatron datasets")
        self._file_docs = [len(o) - 1 for o in offsets]
        self._offsets = join_offsets(offsets)
        self._indices = [Path(f"{p}.idx") for p in prefixes]
        self._fingerprint = self._fingerprint_files([checks.content_fingerprint(i, self._full) for i in self._indices])

    @property
    def index_files(self) -> list[Path]:
        return list(self._indices)

    def _prefixes(self) -> list[Path]:
        if self.path.is_dir():
            found = sorted(f.with_suffix("") for f in self.path.glob("*.idx") if identify.megatron_index(f))
            if not found:
                raise StoreError(f"{self.path}: no Megatron .idx files in this directory")
            return found
        prefix = identify.megatron_prefix(self.path)
        if prefix is None:
            raise StoreError(
                f"{self.path}: not a Megatron dataset (expected PREFIX.idx starting with "
                f"{identify.MEGATRON_IDX_MAGIC!r} beside PREFIX.bin)"
            )
        return [prefix]

    _validate = TokenStore._check_indexed_documents

    @staticmethod
    def _map_bin(bin_: Path, dtype: np.dtype, num_tokens: int) -> np.ndarray:
        checks.require_regular(bin_, "the data file of a Megatron index")
        size = bin_.stat().st_size
        if size != num_tokens * dtype.itemsize:
            raise StoreError(
                f"{bin_}: {size} bytes, but its index describes {num_tokens} {dtype} tokens "
                f"({num_tokens * dtype.itemsize} bytes); the file is truncated or belongs to another index"
            )
        return checks.map_array(bin_, dtype)


def read_index(idx: Path) -> tuple[np.dtype, np.ndarray]:
    """A Megatron `.idx` file's dtype and document offsets (in tokens), after checking that its
    parts agree: sizes, contiguous pointers, and a document index from 0 to the sequence count."""
    checks.require_regular(idx, "Megatron index")
    raw = mapping.map_bytes(idx)
    if len(raw) < _HEADER or bytes(raw[:9]) != identify.MEGATRON_IDX_MAGIC:
        raise StoreError(f"{idx}: not a Megatron index (no {identify.MEGATRON_IDX_MAGIC!r} header)")
    version = int(raw[9:17].view("<u8")[0])
    code = int(raw[17])
    n_seq, n_doc = (int(x) for x in raw[18:34].view("<u8"))
    if version != 1:
        raise StoreError(f"{idx}: Megatron index version {version}; version 1 is the one this reader knows")
    if code not in DTYPES:
        raise StoreError(f"{idx}: unknown Megatron dtype code {code} (known: {sorted(DTYPES)})")
    dtype = checks.integer_dtype(idx, np.dtype(DTYPES[code]), "the Megatron index")
    body = _HEADER + 12 * n_seq + 8 * n_doc
    if len(raw) not in (body, body + n_seq):  # the optional trailing part is one mode byte per sequence
        raise StoreError(
            f"{idx}: {len(raw)} bytes, but its header counts {n_seq} sequences and {n_doc} document entries "
            f"({body} bytes, or {body + n_seq} with sequence modes); the index is truncated or damaged"
        )
    lengths = raw[_HEADER : _HEADER + 4 * n_seq].view("<i4").astype(np.int64)
    pointers = raw[_HEADER + 4 * n_seq : _HEADER + 12 * n_seq].view("<i8")
    docs = raw[_HEADER + 12 * n_seq : body].view("<i8").astype(np.int64)
    token_starts = np.concatenate([[0], np.cumsum(lengths)])
    if np.any(lengths < 0) or not np.array_equal(pointers, token_starts[:-1] * dtype.itemsize):
        raise StoreError(
            f"{idx}: its sequence pointers do not follow its lengths back to back; this reader needs "
            "the contiguous layout IndexedDatasetBuilder writes"
        )
    if n_doc == 0 or docs[0] != 0 or docs[-1] != n_seq or np.any(np.diff(docs) < 0):
        raise StoreError(f"{idx}: its document index does not run from sequence 0 to {n_seq} in order")
    return dtype, token_starts[docs].astype(np.int64)
