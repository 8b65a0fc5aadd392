"""Blocks of whole documents: how a Megatron or raw token file in object storage is cut
under a `cache_limit` (`mirror_ranges`), and how the read order that fits that cache cuts
it too (`forge_grain.packing.fitted`): both from the file's document offsets and the limit
alone, so the two cut at the same places on any host and for a local copy alike."""

from __future__ import annotations

import numpy as np

BLOCK = 64 << 20  # the bytes of a block at most (one document at least) ...
BLOCKS_IN_CACHE = 32  # ... and at most this fraction of cache_limit: the coming steps' blocks fit beside


def block_bytes(limit: int | None) -> int:
    """The most bytes of a block under a cache of `limit` bytes (None: unbounded)."""
    return BLOCK if limit is None else max(1, min(BLOCK, limit // BLOCKS_IN_CACHE))


def block_cuts(offsets: np.ndarray, target: int) -> np.ndarray:
    """Where a file's blocks start, its end appended (token positions): whole documents of
    about `target` tokens together, a longer document a block by itself."""
    cuts, at, end = [0], 0, int(offsets[-1])
    while at < end:
        nxt = int(offsets[np.searchsorted(offsets, at + target, side="right") - 1])
        if nxt <= at:  # the next document alone is longer than a block
            nxt = int(offsets[np.searchsorted(offsets, at, side="right")])
        cuts.append(nxt)
        at = nxt
    return np.array(cuts, np.int64)
