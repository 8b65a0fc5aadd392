"""forge-grain as MaxText's data iterator.

MaxText makes its iterators in one function, `create_data_iterator(config, mesh)` in
`maxtext.input_pipeline.input_pipeline_interface`, chosen by `config.dataset_type`; it has
no hook for an iterator from outside, and reads that function from its module each time it
builds a run. So a launcher puts `data_iterators(...)` in its place before MaxText starts:

    import maxtext.input_pipeline.input_pipeline_interface as maxtext_inputs
    from forge_grain.bridges.maxtext import data_iterators
    maxtext_inputs.create_data_iterator = data_iterators()

    from maxtext.trainers.pre_train import train
    train.main(["train", "base.yml", "dataset_type=grain", "grain_train_files=data.toml", ...])

MaxText asks a `grain` run for `grain_train_files`: it names forge-grain's config there (or
give the config to `data_iterators` and anything there).

With `dataset_type=grain`, MaxText's own Orbax checkpointing saves the iterator's state in
each checkpoint (its `iter` item, through Grain's `DatasetIterator` interface) and restores
it when a run restarts from one; the state is forge-grain's (next step and fingerprint), so a
restart trains every later step once, also on another number of hosts. The batches are
global `jax.Array`s under MaxText's names (`inputs`, `inputs_segmentation`,
`inputs_position`, `targets`, `targets_segmentation`, `targets_position`), laid out by
MaxText's own `data_sharding`; the config's `seq_len` and `global_batch_size` must be
MaxText's `max_target_length` and global batch, or the run stops naming both.
"""

from __future__ import annotations

from pathlib import Path

import jax

from forge_grain import ConfigError, DataConfig, Pipeline
from forge_grain.bridges.jax import JaxIterator


class MaxTextBatches(JaxIterator):
    """`JaxIterator(convention="maxtext")` as MaxText's data loader calls it: each batch holds
    the arrays alone (MaxText puts the whole batch on its input sharding); the step a batch
    is the pipeline's step `last_step`."""

    def __init__(self, pipeline: Pipeline, sharding: jax.sharding.Sharding, *, prefetch: int = 2):
        super().__init__(pipeline, sharding, prefetch=prefetch, convention="maxtext")
        self.last_step = None

    def __next__(self) -> dict:
        batch = super().__next__()
        self.last_step = batch.pop("step")
        return batch


def data_iterators(config: DataConfig | str | Path | None = None, **pipeline_args):
    """MaxText's `create_data_iterator(config, mesh)` fed by forge-grain: it returns
    (`MaxTextBatches` of the pipeline, no eval iterator). `config`: a `DataConfig` or a TOML
    path (default: the TOML MaxText's `grain_train_files` names); `pipeline_args` go to
    `Pipeline` (shard index and count default to the JAX process's)."""

    def create_data_iterator(maxtext_config, mesh):
        data = config if config is not None else getattr(maxtext_config, "grain_train_files", None)
        if not data:
            raise ConfigError("no forge-grain config: pass one to data_iterators, or name its TOML file in "
                              "MaxText's grain_train_files")
        data = DataConfig.from_toml(data) if isinstance(data, (str, Path)) else data
        check_shapes(data, maxtext_config)
        if getattr(maxtext_config, "eval_interval", 0) > 0:
            raise ConfigError("forge-grain gives MaxText's train iterator only: set eval_interval=-1 (or 0)")
        args = {"shard_index": jax.process_index(), "shard_count": jax.process_count(), **pipeline_args}
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*maxtext_config.data_sharding))
        return MaxTextBatches(Pipeline(data, **args), sharding), None

    return create_data_iterator


def check_shapes(data: DataConfig, maxtext_config) -> None:
    """The rows MaxText trains on are the pipeline's: the same length, the same global batch."""
    length, batch = maxtext_config.max_target_length, maxtext_config.global_batch_size_to_load
    wrong = [f"{mine} = {m} but MaxText's {theirs} = {t}" for mine, m, theirs, t in (
        ("seq_len", data.seq_len, "max_target_length", length),
        ("global_batch_size", data.global_batch_size, "global batch (per_device_batch_size x devices)", batch))
        if m != t]
    if len(data.batch_schedule()) > 1:
        wrong.append("batch sizes change by schedule, which MaxText's fixed batch cannot follow")
    if wrong:
        raise ConfigError("forge-grain's config and MaxText's disagree: " + "; ".join(wrong))
    if getattr(maxtext_config, "dataset_type", "grain") != "grain":
        raise ConfigError(f"MaxText's dataset_type is {maxtext_config.dataset_type!r}: set dataset_type=grain, "
                          "so that its checkpoints save and restore forge-grain's iterator state")
