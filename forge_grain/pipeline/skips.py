"""Skipping at resume, exactly: which rows of the uninterrupted stream a run leaves out.

The uninterrupted run trains mixture row h at the step whose rows hold it (h // B at a
fixed batch size B; see `forge_grain.pipeline.batches`). A resume may skip (a) the next N
global batches, or (b) every later row holding given documents. Either removes rows from
the stream; the run then trains, at trainer row t (step t // B), the t-th row not removed,
so everything it does train is what the uninterrupted run trained, in the same order.

Removed rows are kept per source, in that source's own row numbers (the mixture is
monotone: source i's rows at or after stream row x are its rows from counts(x)[i] on):
ranges for skipped batches, and for documents the plan rows holding them, each removed in
every epoch from the skip on. A source row's place in its epoch is a closed form both ways
(`PackedDataset.rows_of` and `positions_of`), so the number of removed rows below any row is
a closed form too, and finding any step's rows costs the same at step 10 or 10 million.
"""

from __future__ import annotations

import numpy as np

from forge_grain.packing.buffers import count
from forge_grain.packing.epoch_counts import tally


class RowMap:
    """Trainer rows -> rows of the uninterrupted stream, after the skips added in order."""

    def __init__(self, mixture, row_of_step):
        # row_of_step(s): the first trainer row of step s (s · B; a batch-size schedule's R(s))
        self.mixture, self.row_of = mixture, row_of_step
        m = len(mixture.datasets)
        self.ranges: list[list[tuple[int, int]]] = [[] for _ in range(m)]  # source rows skipped with batches
        self.docs: list[dict[int, int]] = [{} for _ in range(m)]  # plan row -> first source row it is skipped at
        self._groups: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(m)]  # (start, plan rows) by start
        self._positions: dict = {}  # (source, start, epoch) -> positions of that group's rows in the epoch
        # sources whose rows change length (`LengthSchedule`): [(first source row, documents)], documents
        # held by other plan rows in each piece of the schedule, which the source itself finds
        self.doc_skips: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(m)]
        self.touched: set[int] = set()  # sources with removed rows (so that a map without skips costs nothing)

    @property
    def empty(self) -> bool:
        return not self.touched

    # -- adding skips -----------------------------------------------------------------------

    def skip_steps(self, at_step: int, steps: int) -> None:
        """Leave out the global batches the run would train at steps [at_step, at_step + steps)."""
        lo, hi = self.stream_row(self.row_of(at_step)), self.stream_row(self.row_of(at_step + steps))
        a, b = self.mixture.counts(lo), self.mixture.counts(hi)
        for i in range(len(self.ranges)):
            if b[i] > a[i]:
                self.ranges[i].append((int(a[i]), int(b[i])))
                self.touched.add(i)

    def skip_rows(self, at_step: int, plan_rows: dict[int, np.ndarray]) -> None:
        """Leave out, from step `at_step` on, every row of source i whose plan row is in
        `plan_rows[i]` (the rows holding skipped documents), in every epoch; for a source whose
        rows change length, `plan_rows[i]` are the documents themselves."""
        start = self.mixture.counts(self.stream_row(self.row_of(at_step)))
        for i, rows in plan_rows.items():
            if hasattr(self.mixture.datasets[i], "holding_count"):  # a LengthSchedule
                self.doc_skips[i].append((int(start[i]), np.asarray(rows, np.int64)))
                self.touched.add(i)
                continue
            for r in np.asarray(rows, np.int64).tolist():
                self.docs[i][r] = min(self.docs[i].get(r, int(start[i])), int(start[i]))
                self.touched.add(i)
            by_start: dict[int, list[int]] = {}
            for r, s in self.docs[i].items():
                by_start.setdefault(s, []).append(r)
            self._groups[i] = [(s, np.array(sorted(rs), np.int64)) for s, rs in sorted(by_start.items())]
        self._positions.clear()

    # -- counting ---------------------------------------------------------------------------

    def removed_below(self, i: int, j: int, weights=None) -> int:
        """How many of source i's rows below its row j are removed (with `weights`, a value
        per plan row: their sum, e.g. trained tokens)."""
        d = self.mixture.datasets[i]
        total = 0
        for lo, hi in self.ranges[i]:
            if lo < j:
                hi = min(hi, j)
                total += (hi - lo) if weights is None else d.trained_tokens(hi) - d.trained_tokens(lo)
        for start, rows in self._groups[i]:
            total += self._tally(i, start, rows, start, j, weights)
            for lo, hi in self.ranges[i]:  # rows a skipped batch already removed count once
                total -= self._tally(i, start, rows, max(lo, start), min(hi, j), weights)
        for start, end, docs in self._doc_spans(i, j):  # documents of a source whose rows change length
            total += d.holding_count(docs, start, end, weights is not None)
            for lo, hi in self.ranges[i]:
                total -= d.holding_count(docs, max(lo, start), min(hi, end), weights is not None)
        return total

    def _doc_spans(self, i: int, j: int) -> list[tuple[int, int, np.ndarray]]:
        """(first row, end row, documents) over rows below j: each skip's documents join those
        of the skips before it from its first row on (a row holding several counts once)."""
        skips, out = sorted(self.doc_skips[i], key=lambda x: x[0]), []
        for k, (start, _) in enumerate(skips):
            end = min(j, skips[k + 1][0]) if k + 1 < len(skips) else j
            if end > start:
                out.append((start, end, np.unique(np.concatenate([d for _, d in skips[:k + 1]]))))
        return out

    def _tally(self, i: int, start: int, rows: np.ndarray, lo: int, hi: int, weights) -> int:
        """Source i's rows in [lo, hi) whose plan row is among `rows` (counted or weighed)."""
        n = self.mixture.datasets[i].num_rows
        return tally(n, rows, lo, hi, weights, lambda e: self._epoch_positions(i, start, rows, e))

    def _epoch_positions(self, i: int, start: int, rows: np.ndarray, e: int) -> np.ndarray:
        key = (i, start, e)
        if key not in self._positions:
            if len(self._positions) > 256:
                self._positions.clear()
            self._positions[key] = self.mixture.datasets[i].positions_of(rows, e)
        return self._positions[key]

    def removed(self, x: int) -> int:
        """Removed rows of the stream below stream row x."""
        if self.empty:
            return 0
        c = self.mixture.counts(x)
        return sum(self.removed_below(i, int(c[i])) for i in self.touched)

    # -- mapping ----------------------------------------------------------------------------

    def stream_row(self, t: int) -> int:
        """The stream row trainer row t reads: the t-th row not removed."""
        if self.empty:
            return t
        y = t + 1  # the smallest y with y - removed(y) = t + 1; never overshot, as y - removed(y) grows by <= 1
        while (kept := y - self.removed(y)) < t + 1:
            y += t + 1 - kept
        return y - 1

    def rows(self, t: int, n: int) -> np.ndarray:
        """The stream rows of trainer rows [t, t + n)."""
        if self.empty:
            return count(n, t)
        out, x = [], self.stream_row(t)
        need = n
        while need:
            cand = np.arange(x, x + need + 64, dtype=np.int64)
            kept = cand[~self.is_removed(cand)][:need]
            out.append(kept)
            need -= len(kept)
            x = int(cand[-1]) + 1
        return np.concatenate(out)

    def is_removed(self, stream_rows: np.ndarray) -> np.ndarray:
        src, rank = self.mixture.locate(stream_rows)
        gone = np.zeros(len(stream_rows), bool)
        for i in self.touched & set(np.unique(src).tolist()):
            sel = np.flatnonzero(src == i)
            j = rank[sel]
            hit = np.zeros(len(sel), bool)
            for lo, hi in self.ranges[i]:
                hit |= (j >= lo) & (j < hi)
            if self.docs[i]:
                plan_rows = self.mixture.datasets[i].rows_of(j)
                first = np.array([self.docs[i].get(r, -1) for r in plan_rows.tolist()], np.int64)
                hit |= (first >= 0) & (j >= first)
            for start, docs in self.doc_skips[i]:
                hit |= (j >= start) & self.mixture.datasets[i].holds(j, docs)
            gone[sel] = hit
        return gone
