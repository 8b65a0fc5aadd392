"""Telling sources in object storage which shards the coming steps read.

A store in object storage downloads shards in the background and keeps them from eviction
when told which ones are coming (`TokenStore.prefetch`). The row order says which rows, so
which shards, every step reads: this module keeps a window of steps ahead of the consumer
and tells each such source the shards of that window, in reading order, whenever it moves.
It only advises: a shard nobody was told of is downloaded when a batch reads it.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.lazy import lazy
from forge_grain.stores import step_reads

FETCH_SHARDS = 64  # shards a source in object storage is told of ahead: as many as its reads in flight can grow to
# a step this far behind the hinted window's start is one the prefetch threads made out of order,
# not a restore: it leaves the window as it is (recomputing a window of 1,024 steps took ~40 ms)
BEHIND = 64
HINT_STEPS = 16  # steps entering the window together, their shards found together (not one lookup a step)
LOOKUP_BLOCKS = 4  # blocks of steps looked up in one call (the call's own cost was most of a block's: 2 us a step)
BOUNDARY = 3  # a block of steps reading this many shards of a source at most is looked up step by step


class FetchWindow:
    """The steps ahead whose shards the sources in object storage are told of.

    The window is the steps [`_lo`, `_end`): `_lo` the first not made (nor passed), `_end` the
    first not looked up. Each fetching source's shards in it are kept as the last step of the
    window reading each (`_last`), and each step as the number of shards whose last reader it
    is (`_expiring`): so a step leaving says at once whether a shard leaves with it, and most
    steps cost a few dict lookups (counting each step's reads in and out took a quarter of
    a bounded consumer's CPU a step)."""

    def __init__(self, opened: list, order, fetch_ahead: int):
        self.datasets = [o.dataset for o in opened]
        self.fetching = [i for i, o in enumerate(opened) if o.fetches]  # sources in object storage
        self.order, self.fetch_ahead = order, fetch_ahead
        self.active = bool(self.fetching and fetch_ahead)  # (asked three times a step: not a property)
        self._reads: dict[int, list] = {}  # step -> the arrays each fetching source reads at it (steps that read)
        self._last: list[dict] = [{} for _ in self.fetching]  # shard -> the last step of the window reading it
        self._expiring: dict[int, int] = {}  # step -> shards whose last reader in the window it is
        self._looked: dict[int, tuple] = {}  # a block's first step -> its end and steps, looked up ahead (`_block`)
        self._pending: set = set()  # steps of the window this process began (`advance`), not made yet
        self._lo, self._front, self._end, self._last_made = 0, 0, -1, -1  # (the last step begun: `_front`)
        self._changed, self._sent = False, None  # whether a shard came or went since the last hint; its shards
        self.fresh_step: int | None = None  # the step the window last started afresh at (`step_reads.fresh`)
        self._lock = threading.Lock()

    def making(self, step: int):
        """Around the making of `step`'s batch: `advance` before, `made` after (also when it
        fails)."""
        return _Making(self, step) if self.active else _NOTHING

    def advance(self, step: int) -> None:
        """`step` is being made: tell the sources of the shards it and the next steps read. The
        lookahead goes as far as `FETCH_SHARDS` shards of every such source (enough to keep its
        downloads busy whatever the shard size), `fetch_ahead` steps at most (rounded up to a
        block). Steps enter the window `HINT_STEPS` at a time (their shards found by one lookup)
        and leave it in order, once made (`made`)."""
        if not self.active:
            return
        with self._lock:  # Grain's threads make several steps at once
            if self._front - BEHIND <= step < self._front:
                if step >= self._lo:  # another thread's step, just behind one begun already
                    self._pending.add(step)
                return
            first = None
            if not self._front <= step <= self._end:  # the first call, a restore, or a jump
                first = self.fresh_step = step
                self._empty(step)
            self._front = step
            # (no step leaves here: a step leaves once made, `made`, and no step entering now is made yet)
            self._enter(step)
            if step < self._end:  # (not past the last step)
                self._pending.add(step)
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
            if not self._lo <= step < self._end:
                return
            self._pending.discard(step)
            if step > self._last_made:
                self._last_made = step
            self._leave()
            if self._changed:
                self._enter(self._front)
                self._tell()

    def stop(self) -> None:
        """No step is coming (the iterator closed): the sources are told of no shard, so the
        downloads ahead not yet begun give up (those running, at most the process's
        `ahead_slots`, finish), and the next step starts the window afresh. A closed
        iterator's window went on downloading every shard it named, up to `FETCH_SHARDS` of
        every source, beside the reads of whatever the process read next."""
        with self._lock:
            if self._end < 0:  # (never told anything since the last start)
                return
            self._empty(0)
            self._front, self._end = 0, -1  # (the next step is a first call)
            for i in self.fetching:
                with contextlib.suppress(StoreError):  # a download ahead that failed: no step reads it now
                    self.datasets[i].store.prefetch(np.zeros(0, np.int64))  # (a read of it fetches it again)

    def _empty(self, step: int) -> None:
        """No step in the window, which starts at `step` (a fresh start, or a stop)."""
        self._reads.clear()
        self._expiring.clear()
        self._looked.clear()
        self._pending.clear()
        for last in self._last:
            last.clear()
        self._lo = self._end = step
        self._last_made = -1
        self._changed, self._sent = True, None

    def read_early(self, step: int, store, arrays) -> None:
        """`step`'s batch has read `arrays` of `store` and will read them no more (it waits for
        its other shards): they leave the step's hints now, and a shard that no step in the
        window reads any more leaves the window (`step_reads`)."""
        with self._lock:
            held = self._reads.get(step)
            j = next((j for j, i in enumerate(self.fetching) if self.datasets[i].store is store), None)
            if held is None or j is None or step != self._lo:  # (steps before it still read)
                return
            done = np.isin(held[j], np.asarray(arrays, np.int64))
            if not done.any():
                return
            self._forget(step, j, held[j][done])
            self._reads[step] = [a[~done] if i == j else a for i, a in enumerate(held)]
            if self._changed:
                self._enter(self._front)
                self._tell()

    def _leave(self) -> None:
        """Steps leave the window in order: each once made here or, never begun here (another
        worker process's), once a step after it is made here; the shards whose last reader
        leaves leave with it."""
        lo, pending, expiring, reads = self._lo, self._pending, self._expiring, self._reads
        while lo <= self._last_made and lo not in pending:
            arrays = reads.pop(lo, None)
            if lo in expiring:
                for j, read in enumerate(arrays):
                    self._forget(lo, j, read)
            lo += 1
        self._lo = lo

    def _forget(self, step: int, j: int, read: np.ndarray) -> None:
        """Shards `read` of source `j` are read at `step` no more: those whose last reader it
        was leave the window."""
        last = self._last[j]
        for k in read.tolist():
            if last.get(k) == step:
                del last[k]
                self._expire(step)
                self._changed = True

    def _expire(self, step: int) -> None:
        """One shard fewer has `step` as its last reader."""
        n = self._expiring[step] - 1
        if n:
            self._expiring[step] = n
        else:
            del self._expiring[step]

    def _enter(self, step: int) -> None:
        """Blocks of steps enter the window until it holds `FETCH_SHARDS` shards of every
        source or reaches `fetch_ahead` steps past `step`."""
        o = self.order
        last = min(step + 1 + self.fetch_ahead, o.step_limit)
        while self._end < last and (self._end <= step or not self._full()):
            a = self._end  # (a block may reach up to HINT_STEPS - 1 steps past `fetch_ahead`)
            b = min(a + min(HINT_STEPS, self.fetch_ahead), o.step_limit)
            for s, arrays in self._block(a, b):
                self._add(s, arrays)
            self._end = b

    def _add(self, step: int, arrays: list) -> None:
        """`step` reads `arrays` (those of each fetching source): it is their last reader now."""
        self._reads[step] = arrays
        expiring = self._expiring
        for last, read in zip(self._last, arrays):
            for k in read.tolist():
                before = last.get(k)
                if before is None:
                    self._changed = True
                else:
                    self._expire(before)
                last[k] = step
                expiring[step] = expiring.get(step, 0) + 1

    def _full(self) -> bool:
        """Whether the window holds `FETCH_SHARDS` shards of every fetching source (asked
        every step: a loop, not `any` over a generator)."""
        for last, n in zip(self._last, self._want):
            if len(last) < n:
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

    @lazy
    def _windowed(self) -> list[int]:
        """The fetching sources (their places in `fetching`) read in an order fitted to a
        bounded cache (`packing.fitted`), whose windows hand over from some shards to others
        (`windows_meet`; found once, as `_want`)."""
        return [j for j, i in enumerate(self.fetching) if getattr(self.datasets[i], "fitted", None) is not None]

    def _block(self, a: int, b: int) -> list:
        """(step, the arrays each fetching source reads) of the steps of [a, b) that read.
        Where a source's steps there read one shard, or a shuffle's many, the block's shards
        are given to its last step (they leave the window with the block); where they read
        two or three (a boundary between shards of the locality order) and a cache is
        bounded, or where one window of an order fitted to the cache hands over to the next
        (`windows_meet`), each step gets its own, so a shard read only by the first steps leaves
        the window once those are made, and may be evicted. Unbounded, nothing is evicted: with
        the docs' settings most blocks read two shards, and finding each step's took 0.085-
        0.115 s of an epoch's consumer thread (0.6-0.8 s in all, 16 shards, 6,043 steps)."""
        looked = self._looked.pop(a, None)
        if looked is None or looked[0] != b:
            self._looked = self._look_up(a, b - a)
            looked = self._looked.pop(a)
        return looked[1]

    def _look_up(self, a: int, size: int) -> dict:
        """`_block`'s answer for `LOOKUP_BLOCKS` blocks of `size` steps from step `a`, found in
        one call of each source's lookup (two where a block lies at a boundary), by block."""
        o = self.order
        c = min(a + LOOKUP_BLOCKS * size, o.step_limit)
        rows = o.shard_rows_between(a, c)
        src, rank = o.locate(np.concatenate(rows))
        datasets = o.mixture.datasets  # (a source's rows at the steps' lengths: `seq_lens`)
        step_ends = np.cumsum([len(r) for r in rows])
        starts = list(range(a, c, size))
        block_ends = step_ends[[min(s + size, c) - 1 - a for s in starts]]
        mine = [src == i for i in self.fetching]  # (each source's rows of each group: its rows before the group's end)
        before = [np.concatenate([[0], np.cumsum(m)]) for m in mine]
        wholes = [datasets[i].arrays_read(rank[m], n[block_ends]) for i, m, n in zip(self.fetching, mine, before)]
        each_step = np.array([self._bounded and any(2 <= len(w[k]) <= BOUNDARY for w in wholes)
                              for k in range(len(starts))], bool)
        for j in self._windowed:  # (where one window of a fitted order hands over to the next)
            i = self.fetching[j]
            each_step |= windows_meet(datasets[i], rank[mine[j]], np.concatenate([[0], before[j][block_ends]]))
        if each_step.any():
            each = [datasets[i].arrays_read(rank[m], n[step_ends]) for i, m, n in zip(self.fetching, mine, before)]
        out = {}
        for k, s in enumerate(starts):
            e = min(s + size, c)
            if each_step[k]:
                steps = [(t, [arrays[t - a] for arrays in each]) for t in range(s, e)]
            else:
                steps = [(e - 1, [w[k] for w in wholes])]
            out[s] = (e, steps)
        return out

    def _tell(self, first: int | None = None) -> None:
        """Tell the sources the shards of the window's steps, if a shard came or went; `first`:
        the step the window starts afresh at (an iterator made, a restore, a jump), which may
        read its documents in ranges while its shards arrive (`stores.document_ranges`)."""
        if not self._changed:
            return
        self._changed = False
        shards = [frozenset(last) for last in self._last]
        if shards == self._sent:  # the same shards as the last hint (one left and came back): nothing to tell
            return
        self._sent = shards
        steps = list(self._reads.values())  # (in step order: steps enter in order, and leave from the front)
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


def windows_meet(dataset, indices: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """For each block of steps (block k reads rows `indices[cuts[k]:cuts[k + 1]]` of
    `dataset`, an order fitted to a bounded cache), whether one window of the order ends in
    it and the next begins: its least and greatest rows lie in two windows
    (`PackedDataset.windows_apart`). Each step of such a block gets its own arrays
    (`FetchWindow._block`), so the window ending leaves the hints once read, not with the
    block's last step: given to the last step, a window of four blocks waited for the next
    window's blocks to arrive (a Megatron file at 2 files' worth, behind 2 MB/s a
    connection: 5-6 of the 14 blocks the cache held ahead were there already, so only 8 were
    in flight). Told from the arrays the steps read, most blocks of a window of many small
    files looked like hand-overs (steps of one row read some of its files each): 1,171 of
    1,217 blocks looked at step by step, the reader's CPU 1.49-1.56 s an epoch against
    1.11-1.32 s told from the windows (`benchmarks/bench_reader_sleeps.py --files 256`)."""
    out = np.zeros(len(cuts) - 1, bool)
    full = np.flatnonzero(np.diff(cuts) > 0)  # (blocks where the source reads rows; the last ends at the end)
    if len(full):
        lo = np.minimum.reduceat(indices, cuts[full])
        hi = np.maximum.reduceat(indices, cuts[full])
        out[full] = dataset.windows_apart(lo, hi)
    return out


_NOTHING = contextlib.nullcontext()


class _Making(step_reads.making):
    """`FetchWindow.making`: `step_reads.making` for the step, the window told before and
    after (a class, entered every step: a generator's context manager cost several times as
    much; and one object a step, not two)."""

    __slots__ = ("window",)

    def __init__(self, window: FetchWindow, step: int):
        self.window, self.now, self.before = window, (window, step), None

    def __enter__(self) -> None:
        self.window.advance(self.now[1])
        super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__()
        finally:
            self.window.made(self.now[1])
