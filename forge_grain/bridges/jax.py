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

from forge_grain import ConfigError, Pipeline
from forge_grain.packing.varlen import doc_lens

ARRAY_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "natural_stop", "source_id")
# MaxText's Grain pipeline names (its loss weights are targets_segmentation != 0)
MAXTEXT_KEYS = ("inputs", "inputs_segmentation", "inputs_position", "targets", "targets_segmentation",
                "targets_position")


def maxtext(batch: dict) -> dict:
    """A batch under MaxText's keys: `inputs_segmentation`/`inputs_position` are the segment
    ids and positions, `targets_segmentation` the segment ids where the loss applies (0
    elsewhere: padding, the target that would cross into the next document, overlap heads)."""
    seg = np.asarray(batch["segment_ids"])
    return {"inputs": batch["inputs"], "inputs_segmentation": seg, "inputs_position": batch["positions"],
            "targets": batch["targets"], "targets_segmentation": np.where(batch["loss_mask"], seg, 0).astype(seg.dtype),
            "targets_position": batch["positions"], **({"step": batch["step"]} if "step" in batch else {})}


def document_mask(segment_ids) -> jax.Array:
    """[rows, 1, seq_len, seq_len] bool: causal attention within a segment (padding attends to
    padding), for `jax.nn.dot_product_attention(..., mask=)` and other dense attention."""
    seg = jax.numpy.asarray(segment_ids)
    length = seg.shape[-1]
    causal = jax.numpy.tril(jax.numpy.ones((length, length), bool))
    return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


def splash_segment_ids(segment_ids):
    """`SegmentIds(q, kv)` for splash attention on TPU (`jax.experimental.pallas.ops.tpu.
    splash_attention`); with a causal mask it attends within documents."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    seg = jax.numpy.asarray(segment_ids, jax.numpy.int32)
    return SegmentIds(q=seg, kv=seg)


def to_global(local_batch: dict, sharding: jax.sharding.Sharding, keys=None) -> dict:
    """This process's rows of a batch as global arrays laid out by `sharding`.

    `keys`: the arrays to convert; by default every key of the row format the batch holds
    (a `PackedDataset` batch has no `source_id`, a pipeline batch has). `sharding` applies to
    the [batch, seq_len] arrays; 1-D arrays (source_id) use its batch axis alone.
    """
    keys = [k for k in dict.fromkeys(ARRAY_KEYS + MAXTEXT_KEYS) if k in local_batch] if keys is None else keys
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

    `convention="maxtext"` names the arrays as MaxText's Grain pipeline does (`maxtext`);
    `varlen=True` adds `doc_lens` [rows, segments] (`forge_grain.packing.varlen`; its rows are
    sharded as the batch's, so keep the sequence axis of `sharding` unsharded).
    The state is the pipeline's (next step + fingerprint): batches already transferred
    but not consumed are not counted, so a restore repeats nothing and skips nothing.
    """

    def __init__(self, pipeline: Pipeline, sharding: jax.sharding.Sharding, *, prefetch: int = 2, keys=None,
                 convention: str = "forge", varlen: bool = False):
        super().__init__()
        if convention not in ("forge", "maxtext"):
            raise ValueError(f"convention must be 'forge' or 'maxtext', not {convention!r}")
        self.pipeline, self.sharding, self.prefetch = pipeline, sharding, prefetch
        self.convention, self.varlen = convention, varlen
        self.keys = keys if keys is not None else (MAXTEXT_KEYS if convention == "maxtext" else ARRAY_KEYS)
        self.keys = tuple(self.keys) + (("doc_lens",) if varlen else ())
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
            if self.varlen:
                cap = self.pipeline.config.max_segments_per_row
                local = {**local, "doc_lens": doc_lens(local["segment_ids"], cap + 1 if cap else None)}
            local = {**maxtext(local), **({"doc_lens": local["doc_lens"]} if self.varlen else {})} \
                if self.convention == "maxtext" else local
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

    def set_weights(self, weights, at_step: int | None = None) -> None:
        """Mix with `weights` from step `at_step` on (default: the next batch this returns; see
        `PipelineIterator.set_weights`). Batches already on the devices for steps from
        `at_step` on are made again."""
        at = self._consumed if at_step is None else at_step
        if isinstance(at, int) and not isinstance(at, bool) and self._consumed <= at < self._host.step:
            self._host.set_state(self.pipeline.state_at(at))  # made ahead with the old weights: again
            self._queue = collections.deque((s, b) for s, b in self._queue if s < at)
        elif isinstance(at, int) and not isinstance(at, bool) and at < self._consumed:
            raise ConfigError(f"set_weights at step {at}: step {self._consumed - 1} was already returned")
        self._host.set_weights(weights, at)
        self.pipeline = self._host.pipeline

    def set_state(self, state: dict) -> None:
        self._host.set_state(state)
        self.pipeline = self._host.pipeline  # (rebuilt for a state with weights set live)
        self._queue.clear()
        self._consumed = self._host.step

    def close(self) -> None:
        self._host.close()
        self._queue.clear()


def source_losses(token_losses, source_id, loss_mask, num_sources: int):
    """Each source's mean loss over the batch's trained tokens ([num_sources], NaN where a
    source has none), jittable; see `forge_grain.pipeline.live.source_losses`."""
    import jax.numpy as jnp

    mask = loss_mask.astype(token_losses.dtype)
    total = jax.ops.segment_sum((token_losses * mask).sum(axis=1), source_id, num_segments=num_sources)
    count = jax.ops.segment_sum(mask.sum(axis=1), source_id, num_segments=num_sources)
    return jnp.where(count > 0, total / jnp.maximum(count, 1), jnp.nan)
