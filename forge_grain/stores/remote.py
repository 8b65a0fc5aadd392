"""forge-grain stores in object storage: any fsspec URL (`s3://`, `gs://`, `hf://`, ...).

`TokenStore.open("s3://bucket/prefix")` downloads the manifest and the document indices
(small) when it opens, and each shard into a local cache directory the first time a batch
needs it: to a temporary name, checked against the manifest's size and sha256, renamed.
Failures are retried with backoff; one that persists is an error naming the object. The
pipeline tells the store which shards the next steps read (`prefetch`), so they are
downloaded ahead in background threads, and `cache_limit` bounds the cache's bytes:
eviction removes the least recently used shards that no upcoming step needs.

Processes on one host share the cache directory (by default under `FORGE_GRAIN_CACHE`):
a file lock per object means each shard is downloaded once, whoever asks first.

The parts, each in its own module: `request_pool` (deadlines and request threads),
`remote_dir` (a URL's objects, with retries), `object_cache` (local copies, eviction),
`uploads` (writing a store), `writer_lock` (one writer at a URL); this module is the store
that reads through them.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import threading
from pathlib import Path

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.processes import per_process
from forge_grain.stores import arrayrecord, checks, step_reads
from forge_grain.stores.manifest import MANIFEST_NAME, Manifest, split_joined_index
from forge_grain.stores.mapping import Maps
from forge_grain.files import npy_size, remove_stale_temporaries, sha256_file
from forge_grain.stores.native import NativeStore
from forge_grain.stores.cache_room import read_copy
from forge_grain.stores.document_ranges import DocumentRanges, token_spans
from forge_grain.stores.download import PART_MIN, WrongSize
from forge_grain.stores.room_ahead import arrived, first_numbers
from forge_grain.stores.object_cache import ObjectCache, within_cache
from forge_grain.stores.remote_dir import changed_under
from forge_grain.stores.request_pool import OBJECTS, START

log = logging.getLogger(__name__)
GUESSED = 64 << 20  # the largest joined index read at the size the manifest gives it, without a HEAD


class RemoteStore(NativeStore):
    """A forge-grain store in object storage, read through a local cache.

    Options besides `NativeStore`'s: `storage_options` (for fsspec: credentials,
    `endpoint_url`, ...), `object_cache` (the cache directory; default
    `$FORGE_GRAIN_CACHE/objects`), `cache_limit` (bytes; default unbounded) and
    `fetch_threads` (ranged reads in flight; default: as many as the link gives, from 16
    doubling while the throughput grows, up to 64).
    """

    description = "a forge-grain store in object storage"
    OPTIONS = NativeStore.OPTIONS | {"storage_options", "object_cache", "cache_limit", "fetch_threads"}
    fetches = True

    def __init__(self, path, **options):
        self.url = str(path).rstrip("/")
        try:
            super().__init__(path, **options)
        except StoreError as e:  # name the objects, not their local copies
            mirror = getattr(self, "path", None)
            raise StoreError(str(e).replace(f"{mirror}", self.url) if mirror else str(e)) from None

    def _validate(self) -> None:
        """Shards are checked as they are fetched (their checksums), not all fetched at open."""

    def _open(self, dtype=None, storage_options=None, object_cache=None, cache_limit=None,
              fetch_threads=None) -> None:
        self.cache = ObjectCache(self.url, storage_options, object_cache, cache_limit, requests=fetch_threads)
        manifest = self.cache.probed(MANIFEST_NAME) or self.cache.fresh(MANIFEST_NAME, missing_ok=True)
        if manifest is None:
            raise self.cache.not_a_store()
        # the indices and shards of this manifest live in a directory named by its content:
        # a store rewritten in place gets a new one, so nothing stale is ever read
        self.mirror = Path(hashlib.sha256(manifest).hexdigest()[:16])
        local = self.cache.dir / self.mirror
        local.mkdir(exist_ok=True)
        remove_stale_temporaries(local)  # downloads of processes that died
        if not (local / MANIFEST_NAME).exists():
            self.cache.write_record(local / MANIFEST_NAME, manifest)
        self.path = local
        m = Manifest.load(local)
        if any(s.mask is not None for s in m.shards):  # (rather than train every token of it)
            raise StoreError(f"{self.url}: a store with target masks is read from a local directory in this version of "
                             "forge-grain, not from object storage; copy it to local disk (or a mounted file system)")
        # the shards' sizes come from the manifest and the indices are got whole and checked by their
        # sha256; otherwise one listing gives every object's size (no HEAD before each GET of an index
        # or ArrayRecord shard). A store of 10,000 shards takes 20 list requests (1,000 objects each).
        self._sizes = {} if m.layout == "bin" and all(s.index_sha256 for s in m.shards) else self.cache.sizes()
        if m.indices:  # every shard's index in one object, checked by its sha256: one request at any shard count
            self._get_joined_index(m)
        else:  # a store prepared before: each shard's own (small, all needed at open)
            with concurrent.futures.ThreadPoolExecutor(fetch_threads or START) as pool:
                list(pool.map(lambda s: self.cache.get(s.index, f"{self.mirror}/{s.index}", s.index_sha256,
                                                       self._sizes.get(s.index)), m.shards))
        self._fetch_threads = fetch_threads
        self._mapped = Maps()  # shard -> its tokens, mapped
        self._keep: frozenset = frozenset()
        super()._open(dtype)
        if self._records is not None:
            self._records = arrayrecord.Records(self._files, self._file_docs, fetch=self._fetch,
                                                compressed=self.compressed)

    def _get_joined_index(self, m: Manifest) -> None:
        """The joined index into the cache: a small one in one GET; a larger one in parallel
        parts (every connection at once: a 1.6 MB index behind a link of 2 MB/s a connection
        took 0.87 s in one GET), their ranges from the size `np.save` gives the manifest's
        offset count, without a HEAD first (a round trip before the first batch: 33-39 ms
        behind a 30 ms link). A file of another size (not written by `prepare`) is asked its
        size and read again; so is one the manifest says is larger than `GUESSED` (there the
        round trip is little beside the transfer, and no manifest's counts make a read of more
        than `GUESSED` bytes before the object's own size is known)."""
        name, sha256 = m.indices["file"], m.indices["sha256"]
        copy, offsets = f"{self.mirror}/{name}", sum(s.num_documents + 1 for s in m.shards)
        if 8 * offsets <= 2 * PART_MIN:
            self.cache.get(name, copy, sha256)
            return
        guess = npy_size(offsets)
        if guess <= GUESSED:
            try:
                self.cache.get(name, copy, sha256, guess, guessed=True)
                return
            except WrongSize as e:
                log.info("forge-grain: %s; asking its size", e)
        self.cache.get(name, copy, sha256, self.cache.retry(name, lambda: self.cache.size(name)))

    @per_process
    def _pool(self):
        """This process's download threads (a forked child has none of the parent's: work
        queued to the parent's executor there would never run)."""
        return concurrent.futures.ThreadPoolExecutor(max(OBJECTS, self._fetch_threads or 0),
                                                     thread_name_prefix="forge-grain-fetch")

    @per_process
    def _pending(self) -> dict[int, concurrent.futures.Future]:
        """Downloads this process asked for, by shard (the parent's futures never complete in a
        forked child: its threads are not there)."""
        return {}

    @per_process
    def _lock(self):
        """This process's lock over the maps and pending downloads (the parent's may be held by
        one of its threads at the fork, forever in the child)."""
        return threading.Lock()

    def _map_shards(self, m: Manifest) -> list[np.ndarray]:
        """Indices only: shards are fetched when a batch or a prefetch needs them."""
        if m.indices:
            where = f"{self.url}/{m.indices['file']}"
            joined = split_joined_index(self._map_index(self.path / m.indices["file"]), m.shards, where)
            offsets = [self._check_index(idx, where, s) for idx, s in zip(joined, m.shards)]
        else:
            offsets = [self._load_index(self.path / s.index, s) for s in m.shards]
        if m.layout == "bin":
            self._arrays = [checks.empty_tokens(self.dtype)] * len(m.shards)
            sizes = [s.num_tokens for s in m.shards]
            self._pieces = (np.concatenate([[0], np.cumsum(sizes)]), np.arange(len(sizes)), np.zeros(len(sizes)))
        return offsets

    @per_process
    def _ranges(self) -> DocumentRanges:
        """This process's ranged reads ahead of the downloads (a forked child has its own
        budget and lock)."""
        return DocumentRanges(sum(s.num_tokens for s in self.manifest.shards) * self.dtype.itemsize, self.url)

    def may_read_ranges(self) -> bool:
        """Whether the step this thread makes may read its documents in ranges (`read_ranges`):
        the first of a fresh window of hints, budget left, no `cache_limit`. Asked before the
        step's spans are found: every step that waits would pay for those."""
        return (self.cache.limit is None and self.manifest.layout == "bin"
                and self._ranges.may(step_reads.step_now()))

    def read_ranges(self, spans: dict[int, list]) -> dict[int, list[np.ndarray]] | None:
        """For the shards of `spans` (shard -> token spans [a, b) a step reads) still arriving:
        the tokens of each span, read now in ranged GETs (`document_ranges`), shard -> arrays
        in `spans`' order; shards here are left out (read from their copies). None: the step
        waits for the downloads (a shard no prefetch asked for, ranges that cost more than the
        wait, or the budget spent). Asked where `may_read_ranges`."""
        with self._lock:
            pending, mapped, landed = self._pending, self._mapped, self._ranges.landed_shards
            arriving = [k for k in spans if k not in mapped and k not in landed and not arrived(pending.get(k))]
            if not arriving or any(k not in pending for k in arriving):
                return None
        item, shards = self.dtype.itemsize, self.manifest.shards
        joined = self._ranges.take({k: [(a * item, b * item) for a, b in spans[k]] for k in arriving},
                                   sum(shards[k].num_tokens for k in arriving) * item, step_reads.step_now())
        if joined is None:
            return None
        got = self._ranges.read(self.cache, joined, lambda k: shards[k].tokens, self._fetch)
        return token_spans(got, spans, arriving, self.dtype)

    def _landed(self, k: int, path: Path | None) -> Path | None:
        """A prefetch of shard `k` landed at `path`: the ranges read of it before are compared."""
        if path is not None:
            self._ranges.landed(k, path, self.manifest.shards[k].tokens)
        return path

    def _name(self, k: int) -> str:
        return f"{self.mirror}/{self.manifest.shards[k].tokens}"

    def _fetch(self, k: int, ahead: bool = False, job: int | None = None) -> Path | None:
        s = self.manifest.shards[k]
        size = s.num_tokens * self.dtype.itemsize if self.manifest.layout == "bin" else self._sizes.get(s.tokens)
        keep = (lambda: self._keep) if ahead else self._keep  # (a prefetch waiting for room sees the hints move)
        return self.cache.get(s.tokens, self._name(k), s.sha256, size, upcoming=keep, ahead=ahead, job=job)

    def _array(self, k: int) -> np.ndarray:
        arr = self._mapped.get(k)
        if arr is not None:
            return arr
        with self._lock:
            future = self._pending.get(k)
        path = self.cache.result_now(future, self._name(k)) if future is not None else None
        shard, first = self.manifest.shards[k], [path] if path else []  # (not prefetched: fetched now)

        def mapped(path):
            try:
                return self._map_bin_shard(path, shard)
            except (FileNotFoundError, StoreError):
                if not path.exists():
                    raise  # evicted by another download before it was mapped: fetched again
                return self._map_bin_shard(self._refetch(k, path), shard)  # a damaged copy: the object is the truth

        arr = read_copy(lambda: first.pop() if first else self._fetch(k), mapped, f"{self.url}/{shard.tokens}",
                        self.cache.limit, f"the shards one step reads (this one is "
                                          f"{shard.num_tokens * self.dtype.itemsize} bytes)")
        with self._lock:
            self._mapped[k] = arr
        return arr

    def arrays_for(self, needed) -> list[np.ndarray]:
        """Shards `needed`, for one gather: those still downloading ahead all needed now
        (`CacheRoom.needed_now`)."""
        with self._lock:
            waiting = [self._name(k) for k in map(int, needed) if k not in self._mapped and k in self._pending]
        with self.cache.needed_now(waiting):
            return [self._array(int(k)) for k in needed]

    @property
    def maps(self) -> Maps:
        """The shards mapped now (a gather's table of addresses holds them while these are unchanged)."""
        return self._mapped

    def mapped(self, needed) -> list[np.ndarray] | None:
        """Shards `needed` if all are mapped (None: some must be fetched, or are arriving)."""
        mapped = self._mapped
        arrays = [mapped.get(k) for k in np.asarray(needed, np.int64).tolist()]
        return None if any(a is None for a in arrays) else arrays

    def held(self, arrays) -> np.ndarray:
        """Which of `arrays` (shards) are mapped, or downloaded by a prefetch."""
        pending, mapped = self._pending, self._mapped  # (a prefetch pops a finished download meanwhile)
        return np.array([k in mapped or arrived(pending.get(k)) for k in arrays.tolist()], bool)

    def units_of(self, arrays) -> tuple[np.ndarray, np.ndarray]:
        """The shards holding token arrays `arrays` (one array a shard), and their bytes: what
        the cache fetches whole."""
        shards = np.asarray(arrays, np.int64)
        tokens = np.array([self.manifest.shards[k].num_tokens for k in shards.tolist()], np.int64)
        return shards, tokens * self.dtype.itemsize

    def prefetch(self, needed, first: int | None = None, jobs=None) -> None:
        """Download shards `needed` (in the order the next steps read them) in the background,
        first needed first; until the next hint, eviction spares them. With `cache_limit`, the
        hint is cut to what the cache holds ahead (`within_cache`). Maps of shards no longer
        needed are dropped, so evicted files free their space. `first`: the step the hinted
        steps start afresh at, which may read its documents in ranges (`read_ranges`)."""
        if first is not None:
            self._ranges.first = first
        number = first_numbers(needed, jobs)
        needed = within_cache(list(dict.fromkeys(int(k) for k in needed)),
                              lambda k: self.manifest.shards[k].num_tokens * self.dtype.itemsize, self.cache.room())
        hinted = set(needed)
        with self._lock:
            self._keep = frozenset(self._name(k) for k in needed)
            for k in [k for k in self._mapped if k not in hinted]:
                del self._mapped[k]
            for k in needed:  # each shard's place among the reads taken now, in the order of need (the
                if k not in self._mapped and k not in self._pending:  # threads start them in any order)
                    self._pending[k] = self.cache.turns.submit(
                        self._pool, lambda job, k=k: self._landed(k, self._fetch(k, True, job)), number.get(k))
            for k in [k for k, f in self._pending.items() if f.done()]:
                self._pending.pop(k).result()  # a failed download raises here, naming the object

    def _shard_size(self, shard) -> int:
        """An ArrayRecord shard's size from the store's listing (no shard is fetched to plan)."""
        size = self._sizes.get(shard.tokens)
        if size is None:
            raise StoreError(f"{self.url}/{shard.tokens}: listed in {MANIFEST_NAME} but not found in the store")
        return size

    def _refetch(self, k: int, path: Path) -> Path:
        """Shard `k` downloaded again, its cached copy at `path` having failed a check."""
        log.warning("forge-grain: the cached copy %s of %s/%s is damaged; downloading it "
                                            "again", path, self.url, self.manifest.shards[k].tokens)
        path.unlink(missing_ok=True)
        return self._fetch(k)

    def _verify_files(self) -> None:
        """Every shard's cached copy checked against the manifest's sha256 (a download is checked
        as it arrives; a copy damaged since is downloaded again)."""
        for k, shard in enumerate(self.manifest.shards):
            path = self._fetch(k)
            if sha256_file(path) != shard.sha256:
                self._mapped.pop(k, None)
                path = self._refetch(k, path)
                if sha256_file(path) != shard.sha256:
                    raise StoreError(f"{self.url}/{shard.tokens}: its sha256 does not match the manifest's")

    def __reduce__(self):
        return (_reopen_remote, (self.url, self._options, str(self.mirror)))

    def __repr__(self) -> str:
        return super().__repr__().replace(repr(str(self.path)), repr(self.url), 1)

    def close(self) -> None:
        super().close()
        self._mapped.clear()
        self._keep = frozenset()  # (a prefetch waiting for room stops)
        pool = RemoteStore._pool.made(self)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def _reopen_remote(url, options, mirror=None):
    """The store at `url` opened again in another process (a spawned DataLoader worker), only if
    its manifest is still the one the pipeline opened."""
    store = RemoteStore(url, **options)
    if mirror is not None and str(store.mirror) != mirror:
        raise changed_under(url)
    return store
