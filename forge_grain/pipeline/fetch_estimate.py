"""What an epoch fetches from object storage under a `cache_limit`, before it runs.

The row order is known ahead, so which files (or blocks) each step reads is too: `forge-grain
plan` replays one epoch of a source's rows against a cache of its limit (least recently
used first, those the step reads kept) and counts the bytes fetched. It leaves out the
prefetch and other processes sharing the cache: for an order that fits the cache (the
prefetch fetches the same files earlier, within the same room) it is what the server will
serve to within a few percent; for one that thrashes, a lower bound (hints then evict each
other's files too, and such a run fetches several times more).
"""

from __future__ import annotations

import collections

import numpy as np

from forge_grain.packing import kernels

FETCH_WARNING = 1.5  # `plan` warns about a source fetching this many times its data an epoch, or more


def epoch_fetch(dataset, rows_per_step: int) -> dict | None:
    """{"data_bytes", "fetch_bytes", "limit"} of one epoch of `dataset`'s rows read
    `rows_per_step` at a time; None for a source that does not fetch under a limit."""
    d = getattr(dataset, "base", dataset)  # (a `seq_lens` schedule: its first length)
    store = getattr(d, "store", None)
    if store is None or not getattr(store, "fetches", False) or store.cache.limit is None:
        return None
    room = store.cache.room()
    units_of, (all_units, all_sizes) = _reads(d, store)
    data = int(sum(dict(zip(all_units.tolist(), all_sizes.tolist())).values()))
    cached: collections.OrderedDict = collections.OrderedDict()
    held = fetched = 0
    n, step = d.num_rows, max(1, int(rows_per_step))
    for a in range(0, n, step):
        units, sizes = units_of(np.arange(a, min(a + step, n)))
        now = dict(zip(units.tolist(), sizes.tolist()))
        for u, size in now.items():
            if u in cached:
                cached.move_to_end(u)
            else:
                cached[u] = size
                fetched += size
                held += size
        for u in [u for u in cached if u not in now]:
            if held <= room:
                break
            held -= cached.pop(u)
    return {"data_bytes": data, "fetch_bytes": int(fetched), "limit": store.cache.limit}


def _reads(d, store):
    """(rows -> the units they fetch and their bytes, every unit and its bytes) of `d`'s store:
    its token arrays (files or blocks: `units_of`), or for shards read a record at a time
    (ArrayRecord) the shards, each fetched whole as a record of it is first read."""
    if d._pieces is not None:
        return (lambda rows: store.units_of(d.arrays_read(rows))), store.units_of(np.arange(store.num_arrays))
    first, sizes = np.asarray(store.offsets)[store.file_doc_starts], np.asarray(store.file_bytes, np.int64)
    plan = d.plan

    def units_of(rows):
        seg = kernels.row_segments(d.rows_of(rows), plan.row_ptr)
        shards = np.unique(np.searchsorted(first, np.asarray(plan.seg_start)[seg], side="right") - 1)
        return shards, sizes[shards]

    return units_of, (np.arange(len(sizes)), sizes)
