"""Megatron datasets and raw token files at a URL, read in ranges through the cache.

A Megatron `.bin` or a raw token file is one object, often larger than the cache may hold.
With a `cache_limit` (a Megatron dataset also without one: nothing needs its `.bin` whole),
such a dataset is read in blocks of whole documents, each a ranged GET of its object copied
into the cache as a file of its own and evicted like a shard, the coming steps' blocks
fetched ahead (`FetchedParts`). Where the documents are comes first: a
Megatron `.idx` is fetched whole (it lists them); a raw file is read through once, in ranged
parts held in memory only while they are scanned for the EOS (or BOS) ids that end (start)
its documents. That first open also makes the local reader's checks, with errors naming the
object: the file's type, its dtype and width, its id range, its delimiters, a Megatron index
against its `.bin`. It takes the file's content fingerprint as the local reader does (from
the same sampled ranges), so a state saved over a local copy resumes here and back; for a
file past `KEEP` those ranges are taken from the blocks as the epoch reads them
(`harvest`), not in 2,000 GETs at the open. What it
found (the record) is kept in the cache, in a directory named by the listing (names, sizes,
ETags) and the options: a later open, in this process or another, reads the listing and
the record, and a dataset rewritten in place is indexed anew.
"""

from __future__ import annotations

import bisect
import fnmatch
import functools
import hashlib
import io
import json
from pathlib import Path, PurePosixPath

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.locks import file_lock
from forge_grain.splits import select_split
from forge_grain.stores import checks, identify
from forge_grain.stores.base import join_offsets
from forge_grain.stores.blocks import fetch_cuts
from forge_grain.stores.harvest import PRINTS, Prints, frugal
from forge_grain.stores.fetched_parts import FetchedParts
from forge_grain.stores.download import SPLIT
from forge_grain.stores.object_cache import ObjectCache, read_spans
from forge_grain.stores.cache_room import read_copy
from forge_grain.stores.remote_dir import objects_at

RANGED = ("megatron", "raw")
SCAN_PART = 8 << 20  # bytes of each ranged read while a raw file is scanned for its documents
KEEP = 64 << 20  # an object up to this size is held in memory through its first open (each byte read once)
SAMPLED_ENDS = 1024  # documents whose delimiters are read at the first open (all of them by `verify`)
HEAD = 4096  # bytes of a raw file's start that say what it is
RECORD = "record.npz"


@functools.cache
def ranged_class(base: type) -> type:
    """The store class reading `base`'s format (Megatron, raw) at a URL in ranges."""
    name = f"Ranged{base.__name__}"
    return type(name, (Ranged,), {"format": base.format, "description": base.description,
                                  "OPTIONS": base.OPTIONS | {"storage_options", "object_cache", "cache_limit",
                                                             "fetch_threads"},
                                  "__module__": __name__, "__qualname__": name})


class Ranged(FetchedParts):
    """A Megatron dataset or raw token files at a URL, read in blocks of documents."""

    def __init__(self, path, storage_options=None, object_cache=None, cache_limit=None, fetch_threads=None,
                 **options):
        self.url = str(path).rstrip("/")
        if options.get("label_masks") is not None:  # (rather than train every token of them)
            raise StoreError(f"{self.url}: label_masks are read from local disk, or from a whole copy of the files "
                             "(no cache_limit), in this version of forge-grain; leave cache_limit out or copy them")
        base, self._objects = self._find_objects(storage_options, options.get("split"), options.get("file_pattern"))
        self.cache = ObjectCache(base, storage_options, object_cache, cache_limit, requests=fetch_threads)
        chosen = {k: v for k, v in options.items() if v is not None and k != "format"}
        key = json.dumps([self.format, sorted(self._objects.items()), sorted(chosen.items())], default=str)
        self.home = Path(f"ranges-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
        home = self.cache.dir / self.home
        home.mkdir(exist_ok=True)
        try:
            super().__init__(home, **options)
        except StoreError as e:  # name the objects, not their local copies
            raise StoreError(str(e).replace(str(home), self.url)) from None
        remote = dict(storage_options=storage_options, object_cache=object_cache, cache_limit=cache_limit,
                      fetch_threads=fetch_threads)
        self._options = {**options, **{k: v for k, v in remote.items() if v is not None}}

    # -- which objects ---------------------------------------------------------------------------

    def _find_objects(self, storage_options, split, file_pattern) -> tuple[str, dict]:
        """(the URL the objects are under, {name: (size, ETag)} of those read): a directory's,
        a Megatron prefix's `.idx` and `.bin`, or one token file's."""
        base, found, stem = objects_at(self.url, storage_options)
        if stem is not None:  # a Megatron prefix's .idx and .bin, or one token file
            found = {n: v for n, v in found.items() if (n != stem) == (self.format == "megatron")}
        found = {n: v for n, v in found.items() if "/" not in n}  # (as on disk: a directory's own files)
        if self.format == "megatron":
            stems = sorted(n[:-4] for n in found if n.endswith(".idx"))
            for s in stems:
                if f"{s}.bin" not in found:
                    raise StoreError(f"{base}/{s}.idx: its data file {s}.bin is not beside it")
            if not stems:
                raise StoreError(f"{self.url}: no Megatron .idx and .bin at this URL")
            return base, {n: found[n] for s in stems for n in (f"{s}.idx", f"{s}.bin")}
        names = [n for n in found if n.endswith((".npy", ".bin")) and not n.endswith(".idx.npy")]
        if file_pattern:
            names = [n for n in names if fnmatch.fnmatch(n, file_pattern)]
        if not names:
            raise StoreError(f"{self.url}: no .npy/.bin token files" + (f" matching {file_pattern!r}" if file_pattern
                                                                         else ""))
        picked = select_split([PurePosixPath(n) for n in sorted(names)], split, self.url, StoreError, default=None)
        return base, {p.name: found[p.name] for p in picked}

    def _data_names(self) -> list[str]:
        return sorted(n for n in self._objects if not n.endswith(".idx"))

    def _where(self, name: str) -> str:
        return f"{self.cache.url}/{name}"

    def _tag(self, name: str) -> str | None:
        """The version of object `name` in the listing the dataset is indexed from (its ETag):
        every read of it must come from that version (`ObjectCache.get`)."""
        return self._objects[name][1] or None

    # -- opening ----------------------------------------------------------------------------------

    def _open(self, dtype=None, whole_documents=True, split=None, file_pattern=None) -> None:
        """(`split` and `file_pattern` chose the objects: `_find_objects`.)"""
        names = self._data_names()
        meta, offsets = self._record(names, dtype, whole_documents)
        self.dtype = np.dtype(meta["dtype"])
        self._files = [self.path / n for n in names]
        self._file_docs = [len(o) - 1 for o in offsets]
        self._offsets = join_offsets(offsets)
        self._parts, starts, at = [], [], 0
        for name, file, off, cuts in zip(names, meta["files"], offsets,
                                         fetch_cuts(offsets, self.dtype.itemsize, self.cache.limit)):
            for a, b in zip(cuts[:-1], cuts[1:]):
                self._parts.append(_Block(self, name, file["start"] + int(a) * self.dtype.itemsize,
                                          int(b - a) * self.dtype.itemsize))
                starts.append(at + int(a))
                self._check_fits(name, int(np.searchsorted(off, a)), self._parts[-1].size)
            at += int(off[-1])
        blocks = len(self._parts)
        self._pieces = (np.array(starts + [at], np.int64), np.arange(blocks), np.zeros(blocks, np.int64))
        self._arrays = [checks.empty_tokens(self.dtype)] * blocks
        self._first_array = np.arange(blocks + 1)
        self._prints = Prints(names, [f["print"] for f in meta["files"]], {n: self._objects[n][0] for n in names},
                              self.path / PRINTS, self.cache.write_record)
        self._extra = meta["extra"]
        self._fingerprint = self._of_prints() if self._prints.known else None
        self._keep: frozenset = frozenset()

    def _seed(self, name: str, start: int, offsets: np.ndarray, tokens: "_Tokens") -> None:
        """Without a `cache_limit`, the blocks of a file the first open read whole (`KEEP`) are
        written to the cache from those bytes, as `_open` cuts them, before the next file is
        read (its bytes are let go then): the first epoch does not fetch them again. (Under a
        limit the blocks come as the epoch reads them: written now, the first ones would be
        evicted for the last.)"""
        item = tokens.dtype.itemsize
        cuts = fetch_cuts([offsets], item, None)[0]  # (unbounded, a file's blocks are its own)
        for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            block = _Block(self, name, start + a * item, (b - a) * item)
            self.cache.derive(block.copy, block.size, functools.partial(tokens.write, block.start, block.size))

    def _array_at(self, k: int) -> tuple[str, int, str | None]:
        """Block `k`'s object, the byte it starts at there, and its ETag (the version indexed)."""
        block = self._parts[k]
        return block.name, block.start, self._tag(block.name)

    def _complete_prints(self) -> None:
        """The places of the fingerprints not seen in the blocks read so far, read now (`harvest`)."""
        self._prints.complete(lambda name, spans: read_spans(self.cache, name, spans, ahead=64, tag=self._tag(name)),
                              self._keep)

    def _of_prints(self) -> str:
        return self._fingerprint_of([list(p) for p in zip(self._prints.names, self._prints.values())], self._extra)

    def _arrived(self, p: int, arrays: list) -> None:
        """A block arrived: the places of the fingerprint it holds are taken from it."""
        if self._fingerprint is None:
            block = self._parts[p]
            if self._prints.take(block.name, block.start, arrays[0], self._keep):
                self._fingerprint = self._of_prints()

    def _check_fits(self, name: str, doc: int, size: int) -> None:
        """A block is a document at least: one larger than the cache can hold is refused at open."""
        limit = self.cache.limit
        if limit is not None and size > limit:
            hint = "" if self.format == "megatron" else " (check eos_id/bos_id: without them a file is one document)"
            raise StoreError(f"{self._where(name)}: document {doc} of this file is {size} bytes, more than "
                             f"cache_limit {limit} holds; raise cache_limit{hint}")

    def _record(self, names, dtype, whole) -> tuple[dict, list[np.ndarray]]:
        """What the first open found (each file's data start, content fingerprint and document
        offsets, the dtype): from the cache, or made now and kept there, by one process of
        the host while the others wait (a raw file is read through once, not once a rank)."""
        path = self.path / RECORD
        if not path.exists():
            with file_lock(self.path / ".record.lock"):
                if not path.exists():
                    self._make_record(path, names, dtype, whole)
        with np.load(path) as r:
            return json.loads(str(r["meta"])), [r[f"offsets_{i}"] for i in range(len(names))]

    def _make_record(self, path: Path, names, dtype, whole) -> None:
        files, offsets, dtypes, extra = [], [], set(), []
        for name in names:
            file_dtype, start, off, more, tokens = (self._index_megatron(name, dtype) if self.format == "megatron"
                                                    else self._index_raw(name, dtype, whole))
            if self.cache.limit is None and tokens.held():
                self._seed(name, start, off, tokens)
            files.append({"start": start, "print": None if self._gathers(tokens) else tokens.fingerprint(self._full)})
            offsets.append(off)
            dtypes.add(file_dtype)
            extra += more
        meta = {"dtype": str(self._one_dtype(dtypes, "its data files")), "files": files,
                "extra": extra if self.format == "megatron" else None}
        data = io.BytesIO()
        np.savez(data, meta=np.array(json.dumps(meta)), **{f"offsets_{i}": o for i, o in enumerate(offsets)})
        self.cache.write_record(path, data.getvalue())

    def _gathers(self, tokens) -> bool:
        """Whether a file's sampled fingerprint is gathered from the blocks an epoch reads
        (`harvest`) instead of ranged GETs now: for a file larger than
        `checks.WHOLE_BELOW` (a smaller one is hashed whole) and not held in memory (`KEEP`): a
        first batch does not wait for some 2,000 ranged GETs."""
        return not self._full and tokens.size > KEEP  # (KEEP > WHOLE_BELOW)

    def _index_megatron(self, name: str, dtype):
        """A Megatron `.bin`'s dtype and documents, from its `.idx` (fetched whole), checked as
        the local reader checks them."""
        from forge_grain.stores.megatron import read_index

        stem = name[: -len(".bin")]
        idx = f"{stem}.idx"
        local = self.cache.get(idx, f"{self.home}/{idx}", size=self._objects[idx][0], tag=self._tag(idx))
        try:
            file_dtype, offsets = read_index(local)
            checks.check_declared_dtype(local, dtype, file_dtype, "the Megatron index")
        except StoreError as e:
            raise StoreError(str(e).replace(str(local), self._where(idx))) from None
        size, expected = self._objects[name][0], int(offsets[-1]) * file_dtype.itemsize
        if size != expected:
            raise StoreError(f"{self._where(name)}: {size} bytes, but its index describes {int(offsets[-1])} "
                             f"{file_dtype} tokens ({expected} bytes); the file is truncated or belongs to another "
                             "index")
        tokens = _Tokens(self, name, 0, file_dtype, int(offsets[-1]))
        tokens.load()  # (a file up to KEEP whole, once, in a few large GETs: the checks read it from memory)
        checks.check_arrays_ids(self._where(name), [tokens.sample()], self.vocab_size)
        checks.check_special_ends(self._where(name), tokens.at, offsets, self.eos_id, self.bos_id, limit=SAMPLED_ENDS)
        return file_dtype, 0, offsets, [checks.content_fingerprint(local, self._full)], tokens

    def _index_raw(self, name: str, dtype, whole: bool):
        """A raw file's dtype, data start and documents, found by reading it through once, with
        the local reader's checks (`RawStore`)."""
        from forge_grain.stores import raw

        where, size = self._where(name), self._objects[name][0]
        spans = [(0, min(HEAD, size))] if size else []
        head = b"".join(bytes(b) for b in read_spans(self.cache, name, spans, tag=self._tag(name)))
        self._refuse_other_formats(name, head)
        file_dtype, start, declared = raw_header(where, head, size, dtype, self.vocab_size)
        n = (size - start) // file_dtype.itemsize
        if n == 0:
            raise StoreError(f"{where}: holds no tokens ({size} bytes); a token file holds at least one (write it "
                             "again, or leave it out with file_pattern)")
        tokens = _Tokens(self, name, start, file_dtype, n)
        tokens.load()
        checks.check_width(where, tokens.sample(np.uint8), file_dtype, declared=declared, vocab_size=self.vocab_size)
        offsets, lo, hi = raw.scan_chunks(tokens.chunks(), eos_id=self.eos_id, bos_id=self.bos_id)
        checks.check_ids(where, lo, hi, self.vocab_size)
        # (the documents' inner ends are where this scan found the delimiter: only the first and the
        # last document, which it does not vouch for, are read again; 1,024 ends took as many GETs)
        raw.check_delimiters(where, tokens, offsets, self.eos_id, self.bos_id, whole, limit=2)
        return file_dtype, start, offsets, [], tokens

    def _refuse_other_formats(self, name: str, head: bytes) -> None:
        """A file that is something else (Parquet, text, ...), named by its URL: `identify` reads
        its head, kept in the cache under the file's name."""
        local = self.path / "heads" / name
        local.parent.mkdir(exist_ok=True)
        self.cache.write_record(local, head)
        found = identify.describe(local)
        if found:
            raise StoreError(found.replace(str(local), self._where(name)))

    def _validate(self) -> None:
        """The checks were made when the record was (`_index_megatron`, `_index_raw`)."""

    def _verify_files(self) -> None:
        """No checksums in these formats; `verify` reads every token id."""


def raw_header(where: str, head: bytes, size: int, dtype, vocab_size) -> tuple[np.dtype, int, bool]:
    """Of the raw token file `where` (its first bytes `head`, `size` in all): (dtype, the byte
    its tokens start at, whether the dtype was declared or recorded), a `.npy` header's, or the
    declared (or vocabulary's) one, as `raw.map_tokens` decides."""
    from forge_grain.stores.raw import raw_dtype

    if not head.startswith(identify.NPY_MAGIC):
        file_dtype = raw_dtype(where, dtype, vocab_size)
        if size % file_dtype.itemsize:
            raise StoreError(f"{where}: {size} bytes is not a multiple of the {file_dtype} item size "
                             f"({file_dtype.itemsize}); the file is truncated or the dtype is wrong")
        return file_dtype, 0, dtype is not None
    f = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, file_dtype = read(f)
    except ValueError as e:
        raise StoreError(f"{where}: not a readable .npy array ({e})") from None
    if len(shape) != 1 or file_dtype.kind not in "iu":
        raise StoreError(f"{where}: expected a 1-D integer token array, found {len(shape)}-D {file_dtype}")
    if dtype is not None and checks.declared_dtype(where, dtype) != file_dtype:
        raise StoreError(f"{where}: the .npy header says {file_dtype}, but dtype={np.dtype(dtype)} was declared")
    start = f.tell()
    if size != start + shape[0] * file_dtype.itemsize:
        raise StoreError(f"{where}: {size} bytes, but its .npy header describes {shape[0]} {file_dtype} tokens "
                         f"after {start} header bytes; the file is truncated or damaged")
    return file_dtype, start, True


class _Block:
    """Whole documents of one object: `size` bytes from byte `start`, copied into the cache."""

    def __init__(self, owner: Ranged, name: str, start: int, size: int):
        self.owner, self.name, self.start, self.size = owner, name, start, size
        self.copy = self.fetched = f"{owner.home}/{name}.{start}-{start + size}.bin"

    def fetch(self, keep=frozenset(), ahead: bool = False, job: int | None = None) -> Path | None:
        return self.owner.cache.get(self.name, self.copy, size=self.size, upcoming=keep, ahead=ahead, job=job,
                                    start=self.start, tag=self.owner._tag(self.name))

    def arrays(self, keep=frozenset()) -> list[np.ndarray]:
        """The block's tokens, fetched first if the cache lacks them (again if they were evicted
        between their fetch and their mapping)."""
        return [read_copy(lambda: self.fetch(keep), lambda path: checks.map_array(path, self.owner.dtype),
                          f"{self.owner._where(self.name)} (bytes {self.start}-{self.start + self.size})",
                          self.owner.cache.limit, "the blocks one step reads")]


class _Tokens:
    """The tokens of one object (`n` of `dtype` from byte `start`) as the first open reads
    them: in order, in ranged parts (`chunks`), or at scattered places (`at`, `sample`), places
    near each other in one GET. An object up to `KEEP` bytes keeps what it read in memory until
    the open ends, so the scan, the checks and the fingerprint read each byte once; a larger
    one merges places only where the bytes between them add at most a fiftieth."""

    def __init__(self, owner: Ranged, name: str, start: int, dtype: np.dtype, n: int):
        self.cache, self.name, self.start, self.dtype, self.n = owner.cache, name, start, np.dtype(dtype), n
        self.where, self.tag = owner._where(name), owner._tag(name)
        self.size = start + n * self.dtype.itemsize  # the object's bytes, its data start included
        self._kept: dict[int, memoryview] = {}  # start -> bytes read (an object up to KEEP bytes)
        self._prints: dict[bool, str] = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, positions) -> np.ndarray:
        return self.at(positions)

    def _fetch(self, spans: list, ahead: int = SPLIT):
        """The bytes of `spans` (ranged GETs), in order; kept when the object is small."""
        for (a, _), data in zip(spans, read_spans(self.cache, self.name, spans, ahead=ahead, tag=self.tag)):
            if self.size <= KEEP:
                self._kept[a] = data
            yield data

    def held(self) -> bool:
        """Whether the object's bytes are all held in memory (read whole: `load`)."""
        return self.size <= KEEP and self._covered(0, self.size)

    def write(self, start: int, size: int, path: Path) -> None:
        """Bytes [start, start + size) of the object, held in memory, written to `path`."""
        with open(path, "wb") as f:
            self._covered(start, start + size, f.write)

    def _covered(self, start: int, end: int, out=None) -> bool:
        """Whether the bytes held cover [start, end), giving them in order to `out` if so."""
        at = start
        for a, data in sorted(self._kept.items()):
            if a > at:
                break
            hi = min(a + len(data), end)
            if hi > at:
                if out is not None:
                    out(data[at - a : hi - a])
                at = hi
        return at >= end

    def load(self) -> None:
        """Read an object of up to `KEEP` bytes whole now (it is kept); nothing for a larger one."""
        if self.size <= KEEP:
            self.read([(a, min(a + SCAN_PART, self.size)) for a in range(0, self.size, SCAN_PART)])

    def chunks(self):
        """The tokens in order, `SCAN_PART` bytes at a time (a progress bar on a terminal)."""
        from tqdm.auto import tqdm

        item = self.dtype.itemsize
        step = max(item, SCAN_PART // item * item)
        spans = [(a, min(a + step, self.size)) for a in range(self.start, self.size, step)]
        if self.size <= KEEP:
            got = self.read(spans)
            parts = (got(a, b - a) for a, b in spans)
        else:
            parts = self._fetch(spans)
        with tqdm(total=self.size - self.start, unit="B", unit_scale=True, desc=f"index {self.where}", disable=None,
                  leave=False) as bar:
            for data in parts:
                bar.update(data.nbytes)
                yield np.frombuffer(data, self.dtype)

    def at(self, positions) -> np.ndarray:
        """The tokens at `positions`."""
        positions = np.asarray(positions, np.int64)
        item = self.dtype.itemsize
        got = self.read([(self.start + int(p) * item, self.start + (int(p) + 1) * item) for p in positions])
        return np.array([np.frombuffer(got(self.start + int(p) * item, item), self.dtype)[0] for p in positions],
                        self.dtype)

    def sample(self, as_dtype=None) -> np.ndarray:
        """The tokens of `checks.aligned_sample`'s spans (as bytes with `as_dtype=np.uint8`)."""
        spans = [(self.start + a, self.start + b) for a, b in checks.aligned_spans(self.n * self.dtype.itemsize)]
        got = self.read(spans)
        raw = np.frombuffer(b"".join(bytes(got(a, b - a)) for a, b in spans), np.uint8)
        return raw if as_dtype is not None else raw.view(self.dtype)

    def fingerprint(self, full: bool) -> str:
        """`checks.content_fingerprint` of the whole object, from ranged reads of the same bytes."""
        if full not in self._prints:
            self._prints[full] = self._fingerprint(full)
        return self._prints[full]

    def _fingerprint(self, full: bool) -> str:
        size = self.size

        def whole():
            spans = [(a, min(a + SCAN_PART, size)) for a in range(0, size, SCAN_PART)]
            if size > KEEP:  # (streamed: a large object is not held)
                return self._fetch(spans)
            got = self.read(spans)
            return (got(a, b - a) for a, b in spans)

        return checks.fingerprint_of(size, full, whole, self.read)

    def read(self, spans):
        """A function giving `length` bytes at any offset inside `spans`, after reading those not
        kept already (those close together in one ranged GET of `SCAN_PART` bytes at most,
        `harvest.frugal`; many GETs at once)."""
        pieces = sorted(self._kept.items())
        spans = frugal([(a, b) for a, b in spans if _covering(pieces, a, b - a) is None], self.size, SCAN_PART)
        pieces = sorted(pieces + list(zip([a for a, _ in spans], self._fetch(spans, ahead=64))))

        def got(offset: int, length: int) -> memoryview:
            return _covering(pieces, offset, length)
        return got


def _covering(pieces: list, offset: int, length: int) -> memoryview | None:
    """The `length` bytes at `offset` from the first of `pieces` ((start, bytes), sorted) holding
    them all, or None."""
    i = bisect.bisect_right(pieces, offset, key=lambda p: p[0]) - 1
    while i >= 0:
        start, data = pieces[i]
        if offset + length <= start + len(data):
            return data[offset - start : offset - start + length]
        i -= 1
    return None
