"""Room for prefetches in a bounded cache: the order in which a process's prefetches take
it (`Turns`), and a prefetch fetched as far as the cache holds it (`Partial`), the
`cache_room.CacheRoom` that counts the bytes deciding what fits."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np

from forge_grain.processes import EXITING

GROW_POLL_S = 0.01  # how often a partial prefetch looks whether the room may have changed (two stats)
GROW_ANYWAY_S = 0.25  # how often it asks for room though nothing it watches changed (copies removed by hand)


def first_numbers(needed, jobs) -> dict:
    """Each of `needed` (shards, parts) to the job number of its first place in the hint
    (`jobs`, one for each; None: {}, numbered as they are submitted)."""
    if jobs is None:
        return {}
    number: dict = {}
    for k, job in zip(np.asarray(needed, np.int64).tolist(), np.asarray(jobs, np.int64).tolist()):
        number.setdefault(k, job)
    return number


def arrived(prefetch) -> bool:
    """Whether a prefetch (a future of `Turns.submit`, or None: none) has finished."""
    return prefetch is not None and prefetch.done()


class Turns:
    """Prefetches of one process take room in the cache in the order the steps need them (a
    later one that took the room first was evicted by the earlier one, needed now, and
    fetched twice: an MDS epoch at a limit of two files fetched 1.06x its data), and none
    while a partial prefetch waits for room (it would take the room that one waits for).
    A turn that comes wakes the one prefetch whose turn it is, not every one waiting: a
    Megatron file at a limit of two blocks' worth has ~28 waiting, and each woken one takes
    the interpreter's lock from the reader (1,347 wake-ups an epoch for 257 turns)."""

    def __init__(self, next_job):
        self._next_job = next_job  # (`requests.job`: a number after those of the jobs asked for before)
        self._lock = threading.Lock()
        self._partial = 0  # partial prefetches waiting for room (one at most)
        self._queued: set = set()  # jobs of prefetches submitted and still to take their room
        self._waiting: dict = {}  # job -> the events that wake its prefetches, waiting for their turn

    def submit(self, pool, fetch, job: int | None = None):
        """`fetch(job)` on `pool`, as a prefetch whose job number is taken now, in the order of
        need (or given: `job`, one of a hint's numbers): it takes room after those of lower
        numbers, and its reads queue after theirs."""
        job = self._next_job() if job is None else job
        with self._lock:
            self._queued.add(job)

        def ahead():
            try:
                return fetch(job)
            finally:  # (a prefetch that found its copy there, or failed, leaves its turn too)
                self.end(job)

        try:
            return pool.submit(ahead)
        except BaseException:
            self.end(job)
            raise

    def wait(self, copy: str, keep, job: int | None) -> bool:
        """Wait until prefetch `job` may take room: no partial prefetch waits, and none
        submitted before it is still to take its room. False if `copy` is no longer hinted
        (`keep()`) meanwhile (looked at every `GROW_POLL_S * 5` s), or the interpreter exits."""
        with self._lock:
            if self._may_go(job):  # (most: their turn is there, and nothing to be woken by)
                return True
            woken = threading.Event()
            self._waiting.setdefault(job, []).append(woken)
        try:
            while True:
                if copy not in keep() or EXITING.is_set():
                    return False
                woken.wait(GROW_POLL_S * 5)
                with self._lock:  # (a turn ends under it too: none is missed between the look and the clear)
                    if self._may_go(job):
                        return True
                    woken.clear()
        finally:
            with self._lock:
                waiting = self._waiting[job]
                waiting.remove(woken)
                if not waiting:
                    del self._waiting[job]

    def _may_go(self, job) -> bool:
        """Whether prefetch `job` may take room now (under `_lock`)."""
        return not self._partial and (job not in self._queued or job == min(self._queued))

    def queued(self) -> int:
        """Prefetches submitted and not yet started (what `Download._part_size` counts)."""
        with self._lock:
            return len(self._queued)

    def end(self, job: int | None) -> None:
        """Prefetch `job` has its room (or none, or wants none): the next may take theirs."""
        with self._lock:
            self._queued.discard(job)
            self._wake_next()

    def start_partial(self) -> bool:
        """Whether a prefetch may wait for room, partly fetched (none of this process does)."""
        with self._lock:
            if self._partial:
                return False
            self._partial += 1
            return True

    def end_partial(self) -> None:
        """The partial prefetch has its room, or gave up."""
        with self._lock:
            self._partial -= 1
            self._wake_next()

    def _wake_next(self) -> None:
        """Wake the prefetch whose turn it is now, if it waits (under `_lock`)."""
        if self._queued and not self._partial:
            for woken in self._waiting.get(min(self._queued), ()):
                woken.set()


class Partial:
    """A prefetch fetched as far as the cache holds it, finished once there is room: in a
    cache of two shards' worth, the next shard cannot fit beside the one being read and the
    indices; without this, every shard boundary waited for a whole download (16 shards
    behind a link of 30 ms and 10 MB/s a connection: 0.47x the unbounded rate). It holds the
    object's lock meanwhile; a fetch of it needed now, in any process (`hurry`), makes it
    stop waiting and make room as such a fetch does."""

    def __init__(self, cache, copy: str, tmp: Path, held: int, size: int, keep):
        self.cache, self.copy, self.tmp, self.held, self.size, self.keep = cache, copy, tmp, held, size, keep
        self.marker = cache._hurry_marker(copy)
        self._counted = True  # (in `cache.turns`, by `_partial`)
        self._seen, self._asked = None, 0.0  # (what `_news` said when room was last asked for, and when)

    def hurried(self) -> bool:
        return self.marker.exists()

    def wanted(self) -> bool:
        """Needed now, or still hinted (not once the hints moved on, the store closed or the
        interpreter exits: then what it fetched is dropped)."""
        return self.hurried() or (self.copy in self.keep() and not EXITING.is_set())

    def _news(self) -> tuple:
        """What decides whether the rest fits: the hints, the word that it is needed now, and the
        ledger, which every change of the cache's bytes by any process appends to (or rewrites)."""
        try:
            st = os.stat(self.cache.ledger.path)
            ledger = (st.st_ino, st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            ledger = None
        return self.hurried(), frozenset(self.keep()), ledger

    def try_grow(self) -> bool:
        """Whether the rest's room is reserved: now, evicting none of the copies the next steps
        read unless it is needed now (then it waits for room as such a fetch does). Room is
        asked for only when something it depends on changed (`_news`), or `GROW_ANYWAY_S`
        after the last ask: asked every `GROW_POLL_S`, under the cache's lock, a LitData
        dataset at two chunks' worth spent 72-114 ms an epoch of a download thread's CPU
        beside the reader on 182-244 asks, nearly all finding what the one before found."""
        if self.held < self.size:
            news, now = self._news(), time.monotonic()
            if news == self._seen and now - self._asked < GROW_ANYWAY_S:
                return False
            self._seen, self._asked = news, now
            hurried, upcoming, _ = news  # (asked with the hints it recorded)
            if not self.cache._make_room(self.size - self.held, upcoming, self.tmp, ahead=not hurried,
                                         held=self.held):
                return False
            self.held = self.size
            self.close(counted_only=True)
        return True

    def close(self, counted_only: bool = False) -> None:
        if self._counted:
            self.cache.turns.end_partial()
            self._counted = False
        if not counted_only:
            self.marker.unlink(missing_ok=True)
