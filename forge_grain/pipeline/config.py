"""`DataConfig`: sources, weights and phases, batch geometry and seed; from TOML or Python."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from forge_grain.errors import ConfigError
from forge_grain.pipeline.batches import MAX_BATCH, MAX_SEQ_LEN, ScheduleError, check_segments, ramp_segments
from forge_grain.sources.config import SourceConfig, check_weight, check_weight_sum, positive_int

__all__ = ["ConfigError", "DataConfig", "Phase", "SourceConfig", "register_reader"]

LOADER_KEYS = {"num_workers": int, "pin_memory": bool, "prefetch_factor": int}


# readers of other systems' job files: name -> (recognises(parsed TOML), read(parsed TOML, where=...));
# each registers itself (`forge_grain.pipeline.kempnerforge`), so this module imports none of them
READERS: dict = {}


def register_reader(name: str, recognises, read) -> None:
    """Let `DataConfig.from_toml` read another system's job files (see `READERS`)."""
    READERS[name] = (recognises, read)


@dataclasses.dataclass
class Phase:
    """A change of the mixture at a step (a `[[phases]]` table)."""

    start_step: int
    """The first step mixed with this phase's weights; after 0, and increasing from one
    phase to the next.
    Example: start_step = 10000"""

    weights: dict[str, float]
    """Mixing weights by source name, renormalized (and tempered by `mix_temperature`);
    sources not named get 0.
    Example: weights = { web = 0.3, code = 0.7 }"""

    lr_scale: float = 1.0
    """A learning-rate factor for the trainer (`Pipeline.phase_at(step)` reports it); the
    data ignores it.
    Example: lr_scale = 0.1"""


@dataclasses.dataclass
class DataConfig:
    """What the data pipeline produces: every batch is a pure function of this and the step.

    Read from TOML (`DataConfig.from_toml`: keys at the top level or under `[data]`; a
    KempnerForge job file is read with KempnerForge's meaning) or built in Python. Each
    field's docstring is its entry in `docs/config.md` (generated; see
    `forge_grain.pipeline.reference`); "it is data" marks the fields that change which
    batches a run yields, so a state saved under other values is refused.
    """

    sources: list[SourceConfig]
    """The corpora, one `[[sources]]` table each (keys: see SourceConfig below); at least
    one, with unique names.
    Example:
    [[sources]]
    name = "web"
    path = "data/web"
    weight = 0.7"""

    seq_len: int
    """Tokens per row: the model's context length; every batch array is
    `[rows, seq_len]`.
    Example: seq_len = 2048"""

    global_batch_size: int
    """Rows per step across all shards. Shard k of n receives rows [k·B/n, (k+1)·B/n) of
    each global batch (n must divide it), so the global batch does not depend on n and a
    run resumes on any shard count that divides it.
    Example: global_batch_size = 512"""

    seed: int = 0
    """Decides every shuffle and every draw of the mixture: with the rest of the config it
    fixes every batch.
    Example: seed = 1234"""

    num_epochs: float | None = 1
    """Passes over all sources' rows together: an epoch is `total rows //
    global_batch_size` steps and the run is `floor(num_epochs × that)` steps, so whole
    epochs tile the steps. A source that runs out before then repeats with a fresh
    shuffle. `inf` in TOML (None in Python) is unlimited; fractions are exact (0.29 is
    29/100).
    Example: num_epochs = 2"""

    mix_temperature: float = 1.0
    """Weights w become w^(1/T), renormalized: 1.0 mixes as given, larger is more uniform.
    Example: mix_temperature = 2.0"""

    phases: list[Phase] = dataclasses.field(default_factory=list)
    """Mixture changes at steps (keys: see Phase below). A phase that starts at or past
    the last step is warned about (it never fires).
    Example:
    [[phases]]
    start_step = 10000
    weights = { web = 0.3, code = 0.7 }"""

    anneal_start_step: int | None = None
    """A shortcut for one more phase: from this step on, mix with `anneal_weights` (give
    both or neither).
    Example:
    anneal_start_step = 90000
    anneal_weights = { code = 1.0 }"""

    anneal_weights: dict[str, float] | None = None
    """The weights from `anneal_start_step` on (sources not named get 0).
    Example:
    anneal_weights = { code = 1.0 }
    anneal_start_step = 90000"""

    max_steps: int | None = None
    """Stop after this many steps, or at the end of `num_epochs`, whichever comes first.
    Example: max_steps = 100000"""

    batch_sizes: list[list[int]] | None = None
    """A batch-size schedule: [start_step, global batch size] pairs, the first at step 0,
    the last at `global_batch_size` (the full batch). The rows and their order do not
    change, only how many a step takes: step s covers rows [R(s), R(s + 1)), R the sum of
    the sizes before it. Every size must divide among the shards (see
    `forge_grain.pipeline.batches`).
    Example: batch_sizes = [[0, 128], [1000, 256], [2000, 512]]"""

    batch_ramp: dict[str, int] | None = None
    """A batch-size ramp in tokens (Megatron's `rampup_batch_size`): from `start` rows a
    step, `increment` more each time another equal part of `tokens` tokens is trained,
    up to `global_batch_size`; `increment` must divide the difference. Each size holds
    for whole steps. Give this or `batch_sizes`, not both.
    Example: batch_ramp = { start = 128, increment = 128, tokens = 2_000_000_000 }"""

    seq_lens: list[list[int]] | None = None
    """A sequence-length schedule: [start_step, length] pairs, the first at step 0, the
    last at `seq_len` (the full length). Rows from a start step on are that long; at each
    change the rest of every source's epoch (the documents not yet trained) is planned
    afresh at the new length, so each document is still trained once per epoch and the
    steps before stay what they were (see `forge_grain.packing.lengths`). Batch sizes stay
    in rows: a step trains its batch size times its length (pair it with `batch_sizes` to
    keep tokens per step constant). Stored sources only; the run is counted in steps
    (`max_steps`, with `num_epochs = inf`), as an epoch's rows change with the length.
    Example:
    seq_lens = [[0, 512], [2000, 1024], [6000, 2048]]
    num_epochs = inf
    max_steps = 20000"""

    plan_chunk_docs: int | None = None
    """A store of more documents is planned a chunk of this many at a time (default about
    4 M; see `forge_grain.packing.chunked`), in parallel and in bounded memory. It changes
    the plan, so it is data.
    Example: plan_chunk_docs = 1000000"""

    max_segments_per_row: int | None = None
    """At most this many segments (documents or parts of one) in a row, for attention
    kernels that need a bound (MaxText, TransformerEngine); rows that reach it are padded
    (`forge-grain inspect STORE --seq-len N --max-segments K` shows the fill it costs). It
    is data.
    Example: max_segments_per_row = 32"""

    canonical_streams: int | None = None
    """Streaming sources: their documents are dealt to `canonical_streams ×
    canonical_workers` canonical streams (see `forge_grain.sources.streaming`); a state
    restores exactly on any shard count dividing it. Default: the shard count of the first
    run, recorded in its states. It is data.
    Example: canonical_streams = 8"""

    canonical_workers: int = 1
    """Streaming sources: in the torch bridge, any number of DataLoader workers dividing
    this reads the canonical streams in parallel. It is data.
    Example: canonical_workers = 2"""

    loader: dict = dataclasses.field(default_factory=dict)
    """DataLoader settings a KempnerForge job file carries (`num_workers`, `pin_memory`,
    `prefetch_factor`), kept for the training script to pass to its DataLoader; they do
    not change the data, and the pipeline does not read them.
    Example: loader = { num_workers = 2, pin_memory = true }"""

    def __post_init__(self) -> None:
        if self.num_epochs == float("inf"):  # TOML cannot say None: `num_epochs = inf` means unlimited
            self.num_epochs = None
        self.sources = [s if isinstance(s, SourceConfig) else _source(s, i) for i, s in enumerate(self.sources)]
        self.phases = [p if isinstance(p, Phase) else _phase(p, i) for i, p in enumerate(self.phases)]
        self.validate()

    # -- loading ----------------------------------------------------------------------------

    @classmethod
    def from_toml(cls, path: str | Path, world_size: int | None = None) -> "DataConfig":
        """Read a TOML file: keys at the top level or under a `[data]` table.

        Relative source paths are taken relative to the file's directory. A KempnerForge job
        file (a `[train]` table, or KempnerForge keys such as `dataset_path` in `[data]`) is
        read with KempnerForge's meaning (see `from_kempnerforge`); `world_size` is for such
        job files (a forge-grain config states its global batch).
        """
        path = Path(path)
        d = _read_toml(path)
        for recognises, read in READERS.values():  # other systems' job files, read with their meaning
            if recognises(d):
                return read(d, where=str(path), world_size=world_size)
        d = d.get("data", d)
        cfg = cls.from_dict(d, where=str(path))
        for s in cfg.sources:
            s.path = _relative_to(path.parent, s.path, always=True)
            s.tokenizer = _relative_to(path.parent, s.tokenizer)
            if isinstance(s.hf_data_files, str):
                s.hf_data_files = _relative_to(path.parent, s.hf_data_files)
            elif isinstance(s.hf_data_files, list):
                s.hf_data_files = [_relative_to(path.parent, f) for f in s.hf_data_files]
        return cfg

    @classmethod
    def from_kempnerforge(cls, path: str | Path, world_size: int | None = None) -> "DataConfig":
        """A KempnerForge job TOML read as it is (see `forge_grain.pipeline.kempnerforge`); `world_size`
        resolves `dp_shard = -1` (default: `WORLD_SIZE`, or 1)."""
        _, read = READERS["kempnerforge"]
        return read(_read_toml(Path(path)), where=str(path), world_size=world_size)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config") -> "DataConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{where}: {unknown_keys(unknown, known)}")
        for key in ("sources", "seq_len", "global_batch_size"):
            if key not in d:
                raise ConfigError(f"{where}: missing required key '{key}'")
        try:
            return cls(**d)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # -- checking ---------------------------------------------------------------------------

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError("sources: at least one source is needed")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"sources: names must be unique, got {names}")
        for i, s in enumerate(self.sources):
            s.check(f"sources[{i}]")
        positive_int("seq_len", self.seq_len)
        positive_int("global_batch_size", self.global_batch_size)
        for key, most in (("seq_len", MAX_SEQ_LEN), ("global_batch_size", MAX_BATCH)):
            if getattr(self, key) > most:
                raise ConfigError(f"{key}: {getattr(self, key):,} is past {most:,}, the largest forge-grain makes (a "
                                  "step's arrays must fit in a host's memory)")
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed: must be an integer, got {self.seed!r}")
        if self.num_epochs is not None and not (isinstance(self.num_epochs, (int, float)) and self.num_epochs > 0):
            raise ConfigError(f"num_epochs: must be positive (or None for unlimited), got {self.num_epochs!r}")
        if self.max_steps is not None:
            positive_int("max_steps", self.max_steps)
        if self.plan_chunk_docs is not None:
            positive_int("plan_chunk_docs", self.plan_chunk_docs)
        self._check_batch_schedule()
        if self.seq_lens is not None:
            check_lengths(self, self.seq_lens)
        if self.max_segments_per_row is not None:
            positive_int("max_segments_per_row", self.max_segments_per_row)
        if self.canonical_streams is not None:
            positive_int("canonical_streams", self.canonical_streams)
        positive_int("canonical_workers", self.canonical_workers)
        unknown = sorted(set(self.loader) - set(LOADER_KEYS))
        if unknown:
            raise ConfigError(f"loader: {unknown_keys(unknown, LOADER_KEYS)}")
        for key, value in self.loader.items():
            if not isinstance(value, LOADER_KEYS[key]) or (key != "pin_memory" and isinstance(value, bool)):
                raise ConfigError(f"loader.{key}: must be {LOADER_KEYS[key].__name__}, got {value!r}")
        if not (isinstance(self.mix_temperature, (int, float)) and self.mix_temperature > 0):
            raise ConfigError(f"mix_temperature: must be positive, got {self.mix_temperature!r}")
        check_weight_sum("sources", [s.weight for s in self.sources])
        if (self.anneal_start_step is None) != (self.anneal_weights is None):
            raise ConfigError("anneal_start_step and anneal_weights: give both or neither")
        _check_phases(self.all_phases(), len(self.phases), names)

    def _check_batch_schedule(self) -> None:
        if self.batch_sizes is not None and self.batch_ramp is not None:
            raise ConfigError("batch_sizes and batch_ramp: give one schedule, not both")
        if self.batch_sizes is not None:
            try:
                segments = check_segments(self.batch_sizes)
            except ScheduleError as e:
                raise ConfigError(str(e)) from None
            if segments[-1][1] != self.global_batch_size:
                raise ConfigError(f"batch_sizes ends at {segments[-1][1]} rows a step (from step {segments[-1][0]}); "
                                  f"its last size must be global_batch_size ({self.global_batch_size}), the full batch")
        if self.batch_ramp is not None:
            r = self.batch_ramp
            if not isinstance(r, dict) or set(r) != {"start", "increment", "tokens"}:
                raise ConfigError(f"batch_ramp: {{start = rows, increment = rows, tokens = N}}, not {r!r:.100}")
            for key in ("start", "increment", "tokens"):
                positive_int(f"batch_ramp.{key}", r[key])
            if r["start"] >= self.global_batch_size or (self.global_batch_size - r["start"]) % r["increment"]:
                raise ConfigError(
                    f"batch_ramp: from start {r['start']} the increment {r['increment']} must reach "
                    f"global_batch_size {self.global_batch_size} exactly (start below it, increment dividing "
                    f"{self.global_batch_size - r['start']})")

    def seq_len_schedule(self) -> list[tuple[int, int]]:
        """[(start_step, length)]: the config's row lengths by step (one entry without a schedule)."""
        return check_segments(self.seq_lens, "seq_lens") if self.seq_lens is not None else [(0, self.seq_len)]

    def batch_schedule(self) -> list[tuple[int, int]]:
        """[(start_step, global batch size)]: the config's batch sizes by step (one entry
        without a schedule)."""
        if self.batch_sizes is not None:
            return check_segments(self.batch_sizes)
        if self.batch_ramp is not None:
            r = self.batch_ramp
            return ramp_segments(r["start"], r["increment"], r["tokens"], self.global_batch_size, self.seq_len)
        return [(0, self.global_batch_size)]

    def all_phases(self) -> list[Phase]:
        """The phases, with the anneal shortcut appended as one more."""
        extra = [Phase(self.anneal_start_step, dict(self.anneal_weights))] if self.anneal_weights else []
        return list(self.phases) + extra

    def schedule(self) -> list[tuple[int, list[float]]]:
        """[(start_step, normalized weights by source position)], temperature applied."""
        names = [s.name for s in self.sources]
        raw = [(0, [s.weight for s in self.sources])]
        raw += [(p.start_step, [float(p.weights.get(n, 0.0)) for n in names]) for p in self.all_phases()]
        out = []
        for step, ws in raw:
            ws = [w ** (1.0 / self.mix_temperature) if w > 0 else 0.0 for w in ws]
            total = sum(ws)
            out.append((step, [w / total for w in ws]))
        return out


def check_lengths(config: DataConfig, segments) -> None:
    """What a run whose rows change length needs: `segments` ([start_step, length] pairs; the
    config's `seq_lens`, or after a change at resume the lengths trained, then the config's)
    checked, the last at `seq_len`, and a run counted in steps over stored sources."""
    c = config
    try:
        segments = check_segments(segments, "seq_lens")
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
    if segments[-1][1] != c.seq_len:
        raise ConfigError(f"seq_lens ends at {segments[-1][1]} tokens a row (from step {segments[-1][0]}); its "
                          f"last length must be seq_len ({c.seq_len}), the full length")
    if len({n for _, n in segments}) == 1:
        return
    if c.num_epochs is not None or c.max_steps is None:
        raise ConfigError("seq_lens: a run whose rows change length is counted in steps, not epochs (an "
                          "epoch's rows change with the length): set max_steps and num_epochs = inf")
    if c.batch_ramp is not None:
        raise ConfigError("seq_lens with batch_ramp: the ramp counts tokens at one length; give batch_sizes")
    bad = [s.name for s in c.sources if s.hf_streaming or s.stride is not None]
    if bad:
        raise ConfigError(f"seq_lens: sources {bad} are streaming or set a stride; a sequence-length schedule "
                          "replans stored sources at each length (streaming sources and strides are tied "
                          "to one length)")


def _check_phases(phases: list[Phase], written: int, names: list[str]) -> None:
    """Phases start after step 0, in increasing order, with a positive lr_scale and weights
    of known sources (the last `len(phases) - written` are the anneal shortcut's)."""
    last = 0
    for i, p in enumerate(phases):
        where = f"phases[{i}]" if i < written else "anneal_weights"
        if not isinstance(p.start_step, int) or p.start_step <= last:
            raise ConfigError(
                f"{where}.start_step: phases must start after step 0 and in increasing order "
                f"(got {p.start_step!r} after {last})"
            )
        last = p.start_step
        if isinstance(p.lr_scale, bool) or not isinstance(p.lr_scale, (int, float)) or not p.lr_scale > 0:
            raise ConfigError(f"{where}.lr_scale: must be a positive number, got {p.lr_scale!r}")
        for name, w in p.weights.items():
            if name not in names:
                raise ConfigError(f"{where}.weights: unknown source {name!r} (sources: {names})")
            check_weight(f"{where}.weights.{name}", w)
        check_weight_sum(f"{where}.weights", list(p.weights.values()))


def _source(d: Any, i: int) -> SourceConfig:
    if not isinstance(d, dict):
        raise ConfigError(f"sources[{i}]: expected a table, got {d!r}")
    known = {f.name for f in dataclasses.fields(SourceConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"sources[{i}]: {unknown_keys(unknown, known)}")
    if "name" not in d:
        raise ConfigError(f"sources[{i}]: missing required key 'name'")
    return SourceConfig(**d)


def _phase(d: Any, i: int) -> Phase:
    if (not isinstance(d, dict) or not {"start_step", "weights"} <= set(d) <= {"start_step", "weights", "lr_scale"}
            or not isinstance(d["weights"], dict)):
        raise ConfigError(
            f"phases[{i}]: expected {{start_step = N, weights = {{name = w, ...}}, lr_scale = x (optional)}}, got {d!r}"
        )
    return Phase(d["start_step"], dict(d["weights"]), d.get("lr_scale", 1.0))


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(read_capped(path, MAX_CONFIG_BYTES, "config file").decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None


MAX_CONFIG_BYTES = 16 << 20  # a config is kilobytes; a file past this is not one (`/dev/zero` read forever)


def read_capped(path: Path, cap: int, what: str) -> bytes:
    """The bytes of `path`, a regular file of at most `cap` bytes: else a `ConfigError` naming it
    (a device, a FIFO or a huge file would be read into memory without end); a file that cannot
    be read raises its `OSError`."""
    import stat

    st = path.stat()  # (a missing file: its OSError, as reading it gave)
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path}: not a regular file; a {what} is a file")
    if st.st_size > cap:
        raise ConfigError(f"{path}: {st.st_size:,} bytes, past the {cap:,} a {what} may have")
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise ConfigError(f"{path}: past the {cap:,} bytes a {what} may have")
    return data


def unknown_keys(unknown, known, table: str = "") -> str:
    """'unknown key(s) [...] in TABLE', with the close match of each mistyped key ("did you
    mean 'weight'?"), then every known key."""
    import difflib

    close = {k: difflib.get_close_matches(str(k), sorted(map(str, known)), n=1, cutoff=0.6) for k in unknown}
    hints = "; ".join(f"{k!r}: did you mean {m[0]!r}?" for k, m in close.items() if m)
    return (f"unknown key(s) {sorted(unknown)}{f' in {table}' if table else ''}{f' ({hints})' if hints else ''} "
            f"(known: {sorted(known)})")


def _relative_to(base: Path, p: str | None, always: bool = False) -> str | None:
    """A relative local path in a TOML file is relative to the file. Strings that name no
    local file (a hub dataset, a tokenizer name) stay as they are unless `always`."""
    if p is None or Path(p).is_absolute() or "://" in p:
        return p
    if always or (base / p).exists() or any(c in p for c in "*?["):
        return str(base / p)
    return p


