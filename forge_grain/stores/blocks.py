"""Blocks of whole documents: how a Megatron or raw token file in object storage is cut
under a `cache_limit` (`mirror_ranges`), and how the read order that fits that cache cuts
it too (`forge_grain.packing.fitted`): both from the file's document offsets and the limit
alone, so the two cut at the same places on any host and for a local copy alike.

The order plans in units of at most `cache_limit / BLOCKS_IN_CACHE` bytes and groups
consecutive units into chunks of at most `shuffle_bytes / CHUNKS_IN_WINDOW` (`chunk_starts`);
a window of them reads its chunks whole. So the cache fetches a chunk's units as one block
(`fetch_cuts`): under the default `shuffle_bytes` that is half as many downloads as units,
each a turn of the download threads' bookkeeping (the cache's lock, its ledger, eviction)
taken from the reader's interpreter, for the same order and the same bytes."""

from __future__ import annotations

import numpy as np

BLOCK = 64 << 20  # the bytes of a unit, and of a block, at most (one document at least) ...
BLOCKS_IN_CACHE = 32  # ... and at most this fraction of cache_limit: the coming steps' blocks fit beside
FIT = 4  # cache_limit / shuffle_bytes by default: the window read, the next fetched ahead, room to spare
CHUNKS_IN_WINDOW = 4  # a chunk holds at most shuffle_bytes / this (a window interleaves several)


def block_bytes(limit: int | None) -> int:
    """The most bytes of a unit under a cache of `limit` bytes (None: unbounded)."""
    return BLOCK if limit is None else max(1, min(BLOCK, limit // BLOCKS_IN_CACHE))


def default_shuffle_bytes(cache_limit: int | None) -> int | None:
    """The window of a source with `cache_limit` and no `shuffle_bytes` of its own."""
    return None if cache_limit is None else max(1, cache_limit // FIT)


def block_cuts(offsets: np.ndarray, target: int) -> np.ndarray:
    """Where a file's units start, its end appended (token positions): whole documents of
    about `target` tokens together, a longer document a unit by itself."""
    cuts, at, end = [0], 0, int(offsets[-1])
    while at < end:
        nxt = int(offsets[np.searchsorted(offsets, at + target, side="right") - 1])
        if nxt <= at:  # the next document alone is longer than a block
            nxt = int(offsets[np.searchsorted(offsets, at, side="right")])
        cuts.append(nxt)
        at = nxt
    return np.array(cuts, np.int64)


def chunk_starts(unit_bytes, shuffle_bytes: int) -> list[int]:
    """The first unit of each chunk of the fitted order, for units of `unit_bytes` bytes in
    order: consecutive units together up to `shuffle_bytes / CHUNKS_IN_WINDOW` bytes, one at least."""
    target = max(1, shuffle_bytes // CHUNKS_IN_WINDOW)
    starts, acc, n = [0], 0, 0
    for k, size in enumerate(unit_bytes):
        if n and acc + size > target:
            starts.append(k)
            acc = n = 0
        acc, n = acc + size, n + 1
    return starts


def fetch_cuts(file_offsets: list, itemsize: int, limit: int | None) -> list[np.ndarray]:
    """Each file's blocks as the bounded cache of `limit` bytes fetches them (token cuts of
    each file, its end appended): its units (`block_cuts`), those of one chunk of the order
    fitted to that cache under its default `shuffle_bytes` together (`chunk_starts`, counted
    across files as that order counts them) up to `BLOCK` bytes; a block never spans two
    files, nor two chunks."""
    units = [block_cuts(off, max(1, block_bytes(limit) // itemsize)) for off in file_offsets]
    if limit is None:
        return units
    sizes = [(np.diff(c) * itemsize).tolist() for c in units]
    starts, out, first = set(chunk_starts([n for s in sizes for n in s], default_shuffle_bytes(limit))), [], 0
    for cuts, sized in zip(units, sizes):
        keep, held = [0], 0
        for k, size in enumerate(sized):
            if k and (first + k in starts or held + size > BLOCK):
                keep.append(k)
                held = 0
            held += size
        out.append(cuts[keep + [len(sized)]])
        first += len(sized)
    return out
