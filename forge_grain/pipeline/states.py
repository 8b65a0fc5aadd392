"""What a pipeline state may hold, checked field by field before any of it is used.

A state is JSON a user keeps, copies and sometimes edits: a field that no pipeline could have
written (a string step, a history change after the state's own step, a schedule without
weights) must end in a `StateError` naming the field, never in a resume that trains other
rows or a raw `TypeError` from deep inside. Every bound here is one a real state obeys:
its config summary hashes to its `fingerprint`; histories, batch changes and skips all
happened at or before its `step`; every step, count and size fits the mixture's arithmetic
(`MAX_ROWS` rows, each step at least one).
"""

from __future__ import annotations

import math

import numpy as np

from forge_grain.errors import StateError, StepError
from forge_grain.pipeline import history
from forge_grain.pipeline.batches import ScheduleError, check_segments
from forge_grain.pipeline.mixture import MAX_ROWS

STATE_VERSION = 1
MAX_STEP = MAX_ROWS  # every step holds at least one row
SUMMARY_KEYS = {"stream_version", "seq_len", "global_batch_size", "batch_sizes", "seed", "num_epochs",
                "mix_temperature", "schedule", "max_segments_per_row", "canonical", "epochs", "sources", "history",
                "batch_history", "skips"}


def is_integer(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def step_number(step, limit: int, *, end: bool = False, what: str = "step") -> int:
    """`step` as an int if it is an integer step of a run of `limit` steps (`end=True`: the step
    after the last too, where a finished run's state stands), else a `StepError` naming it."""
    if not is_integer(step):
        raise StepError(f"{what} must be an integer, not {type(step).__name__} {step!r:.40}")
    top = limit if end else limit - 1
    if not 0 <= step <= top:
        raise StepError(f"{what} {step} is outside this run's steps [0, {top}]")
    return int(step)


def check(state) -> dict:
    """`state` if every field is one a pipeline could have written, else a StateError."""
    if not isinstance(state, dict) or "step" not in state or "fingerprint" not in state:
        raise StateError(f"not a forge-grain pipeline state (a dict with step, fingerprint and config): "
                         f"{str(state)[:200]}")
    if state.get("version") != STATE_VERSION:
        raise StateError(f"pipeline state version {state.get('version')!r} is not {STATE_VERSION}")
    step = state["step"]
    if not is_integer(step):
        raise StateError(f"state step must be an integer, not {type(step).__name__} {step!r:.40}")
    if not 0 <= step <= MAX_STEP:
        raise StateError(f"state step {step} is outside [0, {MAX_STEP}]: no run has that many steps")
    if not isinstance(state["fingerprint"], str):
        raise StateError(f"state fingerprint must be a string, not {state['fingerprint']!r:.80}")
    config = state.get("config")
    if not isinstance(config, dict):
        raise StateError(f"state config must be the pipeline's summary (a mapping), not {config!r:.80}")
    if history.digest(config) != state["fingerprint"]:
        raise StateError("the state's config does not match its fingerprint: it was changed after it was saved")
    _check_summary(config, int(step))
    return state


def _check_summary(c: dict, step: int) -> None:
    """The summary's fields, each of the kind a pipeline writes."""
    def fail(key, what):
        raise StateError(f"state config.{key} {what}")

    unknown = set(c) - SUMMARY_KEYS
    if unknown:
        fail(sorted(unknown)[0], f"is not a key a pipeline writes ({', '.join(sorted(SUMMARY_KEYS))})")
    for key in ("seq_len", "global_batch_size"):
        if not is_integer(c.get(key)) or not 0 < c[key] <= MAX_ROWS:
            fail(key, f"must be a positive integer, not {c.get(key)!r:.40}")
    if not is_integer(c.get("seed")):
        fail("seed", f"must be an integer, not {c.get('seed')!r:.40}")
    epochs = c.get("num_epochs")
    if epochs is not None and (not _number(epochs) or not epochs > 0):
        fail("num_epochs", f"must be a positive number or null, not {epochs!r:.40}")
    if not _number(c.get("mix_temperature")) or not c["mix_temperature"] > 0:
        fail("mix_temperature", f"must be a positive number, not {c.get('mix_temperature')!r:.40}")
    sources = c.get("sources")
    if not isinstance(sources, list) or not sources or not all(
            isinstance(s, dict) and isinstance(s.get("name"), str) for s in sources):
        fail("sources", f"must be a list of sources, each with a name, not {sources!r:.80}")
    names = [s["name"] for s in sources]
    try:
        history.check([{"until_step": 0, "sources": names, "schedule": c.get("schedule")}])
    except history.HistoryError:
        fail("schedule", f"must be a list of [start_step, weights], one finite weight >= 0 per source and some "
                         f"positive, not {c.get('schedule')!r:.80}")
    try:
        if "batch_sizes" in c:
            check_segments(c["batch_sizes"], "state config.batch_sizes")
        for key, check, at in (("history", history.check, "until_step"),
                               ("batch_history", history.check_batches, "until_step"),
                               ("skips", history.check_skips, "at_step")):
            entries = check(c.get(key, []))
            late = [e[at] for e in entries if e[at] > step]
            if late:
                fail(key, f"records a change at step {late[0]}, after the state's own step {step}: no run "
                          "writes that")
            if key == "skips" and any(s.get("steps", 0) > MAX_STEP for s in entries):
                fail(key, f"skips more steps than any run has ({MAX_STEP})")
    except history.HistoryError as e:
        raise StateError(str(e)) from None
    except ScheduleError as e:
        raise StateError(str(e)) from None


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
