"""Describing a run before it starts: what `forge-grain plan` prints, and the warnings a
pipeline gives when it is built.

Everything here is read off the row order and the sources' plans: no token is read and no
batch is made, so a plan of a run of a million steps takes as long as one of ten.
"""

from __future__ import annotations

import warnings

from forge_grain.packing.lengths import LengthSchedule
from forge_grain.packing.packed import PackedDataset
from forge_grain.pipeline.config import ConfigError, DataConfig
from forge_grain.pipeline.fetch_estimate import FETCH_WARNING, epoch_fetch

REPEAT_WARNING = 4  # `describe` warns about a source read this many times over a run, or more
CROP_WARNING = 0.3  # ... and about one losing this share of its tokens to cropping (bos_bestfit loses ~20% on web text)


def describe(order, steps: int | None = None) -> dict:
    """See `Pipeline.describe`."""
    c = order.config
    end = order.num_steps if steps is None else min(int(steps), order.step_limit)
    used = order.consumed(end) if end is not None else {}
    names = [s.name for s in c.sources]
    phases = [{"start_step": start, "weights": {n: weights.get(n, 0.0) for n in order.source_names},
               "lr_scale": order.phase(start)["lr_scale"], "reached": order.phase_reached(start, end)}
              for start, weights in order.mixed]  # (with the mixture changes a state recorded)
    warn = [f"a phase starting at step {p['start_step']} never takes effect: the run has {end} steps"
            for p in phases if not p["reached"]]
    sources = []
    for name, d in zip(order.source_names, order.mixture.datasets):
        stored = isinstance(d, (PackedDataset, LengthSchedule))
        entry = _source(name, d, used.get(name, {}), streaming=not stored and name in names)
        if stored:
            entry.update(_fetching(d, c.global_batch_size))
        sources.append(entry)
        warn += _source_warnings(entry, end, c.seq_len)
    B = c.global_batch_size
    return {"steps": end, "steps_per_epoch": order.steps_per_epoch, "global_batch_size": B, "seq_len": c.seq_len,
            "tokens_per_step": _most_tokens_a_step(order, end), "batch_sizes": order.batches.to_list(),
            **({"seq_lens": [list(x) for x in order.seq_lens]} if len(order.seq_lens) > 1 else {}),
            "tokens": None if end is None else order.tokens_before(end),
            "phases": phases, "sources": sources, "warnings": warn}


def _most_tokens_a_step(order, end: int | None) -> int:
    """The most tokens a step of the run holds (rows x length), schedules of both included: a
    step where either changes is where it can be largest."""
    starts = {s for s, _ in order.batches.to_list()} | {s for s, _ in order.seq_lens}
    steps = [s for s in starts if end is None or s < end] or [0]
    return max(order.batches.size(s) * order.seq_len_at(s) for s in steps)


def _source(name: str, d, got: dict, streaming: bool) -> dict:
    """One source's entry: its rows per epoch and packing, and what the run takes of it."""
    rows_per_epoch = getattr(d, "num_rows", None)
    stats = getattr(d, "stats", {})  # a streaming source's: its first epoch's windows
    epochs = got.get("epochs")
    if epochs is None and got.get("rows") is not None and rows_per_epoch:
        epochs = got["rows"] / rows_per_epoch  # a streaming source, from its counting pass
    return {"name": name, "strategy": stats.get("strategy"), "rows_per_epoch": rows_per_epoch,
            "tokens_per_epoch": stats.get("tokens"), "fill": stats.get("fill"),
            "cropped_share": stats.get("cropped_share"), "rows": got.get("rows"), "epochs": epochs,
            "trained_tokens": got.get("trained_tokens"), "streaming": streaming,
            "masked": bool(getattr(getattr(d, "store", None), "masked", False))}


def _fetching(d, rows_per_step: int) -> dict:
    """A source read through a bounded cache: its order (`forge_grain.packing.fitted`) and
    what an epoch fetches (`fetch_estimate`)."""
    fetch = epoch_fetch(d, rows_per_step)
    if fetch is None:
        return {}
    fit = getattr(getattr(d, "base", d), "fitted", None)
    order = None if fit is None else {"shuffle_bytes": fit.shuffle_bytes, "window_chunks": fit.window,
                                      "files_together": fit.files_together}
    return {"cache": {**fetch, "fitted_order": order}}


def _source_warnings(s: dict, end: int | None, seq_len: int) -> list[str]:
    """A source never read, losing much to cropping, read many times over, or fetching much
    more than its data an epoch under a cache_limit."""
    out = []
    name, epochs = s["name"], s["epochs"]
    cache = s.get("cache")
    if cache and cache["fetch_bytes"] > FETCH_WARNING * cache["data_bytes"]:
        fix = ("remove shuffle_window or give shuffle_bytes (the order then fits the cache)"
               if cache["fitted_order"] is None else "raise cache_limit (or lower shuffle_bytes)")
        out.append(f"source '{name}' fetches {cache['fetch_bytes'] / cache['data_bytes']:.1f}x its data "
                   f"({cache['data_bytes']:,} bytes) from object storage an epoch under cache_limit "
                   f"{cache['limit']:,}: {fix}")
    if s["rows"] == 0:
        out.append(f"source '{name}' is never read in {end} steps (its weight is 0 in every phase reached)")
    if (s["cropped_share"] or 0) >= CROP_WARNING:
        out.append(f"source '{name}' loses {s['cropped_share']:.1%} of its tokens to cropping under "
                   f"{s['strategy']} at seq_len {seq_len} (its documents are long for the rows): use "
                   "strategy 'bestfit' (windows of long documents: no token lost) or a longer seq_len")
    if s["rows"] != 0 and epochs is not None and epochs >= REPEAT_WARNING:
        out.append(f"source '{name}' is read {epochs:.1f} times over the run ({s['rows']:,} rows of "
                   f"{s['rows_per_epoch']:,}): lower its weight or the step count, or give it more data")
    return out


def warn_unreachable_phases(config: DataConfig, num_steps: int | None) -> None:
    """A phase starting at or after the run's last step never takes effect: say so once, at build."""
    if num_steps is None:
        return
    for p in config.all_phases():
        if p.start_step >= num_steps:
            warnings.warn(
                f"a phase starts at step {p.start_step}, but the pipeline has {num_steps} steps: it never "
                "takes effect (raise num_epochs or max_steps, or move the phase)", stacklevel=3,
            )


def check_tokenizers(config: DataConfig, opened: list) -> None:
    """Mixed sources share one tokenizer (the same vocabulary size, and tokenizer where known)."""
    first, s0 = config.sources[0], opened[0].vocabulary
    for src, o in zip(config.sources[1:], opened[1:]):
        s = o.vocabulary
        a, b = s0["tokenizer_sha256"], s["tokenizer_sha256"]
        if (s0["vocab_size"] is None) != (s["vocab_size"] is None):
            unknown = first if s0["vocab_size"] is None else src
            raise ConfigError(
                f"source '{unknown.name}' has foreign token files of unknown vocabulary size, mixed with sources "
                "that have one; declare its vocab_size (or tokenizer) so the ids can be checked"
            )
        if s0["vocab_size"] != s["vocab_size"] or (a and b and a != b):
            raise ConfigError(
                f"sources '{first.name}' ({first.where()}) and '{src.name}' ({src.where()}) were tokenized "
                f"differently (vocab_size {s0['vocab_size']} vs {s['vocab_size']}, tokenizer {str(a)[:12]} vs "
                f"{str(b)[:12]}); mixed sources must share one tokenizer"
            )
