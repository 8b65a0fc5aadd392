"""Compiled (numba) kernels: packing plans from document lengths, row gathers, index shuffles.

Plans are arrays of *segments*: a run of `length` tokens starting at `start` in the
store's concatenated token space, with a loss-masked head of `skip` positions and
`flags` (bit 0: the segment ends where its document really ends). `row_ptr[r]` to
`row_ptr[r + 1]` are row r's segments, laid out from slot 0 of a buffer of
`seq_len + 1` slots: inputs are slots [0, seq_len), targets slots [1, seq_len + 1).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numba as nb
import numpy as np
from numba.core import types
from numba.extending import intrinsic

from forge_grain.stores.mapping import token_arrays

NATURAL_END = np.uint8(1)


def _numba_cache() -> bool:
    """Whether compiled kernels can be cached, choosing a writable place for them first.

    numba caches beside this module (`__pycache__`) or in a per-user directory; in a
    read-only deployment (package and home both read-only) neither works and every
    `cache=True` kernel would fail at first use. Then the cache goes to
    `$NUMBA_CACHE_DIR` if set, else `$FORGE_GRAIN_CACHE/numba`, else a temporary directory;
    with none writable, kernels compile on each start without caching. A cache holds code
    numba loads and runs (pickled), so a directory another user could have made or can
    write is never used (see `private_directory`).
    """
    if nb.config.CACHE_DIR:
        return True
    here = Path(__file__).parent
    if os.access(here / "__pycache__" if (here / "__pycache__").is_dir() else here, os.W_OK):
        return True
    from forge_grain.paths import cache_root, private_directory

    for candidate in (cache_root() / "numba", Path(tempfile.gettempdir()) / f"forge_grain-numba-{os.getuid()}"):
        if private_directory(candidate):
            nb.config.CACHE_DIR = str(candidate)
            return True
    return False


CACHE = _numba_cache()


# -- best-fit bins over integer capacities -------------------------------------------------


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


# -- gathering rows -----------------------------------------------------------------------


@nb.njit(cache=CACHE)
def row_loss_positions(row_ptr, seg_len, seg_skip, seq_len):
    """Trained targets (loss positions) of each plan row: what `fill_rows` marks in loss_mask."""
    out = np.zeros(len(row_ptr) - 1, np.int64)
    for r in range(len(row_ptr) - 1):
        p = 0
        for s in range(row_ptr[r], row_ptr[r + 1]):
            lo, hi = p + seg_skip[s], min(p + seg_len[s] - 1, seq_len)
            if hi > lo:
                out[r] += hi - lo
            p += seg_len[s]
    return out


@nb.njit(cache=CACHE)
def row_segments(rows, row_ptr):
    """The segment indices of plan rows `rows`, row after row."""
    n = 0
    for r in rows:
        n += row_ptr[r + 1] - row_ptr[r]
    out = np.empty(n, np.int64)
    k = 0
    for r in rows:
        for s in range(row_ptr[r], row_ptr[r + 1]):
            out[k] = s
            k += 1
    return out


@nb.njit(cache=CACHE, nogil=True)
def arrays_read(rows, row_ptr, seg_start, piece_starts, piece_array, num_arrays):
    """The token arrays (of a store's pieces) plan rows `rows` read, once each, in the order
    the rows first read them: what a store fetched from object storage must have mapped
    before the gather, and what the next steps' downloads are ordered by."""
    seen = np.zeros(num_arrays, np.bool_)
    out = np.empty(num_arrays, np.int64)
    n = 0
    for r in rows:
        for s in range(row_ptr[r], row_ptr[r + 1]):
            a = piece_array[np.searchsorted(piece_starts, seg_start[s], side="right") - 1]
            if not seen[a]:
                seen[a] = True
                out[n] = a
                n += 1
    return out[:n]


def one_piece(tokens: np.ndarray) -> tuple:
    """`fill_rows`'s pieces for a single array of tokens."""
    return token_arrays([tokens]), np.array([0, len(tokens)], np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)


@intrinsic
def _pointer(typingctx, address, like):
    """`address` (an integer) as a pointer to items of `like`'s dtype: how a gather reaches
    the token arrays of a `TokenArrays`."""
    sig = types.CPointer(like.dtype)(address, like)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@nb.njit(cache=CACHE, inline="always")
def _tokens(arrays, k):
    """Array k of a `TokenArrays`, as an array (read only: the gather never writes it)."""
    return nb.carray(_pointer(arrays.addresses[k], arrays.like), arrays.lengths[k])


@nb.njit(cache=CACHE, nogil=True, inline="always")
def _copy(dst, src):
    """dst[:] = src[:], converting: a loop over two contiguous views vectorizes (numba's
    slice assignment between dtypes is a generic strided loop, half the speed)."""
    for j in range(len(dst)):
        dst[j] = src[j]


@nb.njit(cache=CACHE, nogil=True, inline="always")
def _fill(dst, value):
    for j in range(len(dst)):
        dst[j] = value


@nb.njit(cache=CACHE, nogil=True)
def fill_rows(
    rows, dest, row_ptr, seg_start, seg_len, seg_skip, seg_flags, arrays, piece_starts, piece_array, piece_base,
    seq_len, pad_id, inputs, targets, segment_ids, positions, loss_mask, natural_stop,
):
    """Write plan row `rows[k]` into row `dest[k]` of the preallocated [n, seq_len] outputs.

    Token g of the store is in the run (piece) p with piece_starts[p] <= g: at
    piece_base[p] + g - piece_starts[p] of arrays[piece_array[p]] (a store's `pieces`).

    Each segment is written as a few contiguous range copies and fills of row views (no
    per-token branches, every slot written once but natural_stop's), so the compiler
    vectorizes them (slice assignments took 2.4x as long: 67 against 28 us for 16 rows of
    2048 tokens).
    """
    T = seq_len
    for k in range(len(rows)):
        r = rows[k]
        i = dest[k]
        inp, tgt, seg, pos, mask, stop = inputs[i], targets[i], segment_ids[i], positions[i], loss_mask[i], natural_stop[i]
        _fill(stop, False)
        p = 0
        for s in range(row_ptr[r], row_ptr[r + 1]):
            g = seg_start[s]
            length = seg_len[s]
            pc = np.searchsorted(piece_starts, g, side="right") - 1
            tok = _tokens(arrays, piece_array[pc])
            loc = g - piece_starts[pc] + piece_base[pc]
            hi = min(p + length, T)  # input slots [p, hi)
            if hi > p:
                _copy(inp[p:hi], tok[loc : loc + hi - p])
                _fill(seg[p:hi], s - row_ptr[r] + 1)
                out = pos[p:hi]
                for j in range(len(out)):
                    out[j] = j
                a = min(p + seg_skip[s], hi)  # loss on [a, e): the masked head, then up to the segment's last target
                e = max(min(p + length - 1, T), a)
                _fill(mask[p:a], False)
                _fill(mask[a:e], True)
                _fill(mask[e:hi], False)
            lo_t, hi_t = max(p, 1), min(p + length, T + 1)  # target slots: targets[q - 1] = slot q
            if hi_t > lo_t:
                _copy(tgt[lo_t - 1 : hi_t - 1], tok[loc + lo_t - p : loc + hi_t - p])
            if seg_flags[s] & NATURAL_END and length >= 2 and p + length - 2 < T:
                stop[p + length - 2] = True
            p += length
        if p < T:
            _fill(inp[p:], pad_id)
            _fill(seg[p:], 0)
            _fill(pos[p:], 0)
            _fill(mask[p:], False)
        if p < T + 1:
            _fill(tgt[max(p, 1) - 1 :], pad_id)


# -- index shuffle --------------------------------------------------------------------------


@nb.njit(cache=CACHE, inline="always")
def _mix64(x):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@nb.njit(cache=CACHE, inline="always")
def _feistel_halves(n):
    """(bits per half, mask of a half) of the Feistel network over the smallest even bit
    width covering n."""
    bits = 2
    while (np.uint64(1) << np.uint64(bits)) < np.uint64(n):
        bits += 2
    half = np.uint64(bits // 2)
    return half, (np.uint64(1) << half) - np.uint64(1)


@nb.njit(cache=CACHE, inline="always")
def _feistel(x, n, half, mask, k):
    while True:
        left = x >> half
        right = x & mask
        for rnd in range(4):
            f = _mix64(right ^ (k + np.uint64(rnd) * np.uint64(0x9E3779B97F4A7C15))) & mask
            left, right = right, left ^ f
        x = (left << half) | right
        if x < n:
            return x


@nb.njit(cache=CACHE)
def permutation(n, key):
    """A random permutation of [0, n) determined by a 64-bit `key`: Fisher-Yates driven by
    splitmix64. The stream is this project's own, so a numpy upgrade cannot change the data
    (numpy does not promise to keep its Generator streams). The modulo's bias is below
    n / 2^64 per draw."""
    out = np.arange(n)
    state = np.uint64(key)
    for i in range(n - 1, 0, -1):
        state += np.uint64(0x9E3779B97F4A7C15)
        j = np.int64(_mix64(state) % np.uint64(i + 1))
        out[i], out[j] = out[j], out[i]
    return out


EXACT_SHUFFLE_MAX = 4096  # epochs of at most this many rows are shuffled exactly (Fisher-Yates)


@nb.njit(cache=CACHE, inline="always")
def _epoch_key(seed_key, e):
    return _mix64(np.uint64(seed_key) ^ _mix64(np.uint64(e) + np.uint64(0x632BE59BD9B4E019)))


@nb.njit(cache=CACHE, nogil=True)
def epoch_rows(idx, n, seed_key, shuffle):
    """Plan rows of dataset indices: index i is row pi_e(i mod n) of epoch e = i // n, where
    pi_e is a seeded permutation of [0, n) whose key mixes `seed_key` with the epoch.

    Up to `EXACT_SHUFFLE_MAX` rows, pi_e is a Fisher-Yates shuffle (uniform, as an ideal
    shuffle is: a small Feistel network is far from it), built once per epoch a call
    touches, so its cost per index stays bounded. Beyond, pi_e is a 4-round Feistel network
    over the smallest even bit width covering n, with cycle walking to stay below n (as
    Grain's index_shuffle and MosaicML's shuffles do): O(1) memory and time per index.
    """
    out = np.empty(len(idx), np.int64)
    if not shuffle:
        for i in range(len(idx)):
            out[i] = idx[i] - (idx[i] // n) * n
        return out
    if n <= EXACT_SHUFFLE_MAX:
        perm = np.empty(0, np.int64)
        last = np.int64(-1)
        for i in range(len(idx)):
            e = idx[i] // n
            if e != last:
                perm = permutation(n, _epoch_key(seed_key, e))
                last = e
            out[i] = perm[idx[i] - e * n]
        return out
    half, mask = _feistel_halves(n)
    un = np.uint64(n)
    for i in range(len(idx)):
        e = idx[i] // n
        j = idx[i] - e * n
        out[i] = np.int64(_feistel(np.uint64(j), un, half, mask, _epoch_key(seed_key, e)))
    return out


@nb.njit(cache=CACHE, inline="always")
def _feistel_inverse(y, n, half, mask, k):
    while True:  # the rounds of `_feistel` undone in reverse order; cycle walking likewise
        left = y >> half
        right = y & mask
        for rnd in range(3, -1, -1):
            f = _mix64(left ^ (k + np.uint64(rnd) * np.uint64(0x9E3779B97F4A7C15))) & mask
            left, right = right ^ f, left
        y = (left << half) | right
        if y < n:
            return y


@nb.njit(cache=CACHE, nogil=True)
def epoch_positions(rows, n, seed_key, e, shuffle):
    """The inverse of `epoch_rows` within epoch e: the position in the epoch (index - e·n)
    at which each plan row of `rows` is read. A skip of documents at resume uses it to
    find, in closed form, where the rows holding them fall in every later epoch."""
    out = np.empty(len(rows), np.int64)
    if not shuffle:
        for i in range(len(rows)):
            out[i] = rows[i]
        return out
    key = _epoch_key(seed_key, e)
    if n <= EXACT_SHUFFLE_MAX:
        perm = permutation(n, key)
        inverse = np.empty(n, np.int64)
        for i in range(n):
            inverse[perm[i]] = i
        for i in range(len(rows)):
            out[i] = inverse[rows[i]]
        return out
    half, mask = _feistel_halves(n)
    for i in range(len(rows)):
        out[i] = np.int64(_feistel_inverse(np.uint64(rows[i]), np.uint64(n), half, mask, key))
    return out


# -- mixing -------------------------------------------------------------------------------


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
