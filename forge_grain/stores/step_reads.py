"""A batch's early word to the prefetch hints: the shards it has finished reading; and
whether the step it makes starts a fresh window of hints.

A step's hints keep every shard the step reads until its batch is made (the pipeline's
`FetchWindow`). Where a step reads a shard it holds and one still arriving (a boundary
of the read order that fits the cache), the batch fills its rows from the first, then
waits for the second: the first leaves the hints there, not once the second has arrived
(at a `cache_limit` of two shards, that made each shard's download wait for the one
before it to arrive whole). The window being made is per thread: Grain's threads make
several steps at once.
"""

from __future__ import annotations

import threading

_making = threading.local()


class making:
    """While this thread makes `step`: `listener.read_early(step, store, arrays)` hears of
    arrays its batch has finished reading (`done_reading`). A class, not a generator: it is
    entered once a step, and a generator's context manager cost several times as much."""

    __slots__ = ("now", "before")

    def __init__(self, listener, step: int):
        self.now, self.before = (listener, step), None

    def __enter__(self) -> None:
        self.before = getattr(_making, "now", None)
        _making.now = self.now

    def __exit__(self, *exc) -> None:
        _making.now = self.before


def step_now() -> int | None:
    """The step this thread makes (None: none, or no prefetch hints)."""
    now = getattr(_making, "now", None)
    return None if now is None else now[1]


def done_reading(store, arrays) -> None:
    """The batch this thread makes will read `arrays` of `store` no more (nothing outside a
    step being made)."""
    now = getattr(_making, "now", None)
    if now is not None and len(arrays):
        listener, step = now
        listener.read_early(step, store, arrays)


def fresh() -> bool:
    """Whether the step this thread makes is the first of a fresh window of hints (an
    iterator made, a restore, a jump): its sources in object storage have none of its shards
    yet, and each may wait on the network for them."""
    now = getattr(_making, "now", None)
    return now is not None and getattr(now[0], "fresh_step", None) == now[1]


def carried(fn):
    """`fn`, to run on another thread as part of the step this thread makes (its reads' word
    reaches the same hints, and a first step reads ranges there too)."""
    now = getattr(_making, "now", None)
    if now is None:
        return fn

    def run(*args, **kwargs):
        with making(*now):
            return fn(*args, **kwargs)
    return run
