"""Datasets at a URL whose token arrays lie in parts (data files, blocks of documents) fetched
into the bounded cache as the reads need them, the coming steps' parts fetched ahead, and the
first step of a fresh window read in ranged GETs while its parts download.

`mirror_parts.Parted` (a peer's data files) and `mirror_ranges.Ranged` (blocks of a Megatron
or raw file) say what the parts are.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np

from forge_grain.processes import per_process
from forge_grain.stores import step_reads
from forge_grain.stores.base import TokenStore
from forge_grain.stores.document_ranges import DocumentRanges, read_joined, token_spans
from forge_grain.stores.mapping import Maps
from forge_grain.stores.object_cache import within_cache
from forge_grain.stores.remote_dir import changed_under, check_unchanged
from forge_grain.stores.request_pool import OBJECTS
from forge_grain.stores.room_ahead import arrived, first_numbers


class FetchedParts(TokenStore):
    """A dataset at a URL whose token arrays are in parts fetched into the bounded cache as
    the reads need them (`_parts`: each with its `size`, its `copy` in the cache, `fetch` and
    `arrays`; `_first_array`: each part's first token array), the coming steps' parts fetched
    ahead; `Parted` and `mirror_ranges.Ranged` say what the parts are."""

    fetches = True
    _parts: list
    _first_array: list

    @per_process
    def _opened(self) -> Maps:
        """The token arrays of the parts this process has mapped, by part."""
        return Maps()

    @property
    def maps(self) -> Maps:
        """The parts mapped now (a gather's table of addresses holds them while these are unchanged)."""
        return self._opened

    @per_process
    def _lock(self):
        return threading.Lock()

    @per_process
    def _pool(self):
        """This process's download threads, one for each part downloading ahead (`OBJECTS`)."""
        return concurrent.futures.ThreadPoolExecutor(OBJECTS, thread_name_prefix="forge-grain-part")

    @per_process
    def _pending(self) -> dict:
        return {}

    def _array(self, k: int) -> np.ndarray:
        return self.arrays_for([k])[0]

    @property
    def fingerprint(self) -> str:
        """The files' content fingerprints (those the first open did not take, taken from the
        parts an epoch reads: those not read yet are read now, `_complete_prints`) and the
        document boundaries."""
        if self._fingerprint is None:
            self._complete_prints()
            self._fingerprint = self._of_prints()
        return self._fingerprint

    def _complete_prints(self) -> None:
        """Take the content fingerprints not taken yet (`_prints`), reading what they need."""

    def _of_prints(self) -> str:
        """The store's fingerprint, once `_prints` knows every file's."""
        raise NotImplementedError

    # -- the first step of a fresh window read in ranges ----------------------------------------

    @per_process
    def _ranges(self) -> DocumentRanges:
        """This process's ranged reads ahead of the downloads (`document_ranges`: the budget, and
        which step may read them)."""
        return DocumentRanges(sum(p.size for p in self._parts), self.url)

    def _ranged(self) -> bool:
        """Whether a step's documents can be read in ranges of the parts' objects at all (a
        compressed file's cannot)."""
        return True

    def _array_at(self, k: int) -> tuple[str, int, str | None]:
        """Token array `k`'s object, the byte its first token is at there, and its ETag."""
        raise NotImplementedError

    def may_read_ranges(self) -> bool:
        """Whether the step this thread makes may read its documents in ranges: the first of a
        fresh window of hints, budget left, no `cache_limit` (as a forge-grain store's, for the
        same reason: the first step of a global shuffle reads a document or two of dozens of
        files or blocks, each downloaded whole)."""
        return self.cache.limit is None and self._ranges.may(step_reads.step_now()) and self._ranged()

    def read_ranges(self, spans: dict[int, list]) -> dict[int, list[np.ndarray]] | None:
        """For the token arrays of `spans` (array -> token spans [a, b) a step reads) whose parts
        are still arriving: the tokens of each span, read now in ranged GETs of the version the
        dataset was indexed from, array -> arrays in `spans`' order; arrays here are left out.
        None: the step waits for the downloads (a part no prefetch asked for, or ranges that
        cost more than the wait, `DocumentRanges.take`). (No comparison once a part lands, as
        a forge-grain shard's ranges have: both are read of the same version, checked the
        same way: through obstore each GET carries the ETag, through s3fs a HEAD after them.)"""
        part_of = dict(zip(spans, self._parts_of(list(spans)).tolist()))
        with self._lock:
            pending, opened = self._pending, self._opened
            arriving = [k for k in spans if part_of[k] not in opened and not arrived(pending.get(part_of[k]))]
            if not arriving or any(part_of[k] not in pending for k in arriving):
                return None
        item, at = self.dtype.itemsize, {k: self._array_at(k) for k in arriving}
        joined = self._ranges.take({k: [(a * item, b * item) for a, b in spans[k]] for k in arriving},
                                   sum(self._parts[p].size for p in {part_of[k] for k in arriving}),
                                   step_reads.step_now())
        if joined is None:
            return None
        tags = {name: tag for name, _, tag in at.values()}
        conditions = {name: self.cache.conditional(tag) for name, tag in tags.items()}
        got = read_joined(self.cache, joined, lambda k: at[k][:2], conditions)
        for name, tag in tags.items():
            if tag is not None and conditions[name] is None:
                check_unchanged(self.cache, name, tag)
        return token_spans(got, spans, arriving, self.dtype)

    def _parts_of(self, arrays) -> np.ndarray:
        """The parts (files, blocks) holding token arrays `arrays`."""
        return np.searchsorted(self._first_array, np.asarray(arrays, np.int64), side="right") - 1

    def arrays_for(self, needed) -> list[np.ndarray]:
        """Token arrays `needed`, their parts mapped first where they are not (those still
        downloading ahead all needed now: `CacheRoom.needed_now`; not those downloaded
        already: saying so is a file made and removed, 0.2 ms of this thread's CPU)."""
        first, parts = self._first_array, self._parts_of(needed).tolist()
        with self._lock:
            pending = self._pending
            waiting = [self._parts[p].fetched for p in dict.fromkeys(parts) if p in pending and not arrived(pending[p])]
        with self.cache.needed_now(waiting):
            return [self._map_part(p)[k - int(first[p])] for k, p in zip(np.asarray(needed, np.int64).tolist(), parts)]

    def mapped(self, needed) -> list[np.ndarray] | None:
        """Token arrays `needed` if their parts are all mapped: one search and one lock for them
        all (a step reads about six arrays; a lock, a search and the per-process lookups for
        each were a fifth of a Megatron epoch's CPU under a limit)."""
        first, opened, pending, out = self._first_array, self._opened, self._pending, []
        needed = np.asarray(needed, np.int64)
        parts = self._parts_of(needed).tolist()
        with self._lock:  # (as `_map_part` reads them: a prefetch's hints may drop a map meanwhile)
            for k, p in zip(needed.tolist(), parts):
                arrays = opened.get(p)
                if arrays is None or p in pending:
                    return None
                out.append(arrays[k - int(first[p])])
        return out

    def _map_part(self, p: int) -> list[np.ndarray]:
        """Part `p`'s token arrays, mapped (after its prefetch, or fetched now)."""
        with self._lock:
            arrays, future = self._opened.get(p), self._pending.pop(p, None)
        if arrays is None:
            if future is not None:
                self.cache.result_now(future, self._parts[p].fetched)  # (a failed prefetch raises, naming it)
            arrays = self._parts[p].arrays(self._keep)
            with self._lock:
                self._opened[p] = arrays
                self._forget_unhinted(p)
            self._arrived(p, arrays)
        return arrays

    def _arrived(self, p: int, arrays: list) -> None:
        """Part `p` was mapped (`arrays`): what else its bytes serve (see `Ranged`)."""

    def _forget_unhinted(self, now: int) -> None:
        """Drop the maps of parts no hint keeps, oldest first, while the mapped parts exceed
        `cache_limit`: a read across the whole dataset without the pipeline's hints (`verify`,
        random access) keeps no more of it mapped than the cache holds (an evicted file's disk
        space is freed only with its maps)."""
        limit = self.cache.limit
        if limit is None:
            return
        held = sum(self._parts[q].size for q in self._opened)
        for q in [q for q in self._opened if q != now and self._parts[q].copy not in self._keep]:
            if held <= limit:
                break
            held -= self._parts[q].size
            del self._opened[q]

    def held(self, arrays) -> np.ndarray:
        """Which of `arrays` lie in parts mapped, or downloaded by a prefetch."""
        opened, pending = self._opened, self._pending
        return np.array([p in opened or arrived(pending.get(p)) for p in self._parts_of(arrays).tolist()], bool)

    def units_of(self, arrays) -> tuple[np.ndarray, np.ndarray]:
        """The parts (files, blocks) holding token arrays `arrays`, and their bytes: what the
        cache fetches whole."""
        parts = self._parts_of(arrays)
        return parts, np.array([self._parts[p].size for p in parts.tolist()], np.int64)

    def prefetch(self, needed, first: int | None = None, jobs=None) -> None:
        """Fetch the files holding token arrays `needed` (in reading order) in the background,
        as many as the cache holds ahead (`within_cache`); files no longer hinted are
        unmapped, so eviction frees their space. `first`: the step the hinted steps start
        afresh at, which may read its documents in ranges (`read_ranges`)."""
        if first is not None:
            self._ranges.first = first
        holding = self._parts_of(needed)
        number = first_numbers(holding, jobs)
        ordered = list(dict.fromkeys(holding.tolist()))
        parts = within_cache(ordered, lambda p: self._parts[p].size, self.cache.room())
        with self._lock:
            self._keep = frozenset(n for p in parts for n in (self._parts[p].copy, self._parts[p].fetched))
            hinted = set(parts)
            for p in [p for p in self._opened if p not in hinted]:
                del self._opened[p]  # (views handed out stay valid; the file's space is freed with them)
            for p in parts:
                if p not in self._opened and p not in self._pending:
                    self._pending[p] = self.cache.turns.submit(
                        self._pool, lambda job, part=self._parts[p]: part.fetch(lambda: self._keep, True, job),
                        number.get(p))

    def close(self) -> None:
        super().close()
        self._opened.clear()
        self._keep = frozenset()  # (a prefetch waiting for room stops)
        pool = FetchedParts._pool.made(self)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def __reduce__(self):
        return (_reopen_parted, (self.format, self.url, self._options, str(self.home)))

    def __repr__(self) -> str:
        return super().__repr__().replace(repr(str(self.path)), repr(self.url), 1)


def _reopen_parted(format, url, options, home=None):
    """The dataset at `url` opened again in another process (a spawned DataLoader worker), only
    if it is still the one the pipeline opened (its listing names the same records)."""
    store = TokenStore.open(url, **{**options, "format": format})
    if home is not None and str(store.home) != home:
        raise changed_under(url)
    return store
