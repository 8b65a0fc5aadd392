"""The bytes a bounded cache directory holds, and making room in it (`ObjectCache`'s half
that counts): reservations made before a download starts, eviction of the least recently
used copies no upcoming step needs (a file made in the cache, as `ObjectCache.derive` and
`write_record` make one, reserves its bytes the same way before it exists), and the ledger (`cache_ledger`) that keeps the
count, its own bytes included. Every change happens under one lock per cache directory,
across the host's processes, so the directory never holds more than the limit."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from forge_grain.errors import StoreError
from forge_grain.locks import file_lock
from forge_grain.processes import per_process
from forge_grain.stores import handles
from forge_grain.stores.decompress import ALGORITHMS
from forge_grain.stores.request_pool import ahead_slots
from forge_grain.stores.room_ahead import Partial, Turns
from forge_grain.files import remove_stale_temporaries

# data files (shards, LitData chunks, MDS shards, Arrow files): what eviction removes; indices stay
EVICTABLE = (".bin", ".array_record", ".mds", ".arrow")
# a compressed MDS shard's copy (shard.00000.mds.zstd), dropped once decompressed: evicted only where
# nothing else frees the room a fetch needs now (one being decompressed is fetched again), for a
# process killed before it dropped one left it behind, and a re-run at the same limit had no room
PACKED = tuple(f".mds.{a}" for a in ALGORITHMS)
LISTED = 4  # copies in one directory above which eviction lists it (one call) rather than look up each


class CacheRoom:
    """What `ObjectCache` counts and evicts (it sets `dir`, `limit`, `ledger` and `url`)."""

    def room(self) -> int | None:
        """Bytes the limit leaves for copies of data files: what the indices, records and the
        ledger hold is not evicted, so hints ahead must fit beside it (None: unbounded)."""
        if self.limit is None:
            return None
        with self._accounting():
            files = self.ledger.sync()
            kept = sum(size for name, size in files.items()
                       if not name.endswith(EVICTABLE + PACKED) and ".tmp-" not in name)
            return self.limit - kept - self.ledger.reserve()

    def ledger_reserve(self) -> int:
        """The most bytes the ledger may take (`Ledger.reserve`), read under the lock its files
        change under (read outside it, beside another thread's download landing, it stopped
        a run with "dictionary changed size during iteration")."""
        with self._accounting():
            return self.ledger.reserve()

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
        for room (`Partial`) stops waiting and makes room as a fetch needed now does, and one
        of this process waiting for a download slot (`ObjectCache.get`) stops waiting. Only the
        latter for an unbounded cache, where nothing waits for room."""
        self._needed_now.add(copy)
        ahead_slots().poke()
        if self.limit is not None:
            with contextlib.suppress(OSError):
                self._hurry_marker(copy).touch()

    @contextlib.contextmanager
    def needed_now(self, copies: list):
        """All of `copies` (prefetches a step waits for) said to be needed now (`hurry`) before
        the first is waited for, so that each is fetched as a read waiting now, not behind the
        prefetches asked for before it (one at a time, a first batch reading 15 shards of one
        source of a mixture waited 1.2-1.8 s for them); the word spent at the end."""
        for copy in copies:
            self.hurry(copy)
        try:
            yield
        finally:
            for copy in copies:
                self.heard(copy)

    def result_now(self, prefetch, copy: str):
        """The result of `prefetch`, the future of a prefetch of `copy`, needed now: hurried
        while it runs, and the word spent once it is over (the prefetch spends it as it ends,
        but one told after that, and before its future was done, left the marker behind)."""
        if prefetch.done():
            return prefetch.result()
        self.hurry(copy)
        try:
            return prefetch.result()
        finally:
            self.heard(copy)

    def heard(self, copy: str) -> None:
        """The word that `copy` is needed now is spent (its fetch is over)."""
        self._needed_now.discard(copy)
        if self.limit is not None:
            self._hurry_marker(copy).unlink(missing_ok=True)

    @per_process
    def _needed_now(self) -> set:
        """Copies this process waits for now (`hurry`)."""
        return set()

    def _hurry_marker(self, copy: str) -> Path:
        return self._beside(copy, ".hurry.lock")

    def _beside(self, copy: str, suffix: str) -> Path:
        """A hidden file of the cache directory named for `copy` and ending in `suffix`: its lock
        (".lock"), its hurry marker; neither is counted against the limit (`_cached`)."""
        return self.dir / f".{copy.replace('/', '_')}{suffix}"

    def _partial(self, local: Path, tmp: Path, size: int, keep) -> "Partial | None":
        """A prefetch of `size` bytes that does not fit the cache now, reserved as far as it
        fits (None where under a quarter of it does, or another of this process's waits)."""
        if not self.turns.start_partial():
            return None
        with self._accounting():
            files = self.ledger.sync()
            upcoming = keep()
            free = self.limit - self.ledger.used() + sum(
                n for name, n in files.items() if _evictable(name) and name not in upcoming)
        held = min(free, size - 1)
        if held >= max(1, size // 4) and self._make_room(held, upcoming, tmp, ahead=True):
            return Partial(self, self._name(local), tmp, held, size, keep)
        self.turns.end_partial()
        return None

    @per_process
    def turns(self) -> Turns:
        """The order in which this process's prefetches take room in the cache."""
        return Turns(self.requests.job)

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
        walked = False
        while True:
            with self._accounting():
                self.ledger.sync()
                if held + size + self.ledger.reserve() > self.limit:
                    raise StoreError(f"{self.url}: an object of {size} bytes cannot fit cache_limit {self.limit} "
                                     "beside the cache's ledger; raise it")
                used = self.ledger.used()
                if used + size > self.limit:
                    used -= self._evict(used + size - self.limit, upcoming, ahead, never)
                if used + size <= self.limit:
                    fd = os.open(reserve, os.O_WRONLY | (0 if held else os.O_CREAT | os.O_TRUNC), 0o666)
                    try:  # (a bare descriptor: `open` makes four system calls more)
                        os.ftruncate(fd, held + size)
                    finally:
                        os.close(fd)
                    self.ledger.add(self._name(reserve), held + size)
                    return True
                downloading = self._downloading(self._name(reserve) if held else None)
                # the ledger may count files gone: count once more, for a read needed now (a prefetch waiting
                # for room asks again whenever the ledger changes: a store at two files' worth walked and
                # rewrote it 130 times an epoch)
                if not downloading and not walked and not ahead:
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
        those in `upcoming` last (none of them for a prefetch), then compressed copies (`PACKED`),
        none in `never`: the bytes freed.
        Copies removed behind the cache's back are found first (`_present`) and count as freed;
        a copy's time of last use is looked up (a stat) only where it may go: those the next
        steps read only when the others do not free enough. A Megatron file at a limit of two
        blocks' worth holds about 30 blocks, nearly all hinted: a stat of each made 25 system
        calls a download, each a hand-over of the interpreter's lock between a download thread
        and the reader."""
        names = [name for name in self.ledger.files if _evictable(name) and name not in never]
        present, freed = self._present(names), 0
        for name in names:
            if name not in present:  # removed by hand, or a damaged copy dropped: not there to count
                freed += self.ledger.files[name]
                self.ledger.drop(name)
        names = [name for name in names if name in present]
        freed = self._evict_oldest([n for n in names if n not in upcoming], present, excess, freed)
        if freed < excess and not ahead:
            freed = self._evict_oldest([n for n in names if n in upcoming], present, excess, freed)
        if freed < excess and not ahead:
            packed = self._present([n for n in self.ledger.files if n.endswith(PACKED) and n not in never])
            freed = self._evict_oldest(list(packed), packed, excess, freed)
        return freed

    def _evict_oldest(self, names: list, used: dict, excess: int, freed: int) -> int:
        """Remove `names`, least recently used first (`used`: the times known, by name), until
        `excess` bytes are freed counting `freed` so far: the bytes freed then."""
        aged = []
        for name in names:
            if freed >= excess:
                return freed
            try:
                aged.append((used[name] if used[name] is not None else os.stat(self.dir / name).st_mtime, name))
            except FileNotFoundError:  # evicted by another process meanwhile
                freed += self.ledger.files.get(name, 0)
                self.ledger.drop(name)
        for _, name in sorted(aged):
            if freed >= excess:
                break
            freed += self.ledger.files.get(name, 0)
            (self.dir / name).unlink(missing_ok=True)
            handles.POOL.drop(("arrayrecord", str(self.dir / name)))  # an open reader would hold its space
            self.ledger.drop(name)
        return freed

    def _present(self, names: list) -> dict:
        """Which of the copies `names` are in the cache directory, each to its time of last use
        where that was looked up on the way (None where not): a directory holding many of them
        is listed once, a copy alone in its directory is looked up by itself."""
        by_dir: dict = {}
        for name in names:
            by_dir.setdefault(name.rpartition("/")[0], []).append(name)
        present = {}
        for directory, inside in by_dir.items():
            if len(inside) > LISTED:
                try:
                    entries = set(os.listdir(self.dir / directory))
                except FileNotFoundError:
                    continue
                present.update((name, None) for name in inside if name.rpartition("/")[2] in entries)
                continue
            for name in inside:
                try:
                    present[name] = os.stat(self.dir / name).st_mtime
                except FileNotFoundError:
                    pass
        return present

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

    @contextlib.contextmanager
    def _accounting(self):
        """The lock under which the cache's bytes change by more than a shrink (reservations,
        renames, eviction) and are counted, and its ledger written, across the host's processes
        (the ledger's lines of each turn written as it ends)."""
        with file_lock(self.dir / ".evict.lock"):
            try:
                yield
            finally:
                self.ledger.flush()


def _evictable(name: str) -> bool:
    """A copy of a data file (not an index or record, nor a temporary: its name is hidden)."""
    return name.endswith(EVICTABLE) and not name.rsplit("/", 1)[-1].startswith(".")


EVICTED_TRIES = 4  # fetches of one copy that other downloads evicted before it was read


def read_copy(fetch, read, what: str, limit: int | None, needed: str):
    """`read(path)` of the cache copy `fetch()` returns, fetched again when other downloads
    evicted it between the two (the read found no file, and the copy is gone), at most
    `EVICTED_TRIES` times; then an error naming `what` and saying the limit cannot hold
    `needed`. A read that fails on a copy still there raises as it is. The copy read is
    touched: recently used, evicted last. None where `fetch` gives none (a prefetch that
    found no room)."""
    for _ in range(EVICTED_TRIES):
        path = fetch()
        if path is None:  # a prefetch that found no room
            return None
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
