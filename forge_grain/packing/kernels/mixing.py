"""Mixing: which source, and which of its rows, a mixture row is (and each source's count
below a row), in closed form over the weights' exact ratios (128-bit products)."""

from __future__ import annotations

import numba as nb
import numpy as np

from forge_grain.packing.kernels.cache import CACHE

_LOW32 = np.uint64(0xFFFFFFFF)


@nb.njit(cache=CACHE, inline="always")
def _muldivmod(a, b, c):
    """(floor(a·b / c), a·b mod c) for 0 <= a, b < 2^63 and 0 < c < 2^63 with a·b / c < 2^63:
    the 128-bit product in two 64-bit words, then long division (the quotient fits a word)."""
    ua, ub, uc = np.uint64(a), np.uint64(b), np.uint64(c)
    if ub == 0 or ua <= np.uint64(0x7FFFFFFFFFFFFFFF) // ub:  # the product fits: native arithmetic
        p = ua * ub
        return np.int64(p // uc), np.int64(p % uc)
    a0, a1, b0, b1 = ua & _LOW32, ua >> np.uint64(32), ub & _LOW32, ub >> np.uint64(32)
    ll, hl, lh, hh = a0 * b0, a1 * b0, a0 * b1, a1 * b1
    mid = (ll >> np.uint64(32)) + (hl & _LOW32) + (lh & _LOW32)
    lo = (ll & _LOW32) | (mid << np.uint64(32))
    hi = hh + (hl >> np.uint64(32)) + (lh >> np.uint64(32)) + (mid >> np.uint64(32))
    q, r = np.uint64(0), hi  # hi < c because the quotient fits in 63 bits
    for i in range(63, -1, -1):
        r = (r << np.uint64(1)) | ((lo >> np.uint64(i)) & np.uint64(1))
        q = q << np.uint64(1)
        if r >= uc:
            r -= uc
            q |= np.uint64(1)
    return np.int64(q), np.int64(r)


@nb.njit(cache=CACHE, nogil=True)
def mix_locate(rows, phase_rows, phase_root, left, right, leaf_source, node_weight, base):
    """Source and rank-within-source of each global mixture row: O(log m) per row.

    Sources are leaves of a balanced binary tree (phase p's rooted at node `phase_root[p]`:
    several trees may share the node arrays, one per set of sources); a node splits the rows that reach it
    between its children in proportion to their integer weights, Bresenham style: the
    h-th row at a node goes left iff floor((h+1)·wL/w) > floor(h·wL/w), that is iff
    (h·wL mod w) + wL >= w. Every count is a closed form (exact in 128-bit arithmetic),
    so any row is found without replaying the ones before it, and each source's share of
    any prefix is within the tree depth of exact.
    """
    src = np.empty(len(rows), np.int64)
    rank = np.empty(len(rows), np.int64)
    for i in range(len(rows)):
        p = np.searchsorted(phase_rows, rows[i], side="right") - 1
        h = rows[i] - phase_rows[p]
        k = phase_root[p]
        while left[k] >= 0:
            w = node_weight[p, k]
            wl = node_weight[p, left[k]]
            a, r = _muldivmod(h, wl, w)
            if r + wl >= w:
                h = a
                k = left[k]
            else:
                h = h - a
                k = right[k]
        src[i] = leaf_source[k]
        rank[i] = base[p, leaf_source[k]] + h
    return src, rank


@nb.njit(cache=CACHE)
def mix_counts(total, root, end, left, right, leaf_source, node_weight_p, num_sources):
    """Rows each source receives among the first `total` rows of one phase, whose tree
    holds the nodes [root, end)."""
    count = np.zeros(len(left), np.int64)
    count[root] = total
    out = np.zeros(num_sources, np.int64)
    for k in range(root, end):  # parents come before children in the node order
        if left[k] >= 0:
            w = node_weight_p[k]
            c = _muldivmod(count[k], node_weight_p[left[k]], w)[0] if w > 0 else 0
            count[left[k]] = c
            count[right[k]] = count[k] - c
        else:
            out[leaf_source[k]] = count[k]
    return out
