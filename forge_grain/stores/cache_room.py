"""The bytes a bounded cache directory holds, and making room in it (`ObjectCache`'s half
that counts): reservations made before a download starts, eviction of the least recently
used copies no upcoming step needs (a file made in the cache, as `ObjectCache.derive` and
`write_record` make one, reserves its bytes the same way before it exists), and the ledger (`cache_ledger`) that keeps the
count, its own bytes included. Every change happens under one lock per cache directory,
across the host's processes, so the directory never holds more than the limit."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from forge_grain.errors import StoreError
from forge_grain.locks import file_lock
from forge_grain.processes import EXITING, per_process
from forge_grain.stores import handles
from forge_grain.files import remove_stale_temporaries

# data files (shards, LitData chunks, MDS shards, Arrow files): what eviction removes; indices stay
EVICTABLE = (".bin", ".array_record", ".mds", ".arrow")
PARTIAL_MIN = 1 << 20  # the least of a prefetch worth fetching before the rest fits (or a sixteenth of it)
GROW_POLL_S = 0.01  # how often a partial prefetch looks for room (a lock and the ledger's tail)


class CacheRoom:
    """What `ObjectCache` counts and evicts (it sets `dir`, `limit`, `ledger` and `url`)."""

    def room(self) -> int | None:
        """Bytes the limit leaves for copies of data files: what the indices, records and the
        ledger hold is not evicted, so hints ahead must fit beside it (None: unbounded)."""
        if self.limit is None:
            return None
        with self._accounting():
            files = self.ledger.sync()
            kept = sum(size for name, size in files.items() if not name.endswith(EVICTABLE) and ".tmp-" not in name)
            return self.limit - kept - self.ledger.reserve()

    def _commit(self, tmp: Path, local: Path, size: int) -> None:
        """A finished temporary renamed into place, counted at `size` in place of its reservation
        (the ledger and the directory change together)."""
        with self._accounting():
            os.replace(tmp, local)
            self.ledger.sync()
            self.ledger.drop(self._name(tmp))
            self.ledger.add(self._name(local), size)

    def _forget(self, path: Path) -> None:
        """A file removed from the cache and from its count (a failed download's reservation, a
        copy no longer wanted)."""
        with self._accounting():
            path.unlink(missing_ok=True)
            self.ledger.sync()
            self.ledger.drop(self._name(path))

    def hurry(self, copy: str) -> None:
        """Say, to any process, that the copy at `copy` is needed now: a prefetch of it waiting
        for room (`Partial`) stops waiting and makes room as a fetch needed now does."""
        with contextlib.suppress(OSError):
            self._hurry_marker(copy).touch()

    def _hurry_marker(self, copy: str) -> Path:
        return self.dir / f".{copy.replace('/', '_')}.hurry.lock"  # (".lock": not counted, as the locks)

    def _partial(self, local: Path, tmp: Path, size: int, keep) -> "Partial | None":
        """A prefetch of `size` bytes that does not fit the cache now, reserved as far as it
        fits (None where under a quarter of it does, or another of this process's waits)."""
        turns = self._turns
        with turns[0]:
            if turns[1]:
                return None
            turns[1] += 1
        with self._accounting():
            files = self.ledger.sync()
            upcoming = keep()
            free = self.limit - self.ledger.used() + sum(
                n for name, n in files.items()
                if name.endswith(EVICTABLE) and name not in upcoming and not name.rsplit("/", 1)[-1].startswith("."))
        held = min(free, size - 1)
        if held >= max(1, size // 4) and self._make_room(held, upcoming, tmp, ahead=True):
            return Partial(self, self._name(local), tmp, held, size, keep)
        self._end_wait()
        return None

    @per_process
    def _turns(self) -> list:
        """[a condition, this process's partial prefetches waiting for room (one at most), the
        jobs of the prefetches queued (`submit_ahead`)]: prefetches take room in the order the
        steps need them, none while a partial one waits (it would take the room that one
        waits for; and one needed later that took room first would be evicted by the earlier
        one, needed now, and fetched twice)."""
        return [threading.Condition(), 0, set()]

    def submit_ahead(self, pool, fetch, *args):
        """`fetch(*args, job)` of a prefetch on `pool`, its job (`requests.job()`) queued as it
        is submitted, in the order of need: it takes room after those queued before it."""
        job = self.requests.job()
        with self._turns[0]:
            self._turns[2].add(job)

        def ahead():
            try:
                return fetch(*args, job)
            finally:  # (a prefetch that found its copy there, or failed, leaves its turn too)
                self.end_turn(job)

        try:
            return pool.submit(ahead)
        except BaseException:
            self.end_turn(job)
            raise

    def _await_turn(self, copy: str, keep, job: int | None) -> bool:
        """Wait until prefetch `job` may take room: no partial prefetch waits, and no prefetch
        queued before it is still to take its room. False if `copy` is no longer hinted
        meanwhile (or the interpreter exits)."""
        turns = self._turns
        with turns[0]:
            while turns[1] or (job in turns[2] and job != min(turns[2])):
                if copy not in keep() or EXITING.is_set():
                    return False
                turns[0].wait(GROW_POLL_S * 5)
        return True

    def end_turn(self, job: int | None) -> None:
        """Prefetch `job` has its room (or none, or wants none): the next may take theirs."""
        with self._turns[0]:
            self._turns[2].discard(job)
            self._turns[0].notify_all()

    def _end_wait(self) -> None:
        """A partial prefetch has its room, or gave up."""
        with self._turns[0]:
            self._turns[1] -= 1
            self._turns[0].notify_all()

    def _make_room(self, size: int, upcoming: set, reserve: Path, ahead: bool, never=frozenset(),
                   held: int = 0) -> bool:
        """Evict shards until `size` more bytes fit the limit, least recently used first and
        those the next steps read (`upcoming`) last (a prefetch evicts none of them), and
        reserve the bytes: `reserve` (the download's temporary) is created at that size while
        the lock is held, so concurrent downloads, in any process, count each other. False
        for a prefetch that finds no room; a fetch needed now waits for downloads in progress
        to free theirs, and fails only when nothing can. The bytes held come from the ledger;
        only when they do not fit are the copies' times of last use looked up (a stat each).
        `held`: bytes `reserve` holds already (a partial prefetch growing by `size`)."""
        if held + size + self.ledger.reserve() > self.limit:
            raise StoreError(f"{self.url}: an object of {size} bytes cannot fit cache_limit {self.limit} beside the "
                             "cache's ledger; raise it")
        walked = False
        while True:
            with self._accounting():
                self.ledger.sync()
                used = self.ledger.used()
                if used + size > self.limit:
                    used -= self._evict(used + size - self.limit, upcoming, ahead, never)
                if used + size <= self.limit:
                    with open(reserve, "r+b" if held else "wb") as f:
                        f.truncate(held + size)
                    self.ledger.add(self._name(reserve), held + size)
                    return True
                downloading = self._downloading(self._name(reserve) if held else None)
                if not downloading and not walked:  # the ledger may count files gone: count once more
                    self.ledger.rebuild()
                    walked = True
                    continue
            if ahead:
                return False
            if not downloading:
                raise StoreError(f"{self.url}: cache_limit {self.limit} bytes cannot take {size} bytes more: it holds "
                                 f"{used} (indices, records, the ledger and copies being read) and nothing can be "
                                 "evicted; raise it")
            time.sleep(0.05)  # downloads in progress hold reservations: wait for them to land

    def _evict(self, excess: int, upcoming, ahead: bool, never=frozenset()) -> int:
        """Remove copies of shards until `excess` bytes are freed, least recently used first and
        those in `upcoming` last (none of them for a prefetch), none in `never`: the bytes freed."""
        candidates, freed = [], 0
        for name, size in list(self.ledger.files.items()):
            if name.rsplit("/", 1)[-1].startswith(".") or not name.endswith(EVICTABLE) or name in never:
                continue
            try:
                used = os.stat(self.dir / name).st_mtime
            except FileNotFoundError:  # removed by hand, or a damaged copy dropped: not there to count
                self.ledger.drop(name)
                freed += size
                continue
            candidates.append((name in upcoming, used, size, name))
        for is_upcoming, _, size, name in sorted(candidates, key=lambda c: c[:2]):
            if freed >= excess or (ahead and is_upcoming):
                break
            (self.dir / name).unlink(missing_ok=True)
            handles.POOL.drop(("arrayrecord", str(self.dir / name)))  # an open reader would hold its space
            self.ledger.drop(name)
            freed += size
        return freed

    def _downloading(self, own: str | None = None) -> bool:
        """Whether downloads (other than `own`) hold reservations now; those of processes that
        died are reclaimed (their temporaries removed, and dropped from the ledger)."""
        pending = [n for n in self.ledger.files if ".tmp-" in n]
        for d in {(self.dir / n).parent for n in pending}:
            remove_stale_temporaries(d)
        for n in pending:
            if not (self.dir / n).exists():
                self.ledger.drop(n)
        return any(".tmp-" in n and n != own for n in self.ledger.files)

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
                if hidden and (e.name.endswith(".lock") or e.name.startswith(".ledger")):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:  # evicted or renamed meanwhile
                    continue
                yield st.st_mtime, st.st_size, Path(e.path)

    def used(self) -> int:
        """Bytes of the files in the cache directory, downloads in progress at their full size,
        the ledger included."""
        with self._accounting():
            return sum(size for _, size, _ in self._cached()) + self.ledger.size()

    def _accounting(self):
        """The lock under which the cache's bytes change by more than a shrink (reservations,
        renames, eviction) and are counted, and its ledger written, across the host's processes."""
        return file_lock(self.dir / ".evict.lock")


EVICTED_TRIES = 4  # fetches of one copy that other downloads evicted before it was read


def read_copy(fetch, read, what: str, limit: int | None, needed: str):
    """`read(path)` of the cache copy `fetch()` returns, fetched again when other downloads
    evicted it between the two (the read found no file, and the copy is gone), at most
    `EVICTED_TRIES` times; then an error naming `what` and saying the limit cannot hold
    `needed`. A read that fails on a copy still there raises as it is. The copy read is
    touched: recently used, evicted last."""
    for _ in range(EVICTED_TRIES):
        path = fetch()
        try:
            value = read(path)
        except (FileNotFoundError, StoreError):
            if path.exists():
                raise
            continue
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)
        return value
    raise StoreError(f"{what}: evicted before it could be read, {EVICTED_TRIES} times: cache_limit {limit} bytes "
                     f"cannot hold {needed}; raise cache_limit")


class Partial:
    """A prefetch fetched as far as the cache holds it, finished once there is room: in a
    cache of two shards' worth, the next shard cannot fit beside the one being read and the
    indices; without this, every shard boundary waited for a whole download (16 shards
    behind a link of 30 ms and 10 MB/s a connection: 0.47x the unbounded rate). It holds the
    object's lock meanwhile; a fetch of it needed now, in any process (`hurry`), makes it
    stop waiting and make room as such a fetch does."""

    def __init__(self, cache: CacheRoom, copy: str, tmp: Path, held: int, size: int, keep):
        self.cache, self.copy, self.tmp, self.held, self.size, self.keep = cache, copy, tmp, held, size, keep
        self.marker = cache._hurry_marker(copy)
        self._counted = True  # (in `cache._turns`, by `_partial`)

    def hurried(self) -> bool:
        return self.marker.exists()

    def wanted(self) -> bool:
        """Needed now, or still hinted (not once the hints moved on, the store closed or the
        interpreter exits: then what it fetched is dropped)."""
        return self.hurried() or (self.copy in self.keep() and not EXITING.is_set())

    def try_grow(self) -> bool:
        """Whether the rest's room is reserved: now, evicting none of the copies the next steps
        read unless it is needed now (then it waits for room as such a fetch does)."""
        if self.held < self.size:
            hurried = self.hurried()
            if not self.cache._make_room(self.size - self.held, self.keep(), self.tmp, ahead=not hurried,
                                         held=self.held):
                return False
            self.held = self.size
            self.close(counted_only=True)
        return True

    def close(self, counted_only: bool = False) -> None:
        if self._counted:
            self.cache._end_wait()
            self._counted = False
        if not counted_only:
            self.marker.unlink(missing_ok=True)
