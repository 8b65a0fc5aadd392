"""The rest of an epoch planned at another row length: what a sequence-length change trains.

A run that changes its sequence length at step S has trained, in the current epoch of each
source, the rows before S. Its documents' remaining tokens must still be trained once
each, and the rows before S must stay what they were. So the rows of the epoch not yet
read are taken apart into what they would have trained: per document, runs of
consecutive targets (`untrained_runs`). Those runs are planned afresh at the new length
(`rest_plan`) with the source's strategy, as if each were a document: the epoch then ends
with these rows, and the next epoch is planned whole at the new length.

What is guaranteed is what the strategy guarantees within an epoch, across the change:
`bestfit` trains every target of the epoch exactly once (a run longer than a row is split
into overlapping windows, as a long document is); `concat` also, except the last partial
row of the rest (as at the end of any epoch); `bos_bestfit` starts each row at a document
whose start was not yet trained, and fills gaps with the runs that start inside a
document, cropping what does not fit (as it crops within an epoch). No target trained
before the change is trained again in that epoch.
"""

from __future__ import annotations

import numpy as np

from forge_grain.packing import kernels
from forge_grain.packing.chunked import joined_arrays
from forge_grain.packing.plans import PLAN_ARRAYS, PackingPlan, joined_stats, plan_offsets


def untrained_runs(p: PackingPlan, plan_rows) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) token of each run of consecutive targets that plan rows `plan_rows`
    would train, sorted: the targets are tokens first + 1 .. last (the first token is the
    run's context only, as a document's first token is)."""
    rows = np.sort(np.asarray(plan_rows, np.int64))  # (read in plan order: the runs are sorted below anyway)
    first, last = kernels.row_targets(rows, np.asarray(p.row_ptr), np.asarray(p.seg_start), np.asarray(p.seg_len),
                                      np.asarray(p.seg_skip), p.seq_len)
    # runs of targets trained once are disjoint: sorted apart, their firsts and lasts still pair
    # up (a sort of each is several times faster than sorting by one and gathering the other)
    first, last = np.sort(first), np.sort(last)
    if not len(first):
        return first, last
    # targets continue where the previous run's end: first == previous last (one document;
    # a document's first token is never a target, so two documents never join); a joined run
    # ends where its last part does.
    new = np.concatenate([[True], first[1:] != last[:-1]])
    return first[new], last[np.concatenate([new[1:], [True]])]


def rest_plan(p: PackingPlan, plan_rows, offsets, seq_len: int, seed: int,
              max_segments: int | None = None, bounds=None) -> PackingPlan:
    """The targets of `plan_rows` of plan `p` (the rows an epoch has not read yet), planned
    into rows of `seq_len` with `p`'s strategy; seeded by `seed` (see the module docstring).
    `bounds`: the document bounds of the chunks of an order fitted to a bounded cache
    (`packing.fitted`); each chunk's runs are then planned apart, as its documents are, so
    the rest is read a window of chunks at a time (`stats["chunk_rows"]`). Planned whole and
    read in one shuffle, the rest of an epoch read every file at every step: a Megatron file
    under a limit of 2 files' worth fetched 27x its bytes in the epoch of a change."""
    first, last = untrained_runs(p, plan_rows)
    if not len(first):
        return _empty(p.strategy, seq_len)
    offsets = np.asarray(offsets, np.int64)
    starts, natural = kernels.runs_in_documents(first, last, offsets)
    # the runs as the documents of a token space whose gaps (the tokens between them) are
    # documents never planned: segments come out at the store's own token positions
    spaced = np.empty(2 * len(first), np.int64)
    spaced[0::2], spaced[1::2] = first, last + 1
    runs = 2 * np.arange(len(first), dtype=np.int64)
    filler = None
    if p.strategy == "bos_bestfit":  # a run starting inside a document fills gaps, as a tail does
        filler = np.zeros(len(spaced) - 1, np.bool_)
        filler[runs] = ~starts
    if bounds is None:
        q = plan_offsets(spaced, seq_len, p.strategy, seed=seed, chunk=0, max_segments=max_segments, filler=filler,
                         documents=runs)
    else:
        chunk = np.searchsorted(offsets[np.asarray(bounds)], first, side="right") - 1
        q = _by_chunk(spaced, runs, chunk, seq_len, p.strategy, seed, max_segments, filler)
    q.seg_flags = _unnatural_ends(q, np.sort(last[~natural] + 1))
    q.stats["rest_of_epoch"] = {"runs": int(len(first)), "targets": int((last - first).sum())}
    q.__dict__.pop("_checksum", None)
    for name in PLAN_ARRAYS:  # read-only, as a plan mapped from the cache is: the gather's compiled
        setattr(q, name, np.ascontiguousarray(getattr(q, name)))  # code is the one those use (no
        getattr(q, name).setflags(write=False)  # compiling on the first batch past a change)
    return q


def _by_chunk(spaced, runs, chunk, seq_len: int, strategy: str, seed: int, max_segments, filler) -> PackingPlan:
    """The runs planned a chunk at a time (`chunk`: each run's, in order), joined: each chunk's
    rows after the one before's (`stats["chunk_rows"]`); chunks left with no row dropped."""
    cuts = np.flatnonzero(np.diff(chunk)) + 1
    plans = [plan_offsets(spaced, seq_len, strategy, seed=seed, chunk=int(chunk[group[0]]),
                          max_segments=max_segments, filler=filler, documents=runs[group])
             for group in np.split(np.arange(len(runs)), cuts)]
    plans = [q for q in plans if q.num_rows] or plans[:1]
    stats = {**joined_stats([q.stats for q in plans], seq_len, strategy), "chunk_rows": [q.num_rows for q in plans]}
    return PackingPlan(strategy, seq_len, **joined_arrays(plans), stats=stats)


def _unnatural_ends(q: PackingPlan, ends: np.ndarray) -> np.ndarray:
    """`q`'s flags, without the natural end where a segment ends at one of `ends` (sorted):
    where a run ends before its document does, the rest of which was trained already."""
    flags = np.asarray(q.seg_flags).copy()
    if len(ends):
        kernels.clear_natural_ends(np.asarray(q.seg_start), np.asarray(q.seg_len), flags, ends)
    return flags


def _empty(strategy: str, seq_len: int) -> PackingPlan:
    z = np.zeros(0, np.int64)
    return PackingPlan(strategy, seq_len, np.zeros(1, np.int64), z, z.astype(np.int32), z.astype(np.int32),
                       z.astype(np.uint8), {"rows": 0, "rest_of_epoch": {"runs": 0, "targets": 0}})
