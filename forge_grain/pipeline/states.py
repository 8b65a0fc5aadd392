"""Pipeline states: what one holds, how it is made, checked, and joined across shards.

A state is `{version, step, fingerprint, config}` (plus streaming sources' positions):
`config` is the pipeline's *summary*, everything the batches depend on (`summarize`: the
shard count, workers and prefetch are not in it), and `fingerprint` its digest, so that a
state resumes only the run that wrote it (`check_same_run` says what differs otherwise).
What a resume may change, and how the change is recorded, is `forge_grain.pipeline.resume`.

Every field is checked (`check`) before any of it is used. A state is JSON a user keeps,
copies and sometimes edits: a field that no pipeline could have written (a string step, a
history change after the state's own step, a schedule without weights) must end in a
`StateError` naming the field, never in a resume that trains other rows or a raw
`TypeError` from deep inside. Every bound here is one a real state obeys: its config
summary hashes to its `fingerprint`; histories, batch changes and skips all happened at or
before its `step`; every step, count and size fits the mixture's arithmetic
(`MAX_ROWS` rows, each step at least one).
"""

from __future__ import annotations

import json
import math

import numpy as np

from forge_grain.errors import ConfigError, StateError, StepError
from forge_grain.packing.packed import PackedDataset
from forge_grain.pipeline import history
from forge_grain.pipeline.batches import ScheduleError, check_segments
from forge_grain.pipeline.config import DataConfig
from forge_grain.pipeline.mixture import MAX_ROWS
from forge_grain.sources.config import check_weight, check_weight_sum

STATE_VERSION = 1
# Bumped whenever an algorithm that decides the stream changes (plans carry PLAN_VERSION too),
# so a state saved before such a change is refused instead of resuming into other data.
# 2: exact small-epoch shuffles, own document permutation; 3: mixture weights used exactly.
STREAM_VERSION = 3
MAX_STEP = MAX_ROWS  # every step holds at least one row
SUMMARY_KEYS = {"stream_version", "seq_len", "global_batch_size", "batch_sizes", "seed", "num_epochs",
                "mix_temperature", "schedule", "max_segments_per_row", "canonical", "epochs", "sources", "history",
                "batch_history", "skips", "live", "seq_lens", "seq_len_history"}


def is_integer(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _weights(weights: dict) -> bool:
    """Whether `weights` are ones a config could mix with (the rule of `check_weight`)."""
    try:
        check_weight_sum("live", [check_weight("live", w) for w in weights.values()])
    except ConfigError:
        return False
    return True


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
    live = c.get("live")
    if live is not None and (not isinstance(live, dict) or set(live) != set(names) or not _weights(live)):
        fail("live", f"must be the weights set live, one finite weight >= 0 per source, some positive and their "
                     f"sum finite, not {live!r:.80}")
    try:
        history.check([{"until_step": 0, "sources": names, "schedule": c.get("schedule")}])
    except history.HistoryError:
        fail("schedule", f"must be a list of [start_step, weights], one finite weight >= 0 per source and some "
                         f"positive, not {c.get('schedule')!r:.80}")
    try:
        for key in ("batch_sizes", "seq_lens"):
            if key in c:
                check_segments(c[key], f"state config.{key}")
        for key, check, at in (("history", history.check, "until_step"),
                               ("batch_history", history.check_batches, "until_step"),
                               ("seq_len_history", lambda h: history.check_batches(h, "seq_lens"), "until_step"),
                               ("skips", history.check_skips, "at_step")):
            entries = check(c.get(key, []))
            late = [e[at] for e in entries if e[at] > step]
            if late and key == "history" and live is not None:
                late = []  # weights set live for a later step than the one saved: the change is on its way
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


# -- making states ----------------------------------------------------------------------------


def config_batches(config: DataConfig) -> list[list[int]]:
    """The config's batch sizes as [start_step, size] pairs (as summaries record them)."""
    return [[s, b] for s, b in config.batch_schedule()]


def summarize(config: DataConfig, opened: list, canonical: list | None, aligned: bool,
              runs: dict | None = None) -> dict:
    """What the batches of `config` over the `opened` sources depend on; `runs`: the mixture
    history, batch history and skips of the runs before (None: the summary without them)."""
    c = config
    summary = {
        "stream_version": STREAM_VERSION,
        "seq_len": c.seq_len,
        "global_batch_size": c.global_batch_size,
        **({"batch_sizes": config_batches(c)} if len(c.batch_schedule()) > 1 else {}),
        **({"seq_lens": [list(x) for x in c.seq_len_schedule()]} if len(c.seq_len_schedule()) > 1 else {}),
        "seed": c.seed,
        "num_epochs": c.num_epochs,
        "mix_temperature": c.mix_temperature,
        "schedule": c.schedule(),
        **({"max_segments_per_row": c.max_segments_per_row} if c.max_segments_per_row else {}),
        **({"canonical": canonical} if canonical else {}),
        **({"epochs": "aligned"} if aligned else {}),
        "sources": [_source_summary(s, o) for s, o in zip(c.sources, opened)],
    }
    if runs is not None:
        summary["history"] = runs["history"]
        if runs["batch_history"]:  # (absent without: fingerprints of runs that never changed it are unchanged)
            summary["batch_history"] = runs["batch_history"]
        if runs["skips"]:  # (absent without: the fingerprints of runs that never skipped are unchanged)
            summary["skips"] = runs["skips"]
        if runs.get("seq_len_history"):  # (absent without, likewise)
            summary["seq_len_history"] = runs["seq_len_history"]
        if runs.get("live") is not None:  # weights set live (`forge_grain.pipeline.live`)
            summary["live"] = runs["live"]
    return summary


def _source_summary(s, opened) -> dict:
    d = opened.dataset
    return {"name": s.name, "strategy": s.strategy, "stride": s.stride, "window": s.window if s.hf_streaming else None,
            "plan": d.plan_key, "plan_sha256": d.plan_sha256 if isinstance(d, PackedDataset) else None,
            "data": opened.identity["data_id"], **({"shuffle_window": s.shuffle_window} if s.shuffle_window else {}),
            **({"shuffle_bytes": s.fitted_bytes()} if getattr(getattr(d, "base", d), "fitted", None) else {})}


def make(step: int, summary: dict, streams: list | None = None, canonical: list | None = None) -> dict:
    """The state at `step` of the pipeline of `summary`, with streaming sources' positions."""
    state = {"version": STATE_VERSION, "step": step, "fingerprint": history.digest(summary), "config": summary}
    if canonical is not None:
        state.update(streams=streams, canonical=canonical, streams_sha256=history.digest(streams))
    return state


# -- checking a state against a pipeline --------------------------------------------------------


def check_same_run(state: dict, summary: dict, sources: list, canonical: list | None) -> None:
    """Nothing unless `state` (checked by `check`) was saved by the pipeline of `summary`;
    else a StateError saying what differs and what may change on resume."""
    if state["fingerprint"] == history.digest(summary):
        return
    saved = state.get("config") if isinstance(state.get("config"), dict) else {}
    saved, ours = (json.loads(json.dumps(x, default=str)) for x in (saved, summary))  # tuples as lists
    diff = sorted(k for k in set(saved) | set(ours) if saved.get(k) != ours.get(k))
    if "sources" in diff and len(diff) > 1 and _plans_alone_differ(saved.get("sources"), ours["sources"]):
        diff.remove("sources")  # its plans follow from the keys that differ (seed, seq_len): not news
    if diff == ["canonical"]:
        check_canonical(state, canonical)
    changed = _changed_data(saved.get("sources"), ours["sources"], sources)
    if changed:
        raise StateError(f"{changed}: the data is not what the state was saved with (a file rewritten, "
                         "replaced, added or removed since; for a text source, also another tokenizer): "
                         "resume on the data the run trained on, or start a new run on this data")
    raise StateError(
        "this state was saved by a pipeline with another config or other data; differing: "
        f"{diff or ['(unknown)']}. What may change on resume: shard count, workers, threads, prefetch; "
        "weights, phases, temperature and the set of sources with Pipeline(config, resume_from=state, "
        "allow_mixture_change=True); the batch sizes with allow_batch_size_change=True; the sequence length "
        "(seq_len, seq_lens) with allow_seq_len_change=True. What may not: a source's data or packing, seed, "
        "num_epochs, a source's shuffle_bytes (by default a quarter of its cache_limit: keep the cache_limit, or "
        "give shuffle_bytes its value in the run)."
    )


def check_canonical(state: dict, canonical: list | None) -> None:
    """The state's streaming sources were dealt as this pipeline's are."""
    if state.get("canonical") != canonical:
        raise StateError(
            f"this state's streaming sources were dealt by [canonical_streams, canonical_workers] = "
            f"{state.get('canonical')}, this pipeline's by {canonical}: build it with those values in the config, "
            "or with Pipeline(config, resume_from=state), which adopts canonical_streams from the state"
        )


def _changed_data(saved_sources, ours: list[dict], sources: list) -> str:
    """The sources whose data differs from the saved summary's sources of the same name
    ("source 'web' (/data/web.bin)"), or "" when none does."""
    saved = {s.get("name"): s.get("data") for s in saved_sources or [] if isinstance(s, dict)}
    mine = {s["name"]: s["data"] for s in ours}
    names = [n for n in mine if n in saved and saved[n] != mine[n]]
    where = {s.name: s.where() for s in sources}
    return ", ".join(f"source '{n}' ({where[n]})" for n in names)


def _plans_alone_differ(saved, ours) -> bool:
    """Whether two summaries' sources are the same but for their plans (which every change of
    seed, seq_len or packing settings changes)."""
    def strip(sources):
        return [{k: v for k, v in s.items() if k not in ("plan", "plan_sha256")} if isinstance(s, dict) else s
                for s in sources or []]
    return strip(saved) == strip(ours)


# -- joining shards' states -------------------------------------------------------------------


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
