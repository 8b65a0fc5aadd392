"""Raw token files: 1-D `.npy` / `.bin` arrays of token ids without a manifest (`RawStore`).

This is the layout of nanoGPT (`train.bin`, uint16), OLMo (header-less `.npy` memmaps,
uint16/uint32) and KempnerForge's `MemoryMappedDataset` (`.npy` shards). Nothing in a
raw file says what its bytes mean, so nothing is guessed:

- a raw file's dtype is declared (`dtype=`), or decided by a declared `vocab_size` (or a
  tokenizer's) as uint16 up to 65,536 ids and uint32 beyond; a `.npy` with a header
  carries its own dtype, and a declared one must agree;
- a file that is something else (Parquet, ArrayRecord, Megatron, LitData, MDS, Arrow,
  text, archives) is recognised by `identify` and refused with a way to read it;
- negative ids, ids that do not fit int32 batches, and ids at or past `vocab_size` are
  errors, as is 16-bit data that looks like 32-bit ids read with the wrong width.

Documents are found by scanning for an EOS id (a document ends with it) or a BOS id (a
document starts with it); with neither, each file is one stream. The scan runs once; its
offsets are cached beside the data (or under the cache root when that directory is
read-only) together with the file's content fingerprint, and a cache is used only if that
fingerprint still matches and its boundaries really fall on EOS/BOS ids.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from forge_grain.stores import mapping
from forge_grain.errors import MissingFilesError, StoreError
from forge_grain.stores.manifest import token_dtype
from forge_grain.files import save_npy_atomic, write_json_atomic
from forge_grain.paths import BESIDE_DATA, cache_beside_data, cache_root, private_cache, trusted_directory
from forge_grain.splits import select_split
from forge_grain.stores import checks
from forge_grain.stores import identify
from forge_grain.stores.base import TokenStore, join_offsets
from forge_grain.stores.checks import declared_dtype

log = logging.getLogger(__name__)

SUFFIXES = (".npy", ".bin")
CACHE_VERSION = 2
_SCAN_CHUNK = 1 << 26  # tokens per scan step: bounds memory on huge files


def find_token_files(path: str | Path, *, split: str | None = None, file_pattern: str | None = None) -> list[Path]:
    """The `.npy`/`.bin` files named by a file, a directory (optionally filtered by
    `file_pattern`) or a glob, sorted; files of several splits need `split=`."""
    p = Path(path)
    if not p.exists() and not any(c in str(path) for c in "*?["):
        raise MissingFilesError(f"{path}: does not exist (no file or directory at this path)")
    if p.is_file():
        if file_pattern:
            raise StoreError(f"{p}: file_pattern={file_pattern!r} applies to a directory, and this is a file")
        return select_split([p], split, p, StoreError, default=None)  # a split asked of one file must be its own
    if p.is_dir():
        if list(p.glob("shard-*.idx.npy")):
            raise StoreError(f"{p}: a forge-grain store without manifest.json is incomplete (re-run `forge-grain prepare`)")
        candidates = p.glob(file_pattern) if file_pattern else p.iterdir()
        files = sorted(f for f in candidates if _is_token_file(f))
        base = p
    else:
        files = sorted(Path(f) for f in globlib.glob(str(path)) if _is_token_file(Path(f)))
        base = None
    if not files and file_pattern and p.is_dir():
        others = sorted({f.suffix for f in p.iterdir() if _is_token_file(f)})
        if others:
            raise MissingFilesError(f"{p}: no file matches file_pattern={file_pattern!r}, but the directory holds "
                             f"{', '.join(others)} token files: set file_pattern to match them (e.g. '*{others[0]}')")
    if not files:
        hint = identify.describe_directory(p) if p.is_dir() else None
        raise MissingFilesError(hint or f"{path}: no manifest.json and no .npy/.bin token files found"
                         + (f" matching {file_pattern!r}" if file_pattern else ""))
    return select_split(files, split, path, StoreError, base=base, default=None)


def label_mask_files(path: Path, label_masks, token_files: list[Path]) -> list[Path]:
    """OLMo-core's `label_mask_paths`: a boolean array per token file, one byte a token, true
    where the token is a label (trained). Given as a list of files, or a glob (relative to
    the store's directory), taken in sorted order, one per token file in the same order."""
    base = path if path.is_dir() else path.parent
    if isinstance(label_masks, str):
        pattern = label_masks if Path(label_masks).is_absolute() else str(base / label_masks)
        files = sorted(Path(f) for f in globlib.glob(pattern))
    else:
        files = [Path(f) if Path(f).is_absolute() else base / f for f in label_masks]
    among = sorted(set(files) & set(token_files))
    if among:
        raise StoreError(f"{among[0]}: a label mask file is also read as a token file; set file_pattern to pick "
                         "the token files alone (e.g. 'token_ids_*.npy')")
    if len(files) != len(token_files):
        raise StoreError(f"{path}: label_masks names {len(files)} file(s) for {len(token_files)} token file(s) "
                         f"({', '.join(f.name for f in token_files[:3])}{', ...' if len(token_files) > 3 else ''}); "
                         "give one mask file per token file, in the same order")
    for f in files:
        if not f.is_file():
            raise MissingFilesError(f"{f}: label mask file does not exist")
    return files


def map_label_mask(path: Path, token_file: Path, num_tokens: int) -> np.ndarray:
    """A label mask file (header-less bytes, or a .npy of bool or uint8), as long as its token file."""
    if _has_npy_header(path):
        arr = mapping.map_npy(path)
        if arr.ndim != 1 or arr.dtype not in (np.bool_, np.uint8):
            raise StoreError(f"{path}: a label mask is a 1-D bool (or uint8) array, not {arr.ndim}-D {arr.dtype}")
        arr = arr.view(np.uint8)
    else:
        arr = checks.map_array(path, np.dtype(np.uint8))
    if len(arr) != num_tokens:
        raise StoreError(f"{path}: holds {len(arr)} label mask entries, but its token file {token_file.name} holds "
                         f"{num_tokens} tokens; each token has one (true where it is a label)")
    check_mask_values(path, checks.aligned_sample(arr))
    return arr


def check_mask_values(path: Path, values: np.ndarray) -> None:
    bad = np.flatnonzero(np.asarray(values).view(np.uint8) > 1)
    if len(bad):
        raise StoreError(f"{path}: a label mask holds the byte {int(np.asarray(values).view(np.uint8)[bad[0]])} at "
                         f"{int(bad[0])}; each entry must be 0 or 1 (false or true): is this a mask file?")


def _is_token_file(f: Path) -> bool:
    """Token arrays, not our own index caches (hidden) or store indices (.idx.npy)."""
    return f.suffix in SUFFIXES and not f.name.startswith(".") and not f.name.endswith(".idx.npy") and f.is_file()


def raw_dtype(path: Path, dtype, vocab_size: int | None) -> np.dtype:
    """The dtype of a raw file: declared, or decided by the vocabulary size; never guessed."""
    if dtype is not None:
        return checks.integer_dtype(path, declared_dtype(path, dtype), "declared")
    if vocab_size is not None:
        return token_dtype(vocab_size)
    raise StoreError(
        f"{path}: a raw token file does not record its dtype, and reading it with the wrong one gives "
        "plausible-looking garbage. Declare it: dtype='uint16' (nanoGPT; vocabularies up to 65,536), "
        "'uint32' (OLMo with larger vocabularies), 'int32', ... (`--dtype` on the command line, `dtype` in a "
        "source's TOML), or give vocab_size= (or a tokenizer) to take uint16 up to 65,536 ids and uint32 beyond"
    )


def _has_npy_header(path: Path) -> bool:
    """A `.npy` with its header records its dtype; a header-less one (OLMo's memmaps) does not."""
    with open(path, "rb") as f:
        return f.read(len(identify.NPY_MAGIC)) == identify.NPY_MAGIC


def map_tokens(path: Path, dtype=None, vocab_size: int | None = None) -> np.ndarray:
    """Memory-map one foreign file as a 1-D array of integer tokens."""
    found = identify.describe(path)
    if found:
        raise StoreError(found)
    if _has_npy_header(path):
        try:
            arr = mapping.map_npy(path)
        except ValueError as e:
            raise StoreError(f"{path}: not a readable .npy array ({e})") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise StoreError(f"{path}: expected a 1-D integer token array, found {arr.ndim}-D {arr.dtype}")
        if dtype is not None and declared_dtype(path, dtype) != arr.dtype:
            raise StoreError(f"{path}: the .npy header says {arr.dtype}, but dtype={np.dtype(dtype)} was declared")
        return arr
    dt = raw_dtype(path, dtype, vocab_size)  # a raw .bin, or a header-less .npy (OLMo's memmaps)
    size = path.stat().st_size
    if size % dt.itemsize:
        raise StoreError(
            f"{path}: {size} bytes is not a multiple of the {dt} item size ({dt.itemsize}); "
            "the file is truncated or the dtype is wrong"
        )
    return checks.map_array(path, dt)


# -- document index, cached and validated ------------------------------------------------------


def _cache_paths(path: Path, key: str) -> tuple[Path, Path]:
    """(offsets, record) of a file's document index: under the cache root, keyed by the file's
    path (with `cache_beside_data()` and a writable directory, in its `.forge-grain/index`).
    The offsets are named `.offsets`, which no token-file glob (`*.npy`, `*.bin`) matches."""
    stem = f"{path.name}.{key}"
    beside = path.parent / BESIDE_DATA
    if cache_beside_data() and os.access(path.parent, os.W_OK) and trusted_directory(path.parent, owner_of=path) \
            and (not beside.exists() or trusted_directory(beside, owner_of=path)):
        base = beside / "index"
    else:
        base = cache_root() / "index"
        stem = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16] + "-" + stem
    return base / f"{stem}.offsets", base / f"{stem}.json"


def document_offsets(
    path: Path, tokens: np.ndarray, *, eos_id: int | None, bos_id: int | None, fingerprint: str, sample: np.ndarray
) -> tuple[np.ndarray, int, int]:
    """Offsets (num_docs + 1) of the documents in one file, and its smallest and largest ids.

    Cached beside the data: a cache is used only when it was made from content with the
    same fingerprint, its offsets are consistent, the boundaries fall on EOS/BOS ids, and its
    id range covers `sample` (the file's `checks.aligned_sample`); otherwise the file is scanned
    again and the cache rewritten.
    """
    key = hashlib.sha256(json.dumps([CACHE_VERSION, str(tokens.dtype), eos_id, bos_id]).encode()).hexdigest()[:16]
    idx_path, meta_path = _cache_paths(path, key)
    cached = _load_cache(idx_path, meta_path, path, tokens, eos_id, bos_id, fingerprint, sample)
    if cached is not None:
        return cached
    offsets, lo, hi = _scan(tokens, eos_id=eos_id, bos_id=bos_id)
    try:
        private_cache(idx_path.parent)
        save_npy_atomic(idx_path, offsets)
        write_json_atomic(meta_path, {  # written last: marks the cache complete
            "fingerprint": fingerprint, "num_documents": len(offsets) - 1, "min_token": lo, "max_token": hi,
            "offsets_sha256": hashlib.sha256(offsets.tobytes()).hexdigest(),
        })
    except OSError as e:  # a read-only deployment: work without the cache
        log.warning("forge-grain: cannot cache the document index of %s (%s); it is rescanned on each open", path, e)
    return offsets, lo, hi


def _load_cache(idx_path, meta_path, path, tokens, eos_id, bos_id, fingerprint, sample):
    try:
        owners = {os.getuid(), 0, path.stat().st_uid}
        if {idx_path.stat().st_uid, meta_path.stat().st_uid} - owners:
            log.warning("forge-grain: ignoring the cached document index of %s: written by another user", path)
            return None
        meta = json.loads(meta_path.read_text())
        offsets = np.load(idx_path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    problem = _cache_problem(meta, offsets, tokens, eos_id, bos_id, fingerprint, sample)
    if problem:
        log.warning("forge-grain: ignoring the cached document index of %s (%s); rescanning", path, problem)
        return None
    return offsets.astype(np.int64, copy=False), int(meta["min_token"]), int(meta["max_token"])


def _cache_problem(meta, offsets, tokens, eos_id, bos_id, fingerprint, sample) -> str | None:
    """Why a cached index cannot be trusted for this file, or None."""
    n = len(tokens)
    if not isinstance(meta, dict) or meta.get("fingerprint") != fingerprint:
        return "made from other content"
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) != meta.get("num_documents", -2) + 1:
        return "its document count disagrees with its offsets"
    if hashlib.sha256(offsets.astype(np.int64).tobytes()).hexdigest() != meta.get("offsets_sha256"):
        return "its offsets were changed"
    if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) <= 0):
        return "its offsets are not increasing from 0 to the token count"
    if len(sample) and (int(sample.min()) < meta["min_token"] or int(sample.max()) > meta["max_token"]):
        return "its recorded token range excludes ids in the file"
    inner = checks.spread(offsets[1:-1])
    if eos_id is not None and (len(inner) and np.any(np.asarray(tokens[inner - 1]) != eos_id)):
        return "a document boundary does not follow an EOS id"
    if eos_id is None and bos_id is not None and len(inner) and np.any(np.asarray(tokens[inner]) != bos_id):
        return "a document boundary is not at a BOS id"
    if eos_id is None and bos_id is None and len(offsets) != (2 if n else 1):
        return "a single stream was cut into documents"
    if _unmarked_special(tokens, offsets, eos_id, bos_id):
        return "an EOS/BOS id in the file is not a document boundary (boundaries were dropped)"
    return None


def _unmarked_special(tokens: np.ndarray, offsets: np.ndarray, eos_id, bos_id, blocks: int = 64,
                      size: int = 1 << 14) -> bool:
    """Whether some EOS (or, without one, BOS) in sampled blocks of the file is not a boundary:
    a cache must hold every document, not only boundaries that are special ids."""
    special, after = (eos_id, 1) if eos_id is not None else (bos_id, 0)
    if special is None or not len(tokens):
        return False
    for lo in np.unique(np.linspace(0, max(len(tokens) - size, 0), blocks).astype(np.int64)):
        cut = np.flatnonzero(np.asarray(tokens[lo : lo + size]) == special) + lo + after
        cut = cut[(cut > 0) & (cut < len(tokens))]
        at = np.searchsorted(offsets, cut)
        if len(cut) and (np.any(at >= len(offsets)) or np.any(offsets[np.minimum(at, len(offsets) - 1)] != cut)):
            return True
    return False


def _scan(tokens: np.ndarray, *, eos_id: int | None, bos_id: int | None) -> tuple[np.ndarray, int, int]:
    chunks = (np.asarray(tokens[lo : lo + _SCAN_CHUNK]) for lo in range(0, len(tokens), _SCAN_CHUNK))
    return scan_chunks(chunks, eos_id=eos_id, bos_id=bos_id)


def scan_chunks(chunks, *, eos_id: int | None, bos_id: int | None) -> tuple[np.ndarray, int, int]:
    """Document offsets of a file's tokens given as consecutive chunks (a memory map's, or
    ranged reads' of a file in object storage), and its smallest and largest ids."""
    cuts, lo_id, hi_id, at = [], None, -1, 0
    for chunk in chunks:
        if not len(chunk):
            continue
        hi_id = max(hi_id, int(chunk.max()))
        lo_id = int(chunk.min()) if lo_id is None else min(lo_id, int(chunk.min()))
        if eos_id is not None:
            cuts.append(np.flatnonzero(chunk == eos_id) + at + 1)  # a document ends after its EOS
        elif bos_id is not None:
            cuts.append(np.flatnonzero(chunk == bos_id) + at)  # a document starts at its BOS
        at += len(chunk)
    n = at
    inner = np.concatenate(cuts) if cuts else np.zeros(0, np.int64)
    offsets = np.unique(np.concatenate([[0], inner, [n]]).astype(np.int64))  # drops empty documents
    return offsets, (0 if lo_id is None else lo_id), hi_id


SHORT_DOCUMENT = 2  # tokens: documents this short are rare; most of them means the wrong delimiter


def check_delimiters(path: Path, tokens: np.ndarray, offsets: np.ndarray, eos_id, bos_id, whole: bool,
                      limit: int = checks.CHECK_ALL_BOUNDARIES) -> None:
    """A declared EOS (BOS) must really delimit the documents: every document of a file of
    whole documents ends with it (starts with it), the last (first) one included, and the
    documents it cuts must not be mostly 1-2 tokens long (the mark of a common token taken
    for the delimiter). `whole=False` exempts a file's first and last documents, for files
    cut inside a document; `limit`: how many documents' ends are read, evenly spaced."""
    if eos_id is None and bos_id is None or not len(tokens):
        return
    inner = offsets if whole else offsets[1:-1]  # not whole: the first and last documents are exempt
    remedy = "check the id" + (", or pass whole_documents=False if the file begins or ends inside a document"
                               if whole else "")
    checks.check_special_ends(path, lambda at: tokens[at], inner, eos_id, bos_id, remedy=remedy, limit=limit)
    docs = checks.spread(np.arange(len(offsets) - 1))
    lengths = offsets[docs + 1] - offsets[docs]
    short = int(np.count_nonzero(lengths <= SHORT_DOCUMENT))
    if len(docs) >= 16 and short * 2 > len(docs):
        name, value = ("eos_id", eos_id) if eos_id is not None else ("bos_id", bos_id)
        raise StoreError(
            f"{path}: with {name}={value}, {short:,} of {len(docs):,} documents{' sampled' if len(docs) < len(offsets) - 1 else ''} "
            f"are 1-{SHORT_DOCUMENT} tokens long (median {int(np.median(lengths))}): id {value} is not what delimits "
            f"these documents. Check {name} (the id every document {'ends' if name == 'eos_id' else 'starts'} with)"
        )


class RawStore(TokenStore):
    """nanoGPT `.bin`, OLMo/Dolma header-less `.npy` memmaps, KempnerForge `.npy` shards, or
    any 1-D token arrays: the dtype is declared (or decided by the vocabulary, or a `.npy`
    header), documents are found by EOS or BOS ids."""

    format = "raw"
    description = "raw token files"
    OPTIONS = frozenset({"dtype", "eos_id", "bos_id", "vocab_size", "tokenizer", "split", "file_pattern",
                         "whole_documents", "label_masks"})

    def _open(self, dtype=None, split=None, file_pattern=None, whole_documents=True, label_masks=None) -> None:
        vocab_size, eos_id, bos_id = self.vocab_size, self.eos_id, self.bos_id
        self._declared_dtype = dtype is not None
        self._files = find_token_files(self.path, split=split, file_pattern=file_pattern)
        masks = label_mask_files(self.path, label_masks, self._files) if label_masks is not None else []
        self._arrays = [map_tokens(f, dtype, vocab_size) for f in self._files]
        self.dtype = self._one_dtype({a.dtype for a in self._arrays}, "token files")
        offsets = []
        for f, a in zip(self._files, self._arrays):
            if len(a) == 0:  # a write that never happened, or failed: no store of 0 tokens is meant
                raise StoreError(f"{f}: holds no tokens ({f.stat().st_size} bytes); a token file holds at least one "
                                 "(write it again, or leave it out with file_pattern)")
            raw = checks.aligned_sample(a)  # read once: the width check and the cache check use it
            checks.check_width(f, raw, a.dtype, declared=dtype is not None or _has_npy_header(f), vocab_size=vocab_size)
            sample = raw.view(a.dtype)
            content = checks.content_fingerprint(f, full=self._full)
            off, lo, hi = document_offsets(f, a, eos_id=eos_id, bos_id=bos_id, fingerprint=content, sample=sample)
            checks.check_ids(f, lo, hi, vocab_size)
            check_delimiters(f, a, off, eos_id, bos_id, whole_documents)
            offsets.append(off)
        self._file_docs = [len(o) - 1 for o in offsets]
        self._offsets = join_offsets(offsets)
        self._mask_files = masks
        self._mask_arrays = [map_label_mask(m, f, len(a)) for m, f, a in zip(masks, self._files, self._arrays)]
        self._fingerprint = self._fingerprint_files(
            [[m.name, checks.content_fingerprint(m, full=self._full)] for m in masks] or None)

    def _verify_files(self) -> None:
        for file, m in zip(self._mask_files, self._mask_arrays):
            check_mask_values(file, m)
        for f, a in zip(self._files, self._arrays):
            checks.check_width(f, checks.aligned_sample(a), a.dtype, declared=self._declared_dtype or _has_npy_header(f),
                               vocab_size=self.vocab_size)
