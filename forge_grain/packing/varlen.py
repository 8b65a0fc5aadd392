"""What varlen attention needs from a packed batch: each row's segments as lengths and offsets.

A packed row holds several documents (and, for `bestfit`, a run of padding at its end).
Attention must not cross them. Kernels that take variable-length sequences (flash-attn's
`*_varlen_func`, Hugging Face's padding-free path, OLMo-core, TransformerEngine) want the
batch flattened and its sequences described by cumulative lengths; this module derives
them from the batch's `segment_ids`, with numpy only (the bridges turn them into tensors).

A *segment* is a maximal run of equal `segment_ids` within a row. Row boundaries always
cut: a document that continues into the next row (`concat`, long documents split by
`bestfit`) is two segments. Padding (segment id 0) at a row's end is a segment of its own,
so the segments cover every position of the flattened batch (attention among padding
tokens is harmless: their loss is masked).

The padding rule, so batches collate and compiled graphs see one shape: every row gets
`max_segments` slots (default `seq_len`, the most a row can hold; smaller when the plan
caps documents per row). `doc_lens` is [rows, max_segments] with a row's segment lengths
first and zeros after; `cu_seqlens` is the int32 running sum over the flattened batch,
`rows · max_segments + 1` long: its real entries first, then the total repeated, which
adds empty sequences that varlen kernels skip.
"""

from __future__ import annotations

import numpy as np


def segment_lengths(segment_ids: np.ndarray) -> list[np.ndarray]:
    """Each row's segment lengths, in order (they sum to the row's length)."""
    seg = np.asarray(segment_ids)
    if seg.ndim != 2:
        raise ValueError(f"segment_ids must be [rows, seq_len], got shape {seg.shape}")
    out = []
    for row in seg:
        cuts = np.flatnonzero(row[1:] != row[:-1]) + 1
        bounds = np.concatenate([[0], cuts, [len(row)]])
        out.append(np.diff(bounds).astype(np.int32))
    return out


def doc_lens(segment_ids: np.ndarray, max_segments: int | None = None) -> np.ndarray:
    """[rows, max_segments] int32: each row's segment lengths, then zeros (OLMo-core's
    `doc_lens`). A row with more segments than `max_segments` is an error."""
    lengths = segment_lengths(segment_ids)
    width = max_segments if max_segments is not None else np.shape(segment_ids)[1]
    out = np.zeros((len(lengths), width), np.int32)
    for r, row in enumerate(lengths):
        if len(row) > width:
            raise ValueError(f"row {r} has {len(row)} segments, more than max_segments={width}")
        out[r, : len(row)] = row
    return out


def cu_seqlens(lens: np.ndarray) -> np.ndarray:
    """int32 cumulative segment lengths over the flattened batch from `doc_lens`,
    `rows · max_segments + 1` long (see the module docstring for the padding)."""
    flat = np.asarray(lens).reshape(-1)
    real = flat[flat > 0]
    out = np.full(len(flat) + 1, real.sum(), np.int32)
    out[0] = 0
    out[1 : len(real) + 1] = np.cumsum(real)
    return out


def varlen(batch: dict, max_segments: int | None = None) -> dict:
    """`cu_seqlens`, `max_seqlen` (the longest segment, a host int) and `doc_lens` of a
    batch (see the module docstring)."""
    lens = doc_lens(batch["segment_ids"], max_segments)
    return {"cu_seqlens": cu_seqlens(lens), "max_seqlen": int(lens.max()), "doc_lens": lens}
