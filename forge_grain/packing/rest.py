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
from forge_grain.packing.plans import PackingPlan, plan_offsets


def untrained_runs(p: PackingPlan, plan_rows, offsets) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) token of each run of consecutive targets that plan rows `plan_rows`
    would train, sorted: the targets are tokens first + 1 .. last (the first token is the
    run's context only, as a document's first token is)."""
    rows = np.asarray(plan_rows, np.int64)
    seg = kernels.row_segments(rows, np.asarray(p.row_ptr))
    start = np.asarray(p.seg_start, np.int64)[seg]
    length = np.asarray(p.seg_len, np.int64)[seg]
    skip = np.asarray(p.seg_skip, np.int64)[seg]
    # each segment's first slot in its row: the lengths of the segments before it in the row
    per_row = np.diff(np.asarray(p.row_ptr))[rows]
    ends = np.cumsum(length)
    slot = (ends - length) - np.repeat(np.concatenate([[0], ends])[np.cumsum(per_row) - per_row], per_row)
    # trained targets: slots [slot + skip, min(slot + len - 1, seq_len)), tokens start + (that - slot) + 1
    first = start + skip
    last = start + np.minimum(length - 1, p.seq_len - slot)
    keep = last > first
    first, last = first[keep], last[keep]
    order = np.argsort(first, kind="stable")
    first, last = first[order], last[order]
    if not len(first):
        return first, last
    # targets continue where the previous run's end: first == previous last (one document;
    # a document's first token is never a target, so two documents never join). Runs of
    # targets trained once are disjoint, so a joined run ends where its last part does.
    new = np.concatenate([[True], first[1:] != last[:-1]])
    return first[new], last[np.concatenate([new[1:], [True]])]


def rest_plan(p: PackingPlan, plan_rows, offsets, seq_len: int, seed: int,
              max_segments: int | None = None) -> PackingPlan:
    """The targets of `plan_rows` of plan `p` (the rows an epoch has not read yet), planned
    into rows of `seq_len` with `p`'s strategy; seeded by `seed` (see the module docstring)."""
    offsets = np.asarray(offsets, np.int64)
    first, last = untrained_runs(p, plan_rows, offsets)
    if not len(first):
        return _empty(p.strategy, seq_len)
    doc = np.searchsorted(offsets, first, side="right") - 1
    natural = last == offsets[doc + 1] - 1  # the run ends where its document ends
    inside = first != offsets[doc]  # starts within a document: no row may start at it (bos_bestfit)
    lengths = last - first + 1
    fake = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # the runs side by side
    q = plan_offsets(fake, seq_len, p.strategy, seed=seed, chunk=0, max_segments=max_segments,
                     filler=inside if p.strategy == "bos_bestfit" else None)
    # back to the store's tokens: every segment lies within one run
    s = np.asarray(q.seg_start, np.int64)
    run = np.searchsorted(fake, s, side="right") - 1
    ends_run = s + np.asarray(q.seg_len, np.int64) == fake[run + 1]
    flags = np.where(ends_run & ~natural[run], np.asarray(q.seg_flags) & ~kernels.NATURAL_END, q.seg_flags)
    q.seg_start = first[run] + (s - fake[run])
    q.seg_flags = flags.astype(np.uint8)
    q.stats["rest_of_epoch"] = {"runs": int(len(first)), "targets": int((last - first).sum())}
    q.__dict__.pop("_checksum", None)
    return q


def _empty(strategy: str, seq_len: int) -> PackingPlan:
    z = np.zeros(0, np.int64)
    return PackingPlan(strategy, seq_len, np.zeros(1, np.int64), z, z.astype(np.int32), z.astype(np.int32),
                       z.astype(np.uint8), {"rows": 0, "rest_of_epoch": {"runs": 0, "targets": 0}})
