"""Which rows each step trains: step -> global rows -> (source, source row).

This is the exactness promise in one place. From the config, the batch-size schedule and
what earlier runs recorded (mixture history, skips), the row order answers every question
of the form "what does step s train": the mixture rows of the global batch and of this
shard's part of it, the phase in force, the rows and tokens each source gave before a step.
`Pipeline.batch`, `explain`, `consumed`, `describe` (`forge-grain plan`), the skips and the
bridges' lengths all ask it; none keeps a second copy of the arithmetic.

It reads no data and starts no thread: it holds the sources only for their row counts and
plans (to count trained tokens and find the rows holding a document), never calls their
`get_batch`, and pickles with the mixture it was built from.

Global batch s is mixture rows [s·B, (s+1)·B); under a batch-size schedule [R(s), R(s+1)),
R(s) the sizes of the steps before it (`forge_grain.pipeline.batches`). Shard k of n
receives rows [k·b/n, (k+1)·b/n) of a batch of b rows, so the global batch does not depend
on the number of shards.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from forge_grain.errors import StateError
from forge_grain.packing.lengths import LengthSchedule
from forge_grain.packing.packed import PackedDataset
from forge_grain.pipeline import history, states
from forge_grain.pipeline.batches import BatchSchedule
from forge_grain.pipeline.config import ConfigError, DataConfig
from forge_grain.pipeline.mixture import MAX_ROWS, Mixture
from forge_grain.pipeline.skips import RowMap


class RemovedSource:
    """A source of the mixture's history that the config no longer has: it had rows before
    the change, gets weight 0 after it, and is never read."""

    def __init__(self, name: str, seq_len: int):
        self.name, self.seq_len = name, seq_len

    def get_batch(self, ranks, out=None, dest=None, id_dtype=np.int32):
        raise StateError(f"source '{self.name}' was removed from the mixture; steps before the change are not rebuilt")


def check_shards(batches: BatchSchedule, shard_index: int, shard_count: int, from_step: int = 0) -> None:
    """Every batch size from `from_step` on (where a pipeline starts) divides among the shards:
    earlier, smaller batches of a ramp may not, as the run resumes on more hosts."""
    n, bad = shard_count, batches.indivisible(shard_count, from_step)
    if not 0 <= shard_index < n:
        raise ConfigError(f"the shard index {shard_index} must be in [0, {n})")
    if bad is not None and batches.constant:
        raise ConfigError(f"global_batch_size {bad[1]} must divide evenly among {n} shards")
    if bad is not None:
        raise ConfigError(f"the batch size {bad[1]} at step {bad[0]} must divide evenly among {n} shards "
                          f"(the schedule's sizes: {batches.to_list()})")


def count_steps(config: DataConfig, batches: BatchSchedule, rows_per_epoch: int,
                datasets=()) -> tuple[int, int | None, int]:
    """(steps_per_epoch, num_steps, step_limit) of `rows_per_epoch` rows under `batches`:
    num_steps is None for an unlimited run, which ends at the last step the mixing
    arithmetic reaches (step_limit). `datasets` (the sources', in config order) name what
    each packs when not one step fits."""
    steps_per_epoch = batches.steps_within(rows_per_epoch)  # whole steps of one epoch (the first, under a schedule)
    epochs = None if config.num_epochs is None else Fraction(str(float(config.num_epochs)))  # 0.29 is 29/100
    if epochs is None:
        num_steps = None
    elif batches.constant:  # num_epochs of whole epochs' steps, so that whole epochs tile the steps
        num_steps = math.floor(epochs * steps_per_epoch)
    else:  # the steps whose rows fit in num_epochs of rows
        num_steps = batches.steps_within(math.floor(epochs * rows_per_epoch))
    if config.max_steps is not None:
        num_steps = config.max_steps if num_steps is None else min(num_steps, config.max_steps)
    step_limit = num_steps if num_steps is not None else batches.steps_within(MAX_ROWS)
    if num_steps == 0:
        raise ConfigError(too_few_rows(config, batches.size(0), rows_per_epoch, datasets))
    return steps_per_epoch, num_steps, step_limit


def too_few_rows(config: DataConfig, batch: int, rows: int, datasets) -> str:
    """What a run whose first batch is larger than its rows says: the rows each source packs
    at this seq_len, and the three ways out."""
    def packs(s, d) -> str:
        store = getattr(d, "store", None)  # (a streaming source's tokens are not known ahead)
        held = f" of its {store.num_tokens:,} tokens" if store is not None else ""
        return f"source '{s.name}' packs {d.num_rows:,} row(s){held}"

    per_source = "; ".join(packs(s, d) for s, d in zip(config.sources, datasets))
    return (f"global_batch_size {batch} is larger than the {rows:,} rows of num_epochs={config.num_epochs} at seq_len "
            f"{config.seq_len:,}{': ' + per_source if per_source else ''}. Lower seq_len or global_batch_size, or "
            "raise num_epochs, so that the sources fill at least one batch (`forge-grain inspect STORE --seq-len N` "
            "shows the rows a store packs at a length)")


class RowOrder:
    """The rows of every step of one shard's view of a run (see the module docstring)."""

    def __init__(self, config: DataConfig, datasets: list, batches: BatchSchedule, shard_index: int,
                 shard_count: int, mixtures: list[dict] = (), skips: list[dict] = (),
                 seq_lens: list[tuple[int, int]] | None = None, pack_args: list[dict] | None = None):
        self.config, self.batches = config, batches
        self.shard_index, self.shard_count = shard_index, shard_count
        self.rows_per_epoch = sum(d.num_rows for d in datasets)
        self.steps_per_epoch, self.num_steps, self.step_limit = count_steps(config, batches, self.rows_per_epoch)
        names = [s.name for s in config.sources]
        self.source_names, phases = history.mixing_schedule(list(mixtures), names, config.schedule())
        # the weights really mixed from each stream step on, by name: the history's, then the config's
        self.mixed = [(start, {self.source_names[i]: w for i, w in zip(leaves, weights)})
                      for start, leaves, weights in phases]
        removed = [RemovedSource(n, config.seq_len) for n in self.source_names[len(names):]]
        self.mixture = Mixture(
            list(datasets) + removed,
            phases[0][2],
            phases=[(batches.row(step), w) for step, _, w in phases[1:]],
            length=None if self.num_steps is None else batches.row(self.num_steps),
            leaves=[leaves for _, leaves, _ in phases],
        )
        self.seq_lens = list(seq_lens or config.seq_len_schedule())  # [(start step, length)]
        self.rowmap = self._apply_changes(list(skips), pack_args)

    # -- the rows of a step -----------------------------------------------------------------

    def global_rows(self, step: int) -> np.ndarray:
        """The mixture rows of global batch `step`."""
        return self.rowmap.rows(self.batches.row(step), self.batches.size(step))

    def shard_rows(self, step: int) -> np.ndarray:
        """The mixture rows of this shard's part of global batch `step`."""
        b = self.local_size(step)
        return self.rowmap.rows(self.batches.row(step) + self.shard_index * b, b)

    def shard_rows_between(self, a: int, b: int) -> list[np.ndarray]:
        """`shard_rows` of steps [a, b): one array where the batch size is the same throughout
        and no row is skipped (the prefetch hints look steps up in blocks)."""
        if b <= a:
            return []
        if not self.rowmap.empty or not self.batches.uniform(a, b):
            return [self.shard_rows(s) for s in range(a, b)]
        size, local = self.batches.size(a), self.local_size(a)
        first = self.batches.row(a) + self.shard_index * local
        return list(first + np.arange(b - a, dtype=np.int64)[:, None] * size + np.arange(local, dtype=np.int64))

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, the source's row) of each mixture row."""
        return self.mixture.locate(rows)

    def shard_sources(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, the source's row) of each row of this shard's part of step `step`."""
        return self.mixture.locate(self.shard_rows(step))

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

    def stream_step_of(self, step: int) -> int:
        """The step of the uninterrupted stream that step `step`'s first row comes from."""
        return int(self.batches.step_of(self.rowmap.stream_row(self.batches.row(step))))

    def resumable(self, step: int) -> int:
        """`step` where a state may resume this run on this shard count, or a `StateError`."""
        last = self.num_steps if self.num_steps is not None else self.step_limit - 1  # an unlimited run never ends
        if not 0 <= step <= last:
            raise StateError(f"state step {step} is outside [0, {last}]")
        bad = self.batches.indivisible(self.shard_count, step)
        if bad is not None:
            raise StateError(f"the batch size {bad[1]} at step {bad[0]} does not divide among {self.shard_count} "
                             f"shards: resume this state on a shard count dividing every size from step {step} "
                             f"on (the schedule's sizes: {self.batches.to_list()})")
        return step

    # -- phases and what was consumed -------------------------------------------------------

    def phase_at(self, step: int) -> dict:
        """The mixture in force at trainer step `step` (phases are steps of the stream as if
        nothing was skipped)."""
        step = states.step_number(step, self.step_limit, end=True)
        return self.phase(self.stream_step_of(step))

    def phase(self, stream_step: int) -> dict:
        """The mixture in force at `stream_step` of the uninterrupted stream."""
        schedule = self.config.schedule()  # entry 0 is the base mix; entry k > 0 is phase k - 1
        k = max(i for i, (start, _) in enumerate(schedule) if start <= stream_step)
        # the weights mixed then: the config's, or a history segment's (before a change at resume or live)
        start, weights = next(e for e in reversed(self.mixed) if e[0] <= stream_step)  # (in step order)
        return {"start_step": start, "weights": {n: weights.get(n, 0.0) for n in self.source_names},
                "lr_scale": self.config.all_phases()[k - 1].lr_scale if k else 1.0}

    def consumed(self, step: int) -> dict:
        """Per source name, what the steps before `step` consumed (see `Pipeline.consumed`)."""
        reached = self.reached(step)
        rows = self.consumed_rows(step, reached)
        out = {}
        for k, (name, d) in enumerate(zip(self.source_names, self.mixture.datasets)):
            j, epochs, trained = int(reached[k]), None, None
            if isinstance(d, LengthSchedule):  # (its pieces weigh their own rows: skips.RowMap asks them)
                trained, epochs = d.trained_tokens(j) - self.rowmap.removed_below(k, j, ()), d.epochs(j)
            elif isinstance(d, PackedDataset):
                trained = d.trained_tokens(j) - self.rowmap.removed_below(k, j, d.loss_positions)
                epochs = int(rows[k]) / d.num_rows
            out[name] = {"rows": int(rows[k]), "trained_tokens": trained, "epochs": epochs}
        return out

    def consumed_rows(self, step: int, reached: np.ndarray | None = None) -> np.ndarray:
        """The rows each source (in `source_names` order) gave to the steps before `step`."""
        reached = self.reached(step) if reached is None else reached
        return np.array([int(j) - self.rowmap.removed_below(k, int(j)) for k, j in enumerate(reached)], np.int64)

    def reached(self, step: int) -> np.ndarray:
        """Each source's rows of the uninterrupted stream before the row step `step` starts
        at (trained, or skipped)."""
        step = states.step_number(step, self.step_limit, end=True)
        return self.mixture.counts(self.rowmap.stream_row(self.batches.row(step)))

    def phase_reached(self, start: int, end: int | None) -> bool:
        """Whether the phase starting at stream step `start` is in force at a step before `end`."""
        return end is None or (end > 0 and self.batches.row(start)
                               <= self.rowmap.stream_row(self.batches.row(end) - 1))

    # -- sequence lengths -------------------------------------------------------------------

    def seq_len_at(self, step: int) -> int:
        """The row length of trainer step `step` (`seq_lens`)."""
        return next(n for s, n in reversed(self.seq_lens) if s <= step)

    def tokens_before(self, step: int) -> int:
        """Row slots (rows × their length) of the steps before `step`."""
        ends = [s for s, _ in self.seq_lens[1:]] + [step]
        return sum((self.batches.row(min(hi, step)) - self.batches.row(lo)) * n
                   for (lo, n), hi in zip(self.seq_lens, ends) if lo < step)

    def _apply_changes(self, skips: list[dict], pack_args: list[dict] | None) -> RowMap:
        """The map from the trainer's rows to the uninterrupted stream's, after the skips, and
        under a sequence-length schedule each stored source's rows changing length at the rows
        it has given when each change's step starts (`forge_grain.packing.lengths`). Both in step
        order, a skip before a change at its step: where a change falls depends on the rows
        skipped before it, and the rows holding a skipped document on the lengths before it.
        Phases and mixture changes stay where the uninterrupted stream has them, and the run's
        steps are its rows less the skipped ones, in whole batches."""
        rowmap = self.rowmap = RowMap(self.mixture, self.batches.row)
        changes = []
        if len({n for _, n in self.seq_lens}) > 1:
            changes = [(s, n) for s, n in self.seq_lens[1:] if s < self.step_limit]
            for k, d in enumerate(self.mixture.datasets):
                if isinstance(d, PackedDataset):
                    self.mixture.datasets[k] = LengthSchedule(d, [(0, self.seq_lens[0][1])], pack_args[k], d.seed)
        events = [(s["at_step"], 0, s) for s in skips] + [(step, 1, n) for step, n in changes]
        for step, kind, what in sorted(events, key=lambda e: e[:2]):
            if kind == 1:
                at = self.reached(step)
                for k, d in enumerate(self.mixture.datasets):
                    if isinstance(d, LengthSchedule):
                        d.add_change(int(at[k]), what)
            elif "steps" in what:
                rowmap.skip_steps(step, what["steps"])
            else:
                rowmap.skip_rows(step, self._rows_holding(what["documents"]))
        if skips:
            length = self.batches.row(self.step_limit)
            self.step_limit = self.batches.steps_within(length - rowmap.removed(length))
            if self.num_steps is not None:
                if self.step_limit <= skips[-1]["at_step"]:
                    raise ConfigError(f"the skips leave no step after step {skips[-1]['at_step']}: the run has "
                                      f"{self.num_steps} steps and would keep {self.step_limit}")
                self.num_steps = self.step_limit
        return rowmap

    # -- skips ------------------------------------------------------------------------------

    def _rows_holding(self, documents: dict) -> dict:
        """{source index: plan rows holding any of its `documents`}, by source name."""
        out = {}
        for name, docs in documents.items():
            if name not in self.source_names:
                raise ConfigError(f"skip_documents: no source named {name!r} (sources: {self.source_names})")
            i = self.source_names.index(name)
            d = self.mixture.datasets[i]
            if isinstance(d, RemovedSource):
                continue  # removed by a mixture change: none of its rows come again
            if isinstance(d, LengthSchedule):  # its pieces find the rows holding them (skips.RowMap)
                docs = np.unique(np.asarray(docs, np.int64))
                if len(docs) and docs[-1] >= len(d.store.offsets) - 1:
                    raise ConfigError(f"skip_documents[{name!r}]: document {int(docs[-1])} is not in "
                                      f"{d.store.path} ({len(d.store.offsets) - 1} documents)")
                out[i] = docs
                continue
            if not isinstance(d, PackedDataset):
                raise ConfigError(f"skip_documents: source {name!r} is streaming; documents are skipped in stored "
                                  "sources only")
            try:
                out[i] = d.rows_holding(docs)
            except IndexError as e:
                raise ConfigError(f"skip_documents[{name!r}]: {e}") from None
        return out
