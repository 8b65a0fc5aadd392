"""One process of a crossing case (tests/crossings.py): the run's legs through one consumer.

    python tests/crossing_run.py SPEC.json

A leg is a stretch of steps on one shard count with one config, resumed from the state the
leg before it ended with (with its resume options: skips, a mixture change) and with the
weights it sets live. The ranks of a leg run one after another in this process; each batch a
rank sees is appended to the records file as (step, rank, world, arrays) as soon as it is
seen, so what a killed process saw is kept. The state the last leg ends with is written to
`state_out`; with `kill_after`, the process then reads that many steps more (workers running)
and SIGKILLs itself. The parent process also calls `run_legs` itself, with the
iterator on one shard, for the reference run.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
from pathlib import Path

import numpy as np

KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
TIMEOUT_S = 120  # a DataLoader waiting longer for a batch fails: a hang is an error, not a stuck run


def build_pipeline(leg: dict, rank: int, world: int, state, cache_dir, num_threads: int = 0, first: bool = True):
    """The leg's pipeline for `rank` of `world`, resumed from `state` (with the leg's resume
    options where the leg starts: `first`)."""
    from forge_grain import DataConfig, Pipeline

    resume = (leg.get("resume") or {}) if first and state is not None else {}
    return Pipeline(DataConfig.from_dict(leg["config"]), rank, world, num_threads=num_threads,
                    prefetch=0 if num_threads == 0 else 4, cache_dir=cache_dir, resume_from=state, **resume)


def live_to_apply(leg: dict, state, start: int) -> list:
    """The leg's live weight changes not already in the state it resumes from."""
    recorded = state is not None and "live" in (state.get("config") or {})
    return [] if recorded else [(at, w) for at, w in leg.get("live", []) if at >= start]


class Iterated:
    """`Pipeline.iterator`, with `num_threads` batch threads."""

    def __init__(self, leg, rank, world, state, spec, first, threads):
        self.pipeline = build_pipeline(leg, rank, world, state and state["global"], spec["cache_dir"], threads, first)
        self.it = self.pipeline.iterator(state and state["global"])
        for at, weights in live_to_apply(leg, state and state["global"], self.it.step):
            self.it.set_weights(weights, at)

    def next(self):
        b = next(self.it)
        return int(b["step"]), {k: np.asarray(b[k]) for k in KEYS}

    def state(self):
        return {"global": self.it.get_state()}

    def close(self):
        self.it.close()


class Torch:
    """The torch bridge under a DataLoader (`workers`, `context`), or torchdata's
    StatefulDataLoader (`stateful`: its own state resumes it within a shard count)."""

    def __init__(self, leg, rank, world, state, spec, first, workers, context, stateful=False):
        from forge_grain.bridges.torch import GrainIterableDataset

        g = state and state["global"]
        self.ds = GrainIterableDataset(build_pipeline(leg, rank, world, g, spec["cache_dir"], 0, first))
        self.tracker = self.ds.tracker()
        own = (state or {}).get("loader", {}).get(rank) if stateful and not first else None
        if g is not None and own is None:
            self.tracker.load_state_dict(g)
        elif own is not None:  # the loader's own state resumes the workers; the tracker follows it
            self.tracker.next_step = g["step"]
            if g.get("streams"):
                self.tracker._streams = [{c: st for c, st in per.items() if c in mine}
                                         for per, mine in zip(g["streams"], self.tracker._streams)]
        for at, weights in live_to_apply(leg, g, g["step"] if g else 0):
            self.ds.set_weights(weights, at)
        kw = dict(num_workers=workers, multiprocessing_context=context, timeout=TIMEOUT_S) if workers else {}
        if stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            self.loader = StatefulDataLoader(self.ds, batch_size=None, **kw)
            if own is not None:
                self.loader.load_state_dict(own)
        else:
            from torch.utils.data import DataLoader

            self.loader = DataLoader(self.ds, batch_size=None, **kw)
        self.rank, self.stateful = rank, stateful
        self.it = iter(self.loader)

    def next(self):
        b = next(self.it)
        self.tracker.update(b)
        return int(b["step"]), {k: b[k].numpy() for k in KEYS}

    def state(self):
        out = {"global": self.tracker.state_dict()}
        if self.stateful:
            out["loader"] = {self.rank: self.loader.state_dict()}
        return out

    def close(self):
        del self.it


class Jax(Iterated):
    """`forge_grain.bridges.jax.JaxIterator` on this process's one CPU device."""

    def __init__(self, leg, rank, world, state, spec, first):
        import jax

        from forge_grain.bridges.jax import JaxIterator

        g = state and state["global"]
        p = build_pipeline(leg, rank, world, g, spec["cache_dir"], 0, first)
        self.it = JaxIterator(p, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        if g is not None:
            self.it.set_state(g)
        for at, weights in live_to_apply(leg, g, g["step"] if g else 0):
            self.it.set_weights(weights, at)


class Olmo:
    """OLMo-core's data loader (`forge_grain.bridges.olmo.ForgeGrainDataLoader`) as its Trainer drives it:
    `reshuffle`, iterate, `state_dict` / `load_state_dict`."""

    def __init__(self, leg, rank, world, state, spec, first):
        from forge_grain.bridges.olmo import ForgeGrainDataLoader

        g = state and state["global"]
        p = build_pipeline(leg, rank, world, g, spec["cache_dir"], 0, first)
        self.loader = ForgeGrainDataLoader(p, work_dir=spec["work_dir"], dp_world_size=world, dp_rank=rank)
        self.loader.reshuffle(epoch=1)
        if state is not None:
            self.loader.load_state_dict(state["olmo"] if "olmo" in state else {
                "forge_grain": g, "batches_processed": g["step"], "tokens_processed": 0, "epoch": 1})
        for at, weights in live_to_apply(leg, g, g["step"] if g else 0):
            self.loader.dataset.set_weights(weights, at)
        self.it = iter(self.loader)
        self.step = self.loader.batches_processed

    def next(self):
        b = next(self.it)
        self.step += 1
        return self.step - 1, {"inputs": b["input_ids"].numpy()}

    def state(self):
        s = self.loader.state_dict()
        return {"global": s["forge_grain"], "olmo": s}

    def close(self):
        self.loader.reset()


def consumer(name: str, leg, rank, world, state, spec, first):
    if name in ("iter0", "iter2", "reference") or name in ("explain", "replay", "hashes", "plan"):
        return Iterated(leg, rank, world, state, spec, first, 2 if name == "iter2" else 0)
    if name.startswith("torch"):
        workers = 0 if name == "torch0" else 2
        return Torch(leg, rank, world, state, spec, first, workers, name.split("_")[1] if workers else None)
    if name == "stateful":
        return Torch(leg, rank, world, state, spec, first, 2, "fork", stateful=True)
    if name == "jax":
        return Jax(leg, rank, world, state, spec, first)
    if name == "olmo":
        return Olmo(leg, rank, world, state, spec, first)
    raise ValueError(name)


def merged(states: list[dict]) -> dict:
    """One state from every rank's: the pipeline's merged (streaming positions joined), the
    loaders' own kept by rank."""
    from forge_grain.pipeline.states import merge_states

    out = {"global": merge_states([s["global"] for s in states])}
    if "loader" in states[0]:
        out["loader"] = {r: l for s in states for r, l in s["loader"].items()}
    if "olmo" in states[0]:  # OLMo-core's counters (the same on every rank) and, as the loader's state_dict
        # gathers them across ranks under torch.distributed, every rank's stream positions
        out["olmo"] = {**states[0]["olmo"], "forge_grain": out["global"]}
    return out


def run_legs(spec: dict, record) -> dict | None:
    """Run `spec`'s legs (see the module's docstring); `record(step, rank, world, arrays)` takes
    each batch. The state the last leg ended with."""
    state = spec.get("state_in")
    kill = spec.get("kill_after")
    for n, leg in enumerate(spec["legs"]):
        world, ends, last = leg["world"], [], n == len(spec["legs"]) - 1
        first = leg.get("first", True)
        for rank in range(world):
            c = consumer(spec["consumer"], leg, rank, world, state, spec, first)
            for _ in range(leg["start"], leg["stop"]) if leg["stop"] is not None else iter(int, 1):
                try:
                    step, arrays = c.next()
                except StopIteration:
                    if leg["stop"] is None:  # (the reference: to the run's end)
                        break
                    raise
                record(step, rank, world, arrays)
            ends.append(c.state())
            if last and kill and rank == world - 1:  # the checkpoint is this leg's end
                for path in (spec["state_out"], leg.get("save_state_to")):
                    if path:
                        write_state(path, merged(ends))
                for _ in range(kill):
                    step, arrays = c.next()
                    record(step, rank, world, arrays)
                os.kill(os.getpid(), signal.SIGKILL)
            c.close()
        state = merged(ends)
        if leg.get("save_state_to"):
            write_state(leg["save_state_to"], state)
    return state


def write_state(path, state) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_bytes(pickle.dumps(state))
    os.replace(tmp, path)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("state_in_file"):
        spec["state_in"] = pickle.loads(Path(spec["state_in_file"]).read_bytes())
    with open(spec["records"], "ab") as f:
        def record(step, rank, world, arrays):
            pickle.dump((step, rank, world, arrays), f)
            f.flush()

        state = run_legs(spec, record)
    if spec.get("state_out"):
        write_state(spec["state_out"], state)


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
    main(sys.argv[1])
