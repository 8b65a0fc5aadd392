"""The locality order of a packed dataset: an epoch read a few planning chunks at a time.

With `shuffle_window=W`, epoch e visits the plan's chunks in a seeded order, W chunks at a
time, and shuffles the rows of those chunks together (`PackedDataset.rows_of`). Like the
global shuffle it is a pure function of the index, with a closed-form inverse
(`positions`): exact and elastic resume hold as for the global shuffle. It knows chunk row
counts and keys only: no plan or token is read here.
"""

from __future__ import annotations

import numpy as np

from forge_grain.packing import kernels
from forge_grain.packing.plans import stream_key

TABLE_ROWS = 1 << 21  # the most rows of a window given a table of its plan rows once read enough (16 MB)
TABLED_ROWS = 4 * TABLE_ROWS  # the most rows all of a dataset's tables hold together


class WindowOrder:
    """Plan rows <-> positions in an epoch, for windows of `window` chunks."""

    def __init__(self, chunk_rows: np.ndarray, num_rows: int, window: int, seed_key: int):
        self.chunk_rows, self.num_rows, self.window, self.seed_key = chunk_rows, num_rows, window, seed_key
        self._windows: dict = {}  # epoch -> its chunk order and window starts (`_epoch_windows`)
        self._window_parts: dict = {}  # (epoch, window) -> what its rows are found from (`_window`)
        self._asked: dict = {}  # (epoch, window) -> rows found of it while it had no table
        self._last = (0, 0, 0, 0)  # the indices [a, b) of the window read last, its epoch and number

    def rows(self, idx: np.ndarray, first: int, last: int) -> np.ndarray:
        """Plan rows of dataset indices `idx` (`first`, `last`: their least and greatest): each
        epoch visits the plan's chunks in a seeded order, `window` chunks at a time, and
        shuffles the rows of those chunks together.

        A window's rows read only its chunks' documents (contiguous shards), so a reader
        needs those shards, not the store. The price is shuffle quality: rows of different
        windows never neighbour each other within an epoch, and documents of one chunk
        are met together (chunks are random samples of contiguous documents: as random as
        the order the data was written in). Still a pure function of the index, so exact
        and elastic resume hold as for the global shuffle.
        """
        n = self.num_rows
        a, b, e, w = self._last  # (most batches lie in the window of the batch before)
        if a <= first and last < b:
            return self._rows_in_window(e, w, idx - a)
        if len(idx):  # the usual batch lies in one window of one epoch (that of its first index): no grouping
            e = first // n
            starts = self._epoch_windows(e)[1]
            w = int(np.searchsorted(starts, first - e * n, side="right")) - 1
            a, b = e * n + int(starts[w]), e * n + int(starts[w + 1])
            if last < b:
                self._last = (a, b, e, w)
                return self._rows_in_window(e, w, idx - a)
        out = np.empty(len(idx), np.int64)
        epochs = idx // n
        for e in np.unique(epochs):
            starts = self._epoch_windows(int(e))[1]
            sel = np.flatnonzero(epochs == e)
            pos = idx[sel] - e * n
            win = np.searchsorted(starts, pos, side="right") - 1
            for w in np.unique(win):
                out[sel[win == w]] = self._rows_in_window(int(e), int(w), pos[win == w] - starts[w])
        return out

    def _rows_in_window(self, e: int, w: int, local) -> np.ndarray:
        """Plan rows of positions `local` among window w's rows in epoch e: from its table, once
        an eighth of its rows were found without one (a table costs ~50 ns a row to build, a
        compiled call ~4 us a batch: 6-8 us a batch against 1.5 for the global shuffle, about
        0.08 s of a LitData epoch of 12,090 batches under a `cache_limit`). A
        window read here and there (random access, a resume) is not tabled whole."""
        key, m, cum, first, table = self._window(e, w)
        if not len(table) and m <= TABLE_ROWS:
            asked = self._asked.get((e, w), 0) + len(local)
            self._asked[(e, w)] = asked
            if asked * 8 >= m:
                table = self._table(e, w)
        if len(table):  # (a window shuffled exactly has one from the start, `_window`)
            return table[local]
        return kernels.window_rows(np.asarray(local, np.int64), m, key, table, cum, first)

    def _table(self, e: int, w: int) -> np.ndarray:
        """Window w of epoch e's plan row at each of its positions, kept with its parts (those
        of other windows dropped where all would hold more than `TABLED_ROWS`)."""
        key, m, cum, first, _ = self._window(e, w)
        table = kernels.window_rows(np.arange(m, dtype=np.int64), m, key, np.zeros(0, np.int64), cum, first)
        if sum(len(parts[4]) for parts in self._window_parts.values()) + m > TABLED_ROWS:
            self._window_parts, self._asked = {}, {}
        self._window_parts[(e, w)] = (key, m, cum, first, table)
        return table

    def _window(self, e: int, w: int) -> tuple:
        """Window w of epoch e: its shuffle key, row count, its chunks' cumulative rows and
        first plan rows, and, where `epoch_rows` would build its shuffle on every call, the
        plan row of each of its positions (cached: every batch of the window asks; building
        the shuffle of a window of 4,000 rows for each batch was a tenth of an epoch under a
        `cache_limit`, and finding a batch's rows through it in a compiled call a twentieth
        of the consumer's time, against a lookup in this table)."""
        cached = self._window_parts.get((e, w))
        if cached is None:
            order, starts, firsts = self._epoch_windows(e)
            chunks = order[w * self.window : (w + 1) * self.window]
            cum = np.concatenate([[0], np.cumsum(self.chunk_rows[chunks])])
            key, m = stream_key("window", self.seed_key, e, w), int(starts[w + 1] - starts[w])
            cum, first, table = cum.astype(np.int64), firsts[chunks].astype(np.int64), np.zeros(0, np.int64)
            if m <= kernels.EXACT_SHUFFLE_MAX:
                perm = kernels.epoch_permutation(m, key, 0)
                table = kernels.window_rows(np.arange(m, dtype=np.int64), m, key, perm, cum, first)
            cached = (key, m, cum, first, table)
            if len(self._window_parts) > 64:
                self._window_parts, self._asked = {}, {}
            self._window_parts[(e, w)] = cached
        return cached

    def positions(self, rows: np.ndarray, epoch: int) -> np.ndarray:
        """The inverse of `rows` within one epoch: where in epoch `epoch` each plan row is read."""
        order, starts, firsts = self._epoch_windows(int(epoch))
        chunk = np.searchsorted(firsts, rows, side="right") - 1
        rank = np.empty(len(order), np.int64)
        rank[order] = np.arange(len(order))  # where each chunk comes in the epoch's order
        out = np.empty(len(rows), np.int64)
        for i, (c, r) in enumerate(zip(chunk.tolist(), rows.tolist())):
            w, k = divmod(int(rank[c]), self.window)
            key, m, cum, _, _ = self._window(int(epoch), w)
            local = int(cum[k]) + r - int(firsts[c])  # the row among its window's (cum[k]: the chunks before)
            out[i] = starts[w] + kernels.epoch_positions(np.array([local], np.int64), m, key, 0, True)[0]
        return out

    def apart(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Whether dataset indices `lo[k]` and `hi[k]` lie in different windows (or epochs):
        where one window hands over to the next (the hints of object storage, `pipeline.fetching`)."""
        lo, hi, n = np.asarray(lo, np.int64), np.asarray(hi, np.int64), self.num_rows
        out = lo // n != hi // n
        for e in np.unique(lo[~out] // n).tolist():
            sel = np.flatnonzero(~out & (lo // n == e))
            starts = self._epoch_windows(e)[1]
            out[sel] = (np.searchsorted(starts, lo[sel] - e * n, side="right")
                        != np.searchsorted(starts, hi[sel] - e * n, side="right"))
        return out

    def _epoch_windows(self, e: int):
        """Epoch e's chunk order, the start of each window in the epoch's positions, and each
        chunk's first plan row (cached for a few epochs)."""
        cached = self._windows.get(e)  # (threads may share the dataset: read once, then use the local)
        if cached is None:
            order = kernels.permutation(len(self.chunk_rows), stream_key("chunk-order", self.seed_key, e))
            sizes = self.chunk_rows[order]
            per_window = np.add.reduceat(sizes, np.arange(0, len(sizes), self.window))
            starts = np.concatenate([[0], np.cumsum(per_window)])
            firsts = np.concatenate([[0], np.cumsum(self.chunk_rows)])[:-1]
            cached = (order, starts, firsts)
            if len(self._windows) > 4:
                self._windows = {}
            self._windows[e] = cached
        return cached
