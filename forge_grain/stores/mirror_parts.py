"""LitData, MosaicML MDS and Hugging Face Arrow (`save_to_disk`) datasets in object storage,
read a data file at a time through a bounded cache (`cache_limit`), as forge-grain's own
stores are.

These formats keep where each document starts inside their data files (the item table at
the head of a LitData chunk, the sample table of an MDS shard, the list offsets of an Arrow
record batch), so knowing a dataset's documents means reading every data file once. Without a
limit an MDS or Arrow dataset is copied whole (`mirror.py`); a LitData dataset is read here
with or without one. Each data file is a part: at the first open it is downloaded
through the cache (which evicts least recently used parts to stay under the limit), opened
by the format's own local reader as a dataset of that one file (its index — `index.json`, or
Arrow's `state.json` — listing only it, with every check of a local open), and what the reader found (document offsets, the
runs of its token arrays, the file's content fingerprint) is kept beside it in the cache
(`part.npz`, small); the file itself may then be evicted. Later opens read those records
only. Reads fetch the file of the document they need, and the pipeline's hints fetch the
files of the coming steps ahead, as for a forge-grain store.

An uncompressed LitData chunk says where its documents are in its head, so its record is
made from one ranged GET of that head (`_Part.headed`): a first epoch fetches the dataset
once, not twice, and without a limit nothing waits for the whole dataset at the open: the
first step of a fresh start reads its documents in ranges of the chunks while they download
(`FetchedParts.read_ranges`). The local reader still opens each chunk as the epoch first reads it, with
all its checks, and the chunk's content fingerprint is taken from that copy (`harvest.Prints`;
asked for earlier, the chunks not read yet are fetched for it).

The parts' directory is named by the listing (names, sizes, ETags): a dataset rewritten in
place is read anew, never from stale records. The fingerprint is the local reader's over
the same files, so a state saved over the local copy resumes over the bucket and back.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import io
import json
from pathlib import Path

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.stores import checks
from forge_grain.stores.base import TokenStore, join_offsets
from forge_grain.stores.cache_room import read_copy
from forge_grain.stores.harvest import PRINTS, Prints
from forge_grain.stores.object_cache import ObjectCache, read_spans
from forge_grain.stores.fetched_parts import FetchedParts
from forge_grain.stores.remote_dir import changed_under, listing

# format -> (its index file, the list in it naming the data files)
PARTED = {"litdata": ("index.json", "chunks"), "mds": ("index.json", "shards"), "arrow": ("state.json", "_data_files")}
INDEXING_THREADS = 8  # data files indexed at once at the first open
# heads of uncompressed LitData chunks read at once at the first open (`_Part.headed`: a ranged GET of
# a few bytes each, nothing held in the cache): one at a time, the 17 heads of a 16-chunk dataset took
# 0.62 s behind a 30 ms link, the bounded open's largest part
HEADS = 32


@functools.cache
def parted_class(base: type) -> type:
    """The store class reading `base`'s format (LitData or MDS) at a URL a file at a time."""
    name = f"Parted{base.__name__}"
    return type(name, (Parted,), {"format": base.format, "description": base.description, "local": base,
                                  "OPTIONS": base.OPTIONS | {"storage_options", "object_cache", "cache_limit",
                                                             "fetch_threads"},
                                  "__module__": __name__, "__qualname__": name})


class Parted(FetchedParts):
    """A peer's dataset at a URL whose data files are fetched as the reads need them."""

    local: type  # the format's local reader

    def __init__(self, path, storage_options=None, object_cache=None, cache_limit=None, fetch_threads=None,
                 **options):
        self.url = str(path).rstrip("/")
        if self.format == "arrow" and options.get("split") is not None:  # a DatasetDict's split: its directory
            self.url, options = f"{self.url}/{options['split']}", {k: v for k, v in options.items() if k != "split"}
        self.cache = ObjectCache(self.url, storage_options, object_cache, cache_limit, requests=fetch_threads)
        self._remote = dict(storage_options=storage_options, object_cache=object_cache, cache_limit=cache_limit,
                            fetch_threads=fetch_threads)
        self._local_options = {k: v for k, v in options.items() if k != "format" and v is not None}
        self._full = options.get("fingerprint") == "full"  # (checked again, as every store's, when it opens)
        home = self._index_parts()
        super().__init__(home, **options)
        self._options = {**options, **{k: v for k, v in self._remote.items() if v is not None}}

    # -- opening: the parts' records ------------------------------------------------------------

    def _index_parts(self) -> Path:
        """Each data file's record, made at the first open (the files fetched, opened, and
        evicted as the limit needs): the directory of the records."""
        files = listing(self.cache)
        name, key = PARTED[self.local.format]
        if name not in files:
            hint = (" (a DatasetDict: with cache_limit, pass split=, or give the URL of its split, URL/train)"
                    if "dataset_dict.json" in files else "")
            raise StoreError(f"{self.url}: no {name}; not {self.local.description}{hint}")
        digest = hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()[:16]
        self.home = Path(f"parts-{digest}")
        home = self.cache.dir / self.home
        home.mkdir(exist_ok=True)
        if not (home / name).exists():
            self.cache.write_record(home / name, self.cache.fresh(name))  # (small files count toward the limit too)
        try:
            index = json.loads((home / name).read_text())
            entries = index[key]
        except (ValueError, KeyError, TypeError):
            raise StoreError(f"{self.url}/{name}: not a readable {self.local.description} index") from None
        self._parts = [_Part(self, k, index, entry, files) for k, entry in enumerate(entries)]
        self._check_fits()
        if self.local.format == "litdata":  # (what a chunk's head is read as, `_Part.headed`)
            self._token_dtype = _litdata_dtype(self.url, home / name, self._local_options.get("dtype"))
        todo = [p for p in self._parts if not p.indexed()]
        self._each([p for p in todo if p.headed], _Part.index, "index", HEADS)
        self._each([p for p in todo if not p.headed], _Part.index, "index")
        return home

    def _each(self, parts: list, do, what: str, threads: int | None = None) -> None:
        """`do(part)` for each of `parts`, a few at once (`threads`, or as many as fit the limit
        twice over: each holds its file in the cache meanwhile)."""
        if not parts:
            return
        from tqdm.auto import tqdm

        limit, largest = self.cache.limit, max(p.size for p in self._parts)
        if threads is None:
            threads = INDEXING_THREADS if limit is None else max(1, min(INDEXING_THREADS, limit // largest // 2))
        with concurrent.futures.ThreadPoolExecutor(threads) as pool, \
                tqdm(total=len(parts), desc=f"{what} {self.url}", unit="file", disable=None, leave=False) as bar:
            for _ in pool.map(do, parts):
                bar.update()

    def _check_fits(self) -> None:
        """One data file at a time must fit the limit beside the ledger: a compressed one with its
        decompressed copy (both are held while it is decompressed)."""
        limit = self.cache.limit
        if limit is None or not self._parts:
            return
        part = max(self._parts, key=lambda p: p.peak)
        need = part.peak + limit - self.cache.room()  # (what the ledger and the records written so far hold)
        if need <= limit:
            return
        if part.compression:
            raise StoreError(f"{self.url}: its data file {part.name} needs {part.peak} bytes of the cache at once "
                             f"({part.packed_size} compressed and {part.size} decompressed, both held while it is "
                             f"decompressed): cache_limit {limit} cannot hold them beside the cache's ledger and records; "
                             f"raise cache_limit above {need}")
        raise StoreError(f"{self.url}: its data file of {part.size} bytes cannot fit cache_limit {limit} beside the "
                         f"cache's ledger and records; raise it above {need}")

    def _open(self, **options) -> None:
        records = [p.record() for p in self._parts]
        dtypes = {str(r["dtype"]) for r in records}
        self.dtype = np.dtype(self._one_dtype(dtypes, "its data files"))
        self._files = [p.local for p in self._parts]
        self._file_docs = [len(r["offsets"]) - 1 for r in records]
        self._offsets = join_offsets([r["offsets"] for r in records])
        starts, array, base, self._first_array = [], [], [], [0]
        for r, at in zip(records, self._offsets[np.cumsum([0] + self._file_docs[:-1])]):
            starts.append(r["starts"][:-1] + at)
            array.append(r["array"] + self._first_array[-1])
            base.append(r["base"])
            self._first_array.append(self._first_array[-1] + int(r["arrays"]))
        starts.append(self._offsets[-1:])
        self._pieces = tuple(np.concatenate(x).astype(np.int64) for x in (starts, array, base))
        self._arrays = [checks.empty_tokens(self.dtype)] * self._first_array[-1]
        self._print_names = [_name(p, r) for p, r in zip(self._parts, records)]
        self._prints = Prints([p.name for p in self._parts], [p.fingerprint(r, self._full) or None for p, r in
                                                              zip(self._parts, records)],
                              {p.name: p.size for p in self._parts}, self.path / PRINTS, self.cache.write_record)
        self._extra = self._fingerprint_extra()
        self._fingerprint = self._of_prints() if self._prints.known else None
        self._keep: frozenset = frozenset()

    def _fingerprint_extra(self):
        """What the local reader's fingerprint hashes besides its files' (`TokenStore._fingerprint_files`),
        so that a state saved over the local copy resumes here."""
        if self.format == "arrow":  # (ArrowStore: the token field and the dataset's own fingerprint)
            from forge_grain.stores.arrow import DEFAULT_FIELD

            state = json.loads((self.path / "state.json").read_text())
            return [self._local_options.get("token_field") or DEFAULT_FIELD, state.get("_fingerprint")]
        index_print = checks.content_fingerprint(self.path / "index.json", self._full)
        if self.format == "mds":
            from forge_grain.stores.mds import _default_field

            field = self._local_options.get("token_field") or _default_field(
                self.path / "index.json", json.loads((self.path / "index.json").read_text())["shards"][0])
            return [field, index_print]
        return index_print

    def _of_prints(self) -> str:
        return self._fingerprint_of([list(p) for p in zip(self._print_names, self._prints.values())], self._extra)

    def _complete_prints(self) -> None:
        """The files whose print waits (those indexed from their heads, `_Part.headed`, not read
        since) are read now, a few at once, each evicted as the limit needs."""
        self._each([p for p in self._parts if self._prints.waits(p.name)], lambda p: p.arrays(self._keep),
                   "fingerprint")

    def _ranged(self) -> bool:
        """Only uncompressed LitData chunks (`_Part.headed`) say where their tokens are in the
        object itself; an MDS shard's or Arrow file's are read out of it."""
        return bool(self._parts) and all(p.headed for p in self._parts)

    def _array_at(self, k: int) -> tuple[str, int, str | None]:
        """Token array `k` (a LitData chunk's one array): its chunk's object, the byte after its
        head, and its ETag."""
        part = self._parts[int(self._parts_of([k])[0])]
        return part.name, part.head, part.tag

    def _validate(self) -> None:
        """Each file was checked by the local reader when its record was made."""

    def _verify_files(self) -> None:
        """Each file's own checksums (MDS records them), each file fetched for it."""
        for part in self._parts:
            part.open()._verify_files()

class _Part:
    """One data file of a parted dataset: its copy in the cache, its one-file dataset
    directory (its index listing only it), and its record."""

    def __init__(self, owner: Parted, k: int, index: dict, entry: dict, files: dict):
        self.owner, self.k = owner, k
        self.index_name, key = PARTED[owner.local.format]
        self.compression, self.name, raw_name, plain_size, plain_entry = _file_of(owner.local.format, index, entry,
                                                                                   files)
        if not self.name or self.name not in files:
            raise StoreError(f"{owner.url}/{self.index_name}: data file {k} ({self.name or entry}) is not at the URL (a "
                             "missing file): with cache_limit a dataset is read a data file at a time; check the "
                             "upload, or open it without cache_limit")
        self.size, self.tag = files[self.name][0], files[self.name][1] or None
        self.dir = owner.cache.dir / owner.home / f"part-{k:05d}"
        self.copy = self.fetched = f"{owner.home}/part-{k:05d}/{self.name}"
        self.local = self.dir / self.name
        self._index = {**index, key: [entry]}
        # a compressed file (a LitData chunk, an MDS zip_data shard): decompressed beside its copy, in
        # the bounded cache, and read there as an uncompressed file (its one-file index says so);
        # the compressed copy goes
        if self.compression:
            plain, self.packed_size, self.raw_name = f"plain-{raw_name}", self.size, raw_name
            self.promised = plain_size or None  # (what it decompresses to: checked when it does)
            self.size = plain_size or self.size  # (else a guess, to reserve)
            self.copy, self.local = f"{owner.home}/part-{k:05d}/{plain}", self.dir / plain
            self._index = {**index, key: [plain_entry(plain)]}
            if owner.local.format == "litdata":
                self._index["config"] = {**index["config"], "compression": None}

    @property
    def peak(self) -> int:
        """The bytes of the cache this file needs at once: a compressed one and its decompressed copy."""
        return self.size + (self.packed_size if self.compression else 0)

    def indexed(self) -> bool:
        return (self.dir / "part.npz").exists()

    @property
    def headed(self) -> bool:
        """Whether this file's documents are found from its head alone (a ranged GET), its
        content fingerprint and the local reader's checks of its tokens waiting until an epoch
        reads it (`arrays`): an uncompressed LitData chunk (its item table is at its head),
        fingerprinted sampled. Its first epoch then fetches it once, not twice."""
        return self.owner.local.format == "litdata" and not self.compression and not self.owner._full

    @property
    def head(self) -> int:
        """The bytes of a LitData chunk's head (its item count and table): its tokens follow."""
        from forge_grain.stores.litdata import header_bytes

        return header_bytes(f"{self.owner.url}/{self.name}", self._index["chunks"][0], self.size)

    def record(self) -> dict:
        with np.load(self.dir / "part.npz") as r:
            return {k: r[k] for k in r.files}

    def fingerprint(self, record: dict, full: bool) -> str:
        """The file's content fingerprint, as the local reader takes it (a full one made now, from
        the file, if the record was made without)."""
        if not full:
            return str(record["sampled"])
        if not str(record["full"]):
            self.open()
            return checks.content_fingerprint(self.local, True)
        return str(record["full"])

    def fetch(self, keep=frozenset(), ahead: bool = False, job: int | None = None) -> Path | None:
        c = self.owner.cache
        if not self.compression:
            return c.get(self.name, self.copy, size=self.size, upcoming=keep, ahead=ahead, job=job, tag=self.tag)
        if (c.dir / self.copy).exists():
            return c.dir / self.copy
        # (a compressed copy evicted by another download before its decompression began: fetched again)
        return read_copy(lambda: c.get(self.name, self.fetched, size=self.packed_size, upcoming=keep, ahead=ahead,
                                       job=job, tag=self.tag),
                         lambda packed: self._decompressed(packed, keep, ahead), f"{self.owner.url}/{self.name}",
                         c.limit, "it and its decompressed copy")

    def _decompressed(self, packed: Path, keep, ahead: bool = False) -> Path | None:
        """The decompressed copy of the compressed copy at `packed`, made in the cache (which
        never evicts `packed` to make room for it), and `packed` then dropped; for a prefetch
        (`ahead`) with no room for it, None (`packed` stays, for the read)."""
        from forge_grain.stores.decompress import copy_name, decompress_into

        c = self.owner.cache
        try:
            if not (self.dir / "copy-name").exists():  # the local reader's name for the copy (its fingerprint's)
                c.write_record(self.dir / "copy-name", copy_name(packed, self.raw_name).encode())
            plain = c.derive(self.copy, self.size, lambda tmp: decompress_into(packed, self.compression, tmp,
                                                                                 self.promised), keep,
                             source=self.fetched, ahead=ahead)
        except StoreError as e:  # named as the object, not its copy in the cache
            raise StoreError(str(e).replace(str(self.dir), self.owner.url)) from None
        if plain is not None:
            c.discard(self.fetched)
        return plain

    def arrays(self, keep=frozenset()) -> list[np.ndarray]:
        """The file's token arrays (maps that outlive the store object that made them), opened
        by the local reader with all its checks; a headed file's content fingerprint is taken
        from the same copy, and its documents must be those its head showed."""
        owner = self.owner

        def read(store):
            if owner._prints.waits(self.name):
                self._check_record(store)
                if owner._prints.give(self.name, checks.content_fingerprint(self.local), keep):
                    owner._fingerprint = owner._fingerprint or owner._of_prints()
            return store._arrays

        return self.open(keep, read)

    def _check_record(self, store: TokenStore) -> None:
        """The documents the local reader found in this file are those its record (its head) gave."""
        owner = self.owner
        a, b = owner.file_doc_starts[self.k : self.k + 2]
        found = owner._offsets[a : b + 1] - owner._offsets[a]
        if not np.array_equal(found, store._offsets):
            raise changed_under(f"{owner.url}/{self.name}")

    def open(self, keep=frozenset(), then=lambda store: store):
        """`then` of the local reader over this file, fetched first if the cache lacks it (again
        if it was evicted between its fetch and its opening)."""
        def opened(path):  # (path: the copy, `self.local`)
            self._write_index(keep)
            try:
                return then(self.owner.local(self.dir, **self.owner._local_options))
            except StoreError as e:
                if path.exists():  # named as the object, not its copy in the cache
                    raise StoreError(str(e).replace(str(self.dir), self.owner.url)) from None
                raise

        return read_copy(lambda: self.fetch(keep), opened, f"{self.owner.url}/{self.name}", self.owner.cache.limit,
                         f"the files the reads in flight need (this one is {self.size} bytes)")

    def index(self) -> None:
        """The record of this file: what its local reader found (or its head, `headed`), kept
        beside it."""
        if self.headed:  # (its one-file index too: written during an epoch, a record could evict what comes next)
            self._write_record(self._head_record())
            return self._write_index()
        store = self.open()
        runs = store._runs  # (where its tokens are: what the composite's runs are made of)
        record = dict(offsets=store._offsets, starts=runs.starts, array=runs.array, base=runs.base,
                      arrays=len(store._arrays),
                      dtype=str(store.dtype), sampled=checks.content_fingerprint(self.local),
                      full=checks.content_fingerprint(self.local, True) if self.owner._full else "")
        store.close()
        if self.compression:  # the local reader's name for its decompressed copy
            record["name"] = (self.dir / "copy-name").read_text()
        self._write_record(record)

    def _head_record(self) -> dict:
        """The record of an uncompressed LitData chunk from its head alone: its item table,
        checked as the local reader checks it (against the index and the file's size); no
        content fingerprint yet (`sampled` empty: taken when an epoch reads the file)."""
        from forge_grain.stores.litdata import check_table, header_bytes

        owner, chunk, where = self.owner, self._index["chunks"][0], f"{self.owner.url}/{self.name}"
        dtype, head = owner._token_dtype, header_bytes(where, chunk, self.size)
        data = b"".join(bytes(b) for b in read_spans(owner.cache, self.name, [(0, head)], tag=self.tag))
        items = check_table(where, data, chunk, self.size, dtype)
        tokens = (int(items[-1]) - head) // dtype.itemsize
        return dict(offsets=(items - head) // dtype.itemsize, starts=np.array([0, tokens]), array=np.zeros(1, np.int64),
                    base=np.zeros(1, np.int64), arrays=1, dtype=str(dtype), sampled="", full="")

    def _write_index(self, keep=frozenset()) -> None:
        """The one-file index the local reader opens this file by, made where it is missing."""
        if not (self.dir / self.index_name).exists():
            self.owner.cache.write_record(self.dir / self.index_name, json.dumps(self._index).encode(), keep)

    def _write_record(self, record: dict) -> None:
        self.dir.mkdir(exist_ok=True)  # (a headed file's copy has not made it)
        data = io.BytesIO()
        np.savez(data, **record)
        self.owner.cache.write_record(self.dir / "part.npz", data.getvalue())


def _litdata_dtype(url: str, index_file: Path, declared) -> np.dtype:
    """A LitData dataset's token dtype, from its index (as its local reader finds it), checked
    against a declared one; errors name the index at the URL."""
    from forge_grain.stores.litdata import _read_index, _token_dtype

    try:
        dtype = _token_dtype(index_file, _read_index(index_file)["config"])
        checks.check_declared_dtype(index_file, declared, dtype, "its data_format")
    except StoreError as e:
        raise StoreError(str(e).replace(str(index_file), f"{url}/index.json")) from None
    return dtype


def _file_of(fmt: str, index: dict, entry: dict, files: dict):
    """How a data file of the index is stored at the URL: (its compression or None, its name
    there, its name uncompressed, its size uncompressed as the index promises, and a function
    of a name giving the index entry of the file decompressed under that name). An MDS shard
    whose raw file is at the URL is read raw; else its `zip_data`, if that is there."""
    if fmt == "litdata":
        name = entry.get("filename")
        return ((index.get("config") or {}).get("compression"), name, name, int(entry.get("chunk_bytes") or 0),
                lambda plain: {**entry, "filename": plain})
    raw, zipped = entry.get("raw_data") or {}, entry.get("zip_data") or {}
    name = entry.get("filename") or raw.get("basename")  # (an Arrow file's, an MDS shard's)
    if fmt != "mds" or name in files or not zipped.get("basename") or zipped["basename"] not in files:
        return None, name, name, 0, None
    return (entry.get("compression") or "(none named)", zipped["basename"], name, int(raw.get("bytes") or 0),
            lambda plain: {**entry, "raw_data": {**raw, "basename": plain}, "zip_data": None, "compression": None})


def _name(part: _Part, record: dict) -> str:
    """The data file's name as the local reader's fingerprint takes it: a decompressed copy's
    for a compressed chunk (its record says), else the file's own."""
    return str(record["name"]) if "name" in record else part.local.name
