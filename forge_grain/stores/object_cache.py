"""Local copies of a remote directory's objects, shared by the processes of a host.

`ObjectCache.get` downloads an object once per host (a file lock per object; other
processes wait for it), in ranged parts on the process's request threads, to a temporary
name, checked against the size and sha256 the manifest gives, then renamed. With a
`limit`, the cache evicts the least recently used copies that no upcoming step needs, and
reserves a download's bytes before it starts, so concurrent downloads in any process
count each other; what it holds is kept in a ledger (`cache_ledger`), not found by a walk
of the directory per download. It knows objects and bytes, not stores: `RemoteStore` says
which objects it needs.
"""

from __future__ import annotations

import _thread
import collections
import concurrent.futures
import contextlib
import hashlib
import json
import threading
from pathlib import Path

from forge_grain.errors import StoreError
from forge_grain.locks import file_lock
from forge_grain.paths import cache_root, private_cache
from forge_grain.processes import per_process
from forge_grain.stores import identify
from forge_grain.stores.cache_ledger import Ledger
from forge_grain.stores.handles import share_of_descriptors
from forge_grain.stores.cache_room import CacheRoom
from forge_grain.files import temporary
from forge_grain.stores.download import SPLIT, Download
from forge_grain.stores.remote_dir import Damaged, RemoteDir, check_unchanged, endpoint_of, remote_sizes
from forge_grain.stores.request_pool import RETRIES, Carried, ahead_slots, carried_on, read_slot, shared_requests

AT_ONCE = 64  # small reads a batch waits for made at once at most (`read_at_once`; fewer under a low ulimit -n)


def within_cache(needed: list, size_of, limit: int | None) -> list:
    """The head of `needed` (objects in reading order) worth fetching ahead into a cache of
    `limit` bytes (the room beside its indices): cut where they would fill it (objects
    hinted further ahead would evict each other's before they are read), but keeping the
    one read next along with the one read now (with one alone, every object boundary
    waited for a download; where the two do not fit, the next is fetched as far as it
    fits: `room_ahead.Partial`). "The one read next" is counted in bytes: objects past the
    limit are kept until those kept after the first hold half the next one's bytes. A
    small object between two large ones (the short last chunk `litdata.optimize` writes)
    counted as the one read next, and the large one after it was fetched only once the reads
    had left the first: at a limit of two chunks' worth of 24.7 MB, behind 30 ms and 10 MB/s a
    connection, a step waited 0.29 s for it, and the epoch read in a median 2.88 s against
    3.13 s (3 rounds, each faster). Under a read order that fits the cache
    (`packing.fitted`) the processes of a host read the same files at the same steps, so
    their hints name the same copies."""
    if limit is None:
        return needed
    total, ahead, kept = 0, 0, []
    for k in needed:
        size = size_of(k)
        total += size
        if len(kept) >= 2 and total > limit and 2 * ahead >= size:
            break
        kept.append(k)
        ahead += size if len(kept) > 1 else 0
    return kept


class ObjectCache(CacheRoom, RemoteDir):
    """Local copies of one remote directory's files, shared by the processes of a host."""

    def __init__(self, url: str, storage_options: dict | None = None, directory=None, limit: int | None = None,
                 retries: int = RETRIES, requests: int | None = None):
        super().__init__(url, storage_options, retries)
        tag = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self.dir = private_cache(Path(directory or cache_root() / "objects")) / tag
        self.dir.mkdir(parents=True, exist_ok=True)
        self.limit = limit
        self.downloads = 0  # objects this process downloaded (the rest were cached)
        self.requests = shared_requests(requests)
        self.ledger = Ledger(self.dir, self._cached)

    @per_process
    def carried(self) -> Carried:
        """What one request to this store's endpoint and bucket carries (`Carried`)."""
        return carried_on(("/".join(self.url.split("/")[:3]), endpoint_of(self.storage_options)))

    def _name(self, path: Path) -> str:
        return str(path.relative_to(self.dir))

    def get(self, name: str, copy: str, sha256: str | None = None, size: int | None = None,
            upcoming=frozenset(), ahead: bool = False, job: int | None = None, start: int = 0,
            tag: str | None = None, guessed: bool = False) -> Path | None:
        """The local copy (at `copy`, relative to the cache directory) of object `name` (or of
        its `size` bytes from `start`: a range of one large object, copied as a file of its own),
        downloaded first if the cache lacks it, once per host: other processes wait for the
        download. `upcoming`: copies the next steps read (or a function giving them as they
        are now), evicted only when a copy needed now finds no other room. `ahead`: a
        prefetch, which evicts none of those and is skipped (None) when they fill the cache;
        or, where part of it fits, fetched as far as it fits and finished when the cache
        has room (`room_ahead.Partial`). `job` (from `requests.job()`): where its reads
        queue among other objects' (by default after every object asked for before).
        `tag`: the object's version in the listing a dataset was indexed from (ETag); an
        object found rewritten since is an error (`changed_under`), not read. `guessed`: `size`
        is what the object should hold, read without asking; another size is `WrongSize`."""
        local = self.dir / copy
        if local.exists():
            return local
        local.parent.mkdir(parents=True, exist_ok=True)
        keep = upcoming if callable(upcoming) else (lambda: upcoming)
        if not ahead:
            self.hurry(copy)  # (a prefetch of it waiting for room, in any process: it is needed now)
        try:
            if ahead and self.limit is not None and not self.turns.wait(copy, keep, job):
                return None  # no longer hinted while it waited for its turn
            with self._slot(copy, keep, ahead) as wanted:
                if not wanted:
                    return None  # no longer hinted while it waited for a slot
                with file_lock(self._beside(copy, ".lock")):
                    if local.exists():
                        return local
                    now = ahead and copy in self._needed_now  # (a read waits for it already: fetched as such)
                    if not Download(self, name, local, sha256, size, keep, ahead and not now, job, start, tag,
                                    guessed).run():
                        return None
        finally:  # (a prefetch's turn ends where it was submitted: `Turns.submit`)
            if not ahead:
                self.heard(copy)
        return local

    @contextlib.contextmanager
    def _slot(self, copy: str, keep, ahead: bool):
        """One of the process's `ahead_slots` held meanwhile, for a prefetch (`ahead`); True,
        or False where `copy` is no longer hinted (`keep()`) while it waited. One needed now
        (`hurry`) waits no longer: the slots may all be held by prefetches that wait for room
        the reader frees only once it has that copy."""
        slots = ahead_slots()
        held = slots.take(lambda: copy in keep(), lambda: copy in self._needed_now) if ahead else False
        if held is None:
            yield False
            return
        try:
            yield True
        finally:
            if held:
                slots.give()

    def derive(self, copy: str, size: int | None, write, upcoming=frozenset(), source: str | None = None,
               ahead: bool = False) -> Path | None:
        """A file made in the cache from copies there (a compressed chunk's decompressed copy), at
        `copy`, made once per host: `size` bytes (what it will hold, when known) are reserved
        first as a download's are (never evicting the copy at `source` it is made from),
        `write(path)` writes it to a temporary name, then it is renamed and counted at its real
        size. `ahead`: made by a prefetch, which evicts no copy the next steps read and, where
        there is no room, gives up (None) as its download does; the read makes it when it
        comes. (Made as a read makes it, a prefetch's copy evicted the chunk the next steps read
        first, fetched again when they came; where every copy was hinted it stopped the run with
        "nothing can be evicted".)"""
        local = self.dir / copy
        if local.exists():
            return local
        with file_lock(self._beside(copy, ".lock")):
            if local.exists():
                return local
            tmp = temporary(local)
            if self.limit is not None and size and not self._make_room(
                    size, upcoming() if callable(upcoming) else upcoming, tmp, ahead=ahead, never={source}):
                return None
            try:
                write(tmp)
                self._commit(tmp, local, tmp.stat().st_size)
            finally:
                if tmp.exists():
                    self._forget(tmp)
        return local

    def write_record(self, path: Path, data: bytes, upcoming=frozenset()) -> None:
        """A small file of this process's own (a manifest, an index, what a first open found)
        made at `path` in the cache directory as `derive` makes a file: counted against the
        limit before it exists, so the directory never holds more than the limit, not for a
        moment (one that cannot fit beside the ledger is refused, naming it); the copies
        `upcoming` are spared if room must be made."""
        if self.limit is not None and len(data) + self.ledger_reserve() > self.limit:
            raise StoreError(f"{self.url}: cache_limit {self.limit} bytes cannot hold its {path.name} "
                             f"({len(data)} bytes) beside the cache's ledger, let alone its data; raise cache_limit")
        self.derive(self._name(path), len(data), lambda tmp: tmp.write_bytes(data), upcoming)

    def discard(self, copy: str) -> None:
        """Remove the copy at `copy` (a compressed chunk once decompressed) and its bytes from
        the count."""
        self._forget(self.dir / copy)

    def sizes(self) -> dict[str, int]:
        """Each object's size directly under the URL, from one listing (empty if it fails: then
        each download asks for its object's size first)."""
        try:
            return remote_sizes(self)
        except StoreError:
            return {}

    def not_a_store(self) -> StoreError:
        """Why a URL without a manifest cannot be opened as a forge-grain store: the format its
        files show (when format="native" was given), or what is there, or that nothing is."""
        listed = self.retry("", lambda: self.fs.ls(self.root, detail=False), missing_ok=True) or []
        names = {str(n).rstrip("/").rsplit("/", 1)[-1] for n in listed}
        if any(n.startswith("shard-") and n.endswith((".bin", ".array_record")) for n in names):
            return StoreError(f"{self.url}: holds a forge-grain store's shards but no manifest.json (written last): "
                              "an upload or prepare that did not finish; run it again to complete it")
        index = self.fresh("index.json", missing_ok=True) if "index.json" in names else None
        try:
            index = json.loads(index) if index else None
        except ValueError:
            index = None
        found = identify.formats_named(names, index)
        if not found and any(n.endswith((".bin", ".npy")) for n in names):
            found = {"raw": ("raw token files", ".bin/.npy files")}
        if found:  # reached with format="native" given: the listing shows another format
            what = " and ".join(f"{w} ({why})" for w, why in found.values())
            return StoreError(f"{self.url}: this is {what}, not a forge-grain store (format='native' was given); "
                              f"open it without format= (or with format={next(iter(found))!r}) to read it in place")
        if names:
            return StoreError(f"{self.url}: no manifest.json, so not a forge-grain store; it holds "
                              f"{', '.join(sorted(names)[:8])}{', ...' if len(names) > 8 else ''}")
        return StoreError(f"{self.url}: nothing at this URL (no such object or prefix); check the URL and credentials")

    @per_process
    def _in_flight(self) -> list:
        """[a lock, the downloads this process has running, those of them that a read waits
        for]: how finely each is cut (`Download._part_size`)."""
        return [threading.Lock(), 0, 0]


def read_spans(cache: ObjectCache, name: str, spans, ahead: int = SPLIT, tag: str | None = None):
    """The bytes of each span [a, b) of object `name` at `cache`'s URL, in order, `ahead` of them
    read at once on the request threads (each retried, and checked to be whole), so that reading
    an object through once holds `ahead` spans in memory, not the object. `tag`: the
    version they must all come from, as `get`'s."""
    job, spans, pending = cache.requests.job(), iter(spans), collections.deque()
    condition = cache.conditional(tag)
    read = span_reader(cache, name, condition)

    def submit():
        span = next(spans, None)
        if span is not None:
            pending.append(cache.requests.submit(True, job, read, *span, size=span[1] - span[0]))

    try:
        for _ in range(ahead):
            submit()
        while pending:
            data = pending.popleft().result()
            submit()
            yield data
        if tag is not None and condition is None:
            check_unchanged(cache, name, tag)
    finally:  # (a reader that stops early leaves no reads queued)
        for f in pending:
            f.cancel()


def span_reader(cache: ObjectCache, name: str, condition: str | None = None, slot: bool = True):
    """`read(a, b)`: bytes [a, b) of object `name`, retried, and checked to be whole; holding
    one of the process's read slots (`read_slot`) while its bytes are in memory, unless not
    `slot` (small reads, bounded by their caller)."""
    def read(a, b):
        def attempt():
            with read_slot() if slot else contextlib.nullcontext():
                data = memoryview(cache.read_bounded(name, a, b, condition))
            if data.nbytes != b - a:
                raise Damaged(f"{data.nbytes} bytes arrived of the {b - a} asked for at {a}")
            return data
        return cache.retry(name, attempt, bound=False)
    return read


def read_at_once(cache: ObjectCache, spans, conditions: dict | None = None) -> list[memoryview]:
    """The bytes of each span (name, a, b) of objects at `cache`'s URL, in order: small reads a
    batch waits for, made at once on threads of their own (up to `AT_ONCE`, each reading
    spans in turn: each read holds a connection, and a large batch's first step read 1000s),
    while the request pool starts no new part of a download (`Requests.holding`). On the
    pool's threads each waited for a part in flight to end (0.4 s for the 38 ranges of a
    first batch behind a 30 ms link, on 2 cores). The threads are started without waiting
    for each to run (`_thread`: `Thread.start` waits a few ms each while another thread holds
    the GIL). Where `fetch_threads` fixes the reads in flight, they queue first on its
    threads instead. Their memory is their caller's (no read slot). `conditions`: object ->
    the version its reads must come from (`RemoteDir.conditional`)."""
    requests, conditions = cache.requests, conditions or {}
    if requests.fixed:
        job = requests.job()
        futures = [requests.submit(True, job, span_reader(cache, name, conditions.get(name), slot=False), a, b,
                                   size=b - a) for name, a, b in spans]
        try:
            return [f.result() for f in futures]
        finally:  # (one failed: the others are not left queued)
            for f in futures:
                f.cancel()
    futures = [concurrent.futures.Future() for _ in spans]
    jobs, lock = iter(list(zip(futures, spans))), threading.Lock()
    with requests.holding():
        for _ in range(min(len(spans), share_of_descriptors(AT_ONCE))):
            _thread.start_new_thread(_each_into, (cache, jobs, lock, conditions))
        try:
            return [f.result() for f in futures]
        finally:  # (one failed: the others are not started)
            for f in futures:
                f.cancel()


def _each_into(cache: ObjectCache, jobs, lock: threading.Lock, conditions: dict) -> None:
    """Each span of `jobs` ((future, (name, a, b)), shared with the other threads) read, its
    bytes or error into its future, until none is left."""
    while True:
        with lock:
            future, (name, a, b) = next(jobs, (None, (None, 0, 0)))
        if future is None:
            return
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(span_reader(cache, name, conditions.get(name), slot=False)(a, b))
        except BaseException as e:  # handed to the caller
            future.set_exception(e)
