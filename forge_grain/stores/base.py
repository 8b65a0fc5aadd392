"""`TokenStore`: the one interface `pack`, `Pipeline`, the bridges and `inspect` read documents through.

Every format (forge-grain's own stores, raw token files, Megatron, Hugging Face Arrow,
LitData, MosaicML MDS) is a subclass that fills in the same few fields when it opens:
document `offsets` over the store's tokens taken in order, the token arrays they point
into, the dtype and special ids, and a fingerprint of the data. Everything else (random
access, lengths, pickling that reopens, id checks) lives here once.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.files import temporary
from forge_grain.stores.mapping import map_npy, token_arrays
from forge_grain.stores.target_masks import TargetMasks
from forge_grain.paths import local_path
from forge_grain.stores import checks
from forge_grain.stores.runs import TokenRuns


class TokenStore(TargetMasks):
    """Documents of a token store, each a 1-D numpy array of token ids, with O(1) random access.

    `TokenStore.open(path)` (or `TokenStore(path)`) finds the format from what is on disk
    and returns the subclass that reads it; `format=` names it instead. Opening reads only
    indices and headers; documents are views into memory-mapped files where the format
    allows. Pickling sends only the path and options and the other side maps the files
    again, so Grain workers get it cheaply. It is a Grain `RandomAccessDataSource`:
    `grain.MapDataset.source(store)` works.
    """

    format = "?"  # the subclass's format name
    fetches = False  # True: token arrays are fetched on demand (object storage); see `arrays_for`, `mapped`, `held`
    description = "a token dataset"  # for messages: "this is <description>"
    OPTIONS: frozenset[str] = frozenset()  # the `open` options this format accepts (besides `fingerprint`)

    # path, format -> the subclass that reads it; set by `forge_grain.stores.formats` (which
    # knows every format) when the package is imported, so this module imports none of them
    resolve = None

    def __new__(cls, path=None, **options):
        if cls is TokenStore:
            cls = TokenStore.resolve(path, options.get("format"), options)
        return super().__new__(cls)

    def __init__(self, path: str | Path, **options):
        self.path = local_path(path)
        self._options = options
        self.manifest = None
        self.tokenizer: dict | None = None
        self.dtype: np.dtype
        self._files: list[Path] = []  # the data files, for error messages and `files`
        self._file_docs: list[int] = []  # documents per data file
        self._arrays: list[np.ndarray] = []  # token arrays; empty for stores read a document at a time
        self._forget_masks()  # (target masks: `forge_grain.stores.target_masks`)
        self._pieces = None  # (token start, array, start in array) of each contiguous run; None: one per array
        self._offsets = np.zeros(1, np.int64)
        self._fingerprint = ""
        self._open(**self._common_options(options))
        self._file_doc_starts = np.concatenate([[0], np.cumsum(self._file_docs)]).astype(np.int64)
        self._runs = TokenRuns.of(self._arrays, self._pieces, self._offsets)  # None: read a document at a time
        self._lengths: np.ndarray | None = None
        self._gather_arrays = None  # the arrays as the compiled gather takes them (`pieces`)
        checks.check_special_ids(self.path, self.dtype, self.vocab_size, self.eos_id, self.bos_id)
        self._validate()

    def _common_options(self, options: dict) -> dict:
        """Check the options apply to this format, take those every format treats alike
        (`vocab_size`, `eos_id`, `bos_id`, `tokenizer`, `fingerprint`); the rest are `_open`'s."""
        opts = {k: v for k, v in options.items() if v is not None and k != "format"}
        self._check_format(options.get("format"))
        unknown = set(opts) - self.OPTIONS - {"fingerprint"}
        if unknown:
            raise StoreError(
                f"{self.path}: {', '.join(f'{k}=' for k in sorted(unknown))} {'does' if len(unknown) == 1 else 'do'} "
                f"not apply to {self.description} (it accepts {', '.join(sorted(self.OPTIONS | {'fingerprint'}))})"
            )
        self._declared = {k: opts.pop(k) for k in ("vocab_size", "eos_id", "bos_id", "tokenizer") if k in opts}
        self._full = checks.fingerprint_mode(self.path, opts.pop("fingerprint", "sampled"))
        self.vocab_size = self._use_tokenizer(self._declared.get("tokenizer"), self._declared.get("vocab_size"))
        self.eos_id, self.bos_id = self._declared.get("eos_id"), self._declared.get("bos_id")
        return opts

    @classmethod
    def open(cls, path: str | Path, *, verify: bool = False, format: str | None = None, **options) -> "TokenStore":
        """Open a store; `verify=True` also checks every checksum and token id (reads all data).

        `format` is one of `forge_grain.stores.FORMATS` ("native", "raw", "megatron",
        "arrow", "litdata", "mds"); by default it is found from the files, and a path that
        could be read two ways is refused. The other options describe what the files do
        not record (each format accepts those it needs; a forge-grain store records them
        all, and any given must agree): `dtype` of raw files (or `vocab_size`, or a
        `tokenizer` whose vocabulary decides it), `eos_id`/`bos_id` (to find documents in
        raw files; checked against every other format's documents), `split` and
        `file_pattern` to pick files of a directory, `token_field` (the column of an Arrow
        or MDS dataset; default "input_ids" or "tokens"), and `fingerprint="full"` to hash
        every byte for the state fingerprint instead of sampled blocks.
        """
        store = cls(path, format=format, **options)
        if verify:
            store.verify()
        return store

    # -- what a format fills in ---------------------------------------------------------------

    def _open(self, **options) -> None:
        """Given the format's own options (`vocab_size`, `eos_id`, `bos_id` are set already), set
        dtype, `_files`, `_file_docs`, `_offsets`, `_arrays` (or `_document`), `_pieces` when
        arrays hold several runs, and `_fingerprint`."""
        raise NotImplementedError

    def _document(self, i: int) -> np.ndarray:
        """Document `i` of a store that keeps no token arrays (ArrayRecord)."""
        raise NotImplementedError

    def _verify_files(self) -> None:
        """A format's checks over all data beyond the token ids (checksums)."""

    def _validate(self) -> None:
        """Checks once the store is open (formats whose own index finds the documents)."""

    def _check_indexed_documents(self) -> None:
        """Sampled token ids of every file are valid ids for the vocabulary, and declared
        EOS/BOS ids really end/start the documents the format's index describes (formats
        with token arrays: Megatron, Arrow, LitData, MDS)."""
        for s, file in enumerate(self._files):
            lo, hi = self._file_doc_starts[s], self._file_doc_starts[s + 1]
            checks.check_arrays_ids(file, self._sample(lo, hi), self.vocab_size)
        where = self._files[0] if len(self._files) == 1 else self.path
        checks.check_special_ends(where, self._tokens_at, self._offsets, self.eos_id, self.bos_id)

    def _sample(self, lo: int, hi: int, blocks: int = checks.SAMPLE_BLOCKS, size: int = 2048):
        """Evenly spaced blocks of the tokens of documents [lo, hi)."""
        a, b = int(self._offsets[lo]), int(self._offsets[hi])
        return [self._token_range(int(x), min(int(x) + size, b)) for x in checks.spread(np.arange(a, b, size), blocks)]

    def _tokens_at(self, positions: np.ndarray) -> np.ndarray:
        """Tokens at the given positions of the store's tokens in order."""
        return self._runs.at(positions, self._array, self.dtype)

    def _check_format(self, declared: str | None) -> None:
        if declared is not None and declared != self.format:
            raise StoreError(f"{self.path}: format={declared!r} was given, but this is {self.description}")

    # -- shared steps of opening --------------------------------------------------------------------

    def _use_tokenizer(self, tokenizer, vocab_size):
        """A tokenizer decides the vocabulary size (a declared one must agree) and is recorded."""
        if tokenizer is None:
            return vocab_size
        from forge_grain.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer)
        if vocab_size is not None and vocab_size != tok.vocab_size:
            raise StoreError(f"{self.path}: vocab_size {vocab_size} disagrees with {tokenizer} ({tok.vocab_size} ids)")
        self.tokenizer = tok.identity
        return tok.vocab_size

    def _one_dtype(self, dtypes: set, what: str) -> np.dtype:
        """The one dtype of all the store's files; files that disagree are an error."""
        if len(dtypes) > 1:
            raise StoreError(f"{self.path}: {what} mix dtypes {sorted(map(str, dtypes))}")
        return dtypes.pop()

    def _fingerprint_files(self, extra) -> str:
        """The fingerprint of data files and what the format read from them (`extra`)."""
        return self._fingerprint_of([[f.name, checks.content_fingerprint(f, full=self._full)] for f in self._files],
                                    extra)

    def _fingerprint_of(self, parts: list, extra) -> str:
        """The fingerprint of data files given as [name, content fingerprint] pairs (a store
        whose files are not all at hand keeps their fingerprints), and `extra`."""
        digest = hashlib.sha256(json.dumps([self.format, str(self.dtype), self.eos_id, self.bos_id, self.vocab_size,
                                            parts, extra]).encode())
        digest.update(np.ascontiguousarray(self._offsets).view(np.uint8))
        return digest.hexdigest()[:16]

    # -- the data ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self._offsets) - 1
        i = int(i) + (n if int(i) < 0 else 0)
        if not 0 <= i < n:
            raise IndexError(f"document {i} out of range for a store of {n} documents")
        if self._runs is None:
            return self._document(i)
        return self._runs.document(i, self._array)

    def _array(self, k: int) -> np.ndarray:
        """Token array `k` (a store whose files are fetched on demand maps it here first)."""
        return self._arrays[k]

    def arrays_for(self, needed: np.ndarray) -> list[np.ndarray]:
        """Token arrays `needed` (indices), for one gather."""
        return [self._array(int(k)) for k in needed]

    def prefetch(self, needed: np.ndarray, first: int | None = None, jobs=None) -> None:
        """Token arrays the next steps will read (a hint; stores in object storage fetch them);
        `first`: the step they start afresh at, if they do; `jobs`: their numbers (`Requests.jobs`)."""

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def shard_of(self, doc: int) -> int:
        """The data file holding document `doc`."""
        return 0 if len(self._file_docs) == 1 else int(np.searchsorted(self._file_doc_starts, doc, side="right") - 1)

    def place_of(self, doc: int) -> tuple[Path | None, int]:
        """The data file holding document `doc`, and the document's index within that file."""
        k = self.shard_of(doc)
        return (self._files[k] if self._files else None), doc - int(self._file_doc_starts[k])

    @property
    def file_doc_starts(self) -> np.ndarray:
        """The first document of each data file, and the document count appended."""
        return self._file_doc_starts

    @property
    def offsets(self) -> np.ndarray:
        """Start of each document (and the end of the last) in the store's tokens taken in order."""
        return self._offsets

    @property
    def lengths(self) -> np.ndarray:
        """Every document's length in tokens, one int64 array (no token is read)."""
        if self._lengths is None:
            self._lengths = np.diff(self._offsets)
        return self._lengths

    @property
    def pieces(self):
        """What the compiled gather reads tokens from: (arrays, token starts of the runs with
        the end appended, each run's array, each run's start in its array), or None for a
        store read a document at a time."""
        if self._runs is None:
            return None
        if self._gather_arrays is None:
            self._gather_arrays = token_arrays(self._arrays)
        return self._gather_arrays, self._runs.starts, self._runs.array, self._runs.base

    @property
    def num_tokens(self) -> int:
        return int(self._offsets[-1])

    @property
    def files(self) -> list[Path]:
        return list(self._files)

    @property
    def num_arrays(self) -> int:  # what a store in object storage fetches: files, or blocks of one
        return len(self._arrays)

    @property
    def index_files(self) -> list[Path]:
        """Files outside the store's directory it reads besides `files` (a Megatron prefix's
        `.idx`): what else a rewrite of the store touches."""
        return []

    @property
    def fingerprint(self) -> str:
        """Identity of the data: checksums a format records, or the files' content
        fingerprints and the document boundaries (see `checks.content_fingerprint`)."""
        return self._fingerprint

    @property
    def layout(self) -> str:
        return self.format

    def verify(self) -> None:
        """Check the format's checksums, and that every token id is non-negative, fits int32
        batches and lies below `vocab_size` (reads all data)."""
        self._verify_files()
        for s, file in enumerate(self._files):
            lo, hi = self._file_doc_starts[s], self._file_doc_starts[s + 1]
            if self._runs is not None and lo < hi:
                a, b = int(self._offsets[lo]), int(self._offsets[hi])
                tokens = (self._token_range(x, min(x + (1 << 24), b)) for x in range(a, b, 1 << 24))
            else:
                tokens = (self[i] for i in range(lo, hi))
            checks.check_arrays_ids(file, tokens, self.vocab_size)

    @property
    def run_starts(self) -> np.ndarray:
        """Where each contiguous run of tokens starts in the store's token order, the end
        appended: one run per file for raw token files (a KempnerForge sample never
        crosses one), per shard for a forge-grain store."""
        return np.array([0, self.num_tokens], np.int64) if self._runs is None else self._runs.starts

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the store's tokens taken in order, across documents and files."""
        if self._runs is None:
            raise StoreError(f"{self.path}: a {self.description} store is read a document at a time, not by token")
        return self._token_range(int(start), int(stop))

    def _token_range(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of the store's tokens in order (may span runs)."""
        return self._runs.tokens(a, b, self._array, self.dtype)

    def close(self) -> None:
        """Drop the memory maps (views already handed out stay valid while referenced)."""
        self._arrays, self._gather_arrays = [], None
        self._forget_masks()

    def __enter__(self) -> "TokenStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        return (_reopen, (type(self), self.path, self._options))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, format={self.format}, documents={len(self)}, "
            f"tokens={self.num_tokens}, dtype={self.dtype}, vocab_size={self.vocab_size})"
        )


def _reopen(cls, path, options):
    return cls(path, **options)


def join_offsets(per_file: list[np.ndarray], cache: Path | None = None) -> np.ndarray:
    """Concatenate per-file document offsets into offsets over all files' tokens in order.

    One file's are used as they are (a memory-mapped index stays mapped). With `cache`, a
    file, several files' are memory-mapped from it rather than held in memory (8 bytes a
    document in every process otherwise): it is checked against the files' offsets, a
    shard at a time, on every open, and written again (atomically) when missing or
    different, so it is never trusted unchecked.
    """
    if len(per_file) == 1 and per_file[0].dtype == np.int64:
        return per_file[0]
    if cache is not None:
        try:
            joined = map_npy(cache)
            if _joins(joined, per_file):
                return joined
        except (OSError, ValueError):
            pass
        try:
            _write_joined(cache, per_file)
            return map_npy(cache)
        except OSError:  # a read-only or full disk: in memory, as without a cache
            pass
    out = np.empty(sum(len(off) - 1 for off in per_file) + 1, np.int64)
    for at, part in _joined_parts(per_file):
        out[at : at + len(part)] = part
    return out


def _joined_parts(per_file):
    """(position, offsets) of each file's part of the joined offsets, the end last."""
    at, base = 0, 0
    for off in per_file:
        yield at, np.asarray(off[:-1], np.int64) + base
        at += len(off) - 1
        base += int(off[-1])
    yield at, np.array([base], np.int64)


def _joins(joined: np.ndarray, per_file) -> bool:
    total = sum(len(off) - 1 for off in per_file) + 1
    return len(joined) == total and all(np.array_equal(joined[at : at + len(p)], p) for at, p in _joined_parts(per_file))


def _write_joined(path: Path, per_file) -> None:
    tmp = temporary(path)
    try:
        with open(tmp, "wb") as f:
            total = sum(len(off) - 1 for off in per_file) + 1
            np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (total,)})
            for _, part in _joined_parts(per_file):
                f.write(part.astype("<i8").tobytes())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
