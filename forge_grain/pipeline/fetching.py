"""Telling sources in object storage which shards the coming steps read.

A store in object storage downloads shards in the background and keeps them from eviction
when told which ones are coming (`TokenStore.prefetch`). The row order says which rows, so
which shards, every step reads: this module keeps a window of steps ahead of the consumer
and tells each such source the shards of that window, in reading order, whenever it moves.
It only advises: a shard nobody was told of is downloaded when a batch reads it.
"""

from __future__ import annotations

import collections
import contextlib
import threading

import numpy as np

from forge_grain.lazy import lazy
from forge_grain.stores import step_reads

FETCH_SHARDS = 64  # shards a source in object storage is told of ahead: as many as its reads in flight can grow to
# a step this far behind the hinted window's start is one the prefetch threads made out of order,
# not a restore: it leaves the window as it is (recomputing a window of 1,024 steps took ~40 ms)
BEHIND = 64
HINT_STEPS = 16  # steps whose shards are found together (one lookup for 16 steps, not one a step)
BOUNDARY = 3  # a block of steps reading this many shards of a source at most is looked up step by step


class FetchWindow:
    """The steps ahead whose shards the sources in object storage are told of."""

    def __init__(self, opened: list, order, fetch_ahead: int):
        self.datasets = [o.dataset for o in opened]
        self.fetching = [i for i, o in enumerate(opened) if o.fetches]  # sources in object storage
        self.order, self.fetch_ahead = order, fetch_ahead
        # step -> the arrays each fetching source reads at it, in step order; ordered by links, not a
        # dict: its first entry, asked for every step, is found past every entry deleted before it
        # (steps leave from the front), ~4 us a step in a window of 3,000 steps
        self._steps: collections.OrderedDict[int, list] = collections.OrderedDict()
        self._begun: set = set()  # steps of the window this process began (`advance`) ...
        self._made: set = set()  # ... and made (`made`)
        self._last_made = -1
        self._window = {"front": 0, "end": -1}  # the last step begun, the first not in the window, shard counts
        self.fresh_step: int | None = None  # the step the window last started afresh at (`step_reads.fresh`)
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return bool(self.fetching and self.fetch_ahead)

    def making(self, step: int):
        """Around the making of `step`'s batch: `advance` before, `made` after (also when it
        fails)."""
        return _Making(self, step) if self.active else _NOTHING

    def advance(self, step: int) -> None:
        """`step` is being made: tell the sources of the shards it and the next steps read. The
        lookahead goes as far as `FETCH_SHARDS` shards of every such source (enough to keep its
        downloads busy whatever the shard size), `fetch_ahead` steps at most (rounded up to a
        block). Steps enter the window `HINT_STEPS` at a time (their shards found by one lookup)
        and leave it one at a time, once made (`made`)."""
        if not self.active:
            return
        with self._lock:  # Grain's threads make several steps at once
            w = self._window
            if w["front"] - BEHIND <= step < w["front"]:
                if step in self._steps:  # another thread's step, just behind one begun already
                    self._begun.add(step)
                return
            first = None
            if not w["front"] <= step <= w["end"]:  # the first call, a restore, or a jump
                first = self.fresh_step = step
                self._empty()
                w.update(end=step, counts=[collections.Counter() for _ in self.fetching], sent=None)
            w["front"] = step
            # (no step leaves here: a step leaves once made, `made`, and no step entering now is made yet)
            changed = self._enter(step) | (w["sent"] is None)
            if step in self._steps:  # (not a step made again after it left)
                self._begun.add(step)
            if changed:  # a shard came or went: tell the shards, unless they are those told last time
                self._tell(first)

    def made(self, step: int) -> None:
        """`step`'s batch is made: the shards that only it and the steps before it read leave
        the hints now, so a bounded cache may drop them and fetch the next shard while the
        steps after wait for one still arriving (at a limit of two shards, read flat out,
        the next shard was hinted only once the one after it had arrived and a block of
        steps had read it: one download at a time)."""
        if not self.active:
            return
        with self._lock:
            if step not in self._steps:
                return
            self._made.add(step)
            if step > self._last_made:
                self._last_made = step
            if self._leave():
                self._enter(self._window["front"])
                self._tell()

    def stop(self) -> None:
        """No step is coming (the iterator closed): the sources are told of no shard, so the
        downloads ahead not yet begun give up (those running, at most the process's
        `ahead_slots`, finish), and the next step starts the window afresh. A closed
        iterator's window went on downloading every shard it named, up to `FETCH_SHARDS` of
        every source, beside the reads of whatever the process read next."""
        with self._lock:
            if self._window["end"] < 0:  # (never told anything since the last start)
                return
            self._empty()
            self._window.update(front=0, end=-1)  # (the next step is a first call)
            for i in self.fetching:
                self.datasets[i].store.prefetch(np.zeros(0, np.int64))

    def _empty(self) -> None:
        """No step in the window (a fresh start, or a stop)."""
        self._steps.clear()
        self._begun.clear()
        self._made.clear()
        self._last_made = -1

    def read_early(self, step: int, store, arrays) -> None:
        """`step`'s batch has read `arrays` of `store` and will read them no more (it waits for
        its other shards): they leave the step's hints now, and a shard that no step in the
        window reads any more leaves the window (`step_reads`)."""
        with self._lock:
            held = self._steps.get(step)
            j = next((j for j, i in enumerate(self.fetching) if self.datasets[i].store is store), None)
            if held is None or j is None or next(iter(self._steps)) != step:  # (steps before it still read)
                return
            done = np.isin(held[j], np.asarray(arrays, np.int64))
            if not done.any():
                return
            left = _uncount(self._window["counts"][j], held[j][done])
            self._steps[step] = [a[~done] if i == j else a for i, a in enumerate(held)]
            if left:
                self._enter(self._window["front"])
                self._tell()

    def _leave(self) -> bool:
        """Steps leave the window in order: each once made here or, never begun here (another
        worker process's), once a step after it is made here. True if a shard left with them."""
        steps, made, begun = self._steps, self._made, self._begun
        counts, left = self._window["counts"], False
        while steps:
            step = next(iter(steps))
            if step not in made and (step in begun or step >= self._last_made):
                break
            arrays = steps.pop(step)
            if arrays is not None:  # (None: a step whose reads its block's last step holds)
                for count, read in zip(counts, arrays):
                    left |= _uncount(count, read)
            made.discard(step)
            begun.discard(step)
        return left

    def _enter(self, step: int) -> bool:
        """Blocks of steps enter the window until it holds `FETCH_SHARDS` shards of every
        source or reaches `fetch_ahead` steps past `step`."""
        w, o = self._window, self.order
        last = min(step + 1 + self.fetch_ahead, o.step_limit)
        entered = False
        while w["end"] < last and (w["end"] <= step or not self._full()):
            a = w["end"]  # (a block may reach up to HINT_STEPS - 1 steps past `fetch_ahead`)
            b = min(a + min(HINT_STEPS, self.fetch_ahead), o.step_limit)
            for s, arrays in self._block(a, b):
                self._steps[s] = arrays
                if arrays is not None:
                    for count, read in zip(w["counts"], arrays):
                        count.update(read.tolist())
            w["end"] = b
            entered = True
        return entered

    def _full(self) -> bool:
        """Whether the window holds `FETCH_SHARDS` shards of every fetching source (asked
        every step: a loop, not `any` over a generator)."""
        for count, n in zip(self._window["counts"], self._want):
            if len(count) < n:
                return False
        return True

    @lazy
    def _want(self) -> list[int]:
        """The shards of each fetching source the window holds at most (found once, when a store
        may still be opening: `lazy`, not a cached_property)."""
        return [min(FETCH_SHARDS, max(1, self.datasets[i].store.num_arrays)) for i in self.fetching]

    @lazy
    def _bounded(self) -> bool:
        """Whether a fetching source has a `cache_limit` (found once, as `_want`)."""
        return any(self.datasets[i].store.cache.limit is not None for i in self.fetching)

    def _block(self, a: int, b: int) -> list:
        """(step, the arrays each fetching source reads) of steps [a, b), found by one lookup.
        Where a source's steps there read one shard, or a shuffle's many, the block's shards
        are given to its last step (they leave the window with the block); where they read
        two or three (a boundary between shards of the locality order) and a cache is
        bounded, each step gets its own, so a shard read only by the first steps leaves the
        window once those are made, and may be evicted. Unbounded, nothing is evicted: with
        the docs' settings most blocks read two shards, and finding each step's took 0.085-
        0.115 s of an epoch's consumer thread (0.6-0.8 s in all, 16 shards, 6,043 steps)."""
        o = self.order
        rows = o.shard_rows_between(a, b)
        src, rank = o.locate(np.concatenate(rows))
        datasets = o.mixture.datasets  # (a source's rows at the steps' lengths: `seq_lens`)
        whole = [datasets[i].arrays_read(rank[src == i]) for i in self.fetching]
        if not self._bounded or not any(2 <= len(arrays) <= BOUNDARY for arrays in whole):
            return [(s, None) for s in range(a, b - 1)] + [(b - 1, whole)]  # (None: no reads of its own)
        ends = np.cumsum([len(r) for r in rows])
        each = []
        for i in self.fetching:  # (each source's rows of each step: its rows before each step's end)
            mine = src == i
            each.append(datasets[i].arrays_read(rank[mine], np.concatenate([[0], np.cumsum(mine)])[ends]))
        return [(s, [arrays[k] for arrays in each]) for k, s in enumerate(range(a, b))]

    def _tell(self, first: int | None = None) -> None:
        """Tell the sources the shards of the window's steps; `first`: the step the window
        starts afresh at (an iterator made, a restore, a jump), which may read its documents
        in ranges while its shards arrive (`stores.document_ranges`)."""
        w = self._window
        shards = [frozenset(c) for c in w["counts"]]
        if shards == w["sent"]:  # the same shards as the last hint: nothing to tell
            return
        w["sent"] = shards
        steps = [arrays for arrays in self._steps.values() if arrays is not None]
        reads = [[(p, arrays[j]) for p, arrays in enumerate(steps) if len(arrays[j])]  # (most steps' are empty)
                 for j in range(len(self.fetching))]
        jobs = self._numbered(reads)
        for j, i in enumerate(self.fetching):
            read = [a for _, a in reads[j]]
            self.datasets[i].store.prefetch(np.concatenate(read) if read else np.zeros(0, np.int64), first, jobs[j])

    def _numbered(self, reads: list) -> list:
        """The job numbers of each source's reads ((place of the step in the window, arrays)),
        in the order of need across the sources: by step, and within a step (a block's)
        the sources' first arrays, then their second ones, and so on. Numbered one source
        after another, a mixture's whole window of one source queued before the next source's
        first shard, and each of the others was fetched only once a step waited for it."""
        if len(reads) < 2:
            return [None] * len(reads)
        entries = [(np.full(len(a), p), np.arange(len(a)), np.full(len(a), j))
                   for j, read in enumerate(reads) for p, a in read]
        if not entries:
            return [None] * len(reads)
        place, within, source = (np.concatenate(c) for c in zip(*entries))
        rank = np.empty(len(place), np.int64)
        rank[np.lexsort((source, within, place))] = np.arange(len(place))
        pools = [self.datasets[i].store.cache.requests for i in self.fetching]
        # (sources with `fetch_threads` of their own have pools of their own, each numbering its jobs)
        base = {requests: requests.jobs(len(place)) for requests in dict.fromkeys(pools)}
        ends = np.cumsum([sum(len(a) for _, a in read) for read in reads])
        return [base[requests] + r for requests, r in zip(pools, np.split(rank, ends[:-1]))]


_NOTHING = contextlib.nullcontext()


class _Making:
    """`FetchWindow.making` (a class: it is entered every step, and a generator's context
    manager cost several times as much)."""

    __slots__ = ("window", "step", "reads")

    def __init__(self, window: FetchWindow, step: int):
        self.window, self.step, self.reads = window, step, step_reads.making(window, step)

    def __enter__(self) -> None:
        self.window.advance(self.step)
        self.reads.__enter__()

    def __exit__(self, *exc) -> None:
        try:
            self.reads.__exit__()
        finally:
            self.window.made(self.step)


def _uncount(count: collections.Counter, arrays: np.ndarray) -> bool:
    """Take one step's reads of `arrays` off the window's `count` of them: True if a shard is
    read by no step left in the window (it leaves the count)."""
    if not len(arrays):  # (a step of a boundary block reading none of this source's shards)
        return False
    read = arrays.tolist()
    count.subtract(read)
    gone = [k for k in read if count[k] <= 0]
    for k in gone:
        del count[k]
    return bool(gone)
