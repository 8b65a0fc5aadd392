"""Requests to object storage: how long they may take, and the threads that make them.

Every request to a remote store is bounded (`bounded`: `request_deadline()` seconds, a
quarter of `FORGE_GRAIN_REMOTE_DEADLINE`, so a server that accepts a request and never
answers cannot block a job; a read through obstore by its client's own timeout,
`RemoteDir.read_bounded`), and ranged reads run on one pool of worker threads per
process (`shared_requests`), most urgent first. How many run at once is what the link
gives (`Growth`: doubled while the throughput grows with it, from `START` up to `BOUND`),
unless a fixed number is asked for (`fetch_threads`). The pool, its lock and the read slots
are made again in a forked child, which has none of its parent's threads.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import os
import queue
import threading
import time
import weakref

from forge_grain.errors import StoreError
from forge_grain.processes import EXITING, at_fork
from forge_grain.stores.handles import share_of_descriptors

RETRIES = 5
# objects downloading at once ahead of need (a store's threads for them; `ahead_slots`: a
# process's), each on its own thread waiting on its parts' reads (FetchWindow's FETCH_SHARDS);
# `object_cache.within_cache` and the request pool bound them further. The
# parts of a Megatron file under a cache_limit downloaded 8 at a time (the pool they shared with
# the first open's indexing) while the hints held 28: behind 30 ms and 2 MB/s a connection the
# epoch at 2 and 4 blocks' worth took 11.9 and 10.3 s, now 7.4 and 5.3 s (bench_cache_limit.py)
OBJECTS = 64
START, BOUND = 16, 64  # ranged reads in flight: where a pool starts, and the most it grows to
IN_FLIGHT = BOUND  # ranged reads held in memory at once, process-wide (parts of at most 8 MiB: 512 MiB)
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


class Growth:
    """How many reads a pool runs at once, found from what the link gives, as TCP's slow
    start finds a window: object storage is bound by the time to each answer's first byte
    and by what one connection carries, so a reader fills the link only with enough requests
    in flight, and how many is enough depends on the link. Over each round (as many reads
    completed as there are workers, and `INTERVAL` seconds at least) in which requests waited
    for a worker the whole time (so the workers, not the consumer, were the limit), the
    bytes read are measured; while a doubling of the workers raised that rate by `GAIN` or
    more, they double again, up to `BOUND`; the first doubling that did not help ends the
    growth (a link that is already full, or a machine whose CPU is: more requests would only
    hold more memory). Settled below `BOUND`, it probes: once its workers have been the limit
    for `PROBE_S` seconds of rounds, it doubles them for a round, keeps them if the rate rose
    by `GAIN`, and otherwise goes back (more reads sharing a full link would each arrive later,
    the one a batch waits for too) and waits twice as long before the next probe. Without it,
    one round measured while the CPU was busy (a cold start loading its kernels, another
    pipeline of the process) ended the growth for good."""

    INTERVAL = 0.1  # the fewest seconds a measurement spans
    GAIN = 1.15
    PROBE_S = 5.0  # seconds of rounds with requests waiting, settled, before the first probe

    def __init__(self, start: int = START, bound: int = BOUND, clock=time.monotonic):
        self.workers, self.bound, self.settled = start, bound, start >= bound
        self._best, self._lock, self._clock = 0.0, threading.Lock(), clock
        # settled: seconds of rounds the workers were the limit, those a probe waits for, and while
        # a probe's round is measured, the workers before it
        self._waited, self._probe_after, self._probing = 0.0, self.PROBE_S, None
        self._begin()

    def _begin(self) -> None:
        self._since, self._bytes, self._reads, self._busy = self._clock(), 0, 0, True

    def done(self, nbytes: int, backlog: bool) -> int:
        """A read of `nbytes` finished, with requests waiting (`backlog`) or none: the number
        of workers now wanted."""
        with self._lock:
            self._bytes += nbytes
            self._reads += 1
            self._busy &= backlog
            elapsed = self._clock() - self._since
            if (self.settled and self.workers >= self.bound) or self._reads < self.workers or elapsed < self.INTERVAL:
                return self.workers
            rate, busy = self._bytes / elapsed, self._busy
            self._begin()
            if not busy:  # the consumer asked for less than the workers could read: nothing learnt
                return self.workers
            if self.settled:
                self._waited += elapsed
                if self._waited < self._probe_after:
                    return self.workers
                # a doubling tried again, measured against the rate now
                self._best, self._waited, self._probing = rate, 0.0, self.workers
            elif rate >= self._best * self.GAIN:
                self._best, self._probe_after, self._probing = rate, self.PROBE_S, None
            elif self._probing is not None:  # the probe did not help: back, and the next waits longer
                self.workers, self.settled, self._probing = self._probing, True, None
                self._probe_after *= 2
                return self.workers
            else:
                self.settled = True
                return self.workers
            self.workers = min(2 * self.workers, self.bound)
            self.settled = self.workers >= self.bound and self._probing is None
            return self.workers


class Carried:
    """The bytes one request to an endpoint carries in a given time at the rate a connection
    was seen to read at lately: the `BEST` quantile of the rates of the last `RECENT` reads of
    `SMALLEST` bytes or more (each read's bytes over its seconds, its wait for the first byte
    included). What `Download` cuts an object fetched ahead by. Near the best, not a mean:
    reads slowed by a busy CPU would otherwise ask for smaller parts, so more requests, so a
    busier CPU; and not the very best, which one read served from a cache near the host
    would set. A link that slows for good is followed once nine in ten recent reads are slow
    (a 24.7 MB shard is 20-50 reads). One for each endpoint and bucket (`carried_on`): a
    process reading a near bucket and a far one (or a benchmark reading one server straight
    and through a shaped link) cuts each by its own link; shared, the near one's 8 MiB parts
    took a shard 0.8 s a part through the far one."""

    RECENT = 256
    SMALLEST = 1 << 18
    BEST = 0.9

    def __init__(self):
        self._rates: collections.deque = collections.deque(maxlen=self.RECENT)
        self._lock = threading.Lock()

    def read(self, nbytes: int, seconds: float) -> None:
        if nbytes >= self.SMALLEST and seconds > 0:
            with self._lock:
                self._rates.append(nbytes / seconds)

    def bytes_in(self, seconds: float) -> int:
        """What a request carries in `seconds` (0 until a read was seen)."""
        with self._lock:
            rates = sorted(self._rates)
        return int(rates[int(self.BEST * (len(rates) - 1))] * seconds) if rates else 0


class Requests:
    """Worker threads running ranged reads in order of need: a read for a batch waiting now
    first, then prefetches in the order they were asked for (the order the steps read them),
    the parts of one object before the next object's. So the shard the consumer reads next
    arrives with all the connections' bandwidth instead of sharing it with the shards after
    it, and the connections stay busy whatever the object sizes. `workers`: that many at
    once, or None: as many as the link gives (`Growth`)."""

    def __init__(self, workers: int | None = None):
        self.fixed, self._order = workers, itertools.count()  # (ties: the order of submission)
        self._next_job = 0
        self._reset()
        _ALL_REQUESTS.add(self)

    @property
    def workers(self) -> int:
        """The reads it runs at once now."""
        return self.growth.workers

    def _reset(self) -> None:
        """No workers yet (and, in a forked child, none of the parent's queue, lock or
        measurements: it finds its own share of the link)."""
        self._queue, self._lock, self._running = queue.PriorityQueue(), threading.Lock(), 0
        self._numbering = threading.Lock()
        self._resting, self._more = 0, threading.Condition(self._lock)  # (workers above the growth's)
        self.growth = Growth(self.fixed, self.fixed) if self.fixed else Growth()
        self._held, self._unheld = 0, threading.Condition()

    def holding(self) -> "_Holding":
        """While in it, the workers start no read that is not urgent: small reads a batch waits
        for, made on threads of their own (`object_cache.read_at_once`), are not served
        behind the parts of the downloads that start meanwhile (a first batch's 38 ranges
        behind a 30 ms link took 0.2-0.5 s beside them on 2 cores)."""
        return _Holding(self)

    def submit(self, urgent: bool, job: int, fn, *args, size: int = 0) -> concurrent.futures.Future:
        """Run `fn(*args)` on a worker; `job` orders the jobs of equal urgency (earlier first);
        `size`: the bytes it reads (what the pool's growth measures)."""
        self._grow(self.growth.workers)
        future = concurrent.futures.Future()
        self._queue.put(((0 if urgent else 1, job, next(self._order)), future, fn, args, size))
        return future

    def job(self) -> int:
        """A number for a new job, after those of the jobs asked for before."""
        return self.jobs(1)

    def jobs(self, count: int) -> int:
        """The first of `count` consecutive numbers for new jobs, after those asked for before:
        a hint to several sources numbers their prefetches in the order the steps need them
        across the sources (`FetchWindow`)."""
        with self._numbering:
            first, self._next_job = self._next_job, self._next_job + count
        return first

    def _grow(self, workers: int) -> None:
        """Workers up to `workers`, each new one starting the next: `Thread.start` waits until
        the new thread runs, a few ms while another thread holds the GIL (a cold process loading
        its compiled kernels), and 16 started by the thread that asked took 0.2-0.3 s of its
        first batch."""
        with self._lock:
            more = workers - self._running
            self._running = max(self._running, workers)
            if self._resting and self._running - self._resting < workers:
                self._more.notify_all()
        if more > 0:
            self._start(self._queue, more)

    def _start(self, jobs: queue.PriorityQueue, count: int) -> None:
        threading.Thread(target=self._work, args=(jobs, count - 1), daemon=True, name="forge-grain-get").start()

    def _work(self, jobs: queue.PriorityQueue, more: int = 0) -> None:
        if more:
            self._start(jobs, more)
        while True:
            (later, *_), future, fn, args, size = jobs.get()
            if later and self._held:
                with self._unheld:
                    self._unheld.wait_for(lambda: not self._held)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # handed to the waiting download
                    future.set_exception(e)
                    continue
                if jobs is self._queue:  # (not a parent's queue, in a forked child)
                    self._grow(self.growth.done(size, not jobs.empty()))
                    self._rest()

    def _rest(self) -> None:
        """Wait while more workers take jobs than the growth wants (a probe that did not help
        gave its doubling back)."""
        with self._more:
            if self._running - self._resting <= self.growth.workers:
                return
            self._resting += 1
            self._more.wait_for(lambda: self._running - self._resting < self.growth.workers)
            self._resting -= 1


class _Holding:
    """`Requests.holding` (counted: batches in several threads may hold it at once)."""

    def __init__(self, requests: Requests):
        self.requests = requests

    def __enter__(self) -> None:
        with self.requests._unheld:
            self.requests._held += 1

    def __exit__(self, *exc) -> None:
        with self.requests._unheld:
            self.requests._held -= 1
            self.requests._unheld.notify_all()


_REQUESTS: dict[int | None, Requests] = {}  # by worker count: shared by every cache of the process
_CARRIED: dict[tuple, Carried] = {}  # by endpoint and bucket (`carried_on`)
_REQUESTS_LOCK = threading.Lock()
_ALL_REQUESTS: weakref.WeakSet = weakref.WeakSet()


def _after_fork() -> None:
    """A forked child has none of its parent's worker threads, and a lock, queue or read slot
    the parent's threads held mid-operation would stay taken forever: each starts afresh."""
    global _REQUESTS_LOCK, _IN_FLIGHT
    _REQUESTS_LOCK = threading.Lock()
    _IN_FLIGHT = threading.BoundedSemaphore(IN_FLIGHT)
    _AHEAD.clear()
    _CARRIED.clear()
    for pool in list(_ALL_REQUESTS):
        pool._reset()


at_fork(_after_fork)


class Slots:
    """A count of things held at once across a process's threads, which a waiter stops waiting
    for when what it waits to do is no longer wanted, or is needed now (then it goes on
    without one). Waiters sleep until a slot is given back or `poke` says the needs changed
    (hundreds of a mixture's download threads may wait: none polls)."""

    WAKE_S = 1.0  # the longest a waiter sleeps without looking (the interpreter's exit)

    def __init__(self, count: int):
        self.free, self.changed = count, threading.Condition()

    def take(self, wanted, now) -> bool | None:
        """True: a slot taken (`give` it back); False: none, but `now()`: go on without one;
        None: not `wanted()` any more (or the interpreter exits), nothing taken."""
        with self.changed:
            while True:
                if not wanted() or EXITING.is_set():
                    self.changed.notify()  # (the wake-up this waiter took is another's)
                    return None
                if self.free:
                    self.free -= 1
                    return True
                if now():
                    return False
                self.changed.wait(self.WAKE_S)

    def give(self) -> None:
        with self.changed:
            self.free += 1
            self.changed.notify()

    def poke(self) -> None:
        """What the waiters want may have changed: each looks again."""
        with self.changed:
            self.changed.notify_all()


_AHEAD: list = []  # this process's download slots (made on first use: `ahead_slots`)


def ahead_slots() -> Slots:
    """The objects a process downloads ahead of need at once, whatever the number of its
    stores (each has threads for `OBJECTS`): as many, or fewer where the process
    may open few descriptors (`share_of_descriptors`), since each holds two while it runs
    (its temporary file and its lock)."""
    with _REQUESTS_LOCK:
        if not _AHEAD:
            _AHEAD.append(Slots(share_of_descriptors(OBJECTS)))
        return _AHEAD[0]


def read_slot() -> threading.BoundedSemaphore:
    """One of the `IN_FLIGHT` slots a ranged read holds while its bytes are in memory (this
    process's: a forked child starts with all of them free)."""
    return _IN_FLIGHT


def carried_on(link: tuple) -> Carried:
    """This process's `Carried` of the endpoint and bucket `link` (the caches of its stores
    there share it)."""
    with _REQUESTS_LOCK:
        return _CARRIED.setdefault(link, Carried())


def shared_requests(workers: int | None = None) -> Requests:
    """The process's pool of `workers` request threads, or of as many as the link gives (None):
    one per count, however many sources."""
    with _REQUESTS_LOCK:
        return _REQUESTS.setdefault(workers, Requests(workers))
