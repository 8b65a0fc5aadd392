"""Counting a packed dataset's indices by plan row across epochs, in closed form.

Index i of a `PackedDataset` is plan row `rows_of(i)`: epoch e = i // n reads its n rows in
a seeded order, so how many indices in [lo, hi) read one of a set of plan rows is the
positions of those rows in the one or two epochs at the ends, plus whole epochs between.
Skipping documents counts the rows it removes so (`forge_grain.pipeline.skips`), for a
source of one length and for each piece of a length schedule (`forge_grain.packing.lengths`).
"""

from __future__ import annotations

import numpy as np


def tally(n: int, rows: np.ndarray, lo: int, hi: int, weights, positions) -> int:
    """Indices in [lo, hi) of a dataset of `n` rows an epoch whose plan row is among `rows`
    (weighed by `weights` per plan row, when given); `positions(e)` is where `rows` fall in
    epoch e (`PackedDataset.positions_of`)."""
    if hi <= lo or not len(rows):
        return 0
    w = np.ones(len(rows), np.int64) if weights is None else np.asarray(weights)[rows]
    e0, e1 = lo // n, (hi - 1) // n
    total = 0
    for e in sorted({e0, e1}):
        at = positions(e) + e * n
        total += int(w[(at >= lo) & (at < hi)].sum())
    if e1 - e0 > 1:
        total += (e1 - e0 - 1) * int(w.sum())
    return total
