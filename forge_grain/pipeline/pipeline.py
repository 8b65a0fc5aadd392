"""`Pipeline`: global batches of the mixed, packed stream; this shard's slice; exact resume.

Global batch s is mixture rows [s·B, (s+1)·B); under a batch-size schedule [R(s), R(s+1)),
R(s) the sizes of the steps before it (`forge_grain.pipeline.batches`). Shard k of n
receives rows [k·b/n, (k+1)·b/n) of a batch of b rows, so the global batch does not depend
on the number of shards, and the iterator state is one integer (the next step) plus a
fingerprint.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import hashlib
import json
import math
import sys
import threading
import warnings
import weakref
from fractions import Fraction
from pathlib import Path

import grain
import numpy as np

from forge_grain.pipeline import explain as flight
from forge_grain.pipeline import history, states
from forge_grain.pipeline.batches import BatchSchedule, combined as batch_plan
from forge_grain.pipeline.config import ConfigError, DataConfig
from forge_grain.errors import StateError, StoreError
from forge_grain.pipeline.mixture import MAX_ROWS, Mixture
from forge_grain.pipeline.opening import AheadOpener
from forge_grain.pipeline.skips import RowMap
from forge_grain.packing.packed import PackedDataset, empty_rows
from forge_grain.sources.deferred import SourceRecords, source_key
from forge_grain.sources.factory import open_source
from forge_grain.sources.streaming import START

# Bumped whenever an algorithm that decides the stream changes (plans carry PLAN_VERSION too),
# so a state saved before such a change is refused instead of resuming into other data.
# 2: exact small-epoch shuffles, own document permutation; 3: mixture weights used exactly.
STREAM_VERSION = 3
STREAM_STATE_KEYS = {"epoch", "window", "stream", "row_index", "emitted"}


def default_shard() -> tuple[int, int]:
    """(index, count) from JAX or torch.distributed when initialized, else (0, 1).

    Neither framework is imported here: only one the program already loaded is asked.
    """
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            if jax.process_count() > 1:
                return jax.process_index(), jax.process_count()
        except Exception:  # JAX not usable in this process
            pass
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


REPEAT_WARNING = 4  # `describe` warns about a source read this many times over a run, or more
CROP_WARNING = 0.3  # ... and about one losing this share of its tokens to cropping (bos_bestfit loses ~20% on web text)
FETCH_SHARDS = 16  # shards a source in object storage is told of ahead: twice its default fetch threads
# a step this far behind the hinted window's start is one the prefetch threads made out of order,
# not a restore: it leaves the window as it is (recomputing a window of 1,024 steps took ~40 ms)
BEHIND = 64
HINT_STEPS = 16  # steps whose shards are found together (one lookup for 16 steps, not one a step)


class _RemovedSource:
    """A source of the mixture's history that the config no longer has: it had rows before
    the change, gets weight 0 after it, and is never read."""

    def __init__(self, name: str, seq_len: int):
        self.name, self.seq_len = name, seq_len

    def get_batch(self, ranks, out=None, dest=None, id_dtype=np.int32):
        raise StateError(f"source '{self.name}' was removed from the mixture; steps before the change are not rebuilt")


class Pipeline:
    """The data stream a `DataConfig` describes, for one shard of the cluster.

    `num_threads` threads assemble batches ahead of the consumer (the gather kernels
    release the GIL); `worker_count > 0` uses Grain's `mp_prefetch` worker processes
    instead (spawned: the main script needs an `if __name__ == "__main__":` guard).
    Neither changes the data, and the state does not record them, nor does
    `plan_workers` (processes planning the chunks of a large store; default one per
    core past 2 M documents, else this process), nor `fetch_ahead` (the most steps whose
    shards sources in object storage download ahead: the lookahead stops at `FETCH_SHARDS`
    shards a source), nor `tokenize_threads` (threads tokenizing streaming sources; default
    one per core).
    `dtype` is that of ids and positions (int32; int64 for torch embedding lookups).
    `progress`: progress bars of first-use work (planning, tokenizing, counting); by default
    shown by shard 0 only, so that ranks do not print interleaved bars.

    `skip_steps=N` with `resume_from=state` continues the run without the next N global
    batches (rewind past a loss spike): step s >= the state's step trains what the
    uninterrupted run trained at s + N. `skip_documents={source: [document, ...]}` (indices
    in the source's store, as `explain` names them) continues it without every row that
    holds one of them, in every epoch from the state's step on; the rows left close up, so
    each step still has a full batch of what the uninterrupted run trained, in its order.
    Skips are recorded in the states (`skips`), so later resumes, any shard count,
    `consumed` and `explain` follow them (see `forge_grain.pipeline.skips`).

    `allow_batch_size_change=True` with `resume_from=state` lets the config's batch sizes
    (`global_batch_size`, `batch_sizes`, `batch_ramp`) differ from the state's: the steps
    before the state's step keep the sizes they had (`batch_history` in the states), and
    the rows after it continue the same row sequence in the new sizes.
    """

    def __init__(
        self,
        config: DataConfig,
        shard_index: int | None = None,
        shard_count: int | None = None,
        *,
        num_threads: int = 2,
        prefetch: int = 4,
        worker_count: int = 0,
        plan_workers: int | None = None,
        fetch_ahead: int = 1024,
        tokenize_threads: int | None = None,
        cache_dir: str | Path | None = None,
        dtype=np.int32,
        resume_from: dict | None = None,
        allow_mixture_change: bool = False,
        allow_batch_size_change: bool = False,
        skip_steps: int = 0,
        skip_documents: dict | None = None,
        progress: bool | None = None,
    ):
        if shard_index is None or shard_count is None:
            shard_index, shard_count = default_shard()
        self.config = config
        self.shard_index, self.shard_count = shard_index, shard_count
        self.batches = BatchSchedule(config.batch_schedule())  # the config's; with the resumed history below
        start = resume_from.get("step") if isinstance(resume_from, dict) else 0
        start = start if isinstance(start, int) and not isinstance(start, bool) and start >= 0 else 0
        self._check_shards(self.batches, start)
        self.num_threads, self.prefetch, self.worker_count = num_threads, prefetch, worker_count
        self.cache_dir = cache_dir
        self.fetch_ahead = fetch_ahead
        self.dtype = np.dtype(dtype)  # of ids and positions in batches
        self.tokenize_threads = tokenize_threads
        self.layout = self._stream_layout(resume_from)
        # one bar per job, not one per rank interleaved: by default only shard 0 shows first-use work
        self.progress = shard_index == 0 if progress is None else progress
        self._sources = self._open_sources(plan_workers)
        self.datasets = [o.dataset for o in self._sources]
        self._fetching = [i for i, o in enumerate(self._sources) if o.fetches]  # sources in object storage
        self._hints: dict[int, tuple] = {}  # first step -> (end, the arrays each fetching source reads)
        self._window = {"start": 0, "end": -1}  # the steps hinted, their shards' counts, the last hint sent
        self._hint_lock = threading.Lock()
        self.streams = [o.stream for o in self._sources if o.stream is not None]
        self._check_tokenizers()
        if self.streams:
            if worker_count:
                raise ConfigError("streaming sources are read in order in this process: worker_count must be 0")
            self.num_threads = min(num_threads, 1)  # one thread keeps the steps in order
            self._stream_step, self._stream_stride = 0, 1
            self._stream_states = {0: [r.states() for r in self.streams]}
        schedule = config.schedule()
        self.rows_per_epoch = sum(d.num_rows for d in self.datasets)
        self._count_steps()
        self.history: list[dict] = []  # mixture changes at resume (see `forge_grain.pipeline.history`)
        self.batch_history: list[dict] = []  # batch-size changes at resume: [{until_step, batches}]
        # [{at_step, steps} or {at_step, documents: {source: [document]}}]: what resumes skipped, in trainer steps
        self.skips: list[dict] = []
        self._resumed_from: tuple[str, int] | None = None  # (fingerprint, step) of a state resumed with a change
        # for copies rebuilt in worker processes
        self._resume_args = (resume_from, allow_mixture_change, skip_steps, skip_documents, allow_batch_size_change)
        if resume_from is not None:
            self._adopt_history(resume_from, allow_mixture_change, allow_batch_size_change)
            if self.batch_history:  # the sizes each earlier run trained, then the config's
                self.batches = BatchSchedule(batch_plan(self.batch_history, config.batch_schedule()))
                self._check_shards(self.batches, start)
                self._count_steps()
        if skip_steps or skip_documents:
            self._skip(resume_from, skip_steps, skip_documents)
        self.source_names, phases = history.mixing_schedule(self.history, [s.name for s in config.sources], schedule)
        removed = [_RemovedSource(n, config.seq_len) for n in self.source_names[len(config.sources):]]
        self.mixture = Mixture(
            self.datasets + removed,
            phases[0][2],
            phases=[(self.batches.row(step), w) for step, _, w in phases[1:]],
            length=None if self.num_steps is None else self.batches.row(self.num_steps),
            leaves=[leaves for _, leaves, _ in phases],
        )
        self.fingerprint, self._summary = self._fingerprint()
        self._not_as_sent: StoreError | None = None  # set where a process rebuilt it on other data (_rebuild)
        self._warn_unreachable_phases()
        self.rowmap = self._apply_skips()
        if resume_from is not None:
            self.check_state(resume_from)  # its step is one of this run's, before anything is opened
        self._opener = AheadOpener(self, start)

    def _check_shards(self, batches: BatchSchedule, from_step: int = 0) -> None:
        """Every batch size from `from_step` on (where this pipeline starts) divides among the
        shards: earlier, smaller batches of a ramp may not, as the run resumes on more hosts."""
        n, bad = self.shard_count, batches.indivisible(self.shard_count, from_step)
        if not 0 <= self.shard_index < n:
            raise ConfigError(f"the shard index {self.shard_index} must be in [0, {n})")
        if bad is not None and batches.constant:
            raise ConfigError(f"global_batch_size {bad[1]} must divide evenly among {n} shards")
        if bad is not None:
            raise ConfigError(f"the batch size {bad[1]} at step {bad[0]} must divide evenly among {n} shards "
                              f"(the schedule's sizes: {batches.to_list()})")

    def _count_steps(self) -> None:
        """`steps_per_epoch`, `num_steps` and `step_limit` under the batch schedule."""
        c, batches = self.config, self.batches
        # whole steps of one epoch (the first, under a schedule)
        self.steps_per_epoch = batches.steps_within(self.rows_per_epoch)
        epochs = None if c.num_epochs is None else Fraction(str(float(c.num_epochs)))  # as written: 0.29 is 29/100
        if epochs is None:
            self.num_steps = None
        elif batches.constant:  # num_epochs of whole epochs' steps, so that whole epochs tile the steps
            self.num_steps = math.floor(epochs * self.steps_per_epoch)
        else:  # the steps whose rows fit in num_epochs of rows
            self.num_steps = batches.steps_within(math.floor(epochs * self.rows_per_epoch))
        if c.max_steps is not None:
            self.num_steps = c.max_steps if self.num_steps is None else min(self.num_steps, c.max_steps)
        # the last step the mixing arithmetic can reach (unlimited epochs end there)
        self.step_limit = self.num_steps if self.num_steps is not None else batches.steps_within(MAX_ROWS)
        if self.num_steps == 0:
            raise ConfigError(f"global_batch_size {batches.size(0)} is larger than the {self.rows_per_epoch} rows of "
                              f"num_epochs={c.num_epochs}")

    @property
    def local_batch_size(self) -> int:
        """Rows of this shard's part of every batch (see `local_size` under a batch-size schedule)."""
        if not self.batches.constant:
            raise ConfigError(f"the batch size changes with the step ({self.batches.to_list()}): use "
                              "local_size(step)")
        return self.batches.size(0) // self.shard_count

    def local_size(self, step: int) -> int:
        """Rows of this shard's part of global batch `step`."""
        size = self.batches.size(states.step_number(step, self.step_limit, end=True))
        if size % self.shard_count:
            raise ConfigError(f"the batch size {size} at step {step} does not divide among {self.shard_count} "
                              f"shards (the schedule's sizes: {self.batches.to_list()})")
        return size // self.shard_count

    def _apply_skips(self) -> RowMap:
        """The map from the trainer's rows to the uninterrupted stream's, after the skips;
        phases and mixture changes stay where the uninterrupted stream has them, and the
        run's steps are its rows less the skipped ones, in whole batches."""
        rowmap = RowMap(self.mixture, self.batches.row)
        for s in self.skips:
            if "steps" in s:
                rowmap.skip_steps(s["at_step"], s["steps"])
            else:
                rowmap.skip_rows(s["at_step"], self._rows_holding(s["documents"]))
        if self.skips:
            length = self.batches.row(self.step_limit)
            self.step_limit = self.batches.steps_within(length - rowmap.removed(length))
            if self.num_steps is not None:
                if self.step_limit <= self.skips[-1]["at_step"]:
                    raise ConfigError(f"the skips leave no step after step {self.skips[-1]['at_step']}: the run has "
                                      f"{self.num_steps} steps and would keep {self.step_limit}")
                self.num_steps = self.step_limit
        return rowmap

    def _rows_holding(self, documents: dict) -> dict:
        """{source index: plan rows holding any of its `documents`}, by source name."""
        out = {}
        for name, docs in documents.items():
            if name not in self.source_names:
                raise ConfigError(f"skip_documents: no source named {name!r} (sources: {self.source_names})")
            i = self.source_names.index(name)
            d = self.mixture.datasets[i]
            if isinstance(d, _RemovedSource):
                continue  # removed by a mixture change: none of its rows come again
            if not isinstance(d, PackedDataset):
                raise ConfigError(f"skip_documents: source {name!r} is streaming; documents are skipped in stored "
                                  "sources only")
            try:
                out[i] = d.rows_holding(docs)
            except IndexError as e:
                raise ConfigError(f"skip_documents[{name!r}]: {e}") from None
        return out

    def _open_sources(self, plan_workers: int | None) -> list:
        """Each source's packed rows; stored sources whose files match their record are
        deferred (opened when first read; see `forge_grain.sources.deferred`)."""
        c = self.config
        seeds = [_source_seed(c.seed, s.name) for s in c.sources]
        keys = [source_key(s, c.seq_len, seed, c.plan_chunk_docs, c.max_segments_per_row)
                for s, seed in zip(c.sources, seeds)]
        records = SourceRecords(keys, self.cache_dir) if any(k is not None for k in keys) else None
        opened = [open_source(s, c.seq_len, seed, self.shard_index, self.shard_count, self.cache_dir,
                              c.plan_chunk_docs, plan_workers, records, key, c.max_segments_per_row, self.layout,
                              self.tokenize_threads, self.progress)
                  for s, seed, key in zip(c.sources, seeds, keys)]
        if records is not None:
            records.save()
        return opened

    def _stream_layout(self, resume_from: dict | None):
        """How streaming sources deal documents (None without them): `canonical_streams` of the
        config, else of the state resumed from, else the shard count."""
        c = self.config
        if not any(s.hf_dataset is not None and s.hf_streaming for s in c.sources):
            return None
        from forge_grain.sources.streaming import StreamLayout

        saved = resume_from.get("canonical") if isinstance(resume_from, dict) else None
        groups = c.canonical_streams or (saved[0] if isinstance(saved, list) and saved else None) or self.shard_count
        sizes = self.batches.sizes_used
        if groups % self.shard_count or any(b % groups for b in sizes):
            whole = math.gcd(*sizes)
            what = f"global_batch_size ({c.global_batch_size})" if len(sizes) == 1 else f"every batch size {sizes}"
            works = (f"e.g. canonical_streams = {whole} (any multiple of the shard count dividing {whole})"
                     if whole % self.shard_count == 0 else
                     f"none does on {self.shard_count} shards, which do not divide every batch size")
            raise ConfigError(
                f"canonical_streams {groups}: streaming sources need the shard count ({self.shard_count}) to divide "
                f"it and it to divide {what}: {works}. A state resumes on any shard count dividing the "
                "canonical_streams it was saved with; set canonical_streams in the config (or pass "
                "resume_from=state) to choose it"
            )
        return StreamLayout(groups, c.canonical_workers, self.batches)

    def start_streams(self, step: int, workers: int = 1, streams: list | None = None) -> None:
        """Make this process read steps `step`, `step + workers`, ...: it reads only the canonical
        streams of their step class, positioned by `streams` (a state's, or those another
        process handed over), else by the positions recorded as this process made the steps
        before, else at an epoch's start (step 0, or a pass start of an epoch-aligned source)."""
        if not self.streams:
            return
        P = self.layout.classes
        if P % workers:
            raise StateError(
                f"{workers} DataLoader workers cannot share streaming sources dealt for canonical_workers={P}: the "
                f"worker count must divide it. Set canonical_workers to a multiple of {workers} in the config "
                "(it is data: a new run), or use a worker count that divides it"
            )
        owned = self.layout.owned(self.shard_index, self.shard_count, step % workers, workers)
        for rows in self.streams:
            rows.own(owned)
        self._stream_stride = workers
        streams = streams if streams is not None else self.known_streams(step)
        if streams is not None:
            self.seek(step, streams)
            return
        epoch_start = step // self.steps_per_epoch * self.steps_per_epoch if self.epoch_aligned else 0
        base = max(s for s in [*self._stream_states, epoch_start]  # the latest place known (0 always is)
                   if s <= step and self._covers(self.known_streams(s), owned))
        warnings.warn(
            f"no saved position of the streaming sources for step {step}: reading their rows of steps "
            f"[{base}, {step}) to reach it. Restore a saved state (the tracker's, StatefulDataLoader's, a "
            "checkpoint's) to start there at once", stacklevel=2)
        self.seek(base, self.known_streams(base))
        self._read_streams_to(step)

    @staticmethod
    def _covers(streams: list | None, owned: list[int]) -> bool:
        return streams is not None and all(str(c) in per for per in streams for c in owned)

    def _read_streams_to(self, step: int) -> None:
        """Read this process's streams through the steps before `step` without making batches (a
        stream's place is known only by reading up to it)."""
        scratch = empty_rows(max(self.batches.sizes_used) // self.shard_count, self.config.seq_len, self.dtype)
        which = {id(d): i for i, d in enumerate(self.mixture.datasets)}
        for t in range(self._stream_step, step):
            rows = self.shard_rows(t)
            src, _ = self.mixture.locate(rows)
            for stream in self.streams:
                mine = rows[src == which[id(stream)]]
                mine = mine[np.isin(self.layout.stream_of(mine), stream.owned)]
                if len(mine):
                    stream.get_batch(None, out=scratch, dest=np.arange(len(mine)), rows=mine)
        self._stream_step = step
        self._stream_states = {step: [r.states() for r in self.streams]}

    def known_streams(self, step: int) -> list | None:
        """The streaming sources' positions at `step` where this process knows them without
        reading: recorded as it made the step before, or an epoch's start; else None."""
        return self._stream_states.get(step) or self._stream_starts(step)

    def _stream_starts(self, step: int) -> list | None:
        """Every canonical stream at the start of an epoch, where `step` starts one: step 0, or
        with an epoch-aligned source every multiple of `steps_per_epoch`."""
        if step and not (self.epoch_aligned and step % self.steps_per_epoch == 0):
            return None
        epoch = step // self.steps_per_epoch if step else 0
        return [{str(c): {**START, "epoch": epoch} for c in range(self.layout.count)} for _ in self.streams]

    @property
    def epoch_aligned(self) -> bool:
        """A pipeline whose one source is streaming makes epochs of exactly `steps_per_epoch`
        steps: every canonical stream starts its epoch e at step e · steps_per_epoch (the rows
        a stream has left of epoch e - 1, fewer than a step's share, are not read), so a pass
        starts without reading the passes before it."""
        return (bool(self.streams) and len(self.config.sources) == 1 and self.batches.constant
                and self.steps_per_epoch > 0)

    def _align_streams(self, step: int) -> None:
        """Move the streams still in an earlier epoch to the start of `step`'s epoch."""
        epoch = step // self.steps_per_epoch
        current = self._stream_states.get(step) or [r.states() for r in self.streams]
        if all(st["epoch"] >= epoch for per in current for st in per.values()):
            return
        moved = [{c: st if st["epoch"] >= epoch else {**START, "epoch": epoch} for c, st in per.items()}
                 for per in current]
        for rows, st in zip(self.streams, moved):
            rows.set_states(st)
        self._stream_states[step] = moved

    @property
    def stores(self) -> list:
        """Each source's documents (a `TokenStore`, or a streaming source); opens deferred sources."""
        return [o.store for o in self._sources]

    def _adopt_history(self, state: dict, allow_change: bool, allow_batches: bool = False) -> None:
        """The mixture and batch histories and skips of `state`, extended by a change to this
        config if allowed."""
        saved = states.check(state)["config"]
        try:
            self.history = list(history.check(saved.get("history", [])))
            self.skips = list(history.check_skips(saved.get("skips", [])))
            self.batch_history = list(history.check_batches(saved.get("batch_history", [])))
        except history.HistoryError as e:
            raise StateError(str(e)) from None
        if state["fingerprint"] == self._fingerprint()[0]:
            return  # the same mixture and batch sizes: an ordinary resume
        kept = self.history, self.skips, self.batch_history
        self.history, self.skips, self.batch_history = [], [], []
        if not (allow_change or allow_batches):
            return  # strict: check_state names what differs
        mixtures, self.skips, self.batch_history = kept
        try:
            history.check_fixed(saved, self._fingerprint(with_history=False)[1])  # before advising an allowance
            if history.saved_batches(saved) != self._config_batches():
                if not allow_batches:
                    raise StateError("the batch size differs from the state's (global_batch_size, batch_sizes or "
                                     "batch_ramp): pass allow_batch_size_change=True to continue its rows in the new "
                                     "sizes")
                self.batch_history = history.batch_change(state, self.batch_history)
            self.history = mixtures
            if self._same_mixture(saved):
                self._resumed_from = (state["fingerprint"], int(state["step"]))
                return  # only the batch size changed
            if not allow_change:
                return  # strict: check_state names what differs
            if any("documents" in s for s in self.skips):
                raise StateError("a mixture change after skipped documents is not supported yet: resume without "
                                 "allow_mixture_change, or change the mixture from a state saved before the skip")
            if self.skips and not BatchSchedule(batch_plan(self.batch_history, self.config.batch_schedule())).constant:
                raise StateError("a mixture change after skipped steps under a batch-size schedule is not supported "
                                 "yet: change the mixture from a state saved before the skip")
            # the change's step, in the uninterrupted stream's steps (as phases are)
            step = state["step"] + sum(s["steps"] for s in self.skips if s["at_step"] <= state["step"])
            at = {**state, "step": step} if self.skips else state
            self.history = history.extend(at, self._fingerprint(with_history=False)[1])
        except history.HistoryError as e:
            raise StateError(str(e)) from None
        self._resumed_from = (state["fingerprint"], int(state["step"]))

    def _same_mixture(self, saved: dict) -> bool:
        """Whether the saved summary is this pipeline's but for the batch sizes."""
        return _without_batches(saved) == _without_batches(self._fingerprint()[1])

    def _config_batches(self) -> list[list[int]]:
        """The config's batch sizes as [start_step, size] pairs (as summaries record them)."""
        return [[s, b] for s, b in self.config.batch_schedule()]

    def _skip(self, state: dict | None, steps: int, documents: dict | None) -> None:
        """Record skipping the next `steps` global batches and the rows holding `documents`
        after the step of `state`."""
        what = "skip_steps" if steps else "skip_documents"
        if state is None:
            raise ConfigError(f"{what} needs resume_from: the state of the step to skip from")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError(f"skip_steps must be a non-negative integer, not {steps!r}")
        documents = _document_lists(documents)
        if self.layout is not None:
            raise ConfigError(f"{what}: streaming sources are read in order and cannot skip yet")
        # (every field of `state` was checked by `_adopt_history`, which runs first)
        if self._resumed_from is None and state["fingerprint"] != self._fingerprint()[0]:
            raise StateError(f"{what}: the state was saved by a pipeline with another config or other data "
                             "(to change the mixture as well, pass allow_mixture_change=True)")
        step = state["step"]
        if self.skips and step < self.skips[-1]["at_step"]:
            raise StateError(f"the state's step {step} is before its own last skip (at {self.skips[-1]['at_step']})")
        self._resumed_from = self._resumed_from or (state["fingerprint"], step)
        if steps:
            self.skips.append({"at_step": step, "steps": steps})
        if documents:
            self.skips.append({"at_step": step, "documents": documents})

    def _stream_step_of(self, step: int) -> int:
        """The step of the uninterrupted stream that step `step`'s first row comes from."""
        return int(self.batches.step_of(self.rowmap.stream_row(self.batches.row(step))))

    # -- phases -----------------------------------------------------------------------------

    def phase_at(self, step: int) -> dict:
        """The mixture in force at `step`: its `start_step`, `weights` by source name (after the
        temperature, summing to 1) and `lr_scale`, for a scheduler to apply exactly at the step."""
        step = states.step_number(step, self.step_limit, end=True)
        return self._phase(self._stream_step_of(step))  # phases are steps of the stream as if nothing was skipped

    def _phase(self, stream_step: int) -> dict:
        schedule = self.config.schedule()  # entry 0 is the base mix; entry k > 0 is phase k - 1
        k = max(i for i, (start, _) in enumerate(schedule) if start <= stream_step)
        start, weights = schedule[k]
        return {"start_step": start, "weights": dict(zip([s.name for s in self.config.sources], weights)),
                "lr_scale": self.config.all_phases()[k - 1].lr_scale if k else 1.0}

    def consumed(self, step: int) -> dict:
        """Per source name, what the steps before `step` consumed, in closed form (no batch is
        made): `rows`, `trained_tokens` (loss positions) and `epochs` (passes over its rows;
        both None for a streaming source, whose rows are known only once read). Removed
        sources of a mixture change are included; skipped rows are not counted."""
        reached = self._reached(step)
        rows = self.consumed_rows(step, reached)
        out = {}
        for k, (name, d) in enumerate(zip(self.source_names, self.mixture.datasets)):
            packed = isinstance(d, PackedDataset)
            trained = None
            if packed:
                j = int(reached[k])
                trained = d.trained_tokens(j) - self.rowmap.removed_below(k, j, d.loss_positions)
            out[name] = {"rows": int(rows[k]), "trained_tokens": trained,
                         "epochs": int(rows[k]) / d.num_rows if packed else None}
        return out

    def consumed_rows(self, step: int, reached: np.ndarray | None = None) -> np.ndarray:
        """The rows each source (in `source_names` order) gave to the steps before `step`:
        `consumed` without its token counts, which read plans (for many steps: a plot)."""
        reached = self._reached(step) if reached is None else reached
        return np.array([int(j) - self.rowmap.removed_below(k, int(j)) for k, j in enumerate(reached)], np.int64)

    def _reached(self, step: int) -> np.ndarray:
        """Each source's rows of the uninterrupted stream before the row step `step` starts
        at (trained, or skipped)."""
        step = states.step_number(step, self.step_limit, end=True)
        return self.mixture.counts(self.rowmap.stream_row(self.batches.row(step)))

    def describe(self, steps: int | None = None) -> dict:
        """The run this config describes, from plans and lengths alone (no token is read):
        steps, tokens per step, the phases, and per source its rows per epoch, packing
        (fill, crop), and over the first `steps` steps (default: all of them) the rows, epochs
        and trained tokens it gives, with warnings for a source read many times or never, and
        a phase that never starts. `forge-grain plan CONFIG` prints it."""
        c, B = self.config, self.config.global_batch_size
        end = self.num_steps if steps is None else min(int(steps), self.step_limit)
        used = self.consumed(end) if end is not None else {}
        names = [s.name for s in c.sources]
        phases = [{"start_step": start, "weights": dict(zip(names, weights)),
                   "lr_scale": self._phase(start)["lr_scale"],
                   "reached": end is None or (end > 0 and self.batches.row(start)
                                              <= self.rowmap.stream_row(self.batches.row(end) - 1))}
                  for start, weights in c.schedule()]
        sources, warn = [], [f"a phase starting at step {p['start_step']} never takes effect: the run has {end} steps"
                             for p in phases if not p["reached"]]
        for name, d in zip(self.source_names, self.mixture.datasets):
            rows_per_epoch = getattr(d, "num_rows", None)
            packed = isinstance(d, PackedDataset)
            stats = getattr(d, "stats", {})  # a streaming source's: its first epoch's windows
            got = used.get(name, {})
            epochs = got.get("epochs")
            if epochs is None and got.get("rows") is not None and rows_per_epoch:
                epochs = got["rows"] / rows_per_epoch  # a streaming source, from its counting pass
            sources.append({
                "name": name, "strategy": stats.get("strategy"), "rows_per_epoch": rows_per_epoch,
                "tokens_per_epoch": stats.get("tokens"), "fill": stats.get("fill"),
                "cropped_share": stats.get("cropped_share"), "rows": got.get("rows"), "epochs": epochs,
                "trained_tokens": got.get("trained_tokens"), "streaming": not packed and name in names,
            })
            if got.get("rows") == 0:
                warn.append(f"source '{name}' is never read in {end} steps (its weight is 0 in every phase reached)")
            if (stats.get("cropped_share") or 0) >= CROP_WARNING:
                warn.append(f"source '{name}' loses {stats['cropped_share']:.1%} of its tokens to cropping under "
                            f"{stats.get('strategy')} at seq_len {c.seq_len} (its documents are long for the rows): use "
                            "strategy 'bestfit' (windows of long documents: no token lost) or a longer seq_len")
            if got.get("rows") != 0 and epochs is not None and epochs >= REPEAT_WARNING:
                warn.append(f"source '{name}' is read {epochs:.1f} times over the run ({got['rows']:,} rows of "
                            f"{rows_per_epoch:,}): lower its weight or the step count, or give it more data")
        return {"steps": end, "steps_per_epoch": self.steps_per_epoch, "global_batch_size": B, "seq_len": c.seq_len,
                "tokens_per_step": B * c.seq_len, "batch_sizes": self.batches.to_list(),
                "tokens": None if end is None else self.batches.row(end) * c.seq_len,
                "phases": phases, "sources": sources, "warnings": warn}

    def _warn_unreachable_phases(self) -> None:
        if self.num_steps is None:
            return
        for p in self.config.all_phases():
            if p.start_step >= self.num_steps:
                warnings.warn(
                    f"a phase starts at step {p.start_step}, but the pipeline has {self.num_steps} steps: it never "
                    "takes effect (raise num_epochs or max_steps, or move the phase)", stacklevel=3,
                )

    # -- identity ---------------------------------------------------------------------------

    def _check_tokenizers(self) -> None:
        first, s0 = self.config.sources[0], self._sources[0].identity
        for src, opened in zip(self.config.sources[1:], self._sources[1:]):
            s = opened.identity
            a, b = s0["tokenizer_sha256"], s["tokenizer_sha256"]
            if (s0["vocab_size"] is None) != (s["vocab_size"] is None):
                unknown = first if s0["vocab_size"] is None else src
                raise ConfigError(
                    f"source '{unknown.name}' has foreign token files of unknown vocabulary size, mixed with sources "
                    "that have one; declare its vocab_size (or tokenizer) so the ids can be checked"
                )
            if s0["vocab_size"] != s["vocab_size"] or (a and b and a != b):
                raise ConfigError(
                    f"sources '{first.name}' ({_where(first)}) and '{src.name}' ({_where(src)}) were tokenized "
                    f"differently (vocab_size {s0['vocab_size']} vs {s['vocab_size']}, tokenizer {str(a)[:12]} vs "
                    f"{str(b)[:12]}); mixed sources must share one tokenizer"
                )

    def _fingerprint(self, with_history: bool = True) -> tuple[str, dict]:
        """What the batches depend on; the shard count, workers and prefetch are not in it."""
        c = self.config
        summary = {
            "stream_version": STREAM_VERSION,
            "seq_len": c.seq_len,
            "global_batch_size": c.global_batch_size,
            **({"batch_sizes": self._config_batches()} if len(c.batch_schedule()) > 1 else {}),
            "seed": c.seed,
            "num_epochs": c.num_epochs,
            "mix_temperature": c.mix_temperature,
            "schedule": c.schedule(),
            **({"max_segments_per_row": c.max_segments_per_row} if c.max_segments_per_row else {}),
            **({"canonical": [self.layout.groups, self.layout.classes]} if self.layout else {}),
            **({"epochs": "aligned"} if self.epoch_aligned else {}),
            "sources": [
                {"name": s.name, "strategy": s.strategy, "stride": s.stride, "window": s.window if s.hf_streaming else None,
                 "plan": d.plan_key, "plan_sha256": d.plan_sha256 if isinstance(d, PackedDataset) else None,
                 "data": o.identity["data_id"], **({"shuffle_window": s.shuffle_window} if s.shuffle_window else {})}
                for s, d, o in zip(c.sources, self.datasets, self._sources)
            ],
        }
        if with_history:
            summary["history"] = self.history
            if self.batch_history:  # (absent without: fingerprints of runs that never changed it are unchanged)
                summary["batch_history"] = self.batch_history
            if self.skips:  # (absent without: the fingerprints of runs that never skipped are unchanged)
                summary["skips"] = self.skips
        return history.digest(summary), summary

    # -- batches ----------------------------------------------------------------------------

    def global_rows(self, step: int) -> np.ndarray:
        """The mixture rows of global batch `step`."""
        return self.rowmap.rows(self.batches.row(step), self.batches.size(step))

    def shard_rows(self, step: int) -> np.ndarray:
        """The mixture rows of this shard's part of global batch `step`."""
        b = self.local_size(step)
        return self.rowmap.rows(self.batches.row(step) + self.shard_index * b, b)

    def batch(self, step: int) -> dict:
        """This shard's part of global batch `step`: arrays of leading dimension `local_size(step)`.

        With streaming sources, steps must come in order (restore a state to go back).
        """
        step = states.step_number(step, self.step_limit)
        if self._not_as_sent is not None:
            raise self._not_as_sent
        if self.streams and step != self._stream_step:
            raise StateError(f"streaming sources are read in order: the next step is {self._stream_step}, not {step}")
        if self.streams and self.epoch_aligned:
            self._align_streams(step)
        self._fetch_ahead(step)
        with self._opener.making(step):
            out = self.mixture.get_batch(self.shard_rows(step), id_dtype=self.dtype)
        out["step"] = np.int64(step)
        if self.streams:
            # the next step this process makes: the next of its class when it owns one class in `stride`
            self._stream_step = step + self._stream_stride
            self._stream_states[self._stream_step] = [r.states() for r in self.streams]
            self._stream_states.pop(step - 64 * self._stream_stride, None)  # what unconsumed prefetched steps may need
        return out

    def _fetch_ahead(self, step: int) -> None:
        """Tell sources in object storage which shards this step and the next ones read, in
        reading order: they download them in the background and keep them from eviction. The
        lookahead goes as far as `FETCH_SHARDS` shards of every such source (enough to keep its
        downloads busy whatever the shard size), `fetch_ahead` steps at most (rounded up to a
        block). Steps enter the window `HINT_STEPS` at a time (their shards found by one lookup)
        and leave it when all of them are made."""
        if not self._fetching or not self.fetch_ahead:
            return
        with self._hint_lock:  # Grain's threads make several steps at once
            w, hints = self._window, self._hints
            if w["start"] - BEHIND <= step < w["start"]:
                return  # another thread's step, just behind one made already: the window has passed it
            if not w["start"] <= step <= w["end"]:  # the first call, a restore, or a jump
                hints.clear()
                w.update(start=step, end=step, counts=[collections.Counter() for _ in self._fetching], sent=None)
            changed = w["sent"] is None
            for a in list(hints):  # blocks whose steps are all made leave the window, oldest first
                if hints[a][0] > step:
                    break
                for count, arrays in zip(w["counts"], hints.pop(a)[1]):  # (`-=` drops counts at 0)
                    count -= collections.Counter(arrays.tolist())
                changed = True
            w["start"] = step
            want = [min(FETCH_SHARDS, len(self.datasets[i].store.files)) for i in self._fetching]
            last = min(step + 1 + self.fetch_ahead, self.step_limit)
            while w["end"] < last and (w["end"] <= step or any(len(c) < n for c, n in zip(w["counts"], want))):
                a = w["end"]  # (a block may reach up to HINT_STEPS - 1 steps past `fetch_ahead`)
                b = min(a + min(HINT_STEPS, self.fetch_ahead), self.step_limit)
                src, rank = self.mixture.locate(np.concatenate([self.shard_rows(s) for s in range(a, b)]))
                hints[a] = (b, [self.datasets[i].arrays_read(rank[src == i]) for i in self._fetching])
                for count, arrays in zip(w["counts"], hints[a][1]):
                    count.update(arrays.tolist())
                w["end"] = b
                changed = True
            if not changed:
                return  # no block came or went: the shards told of last time stand
            shards = [frozenset(c) for c in w["counts"]]
            if shards == w["sent"]:  # the same shards as the last hint: nothing to tell
                return
            w["sent"] = shards
            for j, i in enumerate(self._fetching):
                self.datasets[i].store.prefetch(np.concatenate([arrays[j] for _, arrays in hints.values()]))

    def seek(self, step: int, streams: list | None = None) -> None:
        """Position streaming sources for `step` (the positions of a state's `streams`, else those
        recorded as batches were made); no-op without streams."""
        if not self.streams:
            return
        streams = streams if streams is not None else self._stream_states.get(step)
        if streams is None:
            raise StateError(f"no stream state recorded for step {step}; restore a saved state instead")
        for rows, st in zip(self.streams, streams):
            rows.set_states(st)
        self._stream_step = step
        self._stream_states = {step: [r.states() for r in self.streams]}

    def global_batch(self, step: int) -> dict:
        """All of global batch `step` (what every shard's parts concatenate to)."""
        if self.streams:
            raise StateError("streaming sources are read per shard; there is no global batch to compute here")
        step = states.step_number(step, self.step_limit)
        out = self.mixture.get_batch(self.global_rows(step), id_dtype=self.dtype)
        out["step"] = np.int64(step)
        return out

    def explain(self, step: int, shard: int | None = None, decode: bool = False,
                tokenizer: str | None = None) -> list[dict]:
        """Which documents (and which of their tokens) each row of global batch `step` holds,
        without making the batch; `shard`: only that shard's rows; `decode`: with their text
        (`tokenizer`: decoded with this one; see `forge_grain.pipeline.explain`)."""
        return flight.explain(self, step, shard, decode, tokenizer)

    def batch_hash(self, step: int) -> str:
        """A digest of global batch `step`'s content, equal on any shard count and to
        `forge_grain.pipeline.explain.hash_batch` of the batch a bridge yields."""
        return flight.batch_hash(self, step)

    def batch_stats(self, batch: dict) -> dict:
        """For logging: trained tokens per source, fill, documents per row."""
        seg = batch["segment_ids"]
        per_source = np.bincount(batch["source_id"], weights=batch["loss_mask"].sum(1), minlength=len(self.datasets))
        return {
            "tokens_per_source": {s.name: int(n) for s, n in zip(self.config.sources, per_source)},
            "fill": float((seg > 0).mean()),
            "documents_per_row": float(seg.max(axis=1).mean()),
        }

    # -- iteration --------------------------------------------------------------------------

    def __iter__(self) -> "PipelineIterator":
        return PipelineIterator(self)

    def iterator(self, state: dict | None = None) -> "PipelineIterator":
        it = PipelineIterator(self)
        if state is not None:
            it.set_state(state)
        return it

    def state_at(self, step: int) -> dict:
        """The iterator state whose next batch is global batch `step`.

        With streaming sources it also holds the positions of this process's canonical
        streams (recorded as batches are made); `merge_states` joins the states of all shards.
        """
        return self.make_state(step, self.stream_positions(step) if self.streams else None)

    def stream_positions(self, step: int) -> list[dict]:
        """The streaming sources' positions before `step` (one dict of canonical stream states
        per source), as recorded when the batches before it were made."""
        if step not in self._stream_states:
            raise StateError(f"no stream state recorded for step {step}")
        return self._stream_states[step]

    def make_state(self, step: int, streams: list | None = None) -> dict:
        """The state at `step`, with streaming sources' positions `streams` (one dict of
        canonical stream states per streaming source)."""
        step = states.step_number(step, self.step_limit, end=True)
        state = {"version": states.STATE_VERSION, "step": step, "fingerprint": self.fingerprint, "config": self._summary}
        if self.streams:
            state.update(streams=streams, canonical=[self.layout.groups, self.layout.classes],
                         streams_sha256=history.digest(streams))
        return state

    def check_state(self, state: dict) -> int:
        """The step of `state`, after checking it belongs to this pipeline's config and data."""
        states.check(state)
        if self._resumed_from is not None and (state["fingerprint"], state["step"]) == self._resumed_from:
            return int(state["step"])  # the state this pipeline changed the mixture of
        if state["fingerprint"] != self.fingerprint:
            saved = state.get("config") if isinstance(state.get("config"), dict) else {}
            saved, ours = (json.loads(json.dumps(x, default=str)) for x in (saved, self._summary))  # tuples as lists
            diff = sorted(k for k in set(saved) | set(ours) if saved.get(k) != ours.get(k))
            if "sources" in diff and len(diff) > 1 and _plans_alone_differ(saved.get("sources"), ours["sources"]):
                diff.remove("sources")  # its plans follow from the keys that differ (seed, seq_len): not news
            if diff == ["canonical"]:
                self._check_canonical(state)
            changed = self._changed_data(saved.get("sources"))
            if changed:
                raise StateError(f"{changed}: the data is not what the state was saved with (a file rewritten, "
                                 "replaced, added or removed since; for a text source, also another tokenizer): "
                                 "resume on the data the run trained on, or start a new run on this data")
            raise StateError(
                "this state was saved by a pipeline with another config or other data; differing: "
                f"{diff or ['(unknown)']}. What may change on resume: shard count, workers, threads, prefetch; "
                "weights, phases, temperature and the set of sources with Pipeline(config, resume_from=state, "
                "allow_mixture_change=True); the batch sizes with allow_batch_size_change=True. What may not: "
                "a source's data or packing, seq_len, seed, num_epochs."
            )
        step = int(state["step"])
        last = self.num_steps if self.num_steps is not None else self.step_limit - 1  # an unlimited run never ends
        if not 0 <= step <= last:
            raise StateError(f"state step {step} is outside [0, {last}]")
        bad = self.batches.indivisible(self.shard_count, step)
        if bad is not None:
            raise StateError(f"the batch size {bad[1]} at step {bad[0]} does not divide among {self.shard_count} "
                             f"shards: resume this state on a shard count dividing every size from step {step} "
                             f"on (the schedule's sizes: {self.batches.to_list()})")
        if self.streams:
            self._check_stream_state(state)
        return step

    def _changed_data(self, saved_sources) -> str:
        """The sources whose data differs from the saved summary's sources of the same name
        ("source 'web' (/data/web.bin)"), or "" when none does."""
        saved = {s.get("name"): s.get("data") for s in saved_sources or [] if isinstance(s, dict)}
        ours = {s["name"]: s["data"] for s in self._summary["sources"]}
        names = [n for n in ours if n in saved and saved[n] != ours[n]]
        where = {s.name: _where(s) for s in self.config.sources}
        return ", ".join(f"source '{n}' ({where[n]})" for n in names)

    def _check_canonical(self, state: dict) -> None:
        canonical = [self.layout.groups, self.layout.classes] if self.layout else None
        if state.get("canonical") != canonical:
            raise StateError(
                f"this state's streaming sources were dealt by [canonical_streams, canonical_workers] = "
                f"{state.get('canonical')}, this pipeline's by {canonical}: build it with those values in the config, "
                "or with Pipeline(config, resume_from=state), which adopts canonical_streams from the state"
            )

    def _check_stream_state(self, state: dict) -> None:
        self._check_canonical(state)
        streams = state.get("streams")
        if not isinstance(streams, list) or len(streams) != len(self.streams):
            raise StateError(f"state 'streams' must list {len(self.streams)} stream state(s), got {str(streams)[:200]}")
        if state.get("streams_sha256") != history.digest(streams):
            raise StateError("state 'streams' does not match its checksum: the state was changed after it was saved")
        count = self.layout.count
        for i, per in enumerate(streams):
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
            missing = [c for c in self.streams[i].owned if str(c) not in per]
            if missing:
                raise StateError(
                    f"state streams[{i}] has no position for canonical stream(s) {missing}, which this shard "
                    f"({self.shard_index} of {self.shard_count}) reads; it holds {sorted(map(int, per))}. A shard's "
                    "state holds its own streams: join all shards' states with forge_grain.merge_states (the Orbax "
                    "handler does) to resume on another shard count"
                )

    def __reduce__(self):
        # worker processes rebuild it from the config (plans come from the on-disk cache) and,
        # after a mixture change, from the state it resumed; what they build must be this pipeline
        return (_rebuild, ((self.fingerprint, self._summary["sources"]), self.config, self.shard_index,
                           self.shard_count, self.cache_dir, self.dtype, self.tokenize_threads, *self._resume_args))


def _rebuild(sent, config, shard_index, shard_count, cache_dir, dtype, tokenize_threads=None, resume_from=None,
             allow_mixture_change=False, skip_steps=0, skip_documents=None, allow_batch_size_change=False):
    """The pipeline sent to this process (a spawned DataLoader worker), built again from its
    config. Where the data changed since it was sent, its first batch raises an error naming
    the sources: a worker reading other data than its parent would give batches that no state
    describes."""
    p = Pipeline(config, shard_index, shard_count, num_threads=0, prefetch=0, cache_dir=cache_dir, dtype=dtype,
                 tokenize_threads=tokenize_threads, resume_from=resume_from,
                 allow_mixture_change=allow_mixture_change, skip_steps=skip_steps,
                 skip_documents=skip_documents, allow_batch_size_change=allow_batch_size_change, progress=False)
    fingerprint, sources = sent
    if p.fingerprint != fingerprint:  # raised by its first batch: an error while unpickling kills a worker unheard
        changed = [_where(src) for src, mine, theirs in zip(config.sources, p._summary["sources"], sources)
                   if mine != theirs] or ["the sources' plans or data"]
        p._not_as_sent = StoreError(
            f"{', '.join(changed)}: the data changed after the pipeline was built in the process that sent it here "
            "(rewritten in place); this process would make other batches than the pipeline's plan and states "
            "describe. Build the pipeline again, and resume only from a state saved with the data there now")
    return p


def _document_lists(documents) -> dict:
    """`skip_documents` as {source name: sorted distinct document indices}, or a clear error."""
    if not documents:
        return {}
    if not isinstance(documents, dict):
        raise ConfigError(f"skip_documents must map source names to document indices, not {documents!r:.80}")
    out = {}
    for name, docs in documents.items():
        docs = [docs] if isinstance(docs, (int, np.integer)) else docs
        if not isinstance(name, str) or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool)
                                                and d >= 0 for d in docs):
            raise ConfigError(f"skip_documents[{name!r}] must be document indices (integers >= 0), not {docs!r:.80}")
        if docs:
            out[name] = sorted({int(d) for d in docs})
    return out


def merge_states(states: list[dict]) -> dict:
    """One state from the states all shards saved at one step: the same step and data, the
    streaming sources' positions of every shard joined, so that it restores on any shard
    count dividing `canonical_streams`. States without streaming sources are all alike:
    the first is returned."""
    if not states:
        raise StateError("merge_states: no states given")
    first = states[0]
    for s in states[1:]:
        if (s.get("step"), s.get("fingerprint")) != (first.get("step"), first.get("fingerprint")):
            raise StateError(f"merge_states: states of different steps or pipelines (step {first.get('step')} and "
                             f"{s.get('step')}); give the states all shards saved at one step")
    if "streams" not in first:
        return dict(first)
    joined = [dict() for _ in first["streams"]]
    for s in states:
        if s.get("streams_sha256") != history.digest(s.get("streams")):
            raise StateError("merge_states: a state's 'streams' does not match its checksum")
        for mine, theirs in zip(joined, s["streams"]):
            for c, st in theirs.items():
                if mine.setdefault(c, st) != st:
                    raise StateError(f"merge_states: two states give canonical stream {c} different positions")
    return {**first, "streams": joined, "streams_sha256": history.digest(joined)}


def _plans_alone_differ(saved, ours) -> bool:
    """Whether two summaries' sources are the same but for their plans (which every change of
    seed, seq_len or packing settings changes)."""
    def strip(sources):
        return [{k: v for k, v in s.items() if k not in ("plan", "plan_sha256")} if isinstance(s, dict) else s
                for s in sources or []]
    return strip(saved) == strip(ours)


def _without_batches(summary: dict) -> dict:
    """A pipeline summary without its batch sizes, tuples as lists (as a state that went
    through JSON has them)."""
    keys = ("global_batch_size", "batch_sizes", "batch_history")
    return json.loads(json.dumps({k: v for k, v in summary.items() if k not in keys}, default=str))


def _where(src) -> str:
    """A source's data, for messages."""
    return src.path if src.path is not None else f"hf:{src.hf_dataset}"


def _source_seed(seed: int, name: str) -> int:
    """Each source shuffles differently, and adding a source does not change the others."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "little")


# Iterators whose worker processes are running: closed at exit, while the modules Grain's
# finalizers use are still there (left to interpreter teardown, each shared-memory batch and
# queue prints "Exception ignored ... AttributeError" and the workers' memory is reported leaked)
_WITH_WORKERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_workers() -> None:
    for it in list(_WITH_WORKERS):
        it.close()


class PipelineIterator(grain.DatasetIterator):
    """Iterates this shard's batches from a step; state = {step, fingerprint}."""

    def __init__(self, pipeline: Pipeline, step: int = 0):
        super().__init__()
        self.pipeline = pipeline
        self._step = step
        if pipeline.streams and pipeline._stream_step != step:
            pipeline.seek(step)
        self._pending: collections.deque = collections.deque()
        self._pool = None
        self._mp_iter = None
        self._fetch_first()

    def _fetch_first(self) -> None:
        """Start downloading the shards of the first steps of sources in object storage now: an
        iterator is made to be read, and the trainer's own setup (model, compilation) then hides
        the downloads. (A pipeline built only to describe or explain the run downloads nothing.)"""
        p = self.pipeline
        if p._fetching and p.worker_count == 0 and self._step < p.step_limit:
            p._fetch_ahead(self._step)

    def __next__(self) -> dict:
        p = self.pipeline
        if self._step >= p.step_limit:  # the run's last step (or the last the arithmetic reaches)
            raise StopIteration
        if p.worker_count > 0:
            # out of Grain's shared memory into arrays the caller owns: a batch a caller keeps
            # (to exit) then pins no segment of /dev/shm, nor finalizes one after its modules
            batch = {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in next(self._processes()).items()}
        elif p.num_threads > 0:
            batch = self._threads().pop_next()
        else:
            batch = p.batch(self._step)
        self._step += 1
        return batch

    def _threads(self):
        if self._pool is None:
            self._pool = _ThreadPrefetch(self.pipeline, self._step)
        return self._pool

    def _processes(self):
        if self._mp_iter is None:
            from forge_grain.absl_flags import ensure_absl_flags_parsed

            ensure_absl_flags_parsed()
            p = self.pipeline
            end = p.num_steps if p.num_steps is not None else sys.maxsize
            # one thread per worker process: Grain's default (16 threads, 500 elements ahead)
            # would hold hundreds of whole batches in each worker
            read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=max(p.prefetch, 1))
            ds = grain.MapDataset.range(self._step, end).map(p.batch).to_iter_dataset(read)
            self._mp_iter = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=p.worker_count)))
            _WITH_WORKERS.add(self)
        return self._mp_iter

    def get_state(self) -> dict:
        return self.pipeline.state_at(self._step)

    def set_state(self, state: dict) -> None:
        step = self.pipeline.check_state(state)
        self.close()
        self.pipeline.seek(step, state.get("streams"))
        self._step = step
        self._fetch_first()

    @property
    def step(self) -> int:
        """The step of the next batch."""
        return self._step

    def close(self, _finalizing=sys.is_finalizing) -> None:
        # bound at definition: at interpreter exit module globals such as `sys` may already be None
        if _finalizing():  # called from __del__ at exit: threads and processes are going anyway
            return
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._mp_iter is not None:
            getattr(self._mp_iter, "close", lambda: None)()
            self._mp_iter = None
            _WITH_WORKERS.discard(self)



class _ThreadPrefetch:
    """Batches for steps ahead of the consumer, assembled by worker threads, in order."""

    def __init__(self, pipeline: Pipeline, start: int):
        self.pipeline = pipeline
        self.next_submit = start
        self.executor = concurrent.futures.ThreadPoolExecutor(pipeline.num_threads, thread_name_prefix="forge-grain")
        self.futures: collections.deque = collections.deque()
        self._fill()

    def _fill(self) -> None:
        p = self.pipeline
        while len(self.futures) < max(p.prefetch, 1) and (p.num_steps is None or self.next_submit < p.num_steps):
            self.futures.append(self.executor.submit(p.batch, self.next_submit))
            self.next_submit += 1

    def pop_next(self) -> dict:
        batch = self.futures.popleft().result()
        self._fill()
        return batch

    def close(self) -> None:
        for f in self.futures:
            f.cancel()
        # wait for a batch being made: it must not run on while the pipeline is repositioned
        self.executor.shutdown(wait=True, cancel_futures=True)
