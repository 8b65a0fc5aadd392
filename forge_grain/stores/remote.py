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
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import mmap
import itertools
import os
import queue
import threading
import time
import weakref
from pathlib import Path

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.locks import file_lock
from forge_grain.stores.manifest import MANIFEST_NAME, Manifest, remove_stale_temporaries, sha256_file, temporary
from forge_grain.paths import cache_root, private_cache
from forge_grain.processes import at_fork, per_process, without_per_process
from forge_grain.stores import arrayrecord
from forge_grain.stores import checks
from forge_grain.stores import handles
from forge_grain.stores import identify
from forge_grain.stores.native import NativeStore

log = logging.getLogger(__name__)

RETRIES = 5
BLOCK = 1 << 24  # the most bytes one ranged read asks for (and holds in memory)
PART_MIN = 1 << 20  # an object is read in up to SPLIT ranged parts of at least this many bytes
SPLIT = 8
FETCH_THREADS = 8  # ranged reads at once (the server's concurrent rate: bench_scale), and objects in progress
IN_FLIGHT = 16  # ranged reads held in memory at once, process-wide (256 MiB)
_IN_FLIGHT = threading.BoundedSemaphore(IN_FLIGHT)
# seconds an object may take to arrive, every attempt included, before it is an error naming it:
# a server that accepts requests and never answers must not block a job for long (fsspec's own
# timeouts do not reach every call). One request may take a quarter of it (REQUEST_SHARE), so a
# request that hangs leaves time for three more attempts. FORGE_GRAIN_REMOTE_DEADLINE sets it.
DEADLINE = 120.0
REQUEST_SHARE = 4


def deadline() -> float:
    """Seconds an object may take, all attempts included (FORGE_GRAIN_REMOTE_DEADLINE)."""
    text = os.environ.get("FORGE_GRAIN_REMOTE_DEADLINE")
    try:
        value = float(text) if text else DEADLINE
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise StoreError(f"FORGE_GRAIN_REMOTE_DEADLINE={text!r} is not a positive number of seconds")
    return value


def request_deadline() -> float:
    """Seconds one request may take before it counts as failed (and is retried)."""
    return deadline() / REQUEST_SHARE


def bounded(fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, or TimeoutError once `request_deadline()` seconds pass without
    an answer. The call runs on a daemon thread, so one stuck in a network library is
    abandoned (it ends with the process) instead of blocking the caller or the interpreter's exit."""
    limit, box, done = request_deadline(), {}, threading.Event()

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller
            box["error"] = e
        done.set()

    threading.Thread(target=run, daemon=True, name="forge-grain-remote").start()
    if not done.wait(limit):
        raise TimeoutError(f"no answer within {limit:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class Requests:
    """Worker threads running ranged reads in order of need: a read for a batch waiting now
    first, then prefetches in the order they were asked for (the order the steps read them),
    the parts of one object before the next object's. So the shard the consumer reads next
    arrives with all the connections' bandwidth instead of sharing it with the shards after
    it, and the connections stay busy whatever the object sizes."""

    def __init__(self, workers: int):
        self.workers, self._order = workers, itertools.count()
        self._reset()
        _ALL_REQUESTS.add(self)

    def _reset(self) -> None:
        """No workers yet (and, in a forked child, none of the parent's queue or lock state)."""
        self._queue, self._lock, self._started = queue.PriorityQueue(), threading.Lock(), False

    def submit(self, urgent: bool, job: int, fn, *args) -> concurrent.futures.Future:
        """Run `fn(*args)` on a worker; `job` orders the jobs of equal urgency (earlier first)."""
        with self._lock:
            if not self._started:
                self._started = True
                for _ in range(self.workers):
                    threading.Thread(target=self._work, args=(self._queue,), daemon=True,
                                     name="forge-grain-get").start()
        future = concurrent.futures.Future()
        self._queue.put(((0 if urgent else 1, job, next(self._order)), future, fn, args))
        return future

    def job(self) -> int:
        """A number for a new job, after those of the jobs asked for before."""
        return next(self._order)

    @staticmethod
    def _work(jobs: queue.PriorityQueue) -> None:
        while True:
            _, future, fn, args = jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # handed to the waiting download
                    future.set_exception(e)


_REQUESTS: dict[int, Requests] = {}  # by worker count: shared by every cache of the process
_REQUESTS_LOCK = threading.Lock()
_ALL_REQUESTS: weakref.WeakSet = weakref.WeakSet()


def _after_fork() -> None:
    """A forked child has none of its parent's worker threads, and a lock, queue or read slot
    the parent's threads held mid-operation would stay taken forever: each starts afresh."""
    global _REQUESTS_LOCK, _IN_FLIGHT
    _REQUESTS_LOCK = threading.Lock()
    _IN_FLIGHT = threading.BoundedSemaphore(IN_FLIGHT)
    for pool in list(_ALL_REQUESTS):
        pool._reset()


at_fork(_after_fork)


def shared_requests(workers: int) -> Requests:
    """The process's pool of `workers` request threads (one per count, however many sources)."""
    with _REQUESTS_LOCK:
        return _REQUESTS.setdefault(workers, Requests(workers))


class RemoteDir:
    """A directory at an fsspec URL, and the retrying every request to it goes through."""

    def __init__(self, url: str, storage_options: dict | None = None, retries: int = RETRIES):
        import fsspec

        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        RemoteDir.fs.keep(self, fs)  # made here already; a forked child makes its own
        self.retries = retries

    @per_process
    def fs(self):
        """This process's fsspec file system (s3fs's refuses to work in a forked child:
        its event loop and connections are the parent's)."""
        import fsspec

        return fsspec.core.url_to_fs(self.url, **self.storage_options)[0]

    @per_process
    def _fast(self):
        """This process's obstore client, or None (its runtime's threads are the parent's in a
        forked child: a request there never returns)."""
        return fast_client(self.url, self.storage_options)

    def __getstate__(self):
        return without_per_process(self.__dict__)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def read_range(self, name: str, start: int, end: int | None = None):
        """Bytes [start, end) of object `name` (`read_range(name, 0)`: all of it, in one GET
        whose size need not be known first), as a bytes-like buffer: through obstore where
        `fast_client` made one (a Rust client: a fraction of s3fs's CPU a request; its buffer
        is written and hashed as it is, not copied into `bytes` under the GIL first), else
        through fsspec."""
        if self._fast is None:
            return self.fs.cat_file(self.path(name), start=start, end=end)
        import obstore
        from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError

        store, prefix = self._fast
        try:
            if end is None:
                return memoryview(obstore.get(store, f"{prefix}{name}").bytes())[start:]
            return memoryview(obstore.get_range(store, f"{prefix}{name}", start=start, end=end))
        except NotFoundError:
            raise FileNotFoundError(f"{self.url}/{name}") from None
        except (PermissionDeniedError, UnauthenticatedError) as e:
            raise PermissionError(str(e).splitlines()[0]) from None

    def retry(self, name: str, attempt, missing_ok: bool = False, bound: bool = True):
        """`attempt()`, retried with exponential backoff until `retries` attempts or `deadline()`
        seconds are spent; a missing object is not retried (and gives None with `missing_ok`).
        Each attempt is `bounded` (`bound=False` for an attempt of many requests that bounds
        each itself)."""
        where = f"{self.url}/{name}" if name else self.url  # the object, or the URL for its listing
        start, limit = time.monotonic(), deadline()
        for k in range(self.retries):
            if k and time.monotonic() - start + request_deadline() > limit:
                break  # another attempt that hangs would end past the deadline
            tried = k + 1
            try:
                return bounded(attempt) if bound else attempt()
            except FileNotFoundError:
                if missing_ok:
                    return None
                raise StoreError(f"{where}: FileNotFoundError (no such object); check the URL and credentials") from None
            except PermissionError as e:
                raise StoreError(f"{where}: {e.__class__.__name__} ({e}); check the URL and credentials") from None
            except Exception as e:  # network errors come as many types (OSError, botocore, aiohttp, timeouts)
                last = e
                time.sleep(min(0.05 * 2**k, 2.0))
        spent = time.monotonic() - start
        raise StoreError(f"{where}: failed after {tried} attempts in {spent:.0f} s: {last.__class__.__name__}: {last} "
                         f"(FORGE_GRAIN_REMOTE_DEADLINE={limit:g} s bounds an object's attempts)") from None


_OBSTORE_PID: int | None = None  # the process whose obstore runtime this memory holds, if any
FAST_OPTIONS = {"key", "secret", "token", "anon", "endpoint_url", "client_kwargs", "config_kwargs",
                "skip_instance_cache", "use_listings_cache"}


def fast_client(url: str, storage_options: dict | None):
    """(an obstore `S3Store`, the key prefix) for an `s3://` URL whose storage options say
    everything obstore needs (explicit `key`/`secret`, or `anon`; `endpoint_url`, the region
    and timeouts), when obstore is installed; None otherwise (then s3fs reads, with boto's
    own credential chain). Its own retries are off: `RemoteDir.retry` retries.

    None too in a process forked from one that made an obstore client: obstore runs its
    requests on one tokio runtime per process, whose threads a forked child does not have,
    and a request there never returns (tokio does not support fork). Such a child (a
    DataLoader worker) reads through s3fs, which starts afresh after a fork; a worker started
    by "spawn" or "forkserver" uses obstore."""
    global _OBSTORE_PID
    opts = dict(storage_options or {})
    if not url.startswith("s3://") or set(opts) - FAST_OPTIONS or not (opts.get("anon") or
                                                                       (opts.get("key") and opts.get("secret"))):
        return None
    if _OBSTORE_PID not in (None, os.getpid()):
        return None
    try:
        from obstore.store import S3Store
    except ImportError:
        return None
    import datetime

    _OBSTORE_PID = os.getpid()

    bucket, _, prefix = url[len("s3://"):].partition("/")
    client_kwargs, config_kwargs = opts.get("client_kwargs") or {}, opts.get("config_kwargs") or {}
    config = {"region": client_kwargs.get("region_name") or os.environ.get("AWS_REGION")
              or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"}
    if opts.get("anon"):
        config["skip_signature"] = True
    else:
        config.update(access_key_id=opts["key"], secret_access_key=opts["secret"])
        if opts.get("token"):
            config["session_token"] = opts["token"]
    endpoint = opts.get("endpoint_url") or client_kwargs.get("endpoint_url")
    client = {"timeout": f"{config_kwargs.get('read_timeout', request_deadline()):g}s",
              "connect_timeout": f"{config_kwargs.get('connect_timeout', 60):g}s"}
    if endpoint:
        config.update(endpoint=endpoint, virtual_hosted_style_request=False)
        client["allow_http"] = endpoint.startswith("http://")
    retry = {"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=request_deadline())}
    store = S3Store(bucket, config=config, client_options=client, retry_config=retry)
    return store, f"{prefix.strip('/')}/" if prefix.strip("/") else ""


class ObjectCache(RemoteDir):
    """Local copies of one remote directory's files, shared by the processes of a host."""

    def __init__(self, url: str, storage_options: dict | None = None, directory=None, limit: int | None = None,
                 retries: int = RETRIES, requests: int = FETCH_THREADS):
        super().__init__(url, storage_options, retries)
        tag = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self.dir = private_cache(Path(directory or cache_root() / "objects")) / tag
        self.dir.mkdir(parents=True, exist_ok=True)
        self.limit = limit
        self.downloads = 0  # objects this process downloaded (the rest were cached)
        self.requests = shared_requests(requests)

    def get(self, name: str, copy: str, sha256: str | None = None, size: int | None = None,
            upcoming=frozenset(), ahead: bool = False) -> Path | None:
        """The local copy (at `copy`, relative to the cache directory) of object `name`,
        downloaded first if the cache lacks it, once per host: other processes wait for the
        download. `upcoming`: copies the next steps read, evicted only when a copy needed now
        finds no other room. `ahead`: a prefetch, which evicts none of those and is skipped
        (None) when they fill the cache."""
        local = self.dir / copy
        if local.exists():
            return local
        local.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(self.dir / f".{copy.replace('/', '_')}.lock"):
            if local.exists():
                return local
            if not self._download(name, local, sha256, size, upcoming, ahead):
                return None
        return local

    def fresh(self, name: str, missing_ok: bool = False) -> bytes | None:
        """Object `name`'s current bytes (no cache): the manifest, which says what else to trust."""
        def attempt():
            data = self.fs.cat_file(self.path(name))
            size = self.fs.size(self.path(name))
            if len(data) != size:
                raise _Damaged(f"{len(data)} bytes arrived of {size}")
            return data

        return self.retry(name, attempt, missing_ok=missing_ok)

    def sizes(self) -> dict[str, int]:
        """Each object's size directly under the URL, from one listing (empty if it fails: then
        each download asks for its object's size first)."""
        try:
            return _remote_sizes(self)
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

    def _download(self, name: str, local: Path, sha256: str | None, size: int | None, upcoming, ahead) -> bool:
        tmp = temporary(local)
        whole = []  # an object got in one GET before its size was known
        if size is None and sha256 is not None:  # (an index) its sha256 checks it: no listing or HEAD first
            whole.append(memoryview(self.retry(name, lambda: self.read_range(name, 0))))
            size = whole[0].nbytes
        elif size is None:  # neither the manifest nor the listing says: ask, so a cut-off read is never taken
            size = self.retry(name, lambda: self.fs.size(self.path(name)))
        if self.limit is None:
            tmp.write_bytes(b"")
        elif not self._make_room(size, upcoming, tmp, ahead):
            return False

        job = self.requests.job()  # its parts are read before those of any object asked for later

        def attempt():
            step = min(BLOCK, max(PART_MIN, -(-size // SPLIT)))
            spans = [(0, size)] if whole else [(a, min(a + step, size)) for a in range(0, size, step)]
            with open(tmp, "r+b") as dst:
                def part(span):  # one ranged GET (no HEAD first), written where it belongs
                    a, b = span
                    with _IN_FLIGHT:  # (a retry reads ranges: the whole object's bytes are used once)
                        block = whole.pop() if whole else memoryview(bounded(self.read_range, name, a, b))
                        if block.nbytes != b - a:
                            raise _Damaged(f"{a + block.nbytes} bytes arrived of the {size} expected")
                        os.pwrite(dst.fileno(), block, a)
                    return block if len(spans) == 1 else None

                parts = [self.requests.submit(not ahead, job, part, span) for span in spans]
                try:
                    blocks = [f.result() for f in parts]
                finally:  # a failed part: the others are not left writing into the file being retried
                    for f in parts:
                        f.cancel()
                    concurrent.futures.wait(parts)
                os.fsync(dst.fileno())  # durable before the rename: a power loss leaves no short copy behind
            if sha256 is not None:
                with _mapped(tmp) if len(spans) > 1 else contextlib.nullcontext(blocks[0] if spans else b"") as data:
                    digest = hashlib.sha256(data).hexdigest()
                if digest != sha256:
                    raise _Damaged("its sha256 does not match the manifest's: the object is corrupt or was replaced")
            with self._accounting():  # a rename mid-listing could hide the file from a count
                os.replace(tmp, local)

        try:
            self.retry(name, attempt, bound=False)  # each ranged read is bounded
        finally:
            tmp.unlink(missing_ok=True)
        self.downloads += 1
        return True

    def _make_room(self, size: int, upcoming: set, reserve: Path, ahead: bool) -> bool:
        """Evict shards until `size` more bytes fit the limit, least recently used first and
        those the next steps read (`upcoming`) last (a prefetch evicts none of them), and
        reserve the bytes: `reserve` (the download's temporary) is created at that size while
        the lock is held, so concurrent downloads, in any process, count each other. False
        for a prefetch that finds no room; a fetch needed now waits for downloads in progress
        to free theirs, and fails only when nothing can."""
        if size > self.limit:
            raise StoreError(f"{self.url}: an object of {size} bytes cannot fit cache_limit {self.limit}; raise it")
        while True:
            with self._accounting():
                files = list(self._cached())
                used = sum(s for _, s, _ in files)
                evictable = [(str(p.relative_to(self.dir)) in upcoming, t, s, p) for t, s, p in files
                             if not p.name.startswith(".") and p.suffix in (".bin", ".array_record")]
                for is_upcoming, _, s, p in sorted(evictable, key=lambda f: f[:2]):
                    if used + size <= self.limit or (ahead and is_upcoming):
                        break
                    p.unlink(missing_ok=True)
                    handles.POOL.drop(("arrayrecord", str(p)))  # an open reader would hold its space
                    used -= s
                if used + size <= self.limit:
                    with open(reserve, "wb") as f:
                        f.truncate(size)
                    return True
                downloading = any(".tmp-" in p.name for _, _, p in files)
            if ahead:
                return False
            if downloading:  # reservations of processes that died mid-download are reclaimed
                for d in {p.parent for _, _, p in files if ".tmp-" in p.name}:
                    remove_stale_temporaries(d)
            if not downloading:
                raise StoreError(f"{self.url}: cache_limit {self.limit} bytes is full ({used} bytes) and nothing "
                                 "can be evicted; raise it")
            time.sleep(0.05)  # downloads in progress hold reservations: wait for them to land

    def _cached(self):
        """(mtime, size, path) of the cache's files: copies, and downloads in progress (their
        temporaries are allocated at full size); lock files (empty) and `.plans` (packing plans
        kept beside the copies) are skipped without a stat, as this runs before every download."""
        pending = [self.dir]
        while pending:
            try:
                entries = list(os.scandir(pending.pop()))
            except FileNotFoundError:
                continue
            for e in entries:
                hidden = e.name.startswith(".")
                if e.is_dir(follow_symlinks=False):
                    if not hidden:
                        pending.append(e.path)
                    continue
                if hidden and e.name.endswith(".lock"):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:  # evicted or renamed meanwhile
                    continue
                yield st.st_mtime, st.st_size, Path(e.path)

    def used(self) -> int:
        """Bytes of the files in the cache directory, downloads in progress at their full size."""
        with self._accounting():
            return sum(size for _, size, _ in self._cached())

    def _accounting(self):
        """The lock under which the cache's bytes change by more than a shrink (reservations,
        renames, eviction) and are counted, across the host's processes."""
        return file_lock(self.dir / ".evict.lock") if self.limit is not None else contextlib.nullcontext()


def _mapped(path: Path) -> mmap.mmap:
    """A download's own temporary file (no other process writes it: the object's lock is held),
    mapped for its checksum: hashing the pages just written, without reading them into 16 MiB
    copies, is 1.65x `sha256_file`'s rate on a process's first file and 1.07x after (a 24 MB
    file in the page cache). `sha256_file` keeps reading: a file another process truncates
    while it is mapped would kill the reader (SIGBUS) instead of failing its check."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class _Damaged(Exception):
    """A download that arrived incomplete or with the wrong checksum (retried)."""


class RemoteStore(NativeStore):
    """A forge-grain store in object storage, read through a local cache.

    Options besides `NativeStore`'s: `storage_options` (for fsspec: credentials,
    `endpoint_url`, ...), `object_cache` (the cache directory; default
    `$FORGE_GRAIN_CACHE/objects`), `cache_limit` (bytes; default unbounded) and
    `fetch_threads` (downloads at once ahead of need; default 8).
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
              fetch_threads=FETCH_THREADS) -> None:
        self.cache = ObjectCache(self.url, storage_options, object_cache, cache_limit, requests=fetch_threads)
        manifest = self.cache.fresh(MANIFEST_NAME, missing_ok=True)
        if manifest is None:
            raise self.cache.not_a_store()
        # the indices and shards of this manifest live in a directory named by its content:
        # a store rewritten in place gets a new one, so nothing stale is ever read
        self.mirror = Path(hashlib.sha256(manifest).hexdigest()[:16])
        local = self.cache.dir / self.mirror
        local.mkdir(exist_ok=True)
        remove_stale_temporaries(local)  # downloads of processes that died
        if not (local / MANIFEST_NAME).exists():
            tmp = temporary(local / MANIFEST_NAME)
            tmp.write_bytes(manifest)
            os.replace(tmp, local / MANIFEST_NAME)
        self.path = local
        m = Manifest.load(local)
        # the shards' sizes come from the manifest and the indices are got whole and checked by their
        # sha256; otherwise one listing gives every object's size (no HEAD before each GET of an index
        # or ArrayRecord shard). A store of 10,000 shards takes 20 list requests (1,000 objects each).
        self._sizes = {} if m.layout == "bin" and all(s.index_sha256 for s in m.shards) else self.cache.sizes()
        with concurrent.futures.ThreadPoolExecutor(FETCH_THREADS) as pool:  # the indices: small, all needed at open
            list(pool.map(lambda s: self.cache.get(s.index, f"{self.mirror}/{s.index}", s.index_sha256,
                                                   self._sizes.get(s.index)), m.shards))
        self._fetch_threads = fetch_threads
        self._mapped: dict[int, np.ndarray] = {}
        self._keep: frozenset = frozenset()
        super()._open(dtype)
        if self._records is not None:
            self._records = arrayrecord.Records(self._files, self._file_docs, fetch=self._fetch,
                                                compressed=self.compressed)

    @per_process
    def _pool(self):
        """This process's download threads (a forked child has none of the parent's: work
        queued to the parent's executor there would never run)."""
        return concurrent.futures.ThreadPoolExecutor(self._fetch_threads, thread_name_prefix="forge-grain-fetch")

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
        offsets = [self._load_index(self.path / s.index, s) for s in m.shards]
        if m.layout == "bin":
            self._arrays = [checks.empty_tokens(self.dtype)] * len(m.shards)
            sizes = [s.num_tokens for s in m.shards]
            self._pieces = (np.concatenate([[0], np.cumsum(sizes)]), np.arange(len(sizes)), np.zeros(len(sizes)))
        return offsets

    def _name(self, k: int) -> str:
        return f"{self.mirror}/{self.manifest.shards[k].tokens}"

    def _fetch(self, k: int, ahead: bool = False) -> Path | None:
        s = self.manifest.shards[k]
        size = s.num_tokens * self.dtype.itemsize if self.manifest.layout == "bin" else self._sizes.get(s.tokens)
        return self.cache.get(s.tokens, self._name(k), s.sha256, size, upcoming=self._keep, ahead=ahead)

    def _array(self, k: int) -> np.ndarray:
        arr = self._mapped.get(k)
        if arr is not None:
            return arr
        with self._lock:
            future = self._pending.get(k)
        path = future.result() if future is not None else None
        path = path or self._fetch(k)  # not prefetched, or skipped for want of room
        shard, evicted = self.manifest.shards[k], 0
        while True:
            try:
                arr = self._map_bin_shard(path, shard)
                break
            except (FileNotFoundError, StoreError):
                if path.exists():  # a damaged copy (a power loss, a disk error): the object is the truth
                    arr = self._map_bin_shard(self._refetch(k, path), shard)
                    break
                evicted += 1  # evicted between its download and its mapping, by another download
                if evicted > 3:  # ... again and again: the step's shards do not fit together
                    raise StoreError(
                        f"{self.url}/{shard.tokens}: evicted before it could be read, {evicted} times: cache_limit "
                        f"{self.cache.limit} bytes cannot hold the shards one step reads (this one is "
                        f"{shard.num_tokens * self.dtype.itemsize} bytes); raise cache_limit") from None
                path = self._fetch(k)
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # recently used: evicted last
        with self._lock:
            self._mapped[k] = arr
        return arr

    def prefetch(self, needed) -> None:
        """Download shards `needed` (in the order the next steps read them) in the background,
        first needed first; until the next hint, eviction spares them. With `cache_limit`, the
        hint is cut where the shards would fill half the cache (shards hinted further ahead
        would evict each other's, or other processes', before they are read), but keeps the
        shard read next along with the one read now wherever the two fit the limit: with one
        alone, every shard boundary waited for a download. Maps of shards no longer needed are
        dropped, so evicted files free their space."""
        needed = list(dict.fromkeys(int(k) for k in needed))
        if self.cache.limit is not None:
            total, kept = 0, []
            for k in needed:
                total += self.manifest.shards[k].num_tokens * self.dtype.itemsize
                if kept and total > self.cache.limit // 2 and (len(kept) >= 2 or total > self.cache.limit):
                    break
                kept.append(k)
            needed = kept
        with self._lock:
            self._keep = frozenset(self._name(k) for k in needed)
            for k in [k for k in self._mapped if k not in set(needed)]:
                del self._mapped[k]
            for k in needed:
                if k not in self._mapped and k not in self._pending:
                    self._pending[k] = self._pool.submit(self._fetch, k, True)
            for k in [k for k, f in self._pending.items() if f.done()]:
                self._pending.pop(k).result()  # a failed download raises here, naming the object

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


def changed_under(url: str) -> StoreError:
    """The error of a process that finds other data at a URL than the pipeline it serves opened."""
    return StoreError(f"{url}: the data at this URL changed after the pipeline opened it (it was rewritten in "
                      "place); this process would read other documents than the pipeline's plan and states describe. "
                      "Build the pipeline again, and resume only from a state saved with the data there now")


UPLOAD_MARKER = ".forge-grain-upload.json"  # names the manifest an unfinished upload is writing


def upload_store(local: Path, url: str, storage_options: dict | None = None, *, overwrite: bool = False,
                 progress: bool = True, threads: int = 8) -> None:
    """Copy the prepared store at `local` to `url`: shards and indices, then the manifest.

    An object store's PUT is atomic (an object present is whole), and the store is
    complete only once its manifest is there, so an interrupted upload leaves no store
    that looks complete; a re-run uploads only the files missing from this upload (a
    marker object names the manifest being uploaded, so files of an earlier store at
    the same URL are never taken for this one's). A URL holding another store is
    refused unless `overwrite`.
    """
    from tqdm.auto import tqdm

    remote = RemoteDir(url, storage_options)
    manifest = (local / MANIFEST_NAME).read_bytes()
    digest = hashlib.sha256(manifest).hexdigest()
    current = read_or_none(remote, MANIFEST_NAME)
    if current == manifest:
        return  # uploaded already
    if current is not None:
        if not overwrite:
            raise StoreError(f"{remote.url}: already holds another token store; choose another output or pass "
                             "--overwrite")
        remote.retry(MANIFEST_NAME, lambda: remote.fs.rm_file(remote.path(MANIFEST_NAME)))  # incomplete from here
    resuming = read_or_none(remote, UPLOAD_MARKER) == digest.encode()
    if not resuming:
        remote.retry(UPLOAD_MARKER, lambda: remote.fs.pipe_file(remote.path(UPLOAD_MARKER), digest.encode()))
    files = [name for s in Manifest.load(local).shards for name in (s.tokens, s.index)]
    present = _remote_sizes(remote) if resuming else {}
    todo = [f for f in files if present.get(f) != (local / f).stat().st_size]
    with tqdm(total=sum((local / f).stat().st_size for f in todo), unit="B", unit_scale=True,
              desc=f"upload {remote.url}", disable=not progress) as bar:
        def put(name):
            remote.retry(name, lambda: remote.fs.put_file(str(local / name), remote.path(name)))
            bar.update((local / name).stat().st_size)

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(put, todo))
    remote.retry(MANIFEST_NAME, lambda: remote.fs.pipe_file(remote.path(MANIFEST_NAME), manifest))
    remote.retry(UPLOAD_MARKER, lambda: remote.fs.rm_file(remote.path(UPLOAD_MARKER)))


def check_writable(url: str, storage_options: dict | None = None) -> None:
    """Write and remove a small object under `url`, so that a missing bucket or a read-only
    credential is reported before any work is done, not after hours of tokenizing."""
    remote = RemoteDir(url, storage_options)
    if read_or_none(remote, MANIFEST_NAME) is not None:
        return  # a store is there: the bucket exists (whether it may be replaced is decided on upload)
    name = f".forge-grain-write-check-{os.getpid()}"
    try:
        bounded(remote.fs.pipe_file, remote.path(name), b"")
        bounded(remote.fs.rm_file, remote.path(name))
    except Exception as e:  # a missing bucket, no permission, no such host: all say the same to the user
        raise StoreError(f"{remote.url}: cannot write there ({e.__class__.__name__}: {e}); check that the bucket "
                         "exists and the credentials may write to it (storage_options)") from None


def read_or_none(remote: RemoteDir, name: str) -> bytes | None:
    return remote.retry(name, lambda: remote.fs.cat_file(remote.path(name)), missing_ok=True)


def listing(remote: RemoteDir) -> dict[str, tuple[int, str]]:
    """Every file under the URL (relative name -> (size, ETag or modification time)), hidden
    ones (forge-grain's own markers, caches) left out; empty when there is nothing."""
    remote.fs.invalidate_cache(remote.root)
    found = remote.retry("", lambda: remote.fs.find(remote.root, detail=True), missing_ok=True) or {}
    out = {}
    for path, entry in found.items():
        name = str(path)[len(remote.root):].lstrip("/")
        if entry.get("type", "file") != "file" or not name or any(p.startswith(".") for p in name.split("/")):
            continue
        tag = entry.get("ETag") or entry.get("etag") or entry.get("LastModified") or entry.get("mtime") or ""
        out[name] = (int(entry["size"]), str(tag))
    return out


def _remote_sizes(remote: RemoteDir) -> dict[str, int]:
    """Size of each object directly under the URL."""
    return {name: size for name, (size, _) in listing(remote).items() if "/" not in name}
