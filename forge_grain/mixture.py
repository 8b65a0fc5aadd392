"""`mix()`: a deterministic `MapDataset` interleaving packed datasets by weight, with phases.

Row h of the mixture goes to a source by a closed-form rule (see `kernels.mix_locate`):
no state, no precomputed index, O(log m) per row, O(m) memory per phase. The weights are
used exactly as given (as integers in their exact ratios; see `integer_weights`), and
each source's count over any prefix of a phase is within the tree depth (ceil(log2 m)) of
its weight times the prefix length, so over any window of n rows its share is within
2·depth/n of its weight. A phase change takes effect exactly at its first row. Source row r of source
i is row r of its (infinitely repeating, reshuffled per epoch) packed dataset.
"""

from __future__ import annotations

import collections
import math
import sys
from fractions import Fraction

import grain
import numpy as np

from . import kernels
from .buffers import BufferPool
from .packed import PackedDataset, empty_rows

MAX_WEIGHT_SUM = 1 << 62  # integer weights (and their sum) stay below this, for the 128-bit kernel arithmetic
MAX_ROWS = 1 << 43  # the longest mixture: ~8.8e12 rows, far beyond any run


def _tree(m: int):
    """A balanced binary tree over sources 0..m-1; parents are numbered before children."""
    left, right, leaf = [], [], []
    queue = collections.deque([(0, m)])
    while queue:
        lo, hi = queue.popleft()
        k = len(left)
        left.append(-1), right.append(-1), leaf.append(lo if hi - lo == 1 else -1)
        if hi - lo > 1:
            mid = (lo + hi) // 2
            left[k] = k + len(queue) + 1
            right[k] = k + len(queue) + 2
            queue += [(lo, mid), (mid, hi)]
    return np.array(left, np.int64), np.array(right, np.int64), np.array(leaf, np.int64)


def integer_weights(weights) -> np.ndarray:
    """Integers in exactly the ratios of the weights as given: a float is a dyadic rational,
    so one power of two scales them all to integers (divided by their gcd). Weights whose
    exact ratios need more than 62 bits (a spread of more than ~2^9 between the largest and
    the smallest binade used) are rounded at 2^-62 of the total, which moves no source by a
    row before `MAX_ROWS`."""
    fractions = [Fraction(float(x)) for x in weights]
    denominator = 1
    for f in fractions:
        denominator = denominator * f.denominator // math.gcd(denominator, f.denominator)
    ints = [f.numerator * (denominator // f.denominator) for f in fractions]
    g = math.gcd(*ints)
    ints = [x // g for x in ints]
    total = sum(ints)
    if total >= MAX_WEIGHT_SUM:
        scale = Fraction(MAX_WEIGHT_SUM // 2, total)
        ints = [max(1, round(x * scale)) if x else 0 for x in ints]
    return np.array(ints, np.int64)


class Mixture(grain.MapDataset):
    """Rows from several `PackedDataset`s, each carrying a scalar `source_id`."""

    def __init__(self, datasets, weights, *, phases=(), length: int | None = None):
        super().__init__()
        self.datasets = list(datasets)
        m = len(self.datasets)
        seq = {d.seq_len for d in self.datasets}
        if len(seq) != 1:
            raise ValueError(f"mixed datasets must share seq_len, got {sorted(seq)}")
        self.seq_len = seq.pop()
        schedule = [(0, weights)] + [(int(s), w) for s, w in phases]
        for start, w in schedule:
            if len(w) != m or min(w) < 0 or sum(w) <= 0:
                raise ValueError(f"weights at row {start} must be {m} non-negative numbers, not all zero: {w}")
        self.phase_rows = np.array([s for s, _ in schedule], np.int64)
        if np.any(np.diff(self.phase_rows) <= 0):
            raise ValueError(f"phase start rows must increase: {self.phase_rows.tolist()}")
        self.weights = [list(map(float, w)) for _, w in schedule]
        self._left, self._right, self._leaf = _tree(m)
        self._node_weight = np.stack([self._subtree_weights(integer_weights(w)) for _, w in schedule])
        self._base = np.zeros((len(schedule), m), np.int64)
        for p in range(1, len(schedule)):
            span = self.phase_rows[p] - self.phase_rows[p - 1]
            self._base[p] = self._base[p - 1] + kernels.mix_counts(
                span, self._left, self._right, self._leaf, self._node_weight[p - 1], m
            )
        self._length = length
        self._pool = BufferPool()

    def _subtree_weights(self, u: np.ndarray) -> np.ndarray:
        w = np.zeros(len(self._left), np.int64)
        for k in range(len(self._left) - 1, -1, -1):  # children come after parents
            w[k] = u[self._leaf[k]] if self._left[k] < 0 else w[self._left[k]] + w[self._right[k]]
        return w

    def __len__(self) -> int:
        return sys.maxsize if self._length is None else self._length

    def locate(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(source, row within that source) of mixture rows `indices`."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        return kernels.mix_locate(idx, self.phase_rows, self._left, self._right, self._leaf, self._node_weight, self._base)

    def counts(self, num_rows: int) -> np.ndarray:
        """Rows each source contributes to the first `num_rows` rows of the mixture."""
        p = int(np.searchsorted(self.phase_rows, num_rows, side="right") - 1)
        return self._base[p] + kernels.mix_counts(
            num_rows - self.phase_rows[p], self._left, self._right, self._leaf, self._node_weight[p], len(self.datasets)
        )

    def get_batch(self, indices, out: dict | None = None, id_dtype=np.int32) -> dict:
        src, rank = self.locate(indices)
        out = out if out is not None else empty_rows(len(src), self.seq_len, id_dtype, self._pool)
        idx = np.asarray(indices, np.int64).reshape(-1)
        for i in np.unique(src):
            sel = np.flatnonzero(src == i)
            d = self.datasets[i]
            if getattr(d, "sequential", False):  # a streaming source: its rows' place in the batch decides their stream
                d.get_batch(rank[sel], out=out, dest=sel, rows=idx[sel])
            else:
                d.get_batch(rank[sel], out=out, dest=sel)
        out["source_id"] = src.astype(np.int32)
        return out

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return {k: v[0] for k, v in self.get_batch([index]).items()}

    def __str__(self) -> str:
        return f"Mixture({len(self.datasets)} sources, {len(self.phase_rows)} phase(s))"


def mix(datasets: list[PackedDataset], weights, *, phases=(), length: int | None = None) -> Mixture:
    """Interleave packed datasets by `weights`; `phases` = [(start_row, weights), ...].

    Sources repeat with a fresh shuffle when they run out (make them with
    `pack(..., num_epochs=None)`); `length` bounds the mixture (default: unbounded).
    """
    return Mixture(datasets, weights, phases=phases, length=length)
