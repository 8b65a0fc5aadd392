"""Gathering rows: plan segments copied out of the token arrays into batches (without the
GIL), and what rows read (loss positions, segments, token arrays)."""

from __future__ import annotations

import numba as nb
import numpy as np
from numba.core import types
from numba.extending import intrinsic

from forge_grain.packing.kernels.cache import CACHE
from forge_grain.packing.kernels.planning import NATURAL_END
from forge_grain.stores.mapping import token_arrays


@nb.njit(cache=CACHE, nogil=True)
def row_loss_positions(row_ptr, seg_start, seg_len, seg_skip, seq_len, masks, piece_starts, piece_array, piece_base,
                       masked):
    """Trained targets (loss positions) of each plan row: what `fill_rows` marks in loss_mask;
    with `masked`, only those whose target the store's `masks` mark (laid out as its pieces)."""
    out = np.zeros(len(row_ptr) - 1, np.int64)
    for r in range(len(row_ptr) - 1):
        p = 0
        for s in range(row_ptr[r], row_ptr[r + 1]):
            lo, hi = p + seg_skip[s], min(p + seg_len[s] - 1, seq_len)
            if hi > lo and not masked:
                out[r] += hi - lo
            elif hi > lo:
                g = seg_start[s]
                pc = np.searchsorted(piece_starts, g, side="right") - 1
                m = _tokens(masks, piece_array[pc])
                at = g - piece_starts[pc] + piece_base[pc] + 1 - p  # slot j's target: m[at + j]
                for j in range(lo, hi):
                    out[r] += m[at + j]
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
    out, _ = arrays_read_each(rows, np.array([len(rows)], np.int64), row_ptr, seg_start, piece_starts, piece_array,
                              num_arrays)
    return out


@nb.njit(cache=CACHE, nogil=True)
def arrays_read_each(rows, ends, row_ptr, seg_start, piece_starts, piece_array, num_arrays):
    """`arrays_read` of each group of `rows` (group k: rows[ends[k-1]:ends[k]]), in one call:
    the groups' arrays one after another, and where each group's end (the prefetch hints
    look up a block of steps at once, each step's arrays its own)."""
    segments = 0
    for r in rows:
        segments += row_ptr[r + 1] - row_ptr[r]
    seen = np.zeros(num_arrays, np.bool_)
    out = np.empty(min(segments, num_arrays * len(ends)), np.int64)
    out_ends = np.empty(len(ends), np.int64)
    n, lo = 0, 0
    for k in range(len(ends)):
        first = n
        for i in range(lo, ends[k]):
            r = rows[i]
            for s in range(row_ptr[r], row_ptr[r + 1]):
                a = piece_array[np.searchsorted(piece_starts, seg_start[s], side="right") - 1]
                if not seen[a]:
                    seen[a] = True
                    out[n] = a
                    n += 1
        seen[out[first:n]] = False  # (the next group's are its own)
        out_ends[k] = n
        lo = ends[k]
    return out[:n], out_ends


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
    seq_len, pad_id, inputs, targets, segment_ids, positions, loss_mask, natural_stop, masks, masked,
):
    """Write plan row `rows[k]` into row `dest[k]` of the preallocated [n, seq_len] outputs.

    Token g of the store is in the run (piece) p with piece_starts[p] <= g: at
    piece_base[p] + g - piece_starts[p] of arrays[piece_array[p]] (a store's `pieces`).
    With `masked`, `masks` are the store's target masks, laid out as `arrays`: a loss
    position trains only where its target is marked one.

    Each segment is written as a few contiguous range copies and fills of row views (no
    per-token branches, every slot written once but natural_stop's), so the compiler
    vectorizes them (slice assignments took 2.4x as long: 67 against 28 us for 16 rows of
    2048 tokens).

    Returns the rows written: all of them, or k where row k reads an array without an
    address (a table of a store in object storage holds only the arrays mapped for it: the
    caller maps them and fills again).
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
            if arrays.addresses[piece_array[pc]] == 0:
                return k
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
                if masked:  # slot j's target is the store's token loc + j - p + 1
                    m = _tokens(masks, piece_array[pc])
                    for j in range(a, e):
                        mask[j] = m[loc + j - p + 1] != 0
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
    return len(rows)
