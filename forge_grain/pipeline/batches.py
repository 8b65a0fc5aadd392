"""Batch-size schedules: where each step's global batch falls in the row sequence.

The mixed, packed stream is one sequence of rows whatever the batch size; a global batch
is a slice of it. With batch sizes b(0), b(1), ... step s covers rows [R(s), R(s + 1)),
R(s) = b(0) + ... + b(s - 1). A schedule only moves where the slices fall: the same rows
are trained in the same order, grouped differently. Sizes change at a few steps, so R is
a closed form over those segments (a step or a row is located by a binary search), and
a schedule is written as its segments: [(start_step, size)], the first at step 0.

A ramp (Megatron's `rampup_batch_size`, in tokens) is turned into segments once: from
`start` rows a step, the size grows by `increment` each time another `tokens / n` tokens
are trained (n: the increments up to the full batch), each size kept for whole steps.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np

from forge_grain.errors import ForgeGrainError


class ScheduleError(ForgeGrainError, ValueError):
    """A batch-size schedule that is malformed or does not fit the shard count."""


class BatchSchedule:
    """Step -> (first row, size) for segments [(start_step, size)] (first at step 0)."""

    def __init__(self, segments):
        segments = check_segments(segments)
        merged = [segments[0]]
        for s, b in segments[1:]:  # a segment that keeps the size is no change
            if b != merged[-1][1]:
                merged.append((s, b))
        self.segments = merged
        self.steps = np.array([s for s, _ in merged], np.int64)
        self.sizes = np.array([b for _, b in merged], np.int64)
        self.rows_at = np.zeros(len(merged), np.int64)  # R at each segment's first step
        for k in range(1, len(merged)):
            self.rows_at[k] = self.rows_at[k - 1] + (self.steps[k] - self.steps[k - 1]) * self.sizes[k - 1]
        # plain ints for the per-step lookups: a numpy search of one scalar costs microseconds,
        # and every batch asks several times
        self._starts, self._size_list = self.steps.tolist(), self.sizes.tolist()
        self._row_list = self.rows_at.tolist()

    @property
    def constant(self) -> bool:
        """One size throughout: R(s) = s · B, as without a schedule."""
        return len(self.segments) == 1

    @property
    def sizes_used(self) -> list[int]:
        return sorted(set(self.sizes.tolist()))

    def size(self, step: int) -> int:
        """Rows of global batch `step`."""
        return self._size_list[self._segment(step)]

    def row(self, step: int) -> int:
        """R(step): the first row of global batch `step` (the rows of all steps before it)."""
        k = self._segment(step)
        return int(self._row_list[k] + (step - self._starts[k]) * self._size_list[k])

    def uniform(self, a: int, b: int) -> bool:
        """Steps [a, b) all have one size (they lie in one segment)."""
        return self._segment(a) == self._segment(b - 1)

    def steps_within(self, rows: int) -> int:
        """The most steps whose rows fit in the first `rows` rows: the largest s with R(s) <= rows."""
        k = int(np.searchsorted(self.rows_at, rows, side="right")) - 1
        return int(self.steps[k] + (rows - self.rows_at[k]) // self.sizes[k])

    def step_of(self, rows) -> np.ndarray:
        """The step whose global batch holds each row (vectorized)."""
        return self.place(rows)[0]

    def place(self, rows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(step, position in its batch, that batch's size) of each row (vectorized)."""
        rows = np.asarray(rows, np.int64)
        k = np.searchsorted(self.rows_at, rows, side="right") - 1
        offset = rows - self.rows_at[k]
        return self.steps[k] + offset // self.sizes[k], offset % self.sizes[k], self.sizes[k]

    def indivisible(self, n: int, from_step: int = 0) -> tuple[int, int] | None:
        """The first (step, size) at or after `from_step` whose size `n` does not divide, else None."""
        k = self._segment(from_step)
        return next(((max(s, from_step), b) for s, b in self.segments[k:] if b % n), None)

    def _segment(self, step: int) -> int:
        if step < 0:
            raise IndexError(f"step {step} is negative")
        return bisect.bisect_right(self._starts, step) - 1

    def to_list(self) -> list[list[int]]:
        return [[int(s), int(b)] for s, b in self.segments]

    def __eq__(self, other) -> bool:
        return isinstance(other, BatchSchedule) and self.segments == other.segments

    def __repr__(self) -> str:
        return f"BatchSchedule({self.to_list()})"


MAX_SEQ_LEN = 1 << 24  # tokens a row: its arrays (ids, targets, positions, segments, mask) fit in memory
MAX_BATCH = 1 << 24  # rows a step, likewise (a step of more rows than this is no batch a host makes)


def check_segments(segments, where: str = "batch_sizes") -> list[tuple[int, int]]:
    """[(start_step, size)] from a list of pairs, or a ScheduleError naming the bad entry;
    lengths at most `MAX_SEQ_LEN`, batch sizes at most `MAX_BATCH`."""
    noun = "length" if "seq_lens" in where else "batch size"
    most = MAX_SEQ_LEN if "seq_lens" in where else MAX_BATCH
    if not isinstance(segments, (list, tuple)) or not segments:
        raise ScheduleError(f"{where}: a list of [start_step, {noun}] pairs, not {segments!r:.80}")
    out, last = [], -1
    for i, pair in enumerate(segments):
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and all(
            isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in pair)
        if not ok or pair[0] <= last or pair[1] < 1 or (i == 0 and pair[0] != 0):
            first = "the first at step 0, " if i == 0 else ""
            raise ScheduleError(f"{where}[{i}] is {pair!r:.80}: [start_step, {noun}] pairs, {first}steps "
                                f"increasing, {noun}s positive integers")
        if pair[1] > most:
            raise ScheduleError(f"{where}[{i}] is {pair!r:.80}: a {noun} past {most:,} (the largest forge-grain makes: "
                                f"a step's arrays must fit in a host's memory)")
        out.append((int(pair[0]), int(pair[1])))
        last = int(pair[0])
    return out


def ramp_segments(start: int, increment: int, tokens: int | float, full: int, seq_len: int) -> list[tuple[int, int]]:
    """The segments of a ramp from `start` rows a step to `full`, `increment` at a time, the
    sizes before `full` training `tokens` tokens in equal parts (Megatron's rampup, counted
    in tokens): size `start + k·increment` holds until the rows trained reach
    (k + 1) · tokens / (n · seq_len), n = (full - start) / increment."""
    n = (full - start) // increment
    per_size = Fraction(int(tokens), n * seq_len)  # rows each size before the full one trains (exact)
    segments, step, rows = [], 0, 0
    for k in range(n):
        size = start + k * increment
        steps = max(0, math.ceil(((k + 1) * per_size - rows) / size))  # whole steps, until its share is trained
        if steps:
            segments.append((step, size))
            step, rows = step + steps, rows + steps * size
    segments.append((step, full))
    return segments


def combined(history: list[dict], segments: list[tuple[int, int]], key: str = "batches") -> list[tuple[int, int]]:
    """The segments a run follows: each history segment's own batch sizes (`batches`, saved
    when it ended) up to its `until_step`, then the config's `segments` from there on (the
    size in force at the change starts at it). Segments without `batches` were saved when
    the batch size could not change: they used the config's. (`key="seq_lens"`: the same for
    sequence lengths.)"""
    out, lo = [], 0
    for hi, segs in [*((seg["until_step"], seg.get(key, segments)) for seg in history), (None, segments)]:
        if hi is not None and hi <= lo:
            continue
        in_force = [k for k, (s, _) in enumerate(segs) if s <= lo][-1]
        for s, b in segs[in_force:]:
            s = max(int(s), lo)
            if hi is not None and s >= hi:
                break
            out.append((s, int(b)))
        lo = hi if hi is not None else lo
    return out
