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
import concurrent.futures
import math
import sys
from fractions import Fraction

import grain
import numpy as np

from forge_grain.packing import kernels
from forge_grain.packing.buffers import BufferPool, count
from forge_grain.packing.packed import PackedDataset, empty_rows
from forge_grain.stores import step_reads

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


def _forest(leaves: list[list[int]]):
    """One `_tree` per distinct list of sources in `leaves`, in shared node arrays (a leaf
    holds its source's index); returns (left, right, leaf, [(root, end) per entry])."""
    trees: dict[tuple, tuple[int, int]] = {}
    left, right, leaf = [], [], []
    for ls in map(tuple, leaves):
        if ls not in trees:
            lo = sum(len(x) for x in left)
            l, r, f = _tree(len(ls))
            left.append(np.where(l >= 0, l + lo, -1))
            right.append(np.where(r >= 0, r + lo, -1))
            leaf.append(np.where(f >= 0, np.array(ls, np.int64)[np.maximum(f, 0)], -1))
            trees[ls] = (lo, lo + len(l))
    return np.concatenate(left), np.concatenate(right), np.concatenate(leaf), [trees[tuple(ls)] for ls in leaves]


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
    """Rows from several `PackedDataset`s, each carrying a scalar `source_id`.

    `leaves` (one list of source indices per schedule entry: the base weights, then each
    phase) says over which sources an entry's tree is built, its weights being theirs in
    that order; by default every entry uses all sources in order. A pipeline resumed with a
    mixture change passes the trees each segment of its history was trained with, so the
    counts at each change are those of the rows that were really trained.
    """

    def __init__(self, datasets, weights, *, phases=(), length: int | None = None, leaves=None):
        super().__init__()
        self.datasets = list(datasets)
        m = len(self.datasets)
        seq = {d.seq_len for d in self.datasets}
        if len(seq) != 1:
            raise ValueError(f"mixed datasets must share seq_len, got {sorted(seq)}")
        self.seq_len = seq.pop()
        schedule = [(0, weights)] + [(int(s), w) for s, w in phases]
        leaves = [list(range(m))] * len(schedule) if leaves is None else [list(x) for x in leaves]
        if len(leaves) != len(schedule):
            raise ValueError(f"leaves must give one list of sources per schedule entry ({len(schedule)})")
        for (start, w), ls in zip(schedule, leaves):
            if len(w) != len(ls) or min(w) < 0 or sum(w) <= 0:
                raise ValueError(f"weights at row {start} must be {len(ls)} non-negative numbers, not all zero: {w}")
            if not ls or min(ls) < 0 or max(ls) >= m or len(set(ls)) != len(ls):
                raise ValueError(f"the sources of the entry at row {start} must be distinct indices below {m}: {ls}")
        self.phase_rows = np.array([s for s, _ in schedule], np.int64)
        if np.any(np.diff(self.phase_rows) <= 0):
            raise ValueError(f"phase start rows must increase: {self.phase_rows.tolist()}")
        self.weights = [list(map(float, w)) for _, w in schedule]
        self._left, self._right, self._leaf, spans = _forest(leaves)
        self._root = np.array([lo for lo, _ in spans], np.int64)
        self._end = np.array([hi for _, hi in spans], np.int64)
        self._node_weight = np.stack([self._subtree_weights(integer_weights(w), ls, lo, hi)
                                      for (_, w), ls, (lo, hi) in zip(schedule, leaves, spans)])
        self._base = np.zeros((len(schedule), m), np.int64)
        for p in range(1, len(schedule)):
            self._base[p] = self._base[p - 1] + self._phase_counts(p - 1, self.phase_rows[p] - self.phase_rows[p - 1])
        self._length = length
        self._pool = BufferPool()
        # one source, every row its own (its rank is the mixture row): no tree to walk, a step's
        # locate (asked twice a step from object storage: by the batch and the prefetch hints)
        self._alone = m == 1 and bool(np.all(self._left[self._root] < 0)) and np.array_equal(self._base[:, 0],
                                                                                            self.phase_rows)

    def _subtree_weights(self, u: np.ndarray, sources: list[int], lo: int, hi: int) -> np.ndarray:
        """Node weights of the tree [lo, hi) whose leaves are `sources`, weighted `u`."""
        by_source = np.zeros(len(self.datasets), np.int64)
        by_source[sources] = u
        w = np.zeros(len(self._left), np.int64)
        for k in range(hi - 1, lo - 1, -1):  # children come after parents
            w[k] = by_source[self._leaf[k]] if self._left[k] < 0 else w[self._left[k]] + w[self._right[k]]
        return w

    def _phase_counts(self, p: int, num_rows: int) -> np.ndarray:
        return kernels.mix_counts(num_rows, self._root[p], self._end[p], self._left, self._right, self._leaf,
                                  self._node_weight[p], len(self.datasets))

    def __len__(self) -> int:
        return sys.maxsize if self._length is None else self._length

    def locate(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(source, row within that source) of mixture rows `indices`."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        if self._alone:
            return np.zeros(len(idx), np.int64), idx.copy()
        return kernels.mix_locate(idx, self.phase_rows, self._root, self._left, self._right, self._leaf,
                                  self._node_weight, self._base)

    def counts(self, num_rows: int) -> np.ndarray:
        """Rows each source contributes to the first `num_rows` rows of the mixture."""
        p = int(np.searchsorted(self.phase_rows, num_rows, side="right") - 1)
        return self._base[p] + self._phase_counts(p, num_rows - self.phase_rows[p])

    def get_batch(self, indices, out: dict | None = None, id_dtype=np.int32, seq_len: int | None = None) -> dict:
        """Rows `indices` (of `seq_len` tokens: the step's, under a sequence-length schedule)."""
        src, rank = self.locate(indices)
        out = out if out is not None else empty_rows(len(src), seq_len or self.seq_len, id_dtype, self._pool)
        idx = np.asarray(indices, np.int64).reshape(-1)
        one = len(self.datasets) == 1  # (no grouping to do: every row is the one source's)
        groups = [(0, count(len(src)))] if one else [(i, np.flatnonzero(src == i)) for i in np.unique(src)]
        fetching = [g for g in groups if fetches(self.datasets[g[0]])]
        if len(fetching) > 1 and step_reads.fresh():
            together(self._fill, fetching, out, rank, idx)
            done = {i for i, _ in fetching}
            groups = [(i, sel) for i, sel in groups if i not in done]
        for i, sel in groups:
            self._fill(i, sel, out, rank, idx)
        out["source_id"] = src.astype(np.int32)
        return out

    def _fill(self, i: int, sel: np.ndarray, out: dict, rank: np.ndarray, idx: np.ndarray) -> None:
        """Rows `sel` of the batch `out`: source `i`'s rows `rank[sel]`."""
        d = self.datasets[i]
        if getattr(d, "sequential", False):  # a streaming source: its rows' place in the batch decides their stream
            d.get_batch(rank[sel], out=out, dest=sel, rows=idx[sel])
        else:
            d.get_batch(rank[sel], out=out, dest=sel)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        return {k: v[0] for k, v in self.get_batch([index]).items()}

    def __str__(self) -> str:
        return f"Mixture({len(self.datasets)} sources, {len(self.phase_rows)} phase(s))"


def fetches(dataset) -> bool:
    """Whether `dataset` reads a store in object storage (a deferred source is a local one:
    asking its store would open it)."""
    return getattr(dataset, "is_open", True) and getattr(getattr(dataset, "store", None), "fetches", False)


def together(fill, groups: list, *args) -> None:
    """`fill(i, sel, *args)` for each source group at once, on threads of their own: the
    first step of a fresh window of hints, whose sources in object storage each wait on the
    network for their shards (or read its documents in ranges), waited for them one source
    after another (a mixture of 8 sources behind a 30 ms link: its first batch 3.4 s after
    the request, its build 1.2 s of it). Later steps find their shards fetched ahead."""
    fill = step_reads.carried(fill)
    with concurrent.futures.ThreadPoolExecutor(len(groups), thread_name_prefix="forge-grain-source") as pool:
        for f in [pool.submit(fill, i, sel, *args) for i, sel in groups]:
            f.result()


def mix(datasets: list[PackedDataset], weights, *, phases=(), length: int | None = None) -> Mixture:
    """Interleave packed datasets by `weights`; `phases` = [(start_row, weights), ...].

    Sources repeat with a fresh shuffle when they run out (make them with
    `pack(..., num_epochs=None)`); `length` bounds the mixture (default: unbounded).
    """
    return Mixture(datasets, weights, phases=phases, length=length)
