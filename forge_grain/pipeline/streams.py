"""Streaming sources' positions: which canonical streams this process reads, and where they are.

Streaming sources are read in order, not indexed (`forge_grain.sources.streaming`): their
documents are dealt to a fixed number of canonical streams, and a stream's place at a step
is known only by having read up to it, from a state, or at an epoch's start. This module
owns that bookkeeping for one pipeline: the layout (`canonical_streams`,
`canonical_workers`), the positions recorded as batches are made, seeking to a state's
positions, reading forward to a step nobody recorded, and checking a state's positions.

It never decides which rows a step trains (the row order does) and never makes a batch:
reading forward fills a scratch batch only to move the streams.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from forge_grain.errors import StateError
from forge_grain.packing.packed import empty_rows
from forge_grain.pipeline import history
from forge_grain.pipeline.config import ConfigError, DataConfig
from forge_grain.pipeline.states import check_canonical
from forge_grain.sources.streaming import START

STREAM_STATE_KEYS = {"epoch", "window", "stream", "row_index", "emitted"}
KEEP_BEHIND = 64  # recorded positions kept behind the last step made: what unconsumed prefetched steps may need


def layout_for(config: DataConfig, batches, shard_count: int, resume_from: dict | None):
    """How streaming sources deal documents (None without them): `canonical_streams` of the
    config, else of the state resumed from, else the shard count."""
    if not any(s.hf_dataset is not None and s.hf_streaming for s in config.sources):
        return None
    from forge_grain.sources.streaming import StreamLayout

    saved = resume_from.get("canonical") if isinstance(resume_from, dict) else None
    groups = config.canonical_streams or (saved[0] if isinstance(saved, list) and saved else None) or shard_count
    sizes = batches.sizes_used
    if groups % shard_count or any(b % groups for b in sizes):
        whole = math.gcd(*sizes)
        what = f"global_batch_size ({config.global_batch_size})" if len(sizes) == 1 else f"every batch size {sizes}"
        works = (f"e.g. canonical_streams = {whole} (any multiple of the shard count dividing {whole})"
                 if whole % shard_count == 0 else
                 f"none does on {shard_count} shards, which do not divide every batch size")
        raise ConfigError(
            f"canonical_streams {groups}: streaming sources need the shard count ({shard_count}) to divide "
            f"it and it to divide {what}: {works}. A state resumes on any shard count dividing the "
            "canonical_streams it was saved with; set canonical_streams in the config (or pass "
            "resume_from=state) to choose it"
        )
    return StreamLayout(groups, config.canonical_workers, batches)


def epoch_aligned(streams: list, config: DataConfig, batches, steps_per_epoch: int) -> bool:
    """Whether the pipeline makes epochs of exactly `steps_per_epoch` steps: with its one
    source streaming, every canonical stream starts its epoch e at step e · steps_per_epoch
    (the rows a stream has left of epoch e - 1, fewer than a step's share, are not read), so
    a pass starts without reading the passes before it."""
    return bool(streams) and len(config.sources) == 1 and batches.constant and steps_per_epoch > 0


class StreamPositions:
    """The positions of one pipeline's streaming sources in this process."""

    def __init__(self, streams: list, layout, order, aligned: bool, dtype):
        self.streams, self.layout, self.order, self.aligned, self.dtype = streams, layout, order, aligned, dtype
        self.step, self.stride = 0, 1  # the next step this process makes; its steps are `stride` apart
        self.recorded = {0: self._now()}  # step -> positions before it

    def _now(self) -> list[dict]:
        return [r.states() for r in self.streams]

    # -- making batches ---------------------------------------------------------------------

    def before_batch(self, step: int) -> None:
        """Check that `step` is the next in order, and start its epoch where epochs are aligned."""
        if step != self.step:
            raise StateError(f"streaming sources are read in order: the next step is {self.step}, not {step}")
        if self.aligned:
            self._align(step)

    def after_batch(self, step: int) -> None:
        """Record the positions after `step`, for the next step this process makes (the next of
        its class when it owns one class in `stride`)."""
        self.step = step + self.stride
        self.recorded[self.step] = self._now()
        self.recorded.pop(step - KEEP_BEHIND * self.stride, None)

    def _align(self, step: int) -> None:
        """Move the streams still in an earlier epoch to the start of `step`'s epoch."""
        epoch = step // self.order.steps_per_epoch
        current = self.recorded.get(step) or self._now()
        if all(st["epoch"] >= epoch for per in current for st in per.values()):
            return
        moved = [{c: st if st["epoch"] >= epoch else {**START, "epoch": epoch} for c, st in per.items()}
                 for per in current]
        for rows, st in zip(self.streams, moved):
            rows.set_states(st)
        self.recorded[step] = moved

    # -- positioning ------------------------------------------------------------------------

    def start(self, step: int, workers: int = 1, streams: list | None = None) -> None:
        """See `Pipeline.start_streams`."""
        P = self.layout.classes
        if P % workers:
            raise StateError(
                f"{workers} DataLoader workers cannot share streaming sources dealt for canonical_workers={P}: the "
                f"worker count must divide it. Set canonical_workers to a multiple of {workers} in the config "
                "(it is data: a new run), or use a worker count that divides it"
            )
        o = self.order
        owned = self.layout.owned(o.shard_index, o.shard_count, step % workers, workers)
        for rows in self.streams:
            rows.own(owned)
        self.stride = workers
        streams = streams if streams is not None else self.known(step)
        if streams is not None:
            self.seek(step, streams)
            return
        epoch_start = step // o.steps_per_epoch * o.steps_per_epoch if self.aligned else 0
        base = max(s for s in [*self.recorded, epoch_start]  # the latest place known (0 always is)
                   if s <= step and _covers(self.known(s), owned))
        warnings.warn(
            f"no saved position of the streaming sources for step {step}: reading their rows of steps "
            f"[{base}, {step}) to reach it. Restore a saved state (the tracker's, StatefulDataLoader's, a "
            "checkpoint's) to start there at once", stacklevel=3)
        self.seek(base, self.known(base))
        self._read_to(step)

    def _read_to(self, step: int) -> None:
        """Read this process's streams through the steps before `step` without making batches (a
        stream's place is known only by reading up to it)."""
        o = self.order
        scratch = empty_rows(max(o.batches.sizes_used) // o.shard_count, o.config.seq_len, self.dtype)
        which = {id(d): i for i, d in enumerate(o.mixture.datasets)}
        for t in range(self.step, step):
            rows = o.shard_rows(t)
            src, _ = o.locate(rows)
            for stream in self.streams:
                mine = rows[src == which[id(stream)]]
                mine = mine[np.isin(self.layout.stream_of(mine), stream.owned)]
                if len(mine):
                    stream.get_batch(None, out=scratch, dest=np.arange(len(mine)), rows=mine)
        self.step = step
        self.recorded = {step: self._now()}

    def known(self, step: int) -> list | None:
        """The positions at `step` where this process knows them without reading: recorded as
        it made the step before, or an epoch's start; else None."""
        return self.recorded.get(step) or self._epoch_starts(step)

    def _epoch_starts(self, step: int) -> list | None:
        """Every canonical stream at the start of an epoch, where `step` starts one: step 0, or
        with an epoch-aligned source every multiple of `steps_per_epoch`."""
        n = self.order.steps_per_epoch
        if step and not (self.aligned and step % n == 0):
            return None
        epoch = step // n if step else 0
        return [{str(c): {**START, "epoch": epoch} for c in range(self.layout.count)} for _ in self.streams]

    def seek(self, step: int, streams: list | None = None) -> None:
        """Position the streams for `step`: a state's positions `streams`, else those recorded."""
        streams = streams if streams is not None else self.recorded.get(step)
        if streams is None:
            raise StateError(f"no stream state recorded for step {step}; restore a saved state instead")
        for rows, st in zip(self.streams, streams):
            rows.set_states(st)
        self.step = step
        self.recorded = {step: self._now()}

    def positions(self, step: int) -> list[dict]:
        """The positions before `step`, as recorded when the batches before it were made."""
        if step not in self.recorded:
            raise StateError(f"no stream state recorded for step {step}")
        return self.recorded[step]

    # -- states -----------------------------------------------------------------------------

    def check_state(self, state: dict) -> None:
        """A state's positions are well formed, untouched, and cover the streams this shard reads."""
        check_canonical(state, self.layout.canonical)
        streams = state.get("streams")
        if not isinstance(streams, list) or len(streams) != len(self.streams):
            raise StateError(f"state 'streams' must list {len(self.streams)} stream state(s), got {str(streams)[:200]}")
        if state.get("streams_sha256") != history.digest(streams):
            raise StateError("state 'streams' does not match its checksum: the state was changed after it was saved")
        for i, per in enumerate(streams):
            _check_positions(i, per, self.layout.count)
            missing = [c for c in self.streams[i].owned if str(c) not in per]
            if missing:
                o = self.order
                raise StateError(
                    f"state streams[{i}] has no position for canonical stream(s) {missing}, which this shard "
                    f"({o.shard_index} of {o.shard_count}) reads; it holds {sorted(map(int, per))}. A shard's "
                    "state holds its own streams: join all shards' states with forge_grain.merge_states (the Orbax "
                    "handler does) to resume on another shard count"
                )


def _covers(streams: list | None, owned: list[int]) -> bool:
    return streams is not None and all(str(c) in per for per in streams for c in owned)


def _check_positions(i: int, per, count: int) -> None:
    """One source's positions in a state: canonical stream numbers below `count` mapped to
    stream states of the right keys and types."""
    if not isinstance(per, dict) or any(not k.isdigit() or int(k) >= count for k in per):
        raise StateError(f"state streams[{i}] must map canonical stream numbers below {count} to states, "
                         f"got {str(per)[:200]}")
    for c, st in per.items():
        if not isinstance(st, dict) or set(st) != STREAM_STATE_KEYS:
            raise StateError(f"state streams[{i}][{c}] must have the keys {sorted(STREAM_STATE_KEYS)}, "
                             f"got {str(st)[:200]}")
        bad = [k for k in STREAM_STATE_KEYS - {"stream"} if isinstance(st[k], bool) or not isinstance(st[k], int)
               or st[k] < 0]
        if bad or not isinstance(st["stream"], str):
            raise StateError(f"state streams[{i}][{c}]: {sorted(bad) or ['stream']} have the wrong type or sign")
