"""Saving the pipeline's position with Orbax, restorable under any shard count.

The state is global (the next step and a fingerprint), so one copy serves every host:
it is written once, by the primary host, through Orbax's JSON handler, and every host
reads the same file back. Grain's own handler writes `process_i-of-n.json` files and so
cannot restore on a different number of hosts.

    mngr = ocp.CheckpointManager(directory)
    mngr.save(step, args=ocp.args.Composite(data=checkpoint.save_args(it), **model_args))
    restored = mngr.restore(step, args=ocp.args.Composite(data=checkpoint.restore_args(), ...))
    it.set_state(restored["data"])
"""

from __future__ import annotations


def save_args(iterator):
    """Orbax args that save `iterator`'s state (`ocp.args.JsonSave`)."""
    import orbax.checkpoint as ocp

    state = iterator.get_state()
    if "streams" in state and state["shard"][1] > 1:
        raise ValueError(
            "with streaming sources every shard has its own state, and Orbax's JSON handler writes the primary "
            "host's only: save iterator.get_state() per host yourself (for example one JSON file per process)"
        )
    return ocp.args.JsonSave(state)


def restore_args():
    """Orbax args that read a saved pipeline state back (`ocp.args.JsonRestore`)."""
    import orbax.checkpoint as ocp

    return ocp.args.JsonRestore()


def save(manager, step: int, iterator, **extra_args) -> bool:
    """Save the pipeline state (item `data`) and any other Orbax args in one checkpoint."""
    import orbax.checkpoint as ocp

    return manager.save(step, args=ocp.args.Composite(data=save_args(iterator), **extra_args))


def restore(manager, iterator, step: int | None = None) -> dict:
    """Restore the pipeline state of checkpoint `step` (default: the latest) into `iterator`."""
    import orbax.checkpoint as ocp

    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {manager.directory}")
    state = manager.restore(step, args=ocp.args.Composite(data=restore_args()))["data"]
    iterator.set_state(state)
    return state
