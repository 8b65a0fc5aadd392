"""The pipeline's position as an Orbax checkpoint item, restorable under any shard count.

    import orbax.checkpoint as ocp
    from forge_grain import checkpoint

    mngr = ocp.CheckpointManager(directory)
    mngr.save(step, args=ocp.args.Composite(data=checkpoint.Save(it), params=ocp.args.StandardSave(params)))
    mngr.wait_until_finished()  # Orbax saves in the background: wait before the process may exit
    mngr.restore(step, args=ocp.args.Composite(data=checkpoint.Restore(it), params=ocp.args.StandardRestore()))

`Save`/`Restore` are Orbax `CheckpointArgs` registered with `PipelineCheckpointHandler`, so
the data state is an item like any other. The state of stored sources is global (the next
step and a fingerprint): it is written once, by shard 0, as `state.json`, and every host of
any later cluster size reads that one file. (Grain's own handler writes
`process_i-of-n.json` and cannot restore on another host count.) Streaming sources have a
position per canonical stream, and each shard knows its own: each shard also writes
`stream-k-of-n.json`, and a restore joins them all (`merge_states`), so it resumes on any
shard count dividing the `canonical_streams` they were saved with. After weights set live
(`set_weights`), which every shard must make alike, each shard also writes its fingerprint
(`fingerprint-k-of-n.json`), and a restore refuses a checkpoint whose shards disagree.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import orbax.checkpoint as ocp

from forge_grain.errors import StateError
from forge_grain.pipeline.states import merge_states

STATE_FILE = "state.json"


def _stream_file(shard: int, count: int) -> str:
    return f"stream-{shard}-of-{count}.json"


def _fingerprint_file(shard: int, count: int) -> str:
    return f"fingerprint-{shard}-of-{count}.json"


class PipelineCheckpointHandler(ocp.CheckpointHandler):
    """Orbax handler for a `PipelineIterator` or `JaxIterator` (anything with `pipeline`,
    `get_state` and `set_state`)."""

    def save(self, directory, args: "Save" = None, item=None):
        it = item if item is not None else args.iterator
        state = it.get_state()
        pipeline = it.pipeline
        if "streams" in state:
            _write(directory / _stream_file(pipeline.shard_index, pipeline.shard_count), state)
        if "live" in state["config"]:  # changed live: each shard's own change, compared at restore
            _write(directory / _fingerprint_file(pipeline.shard_index, pipeline.shard_count),
                   {"fingerprint": state["fingerprint"], "step": state["step"]})
        if pipeline.shard_index == 0:
            _write(directory / STATE_FILE, state)

    def restore(self, directory, args: "Restore" = None, item=None) -> dict:
        """The saved state; set into `args.iterator` when one is given."""
        it = item if item is not None else (args.iterator if args is not None else None)
        state = _read(directory / STATE_FILE)
        _check_same_changes(directory, state)
        if "streams" in state:
            files = sorted(directory.glob("stream-*-of-*.json"))
            state = merge_states([state, *(_read(f) for f in files)])
        if it is not None:
            it.set_state(state)
        return state

    def metadata(self, directory):
        return None

    def structure(self, directory):
        return None

    def finalize(self, directory):
        pass

    def close(self):
        pass


@ocp.args.register_with_handler(PipelineCheckpointHandler, for_save=True)
@dataclasses.dataclass
class Save(ocp.args.CheckpointArgs):
    """Save a pipeline iterator's position (an Orbax checkpoint item)."""

    iterator: Any


@ocp.args.register_with_handler(PipelineCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class Restore(ocp.args.CheckpointArgs):
    """Restore a position into `iterator` (None: only return the saved state dict)."""

    iterator: Any = None


def _check_same_changes(directory, state: dict) -> None:
    """A StateError naming the shards whose live weight changes differ from shard 0's."""
    differ = [f.name for f in sorted(directory.glob("fingerprint-*-of-*.json"))
              if _read(f).get("fingerprint") != state.get("fingerprint")]
    if differ:
        raise StateError(f"{directory}: the shards of {differ} set other weights than shard 0 (set_weights must be "
                         "called with the same arguments on every rank); this checkpoint describes no single run")


def _write(path, state: dict) -> None:
    path.write_text(json.dumps(state, indent=1))


def _read(path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise StateError(f"{path}: no forge-grain pipeline state in this checkpoint item") from None


def save_args(iterator) -> Save:
    """The Orbax args that save `iterator`'s position (same as `Save(iterator)`)."""
    return Save(iterator)


def restore_args(iterator=None) -> Restore:
    """The Orbax args that restore a position (same as `Restore(iterator)`)."""
    return Restore(iterator)


def save(manager, step: int, iterator, **extra_args) -> bool:
    """Save the pipeline state (item `data`) and any other Orbax args in one checkpoint; wait
    for `manager.wait_until_finished()` before the process may exit."""
    return manager.save(step, args=ocp.args.Composite(data=Save(iterator), **extra_args))


def restore(manager, iterator, step: int | None = None) -> dict:
    """Restore the pipeline state of checkpoint `step` (default: the latest) into `iterator`."""
    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {manager.directory}")
    return manager.restore(step, args=ocp.args.Composite(data=Restore(iterator)))["data"]
