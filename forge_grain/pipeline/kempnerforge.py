"""KempnerForge job files (TOML) read as a `DataConfig`, with KempnerForge's meaning.

`DataConfig.from_kempnerforge(path)` (and `DataConfig.from_toml`, which recognises such a
file) takes a KempnerForge job TOML as it is:

- `[data]`: `dataset_path` + `file_pattern` (pre-tokenized `.npy`/`.bin` files; a raw `.bin`
  takes its width from a `dtype` key, else the local tokenizer's vocabulary, else `[model]
  vocab_size` (KempnerForge's default 32,000): uint16 up to 65,536 ids, uint32 beyond, checked
  against the bytes; never from the file size), `tokenizer_path` (local files only: a Hub
  name is refused, with how to download it), `pack_sequences` (documents found by the
  tokenizer's EOS, so segment ids and the loss mask stop at document ends; without it, plain
  concatenation of each file), `hf_dataset_name` / `hf_dataset_config` / `hf_dataset_split` /
  `hf_dataset_text_field` / `hf_streaming`, `datasets = [{path, weight, name, hf_name,
  hf_config}]` (a source without `name` is named by its `path` or `hf_name` as written, as
  KempnerForge names it), `mix_temperature`, `phases = [{start_step, dataset_weights,
  lr_scale}]`, `anneal_start_step` + `anneal_weights` (0 = disabled; not with `phases`), and
  the loader keys `num_workers`, `pin_memory`, `prefetch_factor`;
- `[train]`: `seq_len`, `data_seed` (else `seed`: KempnerForge's effective data seed),
  `max_steps`, and the global batch, `batch_size` (per device) × `grad_accum_steps` × the
  data-parallel size;
- `[model]`: `vocab_size`, for the width of raw files;
- `[distributed]`: the data-parallel size is `dp_replicate × dp_shard`; `dp_shard = -1`
  (KempnerForge's default) means the world size divided by `dp_replicate × tp × pp × cp ×
  ep`, the world size being `world_size=` or the launcher's (`WORLD_SIZE`, or 1).

Other tables (`[optimizer]`, ...) and keys are the training loop's and are ignored; a
vision-language job (`[vlm]`, `[video]`) is refused: forge-grain has no image path. An
unknown key in `[data]`, or a value of the wrong type, is an error naming it. Phases have
`train.py`'s meaning: a source a phase does not name takes its original weight, and a phase
takes effect from step max(start_step, 1) (KempnerForge checks phases after each step).
Every source is packed by concatenation ("concat"), as KempnerForge packs; Hugging Face
documents end with EOS and start without BOS, as there. Relative paths are taken from the
working directory, as KempnerForge does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from forge_grain.errors import PrepareError
from forge_grain.pipeline.config import ConfigError, DataConfig, Phase, SourceConfig, register_reader, unknown_keys

# [data] keys and their types (KempnerForge's DataConfig, plus `dtype`/`eos_id` for raw files)
DATA_KEYS: dict[str, tuple[type, ...]] = {
    "dataset_path": (str,), "file_pattern": (str,), "tokenizer_path": (str,), "num_workers": (int,),
    "pin_memory": (bool,), "prefetch_factor": (int,), "hf_dataset_name": (str,), "hf_dataset_config": (str,),
    "hf_dataset_split": (str,), "hf_dataset_text_field": (str,), "hf_dataset_image_field": (str,),
    "hf_dataset_prompt_field": (str,), "hf_image_size": (int,), "hf_streaming": (bool,), "pack_sequences": (bool,),
    "datasets": (list,), "mix_temperature": (int, float), "phases": (list,), "anneal_start_step": (int,),
    "anneal_weights": (dict,), "dtype": (str,), "eos_id": (int,),
}
SOURCE_KEYS = {"path": (str,), "weight": (int, float), "name": (str,), "hf_name": (str,), "hf_config": (str,)}
PHASE_KEYS = {"start_step": (int,), "dataset_weights": (dict,), "lr_scale": (int, float)}
TRAIN_KEYS = {"seq_len": (int,), "seed": (int,), "data_seed": (int,), "max_steps": (int,), "batch_size": (int,),
              "grad_accum_steps": (int,)}
MODEL_KEYS = {"vocab_size": (int,)}
DISTRIBUTED_KEYS = {name: (int,) for name in ("dp_shard", "dp_replicate", "tp", "pp", "cp", "ep")}
TRAIN_DEFAULTS = {"seq_len": 2048, "seed": 42, "max_steps": 100_000, "batch_size": 8, "grad_accum_steps": 1}
MODEL_DEFAULTS = {"vocab_size": 32_000}  # KempnerForge's ModelConfig
# tables of a vision-language job: forge-grain has no image path
VISION_TABLES = ("vlm", "video", "vision_encoder", "adapter")

# a [data] table with one of these is KempnerForge's, not forge-grain's
MARKERS = {"dataset_path", "hf_dataset_name", "datasets", "pack_sequences", "tokenizer_path", "file_pattern",
           "hf_dataset_split", "anneal_start_step"}


def is_kempnerforge(doc: dict) -> bool:
    """Whether a parsed TOML document is a KempnerForge job file."""
    data = doc.get("data")
    return isinstance(data, dict) and ("train" in doc or bool(MARKERS & set(data)))


def config_from_job(doc: dict, where: str = "job", world_size: int | None = None) -> DataConfig:
    vision = [f"[{t}]" for t in VISION_TABLES if t in doc]
    if vision:
        raise ConfigError(f"{where}: a vision-language job ({', '.join(vision)}): forge-grain reads text and token "
                          "data only and has no image or video path; train this job with KempnerForge's own loader")
    data = _table(doc, "data", DATA_KEYS, where, strict=True)
    train = {**TRAIN_DEFAULTS, **_table(doc, "train", TRAIN_KEYS, where, strict=False)}
    model = {**MODEL_DEFAULTS, **_table(doc, "model", MODEL_KEYS, where, strict=False)}
    dist = _table(doc, "distributed", DISTRIBUTED_KEYS, where, strict=False)
    sources = _sources(data, where, model["vocab_size"])
    names = [s.name for s in sources]
    loader = {k: data[k] for k in ("num_workers", "pin_memory", "prefetch_factor") if k in data}
    phases = _phases(data, sources, names, where)
    try:
        return DataConfig(
            sources=sources,
            seq_len=train["seq_len"],
            global_batch_size=train["batch_size"] * train["grad_accum_steps"] * data_parallel_size(dist, world_size),
            seed=train.get("data_seed", train["seed"]),  # KempnerForge's effective_data_seed
            num_epochs=None,  # KempnerForge trains for max_steps, repeating its data as needed
            max_steps=train["max_steps"],
            mix_temperature=data.get("mix_temperature", 1.0),
            phases=phases,
            loader=loader,
        )
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def data_parallel_size(dist: dict, world_size: int | None = None) -> int:
    """dp_replicate × dp_shard, with dp_shard = -1 resolved from the world size; every size
    positive, and their product the world size when it is known (KempnerForge checks it)."""
    for key, value in dist.items():
        if value < 1 and not (key == "dp_shard" and value == -1):
            raise ConfigError(f"distributed.{key} must be a positive integer" + (" or -1" if key == "dp_shard" else "")
                              + f", got {value}")
    replicate, shard = dist.get("dp_replicate", 1), dist.get("dp_shard", -1)
    other = dist.get("tp", 1) * dist.get("pp", 1) * dist.get("cp", 1)
    world = _world_size(world_size)
    if shard != -1:
        if world is not None and replicate * shard * other != world:
            raise ConfigError(f"distributed: dp_replicate*dp_shard*tp*pp*cp = {replicate * shard * other} is not the "
                              f"world size {world}")
        return replicate * shard
    world = 1 if world is None else world
    other *= replicate * dist.get("ep", 1)
    if world % other:
        raise ConfigError(f"distributed: world size {world} is not divisible by dp_replicate*tp*pp*cp*ep = {other}")
    return replicate * (world // other)


def _world_size(given: int | None) -> int | None:
    """`world_size=`, else the launcher's WORLD_SIZE, else unknown."""
    if given is not None:
        return given
    text = os.environ.get("WORLD_SIZE")
    if text is None:
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise ConfigError(f"the WORLD_SIZE environment variable is {text!r}, not a positive integer")
    return int(text)


def _table(doc: dict, name: str, keys: dict, where: str, strict: bool) -> dict:
    return _checked(doc.get(name, {}), keys, where, f"[{name}]", name, strict)


def _checked(value: Any, keys: dict, where: str, label: str, prefix: str, strict: bool = True) -> dict:
    """The entries of table `value` that `keys` names, each of its type; with `strict`, any
    other entry is an error. Messages name `label` (the table) or `prefix.key`."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {label} must be a table, got {value!r}")
    unknown = sorted(set(value) - set(keys)) if strict else []
    if unknown:
        raise ConfigError(f"{where}: {unknown_keys(unknown, keys, label)}")
    out = {}
    for key, kinds in keys.items():
        if key in value:
            _check_type(f"{where}: {prefix}.{key}", value[key], kinds)
            out[key] = value[key]
    return out


def _check_type(what: str, value: Any, kinds: tuple[type, ...]) -> None:
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ConfigError(f"{what} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")


def _sources(data: dict, where: str, vocab_size: int) -> list[SourceConfig]:
    entries = data.get("datasets") or []
    if not entries:
        if data.get("dataset_path"):
            entries = [{"path": data["dataset_path"]}]
        elif data.get("hf_dataset_name"):
            entries = [{"hf_name": data["hf_dataset_name"], "hf_config": data.get("hf_dataset_config", "")}]
        else:
            raise ConfigError(f"{where}: [data] names no data: give dataset_path, hf_dataset_name or datasets")
    sources = []
    for i, e in enumerate(entries):
        _checked(e, SOURCE_KEYS, where, f"data.datasets[{i}]", f"data.datasets[{i}]")
        if bool(e.get("path")) == bool(e.get("hf_name")):
            raise ConfigError(f"{where}: data.datasets[{i}] needs exactly one of path and hf_name")
        if e.get("weight", 1.0) <= 0:
            raise ConfigError(f"{where}: data.datasets[{i}].weight must be positive, got {e['weight']!r}")
        sources.append(_path_source(e, data, where, vocab_size) if e.get("path") else _hf_source(e, data))
    return sources


def _path_source(e: dict, data: dict, where: str, vocab_size: int) -> SourceConfig:
    path = e["path"]
    name = e.get("name") or path  # KempnerForge names a source by its path as written
    common = dict(name=name, path=path, weight=float(e.get("weight", 1.0)), strategy="concat")
    if (Path(path) / "manifest.json").exists():  # a forge-grain store carries its own dtype and ids
        return SourceConfig(**common)
    tokenizer = data.get("tokenizer_path") or None
    # a local tokenizer, or a Hub name found in the Hugging Face cache (or downloaded): its vocabulary gives the
    # width of raw files; a Hub name that cannot be had is needed only for pack_sequences' EOS (an error there)
    local_tokenizer = tokenizer if tokenizer and _available(tokenizer) else None
    eos_id = data.get("eos_id")
    if data.get("pack_sequences") and eos_id is None:
        if tokenizer is None:
            raise ConfigError(f"{where}: pack_sequences needs the EOS id that ends documents in {path}: give "
                              "tokenizer_path (or eos_id)")
        from forge_grain.tokenizer import load_tokenizer

        eos_id = load_tokenizer(tokenizer).eos_id
        if eos_id is None:
            raise ConfigError(f"{where}: the tokenizer {tokenizer} has no EOS token; give eos_id for pack_sequences")
    # KempnerForge's prepare_data.py cuts shards at a token count, inside documents, and writes no EOS:
    # its files need not begin or end a document
    packed = bool(data.get("pack_sequences"))
    # the width of raw .bin files: a declared dtype, else the model's vocabulary (ids must fit its
    # embedding), checked against the bytes; never guessed from the file size as KempnerForge does
    dtype = data.get("dtype")
    return SourceConfig(**common, file_pattern=data.get("file_pattern", "*.npy"), tokenizer=local_tokenizer,
                        dtype=dtype, vocab_size=None if dtype or local_tokenizer else vocab_size,
                        eos_id=eos_id if packed else None, whole_documents=False if packed else None)


def _available(tokenizer: str) -> bool:
    """Whether the tokenizer can be loaded here: a local path, or a Hub name that resolves."""
    from forge_grain.tokenizer import resolve

    try:
        return resolve(tokenizer)[0].exists()
    except PrepareError:
        return False


def _hf_source(e: dict, data: dict) -> SourceConfig:
    return SourceConfig(
        name=e.get("name") or e["hf_name"], hf_dataset=e["hf_name"], hf_config=e.get("hf_config") or None,
        weight=float(e.get("weight", 1.0)), split=data.get("hf_dataset_split", "train"),
        text_field=data.get("hf_dataset_text_field", "text"), tokenizer=data.get("tokenizer_path") or None,
        hf_streaming=data.get("hf_streaming", False), strategy="concat", add_bos=False, add_eos=True,
    )


def _phases(data: dict, sources: list[SourceConfig], names: list[str], where: str) -> list[Phase]:
    """KempnerForge's phases as forge-grain's, with `train.py`'s meaning: a source a phase does
    not name takes its original weight (not the previous phase's); KempnerForge checks its
    phases after each step, so one at step 0 (or 1) takes effect from step 1, and of phases
    reached together the last wins."""
    raw = data.get("phases") or []
    if raw and data.get("anneal_start_step", 0) > 0:
        raise ConfigError(f"{where}: cannot use both data.phases and data.anneal_start_step (KempnerForge refuses "
                          "them together too): use phases for multi-phase scheduling")
    if data.get("anneal_start_step", 0) > 0 and data.get("anneal_weights"):
        raw = [{"start_step": data["anneal_start_step"], "dataset_weights": data["anneal_weights"]}]
    original = {s.name: s.weight for s in sources}
    by_step: dict[int, Phase] = {}
    for i, p in enumerate(raw):
        _checked(p, PHASE_KEYS, where, f"data.phases[{i}]", f"data.phases[{i}]")
        weights = p.get("dataset_weights", {})
        for name, w in weights.items():
            _check_type(f"{where}: data.phases[{i}].dataset_weights.{name}", w, (int, float))
            if w < 0:
                raise ConfigError(f"{where}: data.phases[{i}].dataset_weights.{name} must be >= 0, got {w}")
        start, lr_scale = p.get("start_step", 0), float(p.get("lr_scale", 1.0))
        if start < 0 or lr_scale <= 0:
            raise ConfigError(f"{where}: data.phases[{i}]: start_step must be >= 0 and lr_scale > 0")
        if i and start <= raw[i - 1].get("start_step", 0):
            raise ConfigError(f"{where}: data.phases start_steps must increase strictly (as KempnerForge requires)")
        weights = {_source_named(k, sources, f"{where}: data.phases[{i}].dataset_weights"): float(v)
                   for k, v in weights.items()}
        at = max(start, 1)
        by_step[at] = Phase(at, {**original, **weights}, lr_scale)
    return list(by_step.values())


def _source_named(key: str, sources: list[SourceConfig], where: str) -> str:
    """The source a phase's weight names: by its name (KempnerForge's: `name`, else the path or
    Hub name as written), or by the last part of its path when that is one source's (how job
    files written for forge-grain's earlier naming, and people, call a source: `data` for
    `/scratch/corpus/data`). A name that is no source's is an error, not a weight ignored."""
    if any(s.name == key for s in sources):
        return key
    by_tail = [s.name for s in sources if s.path is not None and Path(str(s.path).rstrip("/")).name == key]
    if len(by_tail) == 1:
        return by_tail[0]
    names = [s.name for s in sources]
    if by_tail:
        raise ConfigError(f"{where}: {key!r} is the last part of several sources' paths {by_tail}: name them "
                          "(data.datasets[].name) and use those names")
    raise ConfigError(f"{where} names unknown source(s) [{key!r}] (sources: {names})")


register_reader("kempnerforge", is_kempnerforge, config_from_job)
