"""Rows made from their segments' tokens read apart from the store's token arrays.

The compiled gather (`kernels.fill_rows`) reads a plan's segments from the arrays a store
maps. Where those are not at hand, the segments of the rows asked for are read one by one
into a buffer and the rows described as a plan over it (`over_parts`): a document at a time
for stores read that way (ArrayRecord, MDS: `document_parts`), or in ranged GETs for the
shards of a store in object storage still arriving (`ranged_parts`).
"""

from __future__ import annotations

import numpy as np

from forge_grain.packing import kernels


def over_parts(plan, rows, seg, parts, dtype) -> tuple:
    """Plan rows `rows` (their segments `seg`, those segments' tokens `parts`) as a plan over
    one buffer of those tokens: (rows, row_ptr, start, length, skip, flags, pieces)."""
    counts = np.array([plan.row_ptr[r + 1] - plan.row_ptr[r] for r in rows], np.int64)
    length = np.asarray(plan.seg_len)[seg]
    start = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype)
    row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return (
        np.arange(len(rows), dtype=np.int64), row_ptr, start, length,
        np.asarray(plan.seg_skip)[seg], np.asarray(plan.seg_flags)[seg], kernels.one_piece(flat),
    )


def document_parts(plan, store, seg) -> list[np.ndarray]:
    """Segments `seg`'s tokens, each read from its document."""
    offsets, parts = store.offsets, []
    for s in seg:
        g = int(plan.seg_start[s])
        doc = int(np.searchsorted(offsets, g, side="right") - 1)
        lo = g - int(offsets[doc])
        parts.append(store[doc][lo : lo + int(plan.seg_len[s])])
    return parts


def ranged_parts(plan, pieces, store, seg) -> list[np.ndarray] | None:
    """Segments `seg`'s tokens, those of the arrays still arriving read now in ranges
    (`store.read_ranges`), the rest sliced from the arrays at hand; None where the store says
    to wait for the arrays instead."""
    start, length = np.asarray(plan.seg_start)[seg], np.asarray(plan.seg_len)[seg]
    _, starts, array, base = pieces
    piece = np.searchsorted(starts, start, side="right") - 1
    where = list(zip(np.asarray(array)[piece].tolist(),
                     (np.asarray(base, np.int64)[piece] + start - np.asarray(starts)[piece]).tolist(),
                     length.tolist()))
    spans: dict[int, list] = {}
    for k, a, n in where:
        spans.setdefault(k, []).append((a, a + n))
    got = store.read_ranges(spans)
    if got is None:
        return None
    here = [k for k in spans if k not in got]
    local = dict(zip(here, store.arrays_for(np.array(here, np.int64)) if here else []))
    taken = {k: iter(arrays) for k, arrays in got.items()}
    return [next(taken[k]) if k in taken else local[k][a : a + n] for k, a, n in where]
