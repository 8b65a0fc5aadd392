"""Packing plans from document lengths: best-fit bins, items (windows of long documents),
concatenation, and filling gaps. Lengths in, segments out: no token is read here."""

from __future__ import annotations

import numba as nb
import numpy as np

from forge_grain.packing.kernels.cache import CACHE

NATURAL_END = np.uint8(1)  # a segment's flag: it ends where its document really ends


@nb.njit(cache=CACHE, inline="always")
def _tree_add(tree, size, leaf, delta):
    i = size + leaf
    while i >= 1:
        tree[i] += delta
        i //= 2


@nb.njit(cache=CACHE)
def _tree_find_ge(tree, size, leaf):
    """Smallest capacity >= leaf that has an open bin, or -1 (segment tree descent)."""
    i = size + leaf
    if tree[i] > 0:
        return leaf
    while i > 1:
        if i % 2 == 0 and tree[i + 1] > 0:
            i += 1
            while i < size:
                i = 2 * i if tree[2 * i] > 0 else 2 * i + 1
            return i - size
        i //= 2
    return -1


@nb.njit(cache=CACHE)
def best_fit(item_len, cap, max_items=0):
    """Best-fit of items, in the given order, into bins of capacity `cap`: O(n log cap).
    With `max_items > 0` a bin closes once it holds that many items.

    Returns each item's bin and each bin's fill.
    """
    n = len(item_len)
    size = 1
    while size < cap + 1:
        size *= 2
    tree = np.zeros(2 * size, np.int64)
    head = np.full(cap + 1, -1, np.int64)  # open bins by remaining capacity: linked stacks
    nxt = np.full(max(n, 1), -1, np.int64)
    fill = np.zeros(max(n, 1), np.int64)
    count = np.zeros(max(n, 1), np.int64)
    item_bin = np.empty(n, np.int64)
    nbins = 0
    for k in range(n):
        length = item_len[k]
        c = _tree_find_ge(tree, size, length)
        if c < 0:
            b = nbins
            nbins += 1
        else:
            b = head[c]
            head[c] = nxt[b]
            _tree_add(tree, size, c, -1)
        item_bin[k] = b
        fill[b] += length
        count[b] += 1
        rem = cap - fill[b]
        if rem > 0 and (max_items <= 0 or count[b] < max_items):
            nxt[b] = head[rem]
            head[rem] = b
            _tree_add(tree, size, rem, 1)
    return item_bin, fill[:nbins]


@nb.njit(cache=CACHE)
def group_by_bin(item_bin, nbins):
    """Items ordered by bin (stable), and row_ptr over them."""
    counts = np.zeros(nbins + 1, np.int64)
    for b in item_bin:
        counts[b + 1] += 1
    row_ptr = np.cumsum(counts)
    pos = row_ptr[:-1].copy()
    order = np.empty(len(item_bin), np.int64)
    for k in range(len(item_bin)):
        b = item_bin[k]
        order[pos[b]] = k
        pos[b] += 1
    return order, row_ptr


# -- items: what the packers place --------------------------------------------------------


@nb.njit(cache=CACHE)
def split_items(offsets, order, seq_len, stride):
    """Documents in `order` as items of at most `seq_len` tokens (no token dropped).

    A longer document becomes windows starting every `stride` tokens; each window after
    the first masks the loss on the `seq_len - stride - 1` positions whose targets the
    previous window already trained (stride == seq_len: plain chunks, nothing masked).
    """
    n_items = 0
    for d in order:
        length = offsets[d + 1] - offsets[d]
        if length > seq_len:
            n_items += 1 + (length - seq_len + stride - 1) // stride
        elif length > 0:
            n_items += 1
    start = np.empty(n_items, np.int64)
    ilen = np.empty(n_items, np.int64)
    skip = np.zeros(n_items, np.int32)
    flags = np.zeros(n_items, np.uint8)
    k = 0
    head = max(seq_len - stride - 1, 0)
    for d in order:
        s, e = offsets[d], offsets[d + 1]
        w = 0
        while s + w < e:
            hi = min(s + w + seq_len, e)
            start[k] = s + w
            ilen[k] = hi - s - w
            skip[k] = head if w > 0 else 0
            flags[k] = NATURAL_END if hi == e else 0
            k += 1
            if hi == e:
                break
            w += stride
    return start, ilen, skip, flags


@nb.njit(cache=CACHE)
def plan_concat(offsets, order, seq_len):
    """Concatenate documents in `order`; row r is stream tokens [r*T, r*T + T + 1)."""
    lengths = np.empty(len(order), np.int64)
    total = 0
    for i in range(len(order)):
        lengths[i] = offsets[order[i] + 1] - offsets[order[i]]
        total += lengths[i]
    rows = (total - 1) // seq_len if total > seq_len else 0
    cap = len(order) + 2 * rows + 1
    start = np.empty(cap, np.int64)
    slen = np.empty(cap, np.int64)
    flags = np.zeros(cap, np.uint8)
    row_ptr = np.zeros(rows + 1, np.int64)
    k, ds, nseg = 0, 0, 0  # first document still in view, its stream start, segments so far
    for r in range(rows):
        a = r * seq_len
        b = a + seq_len + 1
        while ds + lengths[k] <= a:
            ds += lengths[k]
            k += 1
        j, s = k, ds
        while s < b and j < len(order):
            e = s + lengths[j]
            if e > s:
                lo, hi = max(a, s), min(b, e)
                if hi > lo:
                    start[nseg] = offsets[order[j]] + lo - s
                    slen[nseg] = hi - lo
                    flags[nseg] = NATURAL_END if hi == e else 0
                    nseg += 1
            s = e
            j += 1
        row_ptr[r + 1] = nseg
    return row_ptr, start[:nseg], slen[:nseg], np.zeros(nseg, np.int32), flags[:nseg], total - rows * seq_len - 1


@nb.njit(cache=CACHE)
def plan_concat_capped(offsets, order, seq_len, max_segments):
    """`plan_concat` with at most `max_segments` segments a row: a row that reaches the cap
    before it is full ends at its last document's end (the rest is padding) and the next
    row starts at the next document; a full row overlaps the next by one token as in
    `plan_concat`. Rows are made while the tokens left can fill one or reach the cap."""
    n = len(order)
    lengths = np.empty(n, np.int64)
    total = 0
    for i in range(n):
        lengths[i] = offsets[order[i] + 1] - offsets[order[i]]
        total += lengths[i]
    rows_max = n + total // max(seq_len, 1) + 2  # a capped row ends a document, a full one takes seq_len
    cap = n + 2 * rows_max + 1
    start = np.empty(cap, np.int64)
    slen = np.empty(cap, np.int64)
    flags = np.zeros(cap, np.uint8)
    row_ptr = np.zeros(rows_max + 1, np.int64)
    k, used, nseg, rows = 0, 0, 0, 0  # document in view, its tokens already consumed, segments, rows
    pos, T1 = 0, seq_len + 1  # stream position of the row's first token
    shared = 0  # 1 after a full row: its last token (a target) is the next row's first
    while k < n:
        # the row: from (k, used), up to T1 tokens or max_segments segments
        j, u, taken, segs, capped = k, used, 0, 0, False
        while j < n and taken < T1:
            avail = lengths[j] - u
            if avail <= 0:
                j += 1
                u = 0
                continue
            if segs == max_segments:
                capped = True
                break
            segs += 1
            take = min(avail, T1 - taken)
            taken += take
            u += take
            if u == lengths[j]:
                j += 1
                u = 0
        if taken < T1 and not capped:
            break  # the tail cannot fill a row: lost, as in plan_concat
        j, u, left = k, used, taken
        while left > 0:
            avail = lengths[j] - u
            if avail <= 0:
                j += 1
                u = 0
                continue
            take = min(avail, left)
            start[nseg] = offsets[order[j]] + u
            slen[nseg] = take
            flags[nseg] = NATURAL_END if u + take == lengths[j] else 0
            nseg += 1
            left -= take
            u += take
            if u == lengths[j]:
                j += 1
                u = 0
        rows += 1
        row_ptr[rows] = nseg
        step = taken if capped else seq_len  # a full row: the next starts at its last token
        shared = 0 if capped else 1
        pos += step
        # advance (k, used) by `step` tokens
        while step > 0:
            avail = lengths[k] - used
            take = min(avail, step)
            used += take
            step -= take
            if used == lengths[k]:
                k += 1
                used = 0
        while k < n and lengths[k] == 0:
            k += 1
    return row_ptr[: rows + 1], start[:nseg], slen[:nseg], np.zeros(nseg, np.int32), flags[:nseg], total - pos - shared


@nb.njit(cache=CACHE)
def fill_gaps(bin_fill, cap, pool_start, pool_len, pool_natural_end, bin_room):
    """Fill every bin's gap with slices of the pool, in order, at most `bin_room[b]` pieces
    into bin b (what a cap on segments per row leaves; a gap past it stays padding).
    Returns the pieces and each piece's bin; pool tokens left over are the cropped ones."""
    n_pieces_max = len(pool_start) + len(bin_fill)
    p_start = np.empty(n_pieces_max, np.int64)
    p_len = np.empty(n_pieces_max, np.int64)
    p_flags = np.zeros(n_pieces_max, np.uint8)
    p_bin = np.empty(n_pieces_max, np.int64)
    q, used = 0, 0  # pool item, tokens of it already used
    n = 0
    for b in range(len(bin_fill)):
        gap = cap - bin_fill[b]
        room = bin_room[b]
        while gap > 0 and room > 0 and q < len(pool_len):
            avail = pool_len[q] - used
            take = min(gap, avail)
            p_start[n] = pool_start[q] + used
            p_len[n] = take
            p_flags[n] = NATURAL_END if (take == avail and pool_natural_end[q]) else 0
            p_bin[n] = b
            n += 1
            room -= 1
            gap -= take
            used += take
            if used == pool_len[q]:
                q += 1
                used = 0
    return p_start[:n], p_len[:n], p_flags[:n], p_bin[:n]


@nb.njit(cache=CACHE)
def row_targets(rows, row_ptr, seg_start, seg_len, seg_skip, seq_len):
    """(first, last) of the targets each segment of plan rows `rows` trains: tokens
    first + 1 .. last (slots [slot + skip, min(slot + len - 1, seq_len)) of its row);
    segments that train none are left out."""
    n = 0
    for r in rows:
        n += row_ptr[r + 1] - row_ptr[r]
    first = np.empty(n, np.int64)
    last = np.empty(n, np.int64)
    k = 0
    for r in rows:
        slot = 0
        for s in range(row_ptr[r], row_ptr[r + 1]):
            g, length = seg_start[s], seg_len[s]
            a = g + seg_skip[s]
            b = g + min(length - 1, seq_len - slot)
            if b > a:
                first[k] = a
                last[k] = b
                k += 1
            slot += length
    return first[:k], last[:k]


@nb.njit(cache=CACHE)
def runs_in_documents(first, last, offsets):
    """For runs sorted by `first` (tokens first .. last of one document each): whether each
    starts at its document's first token, and whether it ends at its last (a merge of two
    sorted lists: linear, where a search per run would be cache misses)."""
    n = len(first)
    starts = np.zeros(n, np.bool_)
    ends = np.zeros(n, np.bool_)
    d = 0
    for i in range(n):
        while offsets[d + 1] <= first[i]:
            d += 1
        starts[i] = first[i] == offsets[d]
        ends[i] = last[i] == offsets[d + 1] - 1
    return starts, ends


@nb.njit(cache=CACHE)
def clear_natural_ends(seg_start, seg_len, seg_flags, ends):
    """Clear the natural-end flag of segments that end at one of `ends` (sorted): in place.
    A coarse map of where `ends` fall (a bucket per few of them) spares most segments the
    search, which misses the cache at every level."""
    top, shift = ends[-1], 0
    while (top >> shift) > 8 * len(ends):
        shift += 1
    near = np.zeros((top >> shift) + 1, np.bool_)
    for e in ends:
        near[e >> shift] = True
    for s in range(len(seg_flags)):
        if seg_flags[s] & NATURAL_END:
            at = seg_start[s] + seg_len[s]
            if at > top or not near[at >> shift]:
                continue
            i = np.searchsorted(ends, at)
            if i < len(ends) and ends[i] == at:
                seg_flags[s] &= ~NATURAL_END
