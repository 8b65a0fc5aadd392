"""Changing the mixture at resume, exactly: the schedule history a pipeline state carries.

A state saved at step S under schedule W (weights and phases over some sources) can resume
under a config whose weights, phases or sources differ, when the user asks for it
(`Pipeline(config, resume_from=state, allow_mixture_change=True)`). Steps before S are what
they were: the old schedule, recorded as a history segment ending at S. From S on, the new
config's schedule applies (the entry in force at S starts there). Mixing is a closed form of
the weights alone, so each continuing source's row count at S follows from the old
schedule, mixed over the sources of the old config in their old order (each segment of the
history records that tree), and it continues from exactly its next unseen row whatever the
edit (sources reweighted, added or removed anywhere, reordered, re-added); a new source
starts at its row 0; a removed source gets no rows. The history travels in every later state, so further
resumes, elastic or with yet other weights, stay exact.
"""

from __future__ import annotations

import hashlib
import json

from forge_grain.errors import ForgeGrainError
from forge_grain.pipeline.batches import ScheduleError, check_segments

# what a mixture change may not touch: the rows of every source and the row length (a change of
# batch size or of sequence length is checked before, and allowed on its own terms: see
# `schedule_change`)
FIXED_KEYS = ("stream_version", "seq_len", "seed", "num_epochs")
LENGTH_KEYS = ("seq_len", "seq_lens", "seq_len_history")  # what a sequence-length change changes
PLAN_KEYS = ("plan", "plan_sha256")  # a source's plan: it follows from its data and the length
SOURCE_KEYS = ("strategy", "stride", "window", "plan", "plan_sha256", "data")


class HistoryError(ForgeGrainError):
    """A state that cannot be resumed under this config, even with a mixture change."""


def digest(obj) -> str:
    """sha256 of JSON with sorted keys: a pipeline summary's is the state's `fingerprint`."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def extend(state: dict, current: dict) -> list[dict]:
    """The history of a pipeline that resumes `state` under the summary `current` (without
    its history) with a mixture change: the saved history plus the saved schedule up to the
    saved step. Refuses changes other than weights, phases, temperature and the source set."""
    saved = state.get("config")
    if not isinstance(saved, dict) or digest(saved) != state.get("fingerprint"):
        raise HistoryError("the state's config does not match its fingerprint: it was changed after it was saved")
    if "streams" in state:
        raise HistoryError("streaming sources resume only with the mixture they were saved with")
    check_fixed(saved, current)
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise HistoryError(f"the state's step {step!r} is not a step")
    history = list(check(saved.get("history", [])))
    if history and step < history[-1]["until_step"]:
        raise HistoryError(f"the state's step {step} is before its own last mixture change")
    names = [s["name"] for s in saved["sources"]]
    tree = names
    if _legacy(history):  # saved by a version that built one tree over every source it had known
        tree = _union(names, history)
        history = [{**seg, "tree": tree} for seg in history]
    return history + [{"until_step": step, "sources": names, "schedule": saved["schedule"], "tree": tree}]


def check_fixed(saved: dict, current: dict) -> None:
    """A HistoryError naming what no resume may change between the summaries `saved` and
    `current`: the keys that decide every source's rows, and a kept source's data or packing
    (`seq_len` and the plans it makes, when the sequence length changes: `schedule_change`)."""
    saved, current = without_lengths(saved, current)
    fixed = [k for k in FIXED_KEYS if saved.get(k) != current.get(k)]
    if fixed:
        raise HistoryError(f"a resume may not change {fixed}; only weights, phases, temperature, sources, batch "
                           "sizes and sequence lengths")
    before = {s["name"]: s for s in saved["sources"]}
    changed = [s["name"] for s in current["sources"] if s["name"] in before
               and any(before[s["name"]].get(k) != s.get(k) for k in SOURCE_KEYS)]
    if changed:
        raise HistoryError(f"sources {changed} changed their data or packing since the state was saved")


def check(history) -> list[dict]:
    """`history` if it has the structure a pipeline writes, else a HistoryError naming what is
    wrong: a list of segments, each with `until_step` (increasing, >= 0), `sources` (names),
    `schedule` ([[start_step, weights]], a finite weight >= 0 per source, some positive) and,
    when present, `tree` (names among `sources`)."""
    def fail(i, what):
        raise HistoryError(f"the state's mixture history is malformed: segment {i} {what}")

    if not isinstance(history, list):
        raise HistoryError(f"the state's mixture history is malformed: a list of segments, not {history!r:.80}")
    last = 0
    for i, seg in enumerate(history):
        if not isinstance(seg, dict):
            fail(i, f"is {seg!r:.80}, not a table")
        until, names = seg.get("until_step"), seg.get("sources")
        if isinstance(until, bool) or not isinstance(until, int) or until < last:
            fail(i, f"ends at step {until!r}, before {last}")
        last = until
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            fail(i, f"has sources {names!r:.80}, not a list of names")
        schedule = seg.get("schedule")
        if not isinstance(schedule, list) or not schedule:
            fail(i, f"has schedule {schedule!r:.80}, not a list of [start_step, weights]")
        for entry in schedule:
            ok = isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], int) and entry[0] >= 0
            weights = entry[1] if ok else None
            if not ok or not isinstance(weights, (list, tuple)) or len(weights) != len(names) or not all(
                    isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w < float("inf")
                    for w in weights) or not sum(weights) > 0:
                fail(i, f"has a schedule entry {entry!r:.80}: [start_step, one finite weight >= 0 per source]")
        if "tree" in seg and (not isinstance(seg["tree"], list) or not set(seg["tree"]) <= set(names)
                              or not all(isinstance(n, str) for n in seg["tree"])):
            fail(i, f"mixes over {seg['tree']!r:.80}, not names among its sources {names}")
    return history


def saved_lengths(summary: dict) -> list[list[int]]:
    """The [start_step, length] pairs of a summary's config (its `seq_len` alone without a schedule)."""
    return [list(x) for x in summary.get("seq_lens") or [[0, summary.get("seq_len")]]]


def without_lengths(saved: dict, current: dict) -> tuple[dict, dict]:
    """Both summaries without their sequence lengths and the plans those make, where their
    lengths differ (a change `schedule_change` records); else both as they are."""
    if saved_lengths(saved) == saved_lengths(current):
        return saved, current

    def strip(summary):
        sources = [{k: v for k, v in s.items() if k not in PLAN_KEYS} if isinstance(s, dict) else s
                   for s in summary.get("sources") or []]
        return {**{k: v for k, v in summary.items() if k not in LENGTH_KEYS}, "sources": sources}
    return strip(saved), strip(current)


def saved_batches(saved: dict) -> list[list[int]]:
    """The [start_step, size] pairs of a saved summary's config (its `global_batch_size` alone
    when it had no schedule)."""
    return saved.get("batch_sizes") or [[0, saved.get("global_batch_size")]]


def schedule_change(state: dict, seg_history: list[dict], key: str = "batches") -> list[dict]:
    """The batch history (`key="batches"`) or sequence-length history (`"seq_lens"`) of a
    pipeline that resumes `state` with other batch sizes or lengths: the saved one plus the
    saved config's schedule up to the saved step. The steps before it keep what they were
    trained with; the rows after it continue in the new sizes, or, at a new length, the rest of
    each source's epoch is planned at it (`forge_grain.packing.lengths`)."""
    what = "batch-size" if key == "batches" else "sequence-length"
    saved = state.get("config")
    if not isinstance(saved, dict) or digest(saved) != state.get("fingerprint"):
        raise HistoryError("the state's config does not match its fingerprint: it was changed after it was saved")
    if "streams" in state:
        raise HistoryError(f"streaming sources resume only with the {what} schedule they were saved with")
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise HistoryError(f"the state's step {step!r} is not a step")
    if seg_history and step < seg_history[-1]["until_step"]:
        raise HistoryError(f"the state's step {step} is before its own last {what} change")
    schedule = saved_batches(saved) if key == "batches" else saved_lengths(saved)
    return check_batches([*seg_history, {"until_step": step, key: schedule}], key)


def check_batches(batch_history, key: str = "batches") -> list[dict]:
    """`batch_history` if it has the structure a pipeline writes (a list of {until_step,
    batches: [[start_step, size], ...]}, until_step not decreasing), else a HistoryError;
    `key="seq_lens"`: the sequence-length history ({until_step, seq_lens: [[start_step, length]]})."""
    what = "batch" if key == "batches" else "sequence-length"
    if not isinstance(batch_history, list):
        raise HistoryError(f"the state's {what} history is malformed: a list, not {batch_history!r:.80}")
    last = 0
    for i, seg in enumerate(batch_history):
        until = seg.get("until_step") if isinstance(seg, dict) else None
        ok = isinstance(seg, dict) and set(seg) == {"until_step", key} and isinstance(until, int) and not \
            isinstance(until, bool) and until >= last
        try:
            ok = ok and bool(check_segments(seg[key]))
        except ScheduleError:
            ok = False
        if not ok:
            raise HistoryError(f"the state's {what} history is malformed: segment {i} is {seg!r:.100}, not "
                               f"{{until_step, {key}: [[start_step, value], ...]}} ending at or after step {last}")
        last = until
    return batch_history


def check_skips(skips) -> list[dict]:
    """`skips` if it has the structure a pipeline writes (each {at_step, steps} or {at_step,
    documents: {source: [document, ...]}}, at_step not decreasing, integers >= 0), else a
    HistoryError naming what is wrong."""
    def count(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    last = 0
    if not isinstance(skips, list):
        raise HistoryError(f"the state's skips are malformed: a list, not {skips!r:.80}")
    for i, s in enumerate(skips):
        docs = s.get("documents") if isinstance(s, dict) else None
        ok = isinstance(s, dict) and count(s.get("at_step")) and (
            (set(s) == {"at_step", "steps"} and count(s["steps"]))
            or (set(s) == {"at_step", "documents"} and isinstance(docs, dict) and all(
                isinstance(k, str) and isinstance(v, list) and all(map(count, v)) for k, v in docs.items())))
        if not ok or s["at_step"] < last:
            raise HistoryError(f"the state's skips are malformed: skip {i} is {s!r:.80}, not {{at_step, steps}} or "
                               f"{{at_step, documents}} at or after step {last}")
        last = s["at_step"]
    return skips


def _union(names: list[str], history: list[dict]) -> list[str]:
    """The config's source names, then those only the history has, each once."""
    return list(dict.fromkeys([*names, *(n for seg in history for n in seg["sources"])]))


def _legacy(history: list[dict]) -> bool:
    """A history written before segments recorded their trees (`tree`): its pipelines mixed
    every segment with one tree over all the sources they knew."""
    return any("tree" not in seg for seg in history)


def mixing_schedule(history: list[dict], names: list[str], schedule: list) -> tuple[list[str], list]:
    """(all source names: the config's, then removed ones; [(start_step, leaves, weights)]) for
    a history and the config's own schedule [(start_step, weights by config source)].

    `leaves` are the indices (into the names) of the sources the entry's mixing tree is
    built over, in the order that run built it, and `weights` are theirs: each history
    segment is mixed exactly as it was trained, so every source's row count at a change is
    the count of rows it really gave, whatever the new config adds, removes or reorders."""
    union = _union(names, history)
    legacy = _legacy(history)
    segments, start = [], 0
    for seg in history:
        segments.append((start, seg["until_step"], seg["sources"], seg["schedule"], union if legacy else seg["tree"]))
        start = seg["until_step"]
    segments.append((start, None, names, schedule, union if legacy else names))
    out = []
    for lo, hi, seg_names, seg_schedule, tree in segments:
        if hi is not None and hi <= lo:
            continue  # a segment with no steps (two changes at one step)
        leaves = [union.index(n) for n in tree]
        in_force = [k for k, (s, _) in enumerate(seg_schedule) if s <= lo][-1]
        for s, weights in seg_schedule[in_force:]:
            s = max(int(s), lo)
            if hi is not None and s >= hi:
                break
            by_name = dict(zip(seg_names, weights))
            out.append((s, leaves, [float(by_name.get(n, 0.0)) for n in tree]))
    return union, out
