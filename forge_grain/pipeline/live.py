"""Changing the mixture while training runs: `set_weights(weights, at_step)`, exactly.

A live change is a mixture change at resume made without the restart: the pipeline that
continues is the one `Pipeline(config', resume_from=state_at(at_step),
allow_mixture_change=True)` builds, config' being the config with the new weights from
`at_step` on. So it inherits that path's guarantees: the steps before `at_step` are what they
were (the old schedule is recorded as a history segment ending there), and from `at_step` on
every source continues from exactly its next unseen row, none repeated or skipped.

What the states add: the weights set live (`live` in the state's summary). A later resume from
such a state, with the config file as it was, continues with those weights (the config is read
with them, so the fingerprints agree); a resume with `allow_mixture_change=True` takes the
config's mixture instead, from the resumed step on (a deliberate change wins). Weights set live
replace the config's mixture from `at_step` on: its later phases and anneal no longer apply.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from forge_grain.pipeline.config import ConfigError, DataConfig
from forge_grain.sources.config import check_weight, check_weight_sum


def weights_by_name(weights, names: list[str]) -> dict[str, float]:
    """`weights` (a dict by source name, or a sequence in the config's source order: a list, a
    numpy array, a tensor) as a dict of floats over every name (sources not named get 0), or a
    ConfigError naming what is wrong."""
    if not isinstance(weights, (dict, str)) and hasattr(weights, "__len__") and hasattr(weights, "__iter__"):
        if len(weights) != len(names):
            raise ConfigError(f"set_weights: {len(weights)} weights for {len(names)} sources {names}")
        weights = dict(zip(names, weights))
    if not isinstance(weights, dict):
        raise ConfigError(f"set_weights: weights by source name (or a list in source order), not {weights!r:.80}")
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ConfigError(f"set_weights: no source named {unknown} (sources: {names})")
    out = {name: check_weight(f"set_weights: the weight of {name!r}", weights.get(name, 0.0)) for name in names}
    check_weight_sum("set_weights", list(out.values()))
    return out


def live_config(config: DataConfig, weights: dict[str, float]) -> DataConfig:
    """`config` mixing with `weights` (by name, every source) and no phases: what a pipeline
    runs from a live change on."""
    sources = [dataclasses.replace(s, weight=weights[s.name]) for s in config.sources]
    return dataclasses.replace(config, sources=sources, phases=[], anneal_start_step=None, anneal_weights=None)


def starting(config: DataConfig, live: dict | None, resume_from: dict | None, allow_change: bool):
    """(the config a pipeline runs, the weights set live it records): `live` (a live change),
    else those of the run `resume_from` was saved in, unless the caller changes the mixture at
    this resume (`allow_change`: the config's mixture wins from the resumed step on)."""
    if live is None and not allow_change and saved_live(resume_from) is not None:
        from forge_grain.pipeline import states

        live = saved_live(states.check(resume_from))  # (its fields checked before they make the config)
    if live is not None and set(live) == {s.name for s in config.sources}:
        config = live_config(config, live)
    return config, live


def saved_live(state: dict | None) -> dict | None:
    """The weights a state's run set live (its summary's `live`), if any."""
    config = state.get("config") if isinstance(state, dict) else None
    live = config.get("live") if isinstance(config, dict) else None
    return live if isinstance(live, dict) else None


def with_weights(pipeline, weights, at_step: int):
    """`pipeline`'s run with the mixture `weights` (by source name, or a list in source order;
    sources not named get 0) from step `at_step` on: the pipeline a resume from
    `state_at(at_step)` with those weights and `allow_mixture_change=True` builds. Steps
    before `at_step` are unchanged; from it on every source continues from its next unseen
    row. Its states record the change (`history`) and the weights (`live`), so resumes,
    elastic ones included, `consumed` and `explain` follow it. Every rank must make the same
    change."""
    if pipeline.streams:
        raise ConfigError("set_weights: streaming sources keep the mixture they started with (their rows are "
                          "read in order); change the weights of stored sources only")
    weights = weights_by_name(weights, [s.name for s in pipeline.config.sources])
    last = pipeline.num_steps if pipeline.num_steps is not None else pipeline.step_limit - 1
    if isinstance(at_step, bool) or not isinstance(at_step, int) or not 0 <= at_step <= last:
        raise ConfigError(f"set_weights: at_step must be a step in [0, {last}], not {at_step!r}")
    if pipeline.history and at_step < pipeline.history[-1]["until_step"]:
        raise ConfigError(f"set_weights at step {at_step}: a change at step {pipeline.history[-1]['until_step']} "
                          "is already set; make changes in the order of their steps")
    # (skips and batch-size changes made at resume are in the state's records)
    return rebuilt(pipeline, resume_from=pipeline.state_at(at_step), allow_mixture_change=True, _live=weights)


def adopting(pipeline, state: dict):
    """`pipeline`, or where `state` was saved after weights were set live (which a pipeline
    built from the config file does not know), the one that resumes it: what restoring a
    checkpoint into an iterator made before the checkpoint was read needs."""
    if saved_live(state) is None or state.get("fingerprint") == pipeline.fingerprint:
        return pipeline
    return rebuilt(pipeline, resume_from=state)


def rebuilt(pipeline, **resume):
    """A pipeline like `pipeline` (shard, threads, cache, dtype) built with `resume`'s arguments."""
    p = pipeline
    return type(p)(p.config, p.shard_index, p.shard_count, num_threads=p.num_threads, prefetch=p.prefetch,
                   worker_count=p.worker_count, fetch_ahead=p.fetch_ahead, tokenize_threads=p.tokenize_threads,
                   cache_dir=p.cache_dir, dtype=p.dtype, progress=False, **resume)


def source_losses(token_losses, source_id, loss_mask, num_sources: int):
    """Each source's mean loss over a batch's trained tokens ([num_sources]; NaN for a source
    with none in the batch): the signal online mixing (DoReMi-style reweighting) feeds back to
    `set_weights`. `token_losses` and `loss_mask` are [rows, seq_len], `source_id` [rows] (the
    batch's own). numpy; `forge_grain.bridges.torch.source_losses` and `forge_grain.bridges.jax.source_losses` do the
    same on their arrays, on device."""
    mask = np.asarray(loss_mask, dtype=np.float64)
    per_row = (np.asarray(token_losses, dtype=np.float64) * mask).sum(axis=1)
    ids = np.asarray(source_id).astype(np.int64)
    total = np.bincount(ids, weights=per_row, minlength=num_sources)
    count = np.bincount(ids, weights=mask.sum(axis=1), minlength=num_sources)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / count, np.nan)
