"""A read order that fits a bounded cache: documents grouped by data file into windows.

A store in object storage under a `cache_limit` holds only part of its files at once. A
global shuffle reads every file at every step, so each step evicts files the next needs:
a dataset re-downloaded a hundred times an epoch. Instead, with `shuffle_bytes = S`
(by default a quarter of `cache_limit`), the store is planned in chunks of whole data files
(a Megatron or raw file: of units of whole documents, and the bounded cache fetches each
chunk's units as one block, `stores.blocks`; at most S / 4 bytes a chunk, one file or unit
at least), and each epoch visits the chunks in a
seeded order, as many at a time as fit in S (`windows.WindowOrder`): rows are shuffled
within a window, and a window reads only its chunks' files. The window being read and the
next one, fetched ahead, fit in half the cache.

The price is shuffle quality, and it is stated: documents of at most `window` chunks
(`files_together` files) are interleaved at a time, and a row packs documents of one chunk.
The chunks follow from the store's layout, its document lengths (and an ArrayRecord
store's file sizes) and S alone: the same on
every host and for a local copy given the same `shuffle_bytes`. Exact and elastic resume
hold as for any windowed order (the order is a pure function of the index).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from forge_grain.stores.blocks import FIT, block_bytes, block_cuts, chunk_starts

DIVISIBLE = ("megatron", "raw")  # formats the bounded cache reads in blocks, not whole files
PADDED = ("arrayrecord",)  # layouts whose files outweigh their tokens: planned in their `file_bytes`


@dataclasses.dataclass(frozen=True)
class Fitted:
    """Planning chunks (document bounds, chunk count + 1 of them) and how many are shuffled together."""

    bounds: np.ndarray
    window: int
    files_together: int  # the most data files (or blocks) one window reads
    shuffle_bytes: int

    @property
    def key(self) -> str:
        """What the plan's cache key adds (its chunks)."""
        return hashlib.sha256(np.ascontiguousarray(self.bounds, np.int64).view(np.uint8)).hexdigest()[:16]


def fitted_chunks(store, shuffle_bytes: int, chunk_docs: int) -> Fitted | None:
    """The chunks and window of `store` for windows of `shuffle_bytes` bytes of its data
    files as the cache holds them (`unit_bounds`); None when the store holds at most twice
    that (half the default cache: no order thrashes a cache that holds the data twice over),
    and the epoch is shuffled whole, as without. No chunk has more than `chunk_docs`
    documents (a plan's memory)."""
    units, unit_bytes = unit_bounds(store, shuffle_bytes)
    if int(unit_bytes.sum()) <= 2 * shuffle_bytes:
        return None
    starts = chunk_starts(unit_bytes.tolist(), shuffle_bytes)  # (as `blocks.fetch_cuts` groups a file's blocks)
    bounds = [int(units[k]) for k in starts] + [int(units[-1])]
    units_in = np.diff(starts + [len(unit_bytes)])
    bounds = _split_large(np.array(bounds, np.int64), chunk_docs)
    held = np.concatenate([[0], np.cumsum(unit_bytes)])  # a chunk holds its units whole, also one cut by `chunk_docs`
    first, end = np.searchsorted(units, bounds[:-1], side="right") - 1, np.searchsorted(units, bounds[1:])
    largest = int((held[end] - held[first]).max())
    window = max(1, min(shuffle_bytes // max(largest, 1), len(bounds) - 1))
    return Fitted(bounds, window, window * int(units_in.max()), shuffle_bytes)


def unit_bounds(store, shuffle_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Document bounds of the units chunks are made of, and each unit's bytes: data files
    (fetched whole; their tokens' bytes, or their sizes where the files are padded:
    `NativeStore.file_bytes`), or (Megatron and raw files) the units `blocks.block_cuts`
    makes under a cache of FIT * shuffle_bytes (fetched a chunk's at a time:
    `blocks.fetch_cuts`; their tokens' bytes)."""
    starts, offsets = np.asarray(store.file_doc_starts, np.int64), np.asarray(store.offsets, np.int64)
    if store.format not in DIVISIBLE:
        files = store.file_bytes if store.layout in PADDED else np.diff(offsets[starts]) * store.dtype.itemsize
        units = np.unique(starts)
        unit = np.searchsorted(units, starts[:-1], side="right") - 1  # (an empty file: the unit of the file after it)
        inside = unit < len(units) - 1
        sizes = np.zeros(len(units) - 1, np.int64)
        np.add.at(sizes, unit[inside], np.asarray(files, np.int64)[inside])
        return units, sizes
    target = max(1, block_bytes(FIT * shuffle_bytes) // store.dtype.itemsize)
    out = [starts[-1:]]
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
        local = offsets[a : b + 1] - offsets[a]
        out.append(a + np.searchsorted(local, block_cuts(local, target)))
    units = np.unique(np.concatenate(out))
    return units, np.diff(offsets[units]) * store.dtype.itemsize


def _split_large(bounds: np.ndarray, chunk_docs: int) -> np.ndarray:
    """Chunks of more than `chunk_docs` documents cut in equal parts (one plan's memory)."""
    out = [bounds[:1]]
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        parts = max(1, -(-(b - a) // chunk_docs))
        out.append(np.array([a + k * (b - a) // parts for k in range(1, parts + 1)], np.int64))
    return np.concatenate(out)
