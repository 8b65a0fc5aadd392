"""forge-grain batches as global `jax.Array`s, prefetched onto devices a few steps ahead.

    it = JaxIterator(Pipeline(config), sharding)   # sharding: e.g. NamedSharding(mesh, P("data"))
    batch = next(it)                               # dict of global jax.Arrays [global_batch, seq_len]
    checkpoint.save(manager, step, it)             # the Orbax helpers work on it (get_state/set_state)

Each process contributes its shard of every global batch (the pipeline's shard index is
`jax.process_index()` by default) and `jax.make_array_from_process_local_data` assembles
the global array, so the rows of process k sit at rows [k·B/n, (k+1)·B/n) of it.
"""

from __future__ import annotations

import collections

import grain
import jax
import numpy as np

from forge_grain import Pipeline

ARRAY_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "natural_stop", "source_id")


def to_global(local_batch: dict, sharding: jax.sharding.Sharding, keys=None) -> dict:
    """This process's rows of a batch as global arrays laid out by `sharding`.

    `keys`: the arrays to convert; by default every key of the row format the batch holds
    (a `PackedDataset` batch has no `source_id`, a pipeline batch has). `sharding` applies to
    the [batch, seq_len] arrays; 1-D arrays (source_id) use its batch axis alone.
    """
    keys = [k for k in ARRAY_KEYS if k in local_batch] if keys is None else keys
    missing = [k for k in keys if k not in local_batch]
    if missing:
        raise KeyError(f"to_global: the batch has no {missing} (its keys: {sorted(local_batch)})")
    out = {}
    for k in keys:
        value = np.asarray(local_batch[k])
        out[k] = jax.make_array_from_process_local_data(_for_rank(sharding, value.ndim), value)
    return out


def _for_rank(sharding, ndim):
    if ndim == 2 or not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    spec = tuple(sharding.spec)[:ndim]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


class JaxIterator(grain.DatasetIterator):
    """Global arrays of a pipeline's batches, `prefetch` steps ahead on the devices.

    The state is the pipeline's (next step + fingerprint): batches already transferred
    but not consumed are not counted, so a restore repeats nothing and skips nothing.
    """

    def __init__(self, pipeline: Pipeline, sharding: jax.sharding.Sharding, *, prefetch: int = 2, keys=ARRAY_KEYS):
        super().__init__()
        self.pipeline, self.sharding, self.prefetch, self.keys = pipeline, sharding, prefetch, keys
        self._host = iter(pipeline)
        self._queue: collections.deque = collections.deque()
        self._consumed = self._host.step

    def _fill(self) -> None:
        while len(self._queue) < max(self.prefetch, 1):
            try:
                local = next(self._host)
            except StopIteration:
                return
            step = int(local["step"])
            self._queue.append((step, to_global(local, self.sharding, self.keys)))  # device_put is asynchronous

    def __next__(self) -> dict:
        self._fill()
        if not self._queue:
            raise StopIteration
        step, batch = self._queue.popleft()
        self._consumed = step + 1
        self._fill()
        return {**batch, "step": step}

    def get_state(self) -> dict:
        return self.pipeline.state_at(self._consumed)

    def set_state(self, state: dict) -> None:
        self._host.set_state(state)
        self._queue.clear()
        self._consumed = self._host.step

    def close(self) -> None:
        self._host.close()
        self._queue.clear()
