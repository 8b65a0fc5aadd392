"""What a resume carries over from a state, and what it may change.

A state records what the runs before it did besides following the config: mixture changes
(`history`), batch-size changes (`batch_history`) and skips (`skips`; see
`forge_grain.pipeline.history` and `forge_grain.pipeline.skips`). A pipeline resuming it
adopts them (`adopt`), adds a change of mixture or batch size where the caller allows one,
and records new skips (`add_skips`). The row order is then built from what this returns.

It only reads and extends these records: it opens no source, and it never decides which
rows a step trains.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import numpy as np

from forge_grain.errors import StateError
from forge_grain.pipeline import history, states
from forge_grain.pipeline.batches import BatchSchedule, combined as batch_plan
from forge_grain.pipeline.config import ConfigError, DataConfig, check_lengths


@dataclasses.dataclass
class Runs:
    """What the runs before this one recorded, and the state this one changed (if any)."""

    history: list = dataclasses.field(default_factory=list)  # mixture changes: [{until_step, sources, schedule}]
    batch_history: list = dataclasses.field(default_factory=list)  # batch-size changes: [{until_step, batches}]
    # [{at_step, steps} or {at_step, documents: {source: [document]}}]: what resumes skipped, in trainer steps
    skips: list = dataclasses.field(default_factory=list)
    length_history: list = dataclasses.field(default_factory=list)  # sequence lengths: [{until_step, seq_lens}]
    resumed_from: tuple | None = None  # (fingerprint, step) of a state resumed with a change

    def schedules(self, config: DataConfig) -> tuple[BatchSchedule, list[tuple[int, int]]]:
        """The batch sizes and the sequence lengths each earlier run trained, then the config's."""
        lengths = batch_plan(self.length_history, config.seq_len_schedule(), "seq_lens")
        check_lengths(config, lengths)
        return BatchSchedule(batch_plan(self.batch_history, config.batch_schedule())), lengths

    def recorded(self) -> dict:
        """The records as a summary holds them (`states.summarize`'s `runs`)."""
        return {"history": self.history, "batch_history": self.batch_history, "skips": self.skips,
                "seq_len_history": self.length_history}


def adopt(state: dict, config: DataConfig, summary_of: Callable[[dict | None], dict], allow_change: bool = False,
          allow_batches: bool = False, allow_lengths: bool = False) -> Runs:
    """The records of `state`, extended by a change to `config` where allowed. `summary_of(runs)`
    is the resuming pipeline's summary with those records (None: without them). A change
    not allowed is left for `Pipeline.check_state` to name."""
    saved = states.check(state)["config"]
    try:
        runs = Runs(list(history.check(saved.get("history", []))), list(history.check_batches(
            saved.get("batch_history", []))), list(history.check_skips(saved.get("skips", []))),
            list(history.check_batches(saved.get("seq_len_history", []), "seq_lens")))
    except history.HistoryError as e:
        raise StateError(str(e)) from None
    if state["fingerprint"] == history.digest(summary_of(runs.recorded())):
        return runs  # the same mixture, batch sizes and lengths: an ordinary resume
    if not (allow_change or allow_batches or allow_lengths):
        return Runs()  # strict: check_state names what differs
    mixtures, runs.history = runs.history, []
    try:
        history.check_fixed(saved, summary_of(None))  # before advising an allowance
        if history.saved_batches(saved) != states.config_batches(config):
            if not allow_batches:
                raise StateError("the batch size differs from the state's (global_batch_size, batch_sizes or "
                                 "batch_ramp): pass allow_batch_size_change=True to continue its rows in the new "
                                 "sizes")
            runs.batch_history = history.schedule_change(state, runs.batch_history)
        if history.saved_lengths(saved) != [list(x) for x in config.seq_len_schedule()]:
            if not allow_lengths:
                raise StateError("the sequence length differs from the state's (seq_len or seq_lens): pass "
                                 "allow_seq_len_change=True to plan the rest of each source's epoch at the new "
                                 "length from the state's step")
            runs.length_history = history.schedule_change(state, runs.length_history, "seq_lens")
        runs.history = mixtures
        before, now = history.without_lengths(saved, summary_of(runs.recorded()))
        if _without_batches(before) == _without_batches(now):
            runs.resumed_from = (state["fingerprint"], int(state["step"]))
            return runs  # only the batch size or the sequence length changed
        if not allow_change:
            return runs  # strict: check_state names what differs
        _check_mixture_change(runs, config)
        # the change's step, in the uninterrupted stream's steps (as phases are)
        step = state["step"] + sum(s["steps"] for s in runs.skips if s["at_step"] <= state["step"])
        at = {**state, "step": step} if runs.skips else state
        runs.history = history.extend(at, summary_of(None))
    except history.HistoryError as e:
        raise StateError(str(e)) from None
    runs.resumed_from = (state["fingerprint"], int(state["step"]))
    return runs


def _check_mixture_change(runs: Runs, config: DataConfig) -> None:
    """The mixture may change after these records (skips of documents, or of steps under a
    batch-size schedule, are not supported yet)."""
    if any("documents" in s for s in runs.skips):
        raise StateError("a mixture change after skipped documents is not supported yet: resume without "
                         "allow_mixture_change, or change the mixture from a state saved before the skip")
    if runs.skips and not BatchSchedule(batch_plan(runs.batch_history, config.batch_schedule())).constant:
        raise StateError("a mixture change after skipped steps under a batch-size schedule is not supported "
                         "yet: change the mixture from a state saved before the skip")


def add_skips(runs: Runs, state: dict | None, steps: int, documents: dict | None, streaming: bool,
              fingerprint: str) -> None:
    """Record skipping the next `steps` global batches and the rows holding `documents` after
    the step of `state` (already adopted into `runs`); `fingerprint`: the resuming pipeline's,
    with `runs`."""
    what = "skip_steps" if steps else "skip_documents"
    if state is None:
        raise ConfigError(f"{what} needs resume_from: the state of the step to skip from")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"skip_steps must be a non-negative integer, not {steps!r}")
    documents = document_lists(documents)
    if streaming:
        raise ConfigError(f"{what}: streaming sources are read in order and cannot skip yet")
    # (every field of `state` was checked by `adopt`, which runs first)
    if runs.resumed_from is None and state["fingerprint"] != fingerprint:
        raise StateError(f"{what}: the state was saved by a pipeline with another config or other data "
                         "(to change the mixture as well, pass allow_mixture_change=True)")
    step = state["step"]
    if runs.skips and step < runs.skips[-1]["at_step"]:
        raise StateError(f"the state's step {step} is before its own last skip (at {runs.skips[-1]['at_step']})")
    runs.resumed_from = runs.resumed_from or (state["fingerprint"], step)
    if steps:
        runs.skips.append({"at_step": step, "steps": steps})
    if documents:
        runs.skips.append({"at_step": step, "documents": documents})


def document_lists(documents) -> dict:
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


def _without_batches(summary: dict) -> dict:
    """A pipeline summary without its batch sizes, tuples as lists (as a state that went
    through JSON has them)."""
    keys = ("global_batch_size", "batch_sizes", "batch_history")
    return json.loads(json.dumps({k: v for k, v in summary.items() if k not in keys}, default=str))
