"""`TokenStore`: a read-only, zero-copy, memory-mapped view of a tokenized corpus as documents."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import resource
import stat
from pathlib import Path
from typing import Iterator

import numpy as np

from . import foreign
from .errors import StoreError
from .manifest import MANIFEST_NAME, Manifest, sha256_file


class TokenStore:
    """Documents of a token store, each a numpy view into memory-mapped shards.

    Open a forge-grain store (a directory with `manifest.json`, layout `bin` or
    `arrayrecord`) or foreign `.npy`/`.bin` token files (see `forge_grain.foreign`).
    Random access is O(1) and thread-safe; pickling sends only the path and options,
    and the other side maps the files again, so Grain workers get it cheaply.
    It is a Grain `RandomAccessDataSource`: `grain.MapDataset.source(store)` works.
    """

    def __init__(self, path: str | Path, **options):
        self.path = Path(path)
        self._options = options
        self.manifest: Manifest | None = None
        self._arrays: list[np.ndarray] = []  # per shard tokens ("bin" and foreign layouts)
        self._records = None  # grain ArrayRecordDataSource ("arrayrecord" layout)
        self._files: list[Path] = []
        if (self.path / MANIFEST_NAME).exists():
            self._open_manifest()
            self._check_declared(options)
        else:
            self._open_foreign(**options)
        self._shard_token_starts = np.concatenate([[0], np.cumsum(self._shard_tokens)]).astype(np.int64)
        self._shard_doc_starts = np.concatenate([[0], np.cumsum(self._shard_docs)]).astype(np.int64)
        self._lengths: np.ndarray | None = None

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        verify: bool = False,
        dtype: str | None = None,
        eos_id: int | None = None,
        bos_id: int | None = None,
        vocab_size: int | None = None,
        tokenizer: str | Path | None = None,
        split: str | None = None,
        file_pattern: str | None = None,
        fingerprint: str = "sampled",
    ) -> "TokenStore":
        """Open a store; `verify=True` also checks every checksum and token id (reads all data).

        The other options describe foreign token files (a forge-grain store records them in
        its manifest; any given for it must agree): `dtype` of raw files (or `vocab_size`, or a
        `tokenizer` whose vocabulary decides it), `eos_id`/`bos_id` to find documents,
        `split` to pick one split's files in a directory of several, `file_pattern` to
        filter a directory, and `fingerprint="full"` to hash every byte for the state
        fingerprint instead of sampled blocks.
        """
        store = cls(path, dtype=dtype, eos_id=eos_id, bos_id=bos_id, vocab_size=vocab_size, tokenizer=tokenizer,
                    split=split, file_pattern=file_pattern, fingerprint=fingerprint)
        if verify:
            store.verify()
        return store

    # -- opening -------------------------------------------------------------------------

    def _open_manifest(self) -> None:
        m = self.manifest = Manifest.load(self.path)
        self.dtype = np.dtype(m.dtype)
        self.vocab_size, self.bos_id, self.eos_id = m.vocab_size, m.bos_id, m.eos_id
        self.tokenizer = m.tokenizer
        self._files = [self.path / s.tokens for s in m.shards]
        with _descriptors(self.path, len(m.shards)):
            offsets = self._map_shards(m)
        if m.layout == "arrayrecord":
            import grain  # lazy: only this layout needs it at open time

            self._records = grain.sources.ArrayRecordDataSource([str(f) for f in self._files])
            if len(self._records) != m.num_documents:
                raise StoreError(
                    f"{self.path}: ArrayRecord shards hold {len(self._records)} records, "
                    f"manifest says {m.num_documents} documents"
                )
        self._shard_tokens = [s.num_tokens for s in m.shards]
        self._shard_docs = [s.num_documents for s in m.shards]
        self._offsets = _join_offsets(offsets)

    def _map_shards(self, m: Manifest) -> list[np.ndarray]:
        """Check every shard and its index, map `bin` shards; each shard's offsets."""
        offsets = []
        for shard, file in zip(m.shards, self._files):
            _require_regular(file, f"shard listed in {self.path / MANIFEST_NAME}")
            _require_regular(self.path / shard.index, f"index listed in {self.path / MANIFEST_NAME}")
            if m.layout == "bin":
                self._arrays.append(self._map_bin_shard(file, shard))
            offsets.append(self._load_index(self.path / shard.index, shard))
            if m.layout == "arrayrecord":
                self._check_records(file, shard, offsets[-1])
        return offsets

    def _check_declared(self, options: dict) -> None:
        """Options given for a store must agree with its manifest (they describe foreign files)."""
        recorded = {"dtype": self.dtype, "eos_id": self.eos_id, "bos_id": self.bos_id, "vocab_size": self.vocab_size}
        for key, value in options.items():
            if value is None or key == "fingerprint":
                continue
            if key not in recorded:
                raise StoreError(f"{self.path}: {key}= applies to foreign token files, not to a forge-grain store")
            same = foreign.declared_dtype(self.path, value) == self.dtype if key == "dtype" else value == recorded[key]
            if not same:
                raise StoreError(
                    f"{self.path}: {key}={value!r} was declared, but the store's {MANIFEST_NAME} records "
                    f"{recorded[key]!r}"
                )

    def _check_records(self, file: Path, shard, offsets: np.ndarray) -> None:
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
                item = self.dtype.itemsize
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

    def _map_bin_shard(self, file: Path, shard) -> np.ndarray:
        size = file.stat().st_size
        if size % self.dtype.itemsize:
            raise StoreError(
                f"{file}: {size} bytes is not a multiple of the {self.dtype} item size "
                f"({self.dtype.itemsize}); the shard is truncated or corrupt"
            )
        if size != shard.num_tokens * self.dtype.itemsize:
            raise StoreError(
                f"{file}: holds {size // self.dtype.itemsize} tokens, manifest says {shard.num_tokens}; "
                "the shard is truncated or was replaced"
            )
        return np.memmap(file, dtype=self.dtype, mode="r") if size else foreign.empty_tokens(self.dtype)

    @staticmethod
    def _load_index(file: Path, shard) -> np.ndarray:
        try:
            idx = np.load(file)
        except (FileNotFoundError, ValueError, OSError) as e:
            raise StoreError(f"{file}: document index missing or unreadable ({e})") from None
        ok = (
            idx.ndim == 1
            and len(idx) == shard.num_documents + 1
            and idx[0] == 0
            and idx[-1] == shard.num_tokens
            and bool(np.all(np.diff(idx) >= 0))
        )
        if not ok:
            raise StoreError(
                f"{file}: document index disagrees with its shard {shard.tokens} "
                f"(expected {shard.num_documents + 1} non-decreasing offsets from 0 to {shard.num_tokens})"
            )
        return idx.astype(np.int64, copy=False)

    def _open_foreign(self, dtype=None, eos_id=None, bos_id=None, vocab_size=None, tokenizer=None, split=None,
                      file_pattern=None, fingerprint="sampled") -> None:
        if fingerprint not in ("sampled", "full"):
            raise StoreError(f"{self.path}: fingerprint must be 'sampled' or 'full', not {fingerprint!r}")
        self.tokenizer = None
        if tokenizer is not None:
            from .tokenizer import load_tokenizer

            tok = load_tokenizer(tokenizer)
            if vocab_size is not None and vocab_size != tok.vocab_size:
                raise StoreError(f"{self.path}: vocab_size {vocab_size} disagrees with {tokenizer} ({tok.vocab_size} ids)")
            vocab_size, self.tokenizer = tok.vocab_size, tok.identity
        self._files = foreign.find_token_files(self.path, split=split, file_pattern=file_pattern)
        with _descriptors(self.path, len(self._files)):
            self._arrays = [foreign.map_tokens(f, dtype, vocab_size) for f in self._files]
        dtypes = {a.dtype for a in self._arrays}
        if len(dtypes) > 1:
            raise StoreError(f"{self.path}: token files mix dtypes {sorted(map(str, dtypes))}")
        self.dtype = self._arrays[0].dtype
        self.vocab_size, self.bos_id, self.eos_id = vocab_size, bos_id, eos_id
        offsets, parts = [], []
        for f, a in zip(self._files, self._arrays):
            sample = foreign.sampled_tokens(a)  # read once: the width check and the cache check use it
            if dtype is None:  # decided by the vocabulary or a .npy header: check it is plausible
                foreign.check_width(f, sample)
            content = foreign.content_fingerprint(f, full=fingerprint == "full")
            off, lo, hi = foreign.document_offsets(f, a, eos_id=eos_id, bos_id=bos_id, fingerprint=content,
                                                   sample=sample)
            foreign.check_ids(f, lo, hi, vocab_size)
            offsets.append(off)
            parts.append([f.name, content, hashlib.sha256(off.tobytes()).hexdigest()])
        self._fingerprint = hashlib.sha256(
            json.dumps([str(self.dtype), eos_id, bos_id, vocab_size, parts]).encode()
        ).hexdigest()[:16]
        self._shard_tokens = [len(a) for a in self._arrays]
        self._shard_docs = [len(o) - 1 for o in offsets]
        self._offsets = _join_offsets(offsets)

    # -- the data ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"document {i} out of range for a store of {n} documents")
        if self._records is not None:
            try:
                return np.frombuffer(self._records[i], dtype=self.dtype)
            except RuntimeError as e:
                raise StoreError(f"{self._files[self.shard_of(i)]}: cannot read document {i} ({e})") from None
        s = self.shard_of(i)
        base = self._shard_token_starts[s]
        return self._arrays[s][self._offsets[i] - base : self._offsets[i + 1] - base]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def shard_of(self, doc: int) -> int:
        """The shard holding document `doc`."""
        if len(self._shard_docs) == 1:
            return 0
        return int(np.searchsorted(self._shard_doc_starts, doc, side="right") - 1)

    @property
    def offsets(self) -> np.ndarray:
        """Start of each document (and the end of the last) in the shards' concatenated tokens."""
        return self._offsets

    @property
    def lengths(self) -> np.ndarray:
        """Every document's length in tokens, one int64 array (no token is read)."""
        if self._lengths is None:
            self._lengths = np.diff(self._offsets)
        return self._lengths

    @property
    def token_arrays(self) -> tuple[np.ndarray, ...] | None:
        """Each shard's tokens as a memory-mapped array, or None for ArrayRecord stores."""
        return tuple(np.asarray(a) for a in self._arrays) or None

    @property
    def shard_starts(self) -> np.ndarray:
        """Where each shard begins in the shards' concatenated tokens."""
        return self._shard_token_starts[:-1].copy()

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    @property
    def files(self) -> list[Path]:
        return list(self._files)

    @property
    def fingerprint(self) -> str:
        """Identity of the data: the manifest's shard checksums, or for foreign files their
        content fingerprints and document boundaries (see `foreign.content_fingerprint`)."""
        if self.manifest is not None:
            parts = "|".join(sh.sha256 for sh in self.manifest.shards)
            return hashlib.sha256(parts.encode()).hexdigest()[:16]
        return self._fingerprint

    @property
    def layout(self) -> str:
        return self.manifest.layout if self.manifest else "foreign"

    def verify(self) -> None:
        """Check every shard's checksum, and that every token id is non-negative, fits int32
        batches and lies below `vocab_size` (reads all data)."""
        if self.manifest is not None:
            for shard, file in zip(self.manifest.shards, self._files):
                if sha256_file(file) != shard.sha256:
                    raise StoreError(f"{file}: checksum mismatch; the shard is corrupt (re-run `forge-grain prepare`)")
        for s, file in enumerate(self._files):
            lo, hi = self._shard_doc_starts[s], self._shard_doc_starts[s + 1]
            tokens = self._arrays[s] if self._arrays else (self[i] for i in range(lo, hi))
            chunks = [t for t in _chunks(tokens) if len(t)]
            if chunks:
                foreign.check_ids(file, min(int(t.min()) for t in chunks), max(int(t.max()) for t in chunks),
                                  self.vocab_size)
            if self.manifest is None and self._arrays:
                foreign.check_width(file, foreign.sampled_tokens(self._arrays[s]))

    def close(self) -> None:
        """Drop the memory maps (views already handed out stay valid while referenced)."""
        self._arrays = []
        if self._records is not None and hasattr(self._records, "close"):
            self._records.close()
        self._records = None

    def __enter__(self) -> "TokenStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        return (_reopen, (type(self), self.path, self._options))

    def __repr__(self) -> str:
        return (
            f"TokenStore({str(self.path)!r}, layout={self.layout}, documents={len(self)}, "
            f"tokens={self.num_tokens}, dtype={self.dtype}, vocab_size={self.vocab_size})"
        )


@contextlib.contextmanager
def _descriptors(path: Path, num_files: int):
    """Running out of file descriptors (each memory map keeps one) is a `StoreError` saying what to do."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.EMFILE:
            raise
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        raise_it = f"raise it (`ulimit -n {hard}` here)" if hard > soft else "ask for a higher hard limit"
        raise StoreError(
            f"{path}: mapping its {num_files} token files needs a file descriptor each, and this process reached its "
            f"limit of {soft} open files (ulimit -n); {raise_it}, or write the data as fewer, larger shards"
        ) from None


def _require_regular(file: Path, what: str) -> None:
    """A regular file (after links), never a device, a FIFO or a directory that would hang or mislead reads."""
    try:
        mode = file.stat().st_mode
    except FileNotFoundError:
        raise StoreError(f"{file}: {what} is missing") from None
    if not stat.S_ISREG(mode):
        raise StoreError(f"{file}: {what} is not a regular file")


def _reopen(cls, path, options):
    return cls(path, **options)


def _join_offsets(per_shard: list[np.ndarray]) -> np.ndarray:
    """Concatenate per-shard offsets into offsets over all shards' tokens in order."""
    parts, base = [], 0
    for off in per_shard:
        parts.append(off[:-1] + base)
        base += int(off[-1])
    parts.append(np.array([base], np.int64))
    return np.concatenate(parts).astype(np.int64)


def _chunks(tokens, size: int = 1 << 24):
    if isinstance(tokens, np.ndarray):
        for lo in range(0, len(tokens), size):
            yield np.asarray(tokens[lo : lo + size])
    else:
        yield from tokens
