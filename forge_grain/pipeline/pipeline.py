"""`Pipeline`: global batches of the mixed, packed stream; this shard's slice; exact resume.

The public face of a few parts, each in its own module: the row order (`row_order`: which
rows step s trains), the sources (`opening`), what a resume carries over (`resume`), states
(`states`), streaming sources' positions (`streams`), shards told of ahead (`fetching`),
iteration with threads or processes (`iteration`), and the run described (`describe`,
`explain`). `Pipeline` builds them in order and makes batches from them; the iterator
state is one integer (the next step) plus a fingerprint.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np

from forge_grain.errors import StateError, StoreError
from forge_grain.lazy import lazy
from forge_grain.pipeline import describe as describing
from forge_grain.pipeline import explain as flight
from forge_grain.pipeline import history, live as live_changes, resume, states
from forge_grain.pipeline.batches import BatchSchedule
from forge_grain.pipeline.config import ConfigError, DataConfig
from forge_grain.pipeline.fetching import FetchWindow
from forge_grain.pipeline.iteration import PipelineIterator
from forge_grain.pipeline.opening import AheadOpener, open_sources, pack_args
from forge_grain.pipeline.row_order import RowOrder, check_shards, count_steps
from forge_grain.pipeline.states import merge_states
from forge_grain.pipeline.streams import StreamPositions, epoch_aligned, layout_for

__all__ = ["Pipeline", "PipelineIterator", "StateError", "default_shard", "merge_states"]


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


class Pipeline:
    """The data stream a `DataConfig` describes, for one shard of the cluster.

    Batches are made in the consumer's thread by default; `num_threads` threads make them
    ahead, which pays only where the consumer's step releases the GIL for long (it waits on
    an accelerator): a batch's making mostly holds the GIL (on 16 idle cores, an epoch read
    flat out from object storage ran 0.72-0.89x as fast with 2 threads as with none).
    `worker_count > 0` uses Grain's `mp_prefetch` worker processes instead (spawned: the main
    script needs an `if __name__ == "__main__":` guard). Neither changes the data, and the state
    does not record them, nor does `plan_workers` (processes planning the chunks of a large
    store; default one per core past 2 M documents, else this process), nor `fetch_ahead` (the
    most steps whose shards sources in object storage download ahead: the lookahead stops at
    `FETCH_SHARDS` shards a source), nor `tokenize_threads` (threads tokenizing streaming
    sources; default one per core).
    `dtype`: of ids and positions (int32; int64 for torch embedding lookups). `progress`: bars
    of first-use work (planning, tokenizing, counting); by default shard 0's only (not interleaved).

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
    the rows after it continue the same row sequence in the new sizes. `allow_seq_len_change`
    likewise for `seq_len`, `seq_lens`: the rest of each epoch at the new length (`packing.lengths`).

    Its parts: `order` (`RowOrder`: which rows each step trains; every method naming a step asks
    it), `positions` (streaming sources'), `fetching` (shards told of ahead); see docs/architecture.md.
    """

    def __init__(
        self,
        config: DataConfig,
        shard_index: int | None = None,
        shard_count: int | None = None,
        *,
        num_threads: int | None = 0,  # (None, the default of earlier versions: 0)
        prefetch: int = 4,
        worker_count: int = 0,
        plan_workers: int | None = None,
        fetch_ahead: int = 4096,
        tokenize_threads: int | None = None,
        cache_dir: str | Path | None = None,
        dtype=np.int32,
        resume_from: dict | None = None,
        allow_mixture_change: bool = False,
        allow_batch_size_change: bool = False,
        allow_seq_len_change: bool = False,
        skip_steps: int = 0,
        skip_documents: dict | None = None,
        progress: bool | None = None,
        _live: dict | None = None,
    ):
        if shard_index is None or shard_count is None:
            shard_index, shard_count = default_shard()
        config, self._live = live_changes.starting(config, _live, resume_from, allow_mixture_change)  # (live.py)
        self.config = config
        self.shard_index, self.shard_count = shard_index, shard_count
        batches = BatchSchedule(config.batch_schedule())  # the config's; with the resumed history below
        start = resume_from.get("step") if isinstance(resume_from, dict) else 0
        start = start if isinstance(start, int) and not isinstance(start, bool) and start >= 0 else 0
        check_shards(batches, shard_index, shard_count, start)
        self.num_threads = num_threads or 0
        self.prefetch, self.worker_count, self.cache_dir, self.fetch_ahead = prefetch, worker_count, cache_dir, fetch_ahead
        self.tokenize_threads, self.dtype = tokenize_threads, np.dtype(dtype)  # (of ids and positions in batches)
        self.layout = layout_for(config, batches, shard_count, resume_from)
        self._canonical = self.layout.canonical if self.layout else None  # how streaming sources are dealt
        # one bar per job, not one per rank interleaved: by default only shard 0 shows first-use work
        self.progress = shard_index == 0 if progress is None else progress
        self._sources = open_sources(config, shard_index, shard_count, cache_dir, plan_workers, self.layout,
                                     tokenize_threads, self.progress)
        self.datasets = [o.dataset for o in self._sources]
        self.streams = [o.stream for o in self._sources if o.stream is not None]
        describing.check_tokenizers(config, self._sources)
        if self.streams:
            if worker_count:
                raise ConfigError("streaming sources are read in order in this process: worker_count must be 0")
            self.num_threads = min(self.num_threads, 1)  # one thread keeps the steps in order
        self._rows = sum(d.num_rows for d in self.datasets)
        count_steps(config, batches, self._rows, self.datasets)  # (a batch larger than the run: named first)
        runs = resume.Runs()
        if resume_from is not None:  # what the runs before recorded, and a change the caller allows
            runs = resume.adopt(resume_from, config, functools.partial(self._summarize, batches),
                                allow_mixture_change, allow_batch_size_change, allow_seq_len_change)
        batches, lengths = runs.schedules(config)  # the sizes and lengths each earlier run trained, then the config's
        check_shards(batches, shard_index, shard_count, start)
        if skip_steps or skip_documents:
            resume.add_skips(runs, resume_from, skip_steps, skip_documents, self.layout is not None,
                             history.digest(self._summarize(batches, runs.recorded())))
        self.history, self.batch_history, self.skips = runs.history, runs.batch_history, runs.skips
        self._resumed_from = runs.resumed_from
        self._resume_args = (resume_from, allow_mixture_change, skip_steps, skip_documents, allow_batch_size_change,
                             _live, allow_seq_len_change)  # (for copies rebuilt in worker processes)
        self.order = RowOrder(config, self.datasets, batches, shard_index, shard_count, runs.history, runs.skips,
                              lengths, pack_args(config, cache_dir, plan_workers, self.progress))
        self._summary_of = batches, runs.recorded()  # (`_summary` and `fingerprint` are made when first asked for)
        self._not_as_sent: StoreError | None = None  # set where a process rebuilt it on other data (_rebuild)
        describing.warn_unreachable_phases(config, self.order.num_steps)
        self.epoch_aligned = epoch_aligned(self.streams, config, batches, self.order.steps_per_epoch)  # streams.py
        self.positions = (StreamPositions(self.streams, self.layout, self.order, self.epoch_aligned, self.dtype)
                          if self.streams else None)
        self.fetching = FetchWindow(self._sources, self.order, fetch_ahead)
        if resume_from is not None:
            self.check_state(resume_from)  # its step is one of this run's, before anything is opened
        self._opener = AheadOpener(self, start)

    # what the batches depend on, and its digest (a state's fingerprint): made when first asked for (a state, a
    # check, a worker), as a store's content fingerprint may come from the blocks an epoch reads (stores/harvest.py)
    _summary = lazy(lambda self: self._summarize(*self._summary_of))
    fingerprint = lazy(lambda self: history.digest(self._summary))

    def _summarize(self, batches: BatchSchedule, runs: dict | None = None) -> dict:
        """This pipeline's summary (`states.summarize`) under `batches`, with the records `runs`."""
        aligned = epoch_aligned(self.streams, self.config, batches, count_steps(self.config, batches, self._rows)[0])
        runs = runs if runs is None or self._live is None else {**runs, "live": self._live}
        return states.summarize(self.config, self._sources, self._canonical, aligned, runs)

    # -- the row order's answers ------------------------------------------------------------

    batches = property(lambda self: self.order.batches, doc="The batch-size schedule (`BatchSchedule`).")
    mixture = property(lambda self: self.order.mixture, doc="The sources mixed (`Mixture`), removed ones included.")
    rowmap = property(lambda self: self.order.rowmap, doc="Trainer rows -> the uninterrupted stream's (skips).")
    source_names = property(lambda self: self.order.source_names, doc="Every source's name, removed ones last.")
    rows_per_epoch = property(lambda self: self.order.rows_per_epoch, doc="Rows of one epoch of every source.")
    steps_per_epoch = property(lambda self: self.order.steps_per_epoch, doc="Whole steps of one epoch.")
    num_steps = property(lambda self: self.order.num_steps, doc="The run's steps; None for an unlimited run.")
    step_limit = property(lambda self: self.order.step_limit, doc="The last step + 1 the arithmetic reaches.")

    @property
    def local_batch_size(self) -> int:
        """Rows of this shard's part of every batch (see `local_size` under a batch-size schedule)."""
        return self.order.local_batch_size

    def local_size(self, step: int) -> int:
        """Rows of this shard's part of global batch `step`."""
        return self.order.local_size(step)

    def global_rows(self, step: int) -> np.ndarray:
        """The mixture rows of global batch `step` (an integer step of the run, else `StepError`)."""
        return self.order.global_rows(states.step_number(step, self.step_limit))

    def shard_rows(self, step: int) -> np.ndarray:
        """The mixture rows of this shard's part of global batch `step`."""
        return self.order.shard_rows(states.step_number(step, self.step_limit))

    def phase_at(self, step: int) -> dict:
        """The mixture in force at `step`: its `start_step`, `weights` by source name (after the
        temperature, summing to 1) and `lr_scale`, for a scheduler to apply exactly at the step."""
        return self.order.phase_at(step)

    def consumed(self, step: int) -> dict:
        """Per source name, what the steps before `step` consumed, in closed form (no batch is
        made): `rows`, `trained_tokens` (loss positions) and `epochs` (passes over its rows;
        both None for a streaming source, whose rows are known only once read). Removed
        sources of a mixture change are included; skipped rows are not counted."""
        return self.order.consumed(step)

    def consumed_rows(self, step: int, reached: np.ndarray | None = None) -> np.ndarray:
        """The rows each source (in `source_names` order) gave to the steps before `step`:
        `consumed` without its token counts, which read plans (for many steps: a plot)."""
        return self.order.consumed_rows(step, reached)

    def describe(self, steps: int | None = None) -> dict:
        """The run this config describes, from plans and lengths alone (no token is read):
        steps, tokens per step, the phases, and per source its rows per epoch, packing
        (fill, crop), and over the first `steps` steps (default: all of them) the rows, epochs
        and trained tokens it gives, with warnings for a source read many times or never, and
        a phase that never starts. `forge-grain plan CONFIG` prints it."""
        return describing.describe(self.order, steps)

    def explain(self, step: int, shard: int | None = None, decode: bool = False,
                tokenizer: str | None = None) -> list[dict]:
        """Which documents (and which of their tokens) each row of global batch `step` holds,
        without making the batch; `shard`: only that shard's rows; `decode`: with their text
        (`tokenizer`: decoded with this one; see `forge_grain.pipeline.explain`)."""
        return flight.explain(self, step, shard, decode, tokenizer)

    # -- batches ----------------------------------------------------------------------------

    @property
    def stores(self) -> list:
        """Each source's documents (a `TokenStore`, or a streaming source); opens deferred sources."""
        return [o.store for o in self._sources]

    def batch(self, step: int) -> dict:
        """This shard's part of global batch `step`: arrays of leading dimension `local_size(step)`
        (with streaming sources, steps must come in order: restore a state to go back)."""
        step = states.step_number(step, self.step_limit)
        if self._not_as_sent is not None:
            raise self._not_as_sent
        if self.positions is not None:
            self.positions.before_batch(step)
        with self.fetching.making(step), self._opener.making(step):
            out = self.mixture.get_batch(self.shard_rows(step), id_dtype=self.dtype, seq_len=self.order.seq_len_at(step))
        out["step"] = np.int64(step)
        if self.positions is not None:
            self.positions.after_batch(step)
        return out

    def global_batch(self, step: int) -> dict:
        """All of global batch `step` (what every shard's parts concatenate to)."""
        if self.streams:
            raise StateError("streaming sources are read per shard; there is no global batch to compute here")
        step = states.step_number(step, self.step_limit)
        out = self.mixture.get_batch(self.global_rows(step), id_dtype=self.dtype, seq_len=self.order.seq_len_at(step))
        out["step"] = np.int64(step)
        return out

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

    def __iter__(self) -> PipelineIterator:
        return PipelineIterator(self)

    def iterator(self, state: dict | None = None) -> PipelineIterator:
        it = PipelineIterator(self)
        if state is not None:
            it.set_state(state)
        return it

    # -- streaming sources' positions -------------------------------------------------------

    def start_streams(self, step: int, workers: int = 1, streams: list | None = None) -> None:
        """Make this process read steps `step`, `step + workers`, ...: it reads only the canonical
        streams of their step class, positioned by `streams` (a state's, or those another
        process handed over), else by the positions recorded as this process made the steps
        before, else at an epoch's start (step 0, or a pass start of an epoch-aligned source)."""
        if self.positions is not None:
            self.positions.start(step, workers, streams)

    def known_streams(self, step: int) -> list | None:
        """The streaming sources' positions at `step` where this process knows them without
        reading: recorded as it made the step before, or an epoch's start; else None."""
        return self.positions.known(step) if self.positions is not None else None

    def seek(self, step: int, streams: list | None = None) -> None:
        """Position streaming sources for `step` (the positions of a state's `streams`, else those
        recorded as batches were made); no-op without streams."""
        if self.positions is not None:
            self.positions.seek(step, streams)

    def stream_positions(self, step: int) -> list[dict]:
        """The streaming sources' positions before `step` (one dict of canonical stream states
        per source), as recorded when the batches before it were made."""
        if self.positions is None:
            raise StateError(f"no stream state recorded for step {step}")
        return self.positions.positions(step)

    # -- states -----------------------------------------------------------------------------

    def state_at(self, step: int) -> dict:
        """The iterator state whose next batch is global batch `step`; with streaming sources, also
        the positions of this process's canonical streams (recorded as batches are made):
        `merge_states` joins the states of all shards."""
        return self.make_state(step, self.stream_positions(step) if self.streams else None)

    def make_state(self, step: int, streams: list | None = None) -> dict:
        """The state at `step`, with streaming sources' positions `streams` (one dict of
        canonical stream states per streaming source)."""
        step = states.step_number(step, self.step_limit, end=True)
        return states.make(step, self._summary, streams, self._canonical)

    def with_weights(self, weights, at_step: int) -> "Pipeline":
        """This run mixing `weights` from step `at_step` on, exactly (`forge_grain.pipeline.live`)."""
        return live_changes.with_weights(self, weights, at_step)

    def check_state(self, state: dict) -> int:
        """The step of `state`, after checking it belongs to this pipeline's config and data."""
        states.check(state)
        if self._resumed_from is not None and (state["fingerprint"], state["step"]) == self._resumed_from:
            return int(state["step"])  # the state this pipeline changed the mixture of
        states.check_same_run(state, self._summary, self.config.sources, self._canonical)
        step = self.order.resumable(int(state["step"]))
        if self.positions is not None:
            self.positions.check_state(state)
        return step

    def __reduce__(self):
        # worker processes rebuild it from the config (plans come from the on-disk cache) and,
        # after a mixture change, from the state it resumed; what they build must be this pipeline
        return (_rebuild, ((self.fingerprint, self._summary["sources"]), self.config, self.shard_index,
                           self.shard_count, self.cache_dir, self.dtype, self.tokenize_threads, *self._resume_args))


def _rebuild(sent, config, shard_index, shard_count, cache_dir, dtype, tokenize_threads=None, resume_from=None,
             allow_mixture_change=False, skip_steps=0, skip_documents=None, allow_batch_size_change=False,
             live=None, allow_seq_len_change=False):
    """The pipeline sent to this process (a spawned DataLoader worker), built again from its
    config. Where the data changed since it was sent, its first batch raises an error naming
    the sources: a worker reading other data than its parent would give batches that no state
    describes."""
    p = Pipeline(config, shard_index, shard_count, num_threads=0, prefetch=0, cache_dir=cache_dir, dtype=dtype,
                 tokenize_threads=tokenize_threads, resume_from=resume_from,
                 allow_mixture_change=allow_mixture_change, skip_steps=skip_steps,
                 skip_documents=skip_documents, allow_batch_size_change=allow_batch_size_change, progress=False,
                 _live=live, allow_seq_len_change=allow_seq_len_change)
    fingerprint, sources = sent
    if p.fingerprint != fingerprint:  # raised by its first batch: an error while unpickling kills a worker unheard
        changed = [src.where() for src, mine, theirs in zip(config.sources, p._summary["sources"], sources)
                   if mine != theirs] or ["the sources' plans or data"]
        p._not_as_sent = StoreError(
            f"{', '.join(changed)}: the data changed after the pipeline was built in the process that sent it here "
            "(rewritten in place); this process would make other batches than the pipeline's plan and states "
            "describe. Build the pipeline again, and resume only from a state saved with the data there now")
    return p
