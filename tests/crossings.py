"""The crossing harness: every feature crossed with every other (tests/test_crossings.py runs it).

A case is one value of each axis below. The covering set (`covering`) holds every pair of values
of any two axes at least once (a greedy pairwise covering array), leaving out the pairs that
cannot exist (`ABSENT`: a Hub-style dataset is on local disk). Every case has one oracle: the
batches each rank sees equal its slice of the uninterrupted single-process run of the same
config over the local copy of the data, or the case ends in the refusal that `REFUSED` lists
for one of its pairs (docs/failures.md shows that table). Under a cache_limit the bytes of the
data's files the server sent are bounded too (`test_crossings.FETCHED_AT_MOST`). `tests/crossings.md` prints the set.

The axes:
- store: the format of the source under test (forge-grain's bin and ArrayRecord layouts,
  Megatron, raw .bin and .npy token files, LitData, MDS plain and zstd, Arrow, a forge-grain
  store with target masks, OLMo-core token files with their label masks; streaming JSON
  Lines files and a Hub-style dataset directory);
- location: on disk, at an s3:// URL of a local moto server, or there under a cache_limit
  below the data's size; credentials: explicit storage options or the environment's;
- shape: a plain run, phases, a batch-size schedule, a sequence-length schedule, weights set
  live, skip_steps or skip_documents at a resume, a mixture change at a resume, an elastic run
  (1, then 2, then 4 shards);
- consumer: the pipeline's iterator (0 and 2 threads), the torch bridge under DataLoader (0
  workers, 2 forked, 2 spawned), torchdata's StatefulDataLoader (its own state), the JAX
  iterator, OLMo-core's data loader, and the flight recorder (`explain`, `replay`, `hashes`,
  `plan`, each run as the command over the training run's state);
- interruption: none, a state at an odd step restored in a new process, or the process
  SIGKILLed two steps after it saved that state (its DataLoader workers must not outlive it).
"""

from __future__ import annotations

import itertools
import random

AXES = {
    "store": ["bin", "arrayrecord", "megatron", "raw_bin", "raw_npy", "litdata", "mds", "mds_zstd", "arrow",
              "masked", "olmo_masks", "stream_files", "stream_hub"],
    "location": ["local", "s3", "s3_limit"],
    "credentials": ["explicit", "environment"],
    "shape": ["plain", "phases", "batch_sizes", "seq_lens", "set_weights", "skip_steps", "skip_documents",
              "mixture_change", "elastic"],
    "consumer": ["iter0", "iter2", "torch0", "torch2_fork", "torch2_spawn", "stateful", "jax", "olmo",
                 "explain", "replay", "hashes", "plan"],
    "interruption": ["none", "restore", "sigkill"],
}
STREAMING = {"stream_files", "stream_hub"}

# pairs that cannot exist: no case holds them, and none needs covering
ABSENT = {
    (("store", "stream_hub"), ("location", "s3")): "a Hub-style dataset directory is read from local disk",
    (("store", "stream_hub"), ("location", "s3_limit")): "a Hub-style dataset directory is read from local disk",
    (("store", "stream_files"), ("location", "s3_limit")): "cache_limit bounds stores; streamed files are read once",
}

# pairs refused by design: a case holding one must end in this error (a regex over its message)
REFUSED = {
    (("store", "masked"), ("location", "s3")):
        ("a store with target masks is read from a local directory in this version",
         "target masks are fetched beside their shards in a later version: trained whole, they would be wrong"),
    (("store", "masked"), ("location", "s3_limit")):
        ("a store with target masks is read from a local directory in this version",
         "target masks are fetched beside their shards in a later version: trained whole, they would be wrong"),
    (("store", "olmo_masks"), ("location", "s3_limit")):
        ("label_masks are read from local disk, or from a whole copy of the files",
         "label masks are read in blocks beside their token files in a later version"),
    (("store", "stream_files"), ("shape", "seq_lens")):
        ("sources .* are streaming or set a stride; a sequence-length schedule",
         "a streaming source's rows are packed as they are read: a length schedule needs stored sources"),
    (("store", "stream_hub"), ("shape", "seq_lens")):
        ("sources .* are streaming or set a stride; a sequence-length schedule",
         "a streaming source's rows are packed as they are read: a length schedule needs stored sources"),
    (("store", "stream_files"), ("shape", "skip_steps")):
        ("skip_steps: streaming sources are read in order and cannot skip yet",
         "a streaming source is read in order: skipping needs its rows made and dropped (not yet supported)"),
    (("store", "stream_hub"), ("shape", "skip_steps")):
        ("skip_steps: streaming sources are read in order and cannot skip yet",
         "a streaming source is read in order: skipping needs its rows made and dropped (not yet supported)"),
    (("store", "stream_files"), ("shape", "skip_documents")):
        ("skip_documents: streaming sources are read in order and cannot skip yet",
         "a streaming source is read in order: skipping needs its rows made and dropped (not yet supported)"),
    (("store", "stream_hub"), ("shape", "skip_documents")):
        ("skip_documents: streaming sources are read in order and cannot skip yet",
         "a streaming source is read in order: skipping needs its rows made and dropped (not yet supported)"),
    (("store", "stream_files"), ("shape", "set_weights")):
        ("set_weights: streaming sources keep the mixture they started with",
         "a streaming source's rows are dealt to its canonical streams by the mixture it started with"),
    (("store", "stream_files"), ("shape", "mixture_change")):
        ("streaming sources resume only with the mixture they were saved with",
         "a streaming source's rows are dealt to its canonical streams by the mixture it started with"),
    (("store", "stream_hub"), ("shape", "set_weights")):
        ("set_weights: streaming sources keep the mixture they started with",
         "a streaming source's rows are dealt to its canonical streams by the mixture it started with"),
    (("store", "stream_hub"), ("shape", "mixture_change")):
        ("streaming sources resume only with the mixture they were saved with",
         "a streaming source's rows are dealt to its canonical streams by the mixture it started with"),
    (("shape", "batch_sizes"), ("consumer", "olmo")):
        ("OLMo-core changes batch sizes itself", "OLMo-core schedules batch sizes itself"),
    (("shape", "seq_lens"), ("consumer", "olmo")):
        ("OLMo-core's loader keeps one batch size in tokens and one sequence length",
         "OLMo-core's loader keeps one sequence length: feed a length schedule through the torch bridge"),
}


def pairs_of(case: dict) -> set:
    """Every pair of (axis, value) of a case, each pair in the axes' order."""
    items = [(a, case[a]) for a in AXES]
    return set(itertools.combinations(items, 2))


def refusal(case: dict) -> tuple[str, str] | None:
    """(the message's pattern, why) of the first refused pair the case holds, or None."""
    held = pairs_of(case)
    return next((r for pair, r in REFUSED.items() if pair in held), None)


def covering(axes: dict = AXES, absent=ABSENT, refused=REFUSED) -> list[dict]:
    """Cases in which every pair of values of two axes occurs at least once (those in `absent`
    excepted, which none holds). A refused pair is held by one case of its own, so that the
    other pairs of that case, which the refusal leaves untried, are covered by cases that run.
    Greedily, each new case the one covering most pairs not yet covered, built axis by axis.
    Deterministic: the same set every time."""
    names = list(axes)
    todo = {((a, x), (b, y)) for i, a in enumerate(names) for b in names[i + 1:]
            for x in axes[a] for y in axes[b]} - set(absent) - set(refused)
    cases = _greedy(axes, names, todo, set(absent) | set(refused))
    for pair in refused:
        cases += _greedy(axes, names, {pair}, set(absent) | (set(refused) - {pair}))
    return cases


def _greedy(axes: dict, names: list, todo: set, absent: set) -> list[dict]:
    cases, used = [], {(a, v): 0 for a in names for v in axes[a]}  # ties go to the value used least
    while todo:
        # start from the first uncovered pair, then take for each other axis the value covering most
        (a, x), (b, y) = min(todo, key=lambda p: (names.index(p[0][0]), axes[p[0][0]].index(p[0][1]),
                                                  names.index(p[1][0]), axes[p[1][0]].index(p[1][1])))
        case = {a: x, b: y}
        for axis in names:
            if axis in case:
                continue
            best, score = None, (-1, 0)
            for v in axes[axis]:
                trial = [((c, case[c]), (axis, v)) if names.index(c) < names.index(axis) else ((axis, v), (c, case[c]))
                         for c in case]
                if any(p in absent for p in trial):
                    continue
                gain = (sum(p in todo for p in trial), -used[(axis, v)])
                if gain > score:
                    best, score = v, gain
            case[axis] = best
        case = {k: case[k] for k in names}
        todo -= pairs_of(case)
        cases.append(case)
        for a in names:
            used[(a, case[a])] += 1
    return cases


def case_id(case: dict) -> str:
    return "-".join(case[a] for a in AXES)


def default_subset(cases: list[dict], n: int = 10, seed: int = 60) -> list[dict]:
    """The cases the default suite runs: a seeded sample (the standard library's generator),
    holding every location and every interruption at least once, and one refusal."""
    rng = random.Random(seed)
    chosen = [rng.choice([c for c in cases if c[axis] == v and not refusal(c)])
              for axis in ("location", "interruption") for v in AXES[axis]]
    chosen.append(rng.choice([c for c in cases if refusal(c)]))
    rest = [c for c in cases if c not in chosen]
    return chosen + rng.sample(rest, max(0, n - len(chosen)))


def table(cases: list[dict]) -> str:
    """The covering set as a Markdown table, with the refusals and absent pairs."""
    lines = ["# The crossings", "",
             "Generated by `tests/crossings.py` (`python tests/crossings.py > tests/crossings.md`); "
             "`tests/test_crossings.py` runs every case under `FORGE_GRAIN_SLOW=1` and a seeded subset by default. "
             f"{len(cases)} cases cover every pair of values of any two axes.", "",
             "| # | " + " | ".join(AXES) + " | expected |", "|---" * (len(AXES) + 2) + "|"]
    for k, c in enumerate(cases):
        r = refusal(c)
        lines.append(f"| {k} | " + " | ".join(c[a] for a in AXES) + f" | {'refused' if r else 'the reference batches'} |")
    lines += ["", "## Refused by design", "", "| pair | why |", "|---|---|"]
    lines += [f"| {a[1]} × {b[1]} | {why} |" for (a, b), (_, why) in REFUSED.items()]
    lines += ["", "## Pairs that cannot exist", "", "| pair | why |", "|---|---|"]
    lines += [f"| {a[1]} × {b[1]} | {why} |" for (a, b), why in ABSENT.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(covering()), end="")
