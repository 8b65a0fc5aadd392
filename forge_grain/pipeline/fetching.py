"""Telling sources in object storage which shards the coming steps read.

A store in object storage downloads shards in the background and keeps them from eviction
when told which ones are coming (`TokenStore.prefetch`). The row order says which rows, so
which shards, every step reads: this module keeps a window of steps ahead of the consumer
and tells each such source the shards of that window, in reading order, whenever it moves.
It only advises: a shard nobody was told of is downloaded when a batch reads it.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

FETCH_SHARDS = 64  # shards a source in object storage is told of ahead: as many as its reads in flight can grow to
# a step this far behind the hinted window's start is one the prefetch threads made out of order,
# not a restore: it leaves the window as it is (recomputing a window of 1,024 steps took ~40 ms)
BEHIND = 64
HINT_STEPS = 16  # steps whose shards are found together (one lookup for 16 steps, not one a step)


class FetchWindow:
    """The steps ahead whose shards the sources in object storage are told of."""

    def __init__(self, opened: list, order, fetch_ahead: int):
        self.datasets = [o.dataset for o in opened]
        self.fetching = [i for i, o in enumerate(opened) if o.fetches]  # sources in object storage
        self.order, self.fetch_ahead = order, fetch_ahead
        self._hints: dict[int, tuple] = {}  # first step -> (end, the arrays each fetching source reads)
        self._window = {"start": 0, "end": -1}  # the steps hinted, their shards' counts, the last hint sent
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return bool(self.fetching and self.fetch_ahead)

    def advance(self, step: int) -> None:
        """`step` is being made: tell the sources of the shards it and the next steps read. The
        lookahead goes as far as `FETCH_SHARDS` shards of every such source (enough to keep its
        downloads busy whatever the shard size), `fetch_ahead` steps at most (rounded up to a
        block). Steps enter the window `HINT_STEPS` at a time (their shards found by one lookup)
        and leave it when all of them are made."""
        if not self.active:
            return
        with self._lock:  # Grain's threads make several steps at once
            w = self._window
            if w["start"] - BEHIND <= step < w["start"]:
                return  # another thread's step, just behind one made already: the window has passed it
            if not w["start"] <= step <= w["end"]:  # the first call, a restore, or a jump
                self._hints.clear()
                w.update(start=step, end=step, counts=[collections.Counter() for _ in self.fetching], sent=None)
            changed = self._leave(step) | (w["sent"] is None)
            w["start"] = step
            changed |= self._enter(step)
            if changed:  # a block came or went: tell the shards, unless they are those told last time
                self._tell()

    def _leave(self, step: int) -> bool:
        """Blocks whose steps are all made leave the window, oldest first."""
        hints, counts, left = self._hints, self._window["counts"], False
        for a in list(hints):
            if hints[a][0] > step:
                break
            for count, arrays in zip(counts, hints.pop(a)[1]):  # (`-=` drops counts at 0)
                count -= collections.Counter(arrays.tolist())
            left = True
        return left

    def _enter(self, step: int) -> bool:
        """Blocks enter the window until it holds `FETCH_SHARDS` shards of every source or
        reaches `fetch_ahead` steps past `step`."""
        w, o = self._window, self.order
        want = [min(FETCH_SHARDS, max(1, self.datasets[i].store.num_arrays)) for i in self.fetching]
        last = min(step + 1 + self.fetch_ahead, o.step_limit)
        entered = False
        while w["end"] < last and (w["end"] <= step or any(len(c) < n for c, n in zip(w["counts"], want))):
            a = w["end"]  # (a block may reach up to HINT_STEPS - 1 steps past `fetch_ahead`)
            b = min(a + min(HINT_STEPS, self.fetch_ahead), o.step_limit)
            src, rank = o.locate(np.concatenate([o.shard_rows(s) for s in range(a, b)]))
            datasets = o.mixture.datasets  # (a source's rows at the steps' lengths: `seq_lens`)
            self._hints[a] = (b, [datasets[i].arrays_read(rank[src == i]) for i in self.fetching])
            for count, arrays in zip(w["counts"], self._hints[a][1]):
                count.update(arrays.tolist())
            w["end"] = b
            entered = True
        return entered

    def _tell(self) -> None:
        w = self._window
        shards = [frozenset(c) for c in w["counts"]]
        if shards == w["sent"]:  # the same shards as the last hint: nothing to tell
            return
        w["sent"] = shards
        for j, i in enumerate(self.fetching):
            self.datasets[i].store.prefetch(np.concatenate([arrays[j] for _, arrays in self._hints.values()]))
