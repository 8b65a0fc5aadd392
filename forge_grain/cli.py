"""The `forge-grain` command line: prepare, plan, inspect, explain, replay, hashes, config-reference, demo."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import warnings
from pathlib import Path

from forge_grain import __version__
from forge_grain.errors import ForgeGrainError, StateError


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line naming it (and how to get help), exit status 2. No
    abbreviations: `--step 10` is not `--steps 10`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _at_least(low: int):
    """An argparse type: an integer >= `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not {'positive' if low == 1 else f'>= {low}'}")
        return value
    parse.__name__ = "integer"
    return parse


def _output_file(text: str) -> str:
    """An argparse type: a file to write, in a directory that exists, not a directory itself, and
    not something that is not a regular file (written to a temporary and renamed over the path,
    `/dev/full` was replaced by the output, as root)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name to write")
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a regular file (a device, a FIFO or a socket); "
                                         "give a file name to write")
    if not path.resolve().parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the directory {path.parent} does not exist")
    return text


MAX_STATE_BYTES = 16 << 20  # a saved state is kilobytes (a streaming run's, with its streams' positions, more)


def _state_file(text: str) -> tuple[str, dict]:
    """An argparse type: (the path, the saved data state read from it as JSON): a regular file
    of at most `MAX_STATE_BYTES` (`/dev/zero` was read until memory ran out)."""
    from forge_grain.pipeline.config import read_capped

    try:
        return text, json.loads(read_capped(Path(text), MAX_STATE_BYTES, "saved state"))
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text}: cannot read ({e.strerror or e})") from None
    except ForgeGrainError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"{text}: not a saved state (invalid JSON: {e})") from None


def _json_object(text: str) -> dict:
    """An argparse type: a JSON object (fsspec's storage options are keyword arguments)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of options is needed, not {text!r:.80}")
    return value


def _row_length(text: str) -> int:
    """An argparse type: a row length, 1 to `MAX_SEQ_LEN` tokens."""
    from forge_grain.pipeline.batches import MAX_SEQ_LEN

    value = _at_least(1)(text)
    if value > MAX_SEQ_LEN:
        raise argparse.ArgumentTypeError(f"{value:,} tokens a row is past {MAX_SEQ_LEN:,}, the longest row "
                                         "forge-grain makes")
    return value


def _storage_options(parser) -> None:
    parser.add_argument("--storage-options", type=_json_object, metavar="JSON",
                        help="for an s3:// (or other fsspec) URL: fsspec options as JSON, e.g. "
                        "'{\"endpoint_url\": \"http://minio:9000\"}' (credentials come from the environment)")


def _config_reference(a) -> None:
    from forge_grain.pipeline.reference import render

    print(render(), end="")


def _prepare(a) -> None:
    from forge_grain.preparation.runners import prepare
    from forge_grain.stores import TokenStore
    from forge_grain.packing.summary import format_summary

    out = prepare(
        a.input, a.output, tokenizer=a.tokenizer, text_field=a.text_field, token_field=a.token_field,
        vocab_size=a.vocab_size, split=a.split, hf_config=a.hf_config, text_unit=a.text_unit,
        list_separator=_unescape(a.join_lists), special_tokens_in_text=a.special_tokens_in_text,
        add_bos=a.bos, add_eos=a.eos, bos_token=a.bos_token, eos_token=a.eos_token, bos_id=a.bos_id,
        eos_id=a.eos_id, layout=a.layout, num_shards=a.num_shards, num_proc=a.num_proc, overwrite=a.overwrite,
        progress=not a.quiet, piece_chars=a.piece_chars, storage_options=a.storage_options, runner=a.runner,
        beam_options=[_beam_option(o) for o in a.beam_option], chat=a.chat, train_roles=tuple(a.train_roles),
    )
    print(format_summary(TokenStore.open(out, storage_options=a.storage_options)))


def _inspect(a) -> None:
    from forge_grain.stores import TokenStore
    from forge_grain.packing.summary import format_summary, plot_lengths

    if str(a.path).endswith(".toml") and Path(a.path).is_file():
        return _inspect_config(Path(a.path))

    store = TokenStore.open(
        a.path, verify=a.verify, dtype=a.dtype, eos_id=a.eos_id, bos_id=a.bos_id, vocab_size=a.vocab_size,
        tokenizer=a.tokenizer, split=a.split, file_pattern=a.file_pattern, format=a.format,
        token_field=a.token_field, **({"whole_documents": False} if a.partial_documents else {}), fingerprint="full" if a.full_fingerprint else "sampled",
        storage_options=a.storage_options,
    )
    print(format_summary(store))
    if a.verify:
        print("  verified    checksums and token ids OK")
    if a.plot:
        print(f"  plot        {plot_lengths(store, a.plot)}")
    if a.seq_len:
        from forge_grain.packing.summary import packing_report

        print(packing_report(store, a.seq_len, seed=a.seed, max_segments=a.max_segments))


def _inspect_config(path: Path) -> None:
    """A config file (forge-grain's or a KempnerForge job file): its geometry, then each
    source's weight and, for stored sources, the summary of its store."""
    from forge_grain.pipeline.config import DataConfig
    from forge_grain.stores import TokenStore
    from forge_grain.packing.summary import format_summary

    c = DataConfig.from_toml(path)
    print(f"{path}: a data config, {len(c.sources)} source(s), seq_len {c.seq_len}, global batch "
          f"{c.global_batch_size}, {len(c.all_phases())} phase(s)")
    schedule = c.schedule()
    for k, s in enumerate(c.sources):
        weights = " -> ".join(f"{w[k]:.3g}" for _, w in schedule)
        print(f"\nsource '{s.name}': weight {weights} (by phase), {s.strategy}")
        if s.path is not None:
            print(format_summary(TokenStore.open(s.path, **s.store_options())))
        else:
            print(f"  Hugging Face dataset {s.hf_dataset!r}{' (streaming)' if s.hf_streaming else ''}")


def _plan(a) -> None:
    """`forge-grain plan CONFIG`: the run a config describes (see `Pipeline.describe`)."""
    from forge_grain.pipeline.config import DataConfig

    path = Path(a.config)
    config = DataConfig.from_toml(path, world_size=a.world_size)  # read and checked before grain and jax load
    from forge_grain.pipeline.pipeline import Pipeline

    with warnings.catch_warnings():  # what the pipeline warns about is in the description's warnings
        warnings.simplefilter("ignore")
        if a.state:  # the run as a saved state recorded it: its mixture changes, at resume or live
            pipeline, _ = _recorded_pipeline(a)
        else:
            pipeline = Pipeline(config, 0, 1, num_threads=0, plan_workers=a.plan_workers)
        d = pipeline.describe(a.steps)
    print(json.dumps(d, indent=2) if a.json else format_plan(path, d))
    if a.plot:
        from forge_grain.pipeline.plot import plot_shares

        png = plot_shares(pipeline, d, a.plot, title=f"{path.name}: share of each source's rows")
        if not a.json:
            print(f"\nplot: {png}")


def format_plan(path, d: dict) -> str:
    steps = "unlimited" if d["steps"] is None else f"{d['steps']:,}"
    full = "up to " if len(d["batch_sizes"]) > 1 else ""
    lengths = sorted({n for _, n in d.get("seq_lens", [[0, d["seq_len"]]])})
    row = f"{lengths[0]:,} tokens" if len(lengths) == 1 else f"{lengths[0]:,} to {lengths[-1]:,} tokens (below)"
    most = "up to " if full or len(lengths) > 1 else ""
    lines = [f"{path}: {steps} steps of {full}{d['global_batch_size']} rows x {row} ({most}{d['tokens_per_step']:,} "
             f"tokens a step; an epoch of all sources' rows is {d['steps_per_epoch']:,} steps)"]
    tokens = "" if d["tokens"] is None else f"; {d['tokens']:,} tokens in all"
    if len(d["batch_sizes"]) > 1:
        sizes = ", ".join(f"{b:,} from step {s:,}" for s, b in d["batch_sizes"])
        lines.append(f"\nbatch sizes (rows a step): {sizes}{tokens}")
    if "seq_lens" in d:
        lengths = ", ".join(f"{n:,} from step {s:,}" for s, n in d["seq_lens"])
        lines.append(f"\nsequence lengths (tokens a row; each change plans the rest of the epoch at the new "
                     f"length): {lengths}{tokens}")
    if len(d["phases"]) > 1:
        lines.append("\nphases:")
        for p in d["phases"]:
            mix = ", ".join(f"{n} {w:.3f}" for n, w in p["weights"].items())
            lines.append(f"  from step {p['start_step']:,}: {mix}; lr_scale {p['lr_scale']}"
                         + ("" if p["reached"] else "  (never reached)"))
    lines.append("\nsources:")
    for s in d["sources"]:
        per_epoch = "unknown" if s["rows_per_epoch"] is None else f"{s['rows_per_epoch']:,} rows an epoch"
        packing = "" if s["fill"] is None else (f", {s['strategy']}: fill {s['fill']:.1%}, "
                                                 f"cropped {s['cropped_share']:.2%}")
        read = "" if s["rows"] is None else f"; the run reads {s['rows']:,} rows"
        epochs = "" if s["epochs"] is None else f" ({s['epochs']:.2f} epochs)"
        trained = "" if s["trained_tokens"] is None else f", {s['trained_tokens']:,} trained tokens"
        trained += " (a target mask: only the tokens it marks train)" if s.get("masked") else ""
        lines.append(f"  {s['name']}: {per_epoch}{packing}{read}{epochs}{trained}")
        if s.get("cache"):
            lines.append(f"    {_cache_line(s['cache'])}")
    lines += ["\nwarnings:", *(f"  ! {w}" for w in d["warnings"])] if d["warnings"] else []
    return "\n".join(lines)


def _cache_line(c: dict) -> str:
    """A source under cache_limit: its read order and what an epoch fetches."""
    fit = c["fitted_order"]
    order = ("an order not fitted to the cache (shuffle_window, or a whole-epoch shuffle)" if fit is None else
             f"windows of at most {fit['files_together']:,} data file(s) or blocks (shuffle_bytes "
             f"{fit['shuffle_bytes']:,}), rows shuffled within each")
    at = "about" if fit is not None else "at least"  # (the replay leaves out a thrashing prefetch's churn)
    return (f"cache_limit {c['limit']:,}: read in {order}; an epoch fetches {at} {c['fetch_bytes']:,} bytes "
            f"({c['fetch_bytes'] / max(c['data_bytes'], 1):.2f}x its {c['data_bytes']:,})")


# -- the flight recorder: explain, replay, hashes ------------------------------------------------


def _steps(text: str) -> range:
    """'A:B' as steps A..B-1."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"steps must be A:B (first step, and the step after the last), not {text!r}")
    if not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"steps A:B need 0 <= A < B, not {text!r}")
    return range(a, b)


def _recorded_pipeline(a, rank: int = 0, world_size: int = 1):
    """The pipeline of a config (and of a saved state, for streaming sources and mixture changes)."""
    from forge_grain.pipeline.config import DataConfig

    path, state = a.state or (None, None)  # (read by `_state_file`)
    config = DataConfig.from_toml(a.config, world_size=a.world_size)  # read and checked before grain and jax load
    from forge_grain.pipeline.live import saved_live
    from forge_grain.pipeline.pipeline import Pipeline

    with warnings.catch_warnings():  # a state of another config: the run resumed it with a change
        warnings.simplefilter("ignore")
        try:
            # weights set live are in the state: a plain resume of it rebuilds the run (`pipeline.live`)
            change = state is not None and saved_live(state) is None
            return Pipeline(config, rank, world_size, num_threads=0, resume_from=state,
                            allow_mixture_change=change, allow_batch_size_change=state is not None,
                            allow_seq_len_change=state is not None), state
        except StateError as e:
            raise StateError(f"--state {path}: {e}") from None


def _explain(a) -> None:
    p, state = _recorded_pipeline(a, a.rank or 0, a.world_size or 1)
    if p.streams:  # a streaming row is known once read: make this rank's steps up to it
        _made(p, state, range(a.step, a.step + 1))
    shard = 0 if a.rank is None and p.streams else a.rank  # streaming rows: only this rank's are made
    rows = p.explain(a.step, shard=shard, decode=a.decode or a.tokenizer is not None, tokenizer=a.tokenizer)
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        where = (f"epoch {r['epoch']}, source row {r['source_row']:,}, plan row {r['plan_row']:,}" if r["segments"]
                 is not None else f"source row {r['source_row']:,}")
        if "canonical_stream" in r:
            where += f", canonical stream {r['canonical_stream']}" + (f" window {r['window']}" if "window" in r else "")
        print(f"step {r['step']}, row {r['row']} (shard {r['shard']}): {r['source']}, {where}")
        for s in r["segments"] or []:
            place = f"{s['file']} #{s['index_in_file']}" if s["file"] else ""
            print(f"  slots [{s['slots'][0]}, {s['slots'][1]}): document {s['document']:,}, tokens "
                  f"[{s['tokens'][0]}, {s['tokens'][1]})  {place}")  # half-open, as Python's slices
            if "targets" in s:  # a source with target masks: which of those tokens train
                runs = ", ".join(f"[{a}, {b})" for a, b in s["targets"]) or "none"
                print(f"    targets (the data's mask): tokens {runs}")
            if "text" in s:
                print(f"    {s['text'][:300]!r}")


def _made(p, state, steps: range) -> list:
    """This rank's batches of `steps` of a pipeline with streaming sources, read in order
    from the state's step (or 0); the batches before are read and dropped."""
    it = p.iterator(state)
    if steps.start < it.step:
        raise ForgeGrainError(f"steps {steps.start}:{steps.stop} start before the state's step {it.step}")
    return list(itertools.islice(it, steps.start - it.step, steps.stop - it.step))


def _replay(a) -> None:
    """The batches rank R of W saw at steps A..B-1, from the config (and a state) alone."""
    import numpy as np

    from forge_grain.files import fsync_rename, temporary

    p, state = _recorded_pipeline(a, a.rank, a.world_size or 1)
    if p.streams:
        batches = _made(p, state, a.steps)
    else:
        batches = [p.batch(step) for step in a.steps]
    out = Path(a.out)
    tmp = temporary(out)
    arrays, shape = _replay_arrays(batches)
    with open(tmp, "wb") as f:
        np.savez(f, step=np.array(list(a.steps), np.int64), **arrays)
    fsync_rename(tmp, out)
    print(f"{out}: steps {a.steps.start}..{a.steps.stop - 1} of rank {a.rank} of {a.world_size or 1}, "
          f"{len(batches)} batches of {shape}")


def _replay_arrays(batches: list[dict]) -> tuple[dict, str]:
    """`replay`'s arrays, and their shape in words. One shape of batch: `[steps, rows, seq_len]`
    per key. A batch-size schedule: the steps' rows one after another, `[rows, seq_len]`, with
    `rows_per_step`. A sequence-length schedule: every row's values one after another, flat,
    with `rows_per_step` and `seq_len_per_step` (step i is the next rows_i x seq_len_i values)."""
    import numpy as np

    keys = [k for k in batches[0] if k != "step"]
    rows = [len(b["inputs"]) for b in batches]
    lengths = [b["inputs"].shape[1] for b in batches]
    words = f"{'/'.join(map(str, sorted(set(rows))))} rows x {'/'.join(map(str, sorted(set(lengths))))}"
    if len(set(rows)) == 1 and len(set(lengths)) == 1:
        return {k: np.stack([b[k] for b in batches]) for k in keys}, words
    per_step = {"rows_per_step": np.array(rows, np.int64)}
    if len(set(lengths)) == 1:
        return {**{k: np.concatenate([b[k] for b in batches]) for k in keys}, **per_step}, words
    return ({**{k: np.concatenate([np.asarray(b[k]).reshape(-1) for b in batches]) for k in keys}, **per_step,
             "seq_len_per_step": np.array(lengths, np.int64)}, words + " (flat: see seq_len_per_step)")


def _hashes(a) -> None:
    p, state = _recorded_pipeline(a)
    if p.streams:  # a streaming row is known once read: the steps made in order (one shard: the global batch)
        from forge_grain.pipeline.explain import hash_batch

        for step, batch in zip(a.steps, _made(p, state, a.steps)):
            print(step, hash_batch(batch))
        return
    for step in a.steps:
        print(step, p.batch_hash(step))


def _beam_option(option: str) -> str:
    """`KEY=VALUE` (or `--KEY=VALUE`, or a bare flag `KEY`) as Beam's `--KEY=VALUE`."""
    return option if option.startswith("--") else f"--{option}"


def _unescape(sep: str | None) -> str | None:
    """`--join-lists '\\n\\n'` means two newlines (shells pass the backslashes through)."""
    return None if sep is None else sep.encode("utf-8").decode("unicode_escape")


def _demo(a) -> None:
    from forge_grain.demo import run_demo

    summary = run_demo(a.workdir, max_files=a.max_files, num_proc=a.num_proc, steps=a.steps)
    if not all(summary["resume_matches"].values()):
        raise SystemExit(1)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="forge-grain", description="Token stores, packing and mixing on Grain.")
    p.add_argument("--version", action="version", version=f"forge-grain {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    pr = sub.add_parser("prepare", help="tokenize a text corpus into a token store")
    pr.add_argument("input", help="file, directory or glob of .txt/.jsonl/.parquet, a saved dataset, or a hub name")
    pr.add_argument("output", help="directory of the token store to write")
    pr.add_argument("--tokenizer", help="a tokenizer.json, a tokenizer directory, or a Hugging Face Hub name such as gpt2 or "
                    "org/name@revision (from the HF cache; default: the shipped one)")
    pr.add_argument("--text-field", default="text", help="column holding the text (default: text)")
    pr.add_argument("--token-field", help="column already holding token ids (lists of ints): written without "
                    "tokenizing; needs --vocab-size or --tokenizer")
    pr.add_argument("--vocab-size", type=_at_least(1), help="with --token-field: ids must lie in [0, N)")
    pr.add_argument("--chat", choices=["messages", "prompt_completion"],
                    help="rows are conversations ('messages': a list of role/content objects) or prompt/completion "
                         "pairs, rendered with the tokenizer's chat template; only the assistant's turns (or the "
                         "completion) train")
    pr.add_argument("--train-roles", nargs="+", default=["assistant"], metavar="ROLE",
                    help="with --chat messages: the roles whose turns train (default: assistant)")
    pr.add_argument("--split", help="split of a directory of split files, a saved DatasetDict or a hub dataset "
                    "(default: train)")
    pr.add_argument("--join-lists", metavar="SEP", help="join a text field holding lists of strings with SEP "
                    "(escapes such as \\n work); without it such a field is an error")
    pr.add_argument("--special-tokens-in-text", action="store_true",
                    help="encode special-token strings in the text (e.g. <|endoftext|>) as special ids "
                    "(default: they are ordinary text)")
    pr.add_argument("--hf-config", help="Hugging Face dataset configuration name")
    pr.add_argument("--text-unit", default="document", choices=["document", "line", "paragraph"],
                    help="for plain text files: one document per file, line or paragraph (default: document)")
    pr.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None,
                    help="start documents with BOS (default: on for text, off for --token-field)")
    pr.add_argument("--eos", action=argparse.BooleanOptionalAction, default=None,
                    help="end documents with EOS (default: on for text, off for --token-field)")
    pr.add_argument("--bos-id", type=_at_least(0), help="with --token-field: the BOS id the documents start with (checked)")
    pr.add_argument("--eos-id", type=_at_least(0), help="with --token-field: the EOS id the documents end with (checked)")
    pr.add_argument("--bos-token", help="the BOS token's string (default: found by its usual names)")
    pr.add_argument("--eos-token", help="the EOS token's string (default: found by its usual names)")
    pr.add_argument("--layout", default="bin", choices=["bin", "arrayrecord"], help="on-disk layout (default: bin)")
    pr.add_argument("--num-shards", type=_at_least(1), help="shards to write (default: about 64 MiB of text each)")
    pr.add_argument("--num-proc", type=_at_least(1), default=1, help="tokenizer processes (default: 1)")
    pr.add_argument("--overwrite", action="store_true", help="replace a store prepared with other settings")
    pr.add_argument("--piece-chars", type=_at_least(1), default=1 << 20,
                    help="tokenize longer documents in pieces of about this many characters, with the same ids; "
                    "bounds memory at ~150 bytes per token of a piece (default: 1048576)")
    pr.add_argument("--runner", default="local", choices=["local", "beam"],
                    help="local: processes on this machine; beam: an Apache Beam job (the same bytes; needs "
                    "forge-grain[beam]; JSON Lines and Parquet inputs)")
    pr.add_argument("--beam-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a Beam pipeline option, repeatable, e.g. --beam-option runner=DataflowRunner "
                    "--beam-option project=P (default: Beam's local runner)")
    pr.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _storage_options(pr)
    pr.set_defaults(func=_prepare)

    pl = sub.add_parser("plan", help="what a config (or a KempnerForge job file) will do, before training")
    pl.add_argument("config", help="a forge-grain TOML config or a KempnerForge job file")
    pl.add_argument("--steps", type=_at_least(1), help="describe the first N steps (default: all of the run's)")
    pl.add_argument("--world-size", type=_at_least(1), help="a KempnerForge job's world size (default: WORLD_SIZE, or 1)")
    pl.add_argument("--plan-workers", type=_at_least(1), help="processes planning large stores (default: one per core)")
    pl.add_argument("--json", action="store_true", help="print the description as JSON, for tools")
    pl.add_argument("--state", type=_state_file, help="a saved data state (JSON): the run with the mixture changes "
                    "it recorded (at resume, or set live)")
    pl.add_argument("--plot", metavar="PNG", type=_output_file, help="also draw the share of each source over the steps to this PNG "
                    "(needs forge-grain[plot])")
    pl.set_defaults(func=_plan)

    def recorded(name: str, help: str):
        sp = sub.add_parser(name, help=help)
        sp.add_argument("config", help="a forge-grain TOML config or a KempnerForge job file")
        sp.add_argument("--state", type=_state_file, help="a saved data state (JSON): for streaming sources and mixture changes")
        sp.add_argument("--world-size", type=_at_least(1), help="the run's number of shards (default 1)")
        return sp

    ex = recorded("explain", "which documents each row of a step's batch holds")
    ex.add_argument("--step", type=_at_least(0), required=True)
    ex.add_argument("--rank", type=_at_least(0), help="only this shard's rows (with --world-size)")
    ex.add_argument("--decode", action="store_true", help="also the text, with the store's tokenizer")
    ex.add_argument("--tokenizer", metavar="PATH", help="decode with this tokenizer (a path or Hub name; checked "
                    "against the store's record) instead of the one the store names")
    ex.add_argument("--json", action="store_true", help="as JSON, for tools")
    ex.set_defaults(func=_explain)
    rp = recorded("replay", "write the exact batches a rank saw at some steps to an .npz file")
    rp.add_argument("--steps", type=_steps, required=True, metavar="A:B", help="steps A..B-1")
    rp.add_argument("--rank", type=_at_least(0), default=0)
    rp.add_argument("--out", required=True, type=_output_file, help="the .npz file: one array per batch key, [steps, rows, seq_len] (under a batch-size or sequence-length schedule see rows_per_step and seq_len_per_step)")
    rp.set_defaults(func=_replay)
    ha = recorded("hashes", "a digest of each global batch's content (Pipeline.batch_hash), one line a step")
    ha.add_argument("--steps", type=_steps, required=True, metavar="A:B", help="steps A..B-1")
    ha.set_defaults(func=_hashes)

    ref = sub.add_parser("config-reference", help="print the reference of every config key (Markdown; docs/config.md)")
    ref.set_defaults(func=_config_reference)

    ins = sub.add_parser("inspect", help="summarize a token store (or the sources of a config file)")
    ins.add_argument("path", help="a token store in any format read in place: a forge-grain store, raw .npy/.bin "
                     "file(s), a Megatron prefix, a save_to_disk dataset, a LitData or MDS directory")
    ins.add_argument("--format", choices=["native", "raw", "megatron", "arrow", "litdata", "mds"],
                     help="the format, when detection from the files should not decide")
    ins.add_argument("--token-field", help="Arrow/MDS datasets: the column of token ids (default input_ids / tokens)")
    ins.add_argument("--verify", action="store_true", help="check checksums and token ids (reads everything)")
    ins.add_argument("--plot", metavar="PNG", type=_output_file, help="also write a length histogram to this PNG")
    ins.add_argument("--dtype", help="dtype of raw token files (uint16, uint32, int32, ...); required for raw "
                     "files unless --vocab-size or --tokenizer decides it")
    ins.add_argument("--eos-id", type=_at_least(0), help="raw files: documents end with this id (other formats: checked)")
    ins.add_argument("--bos-id", type=_at_least(0), help="raw files: documents start with this id (other formats: checked)")
    ins.add_argument("--vocab-size", type=_at_least(1), help="foreign files: check ids are below this")
    ins.add_argument("--tokenizer", help="foreign files: the tokenizer that made them (gives the vocabulary size)")
    ins.add_argument("--split", help="foreign files: the split to read in a directory of several (train, validation, test)")
    ins.add_argument("--file-pattern", help="foreign files: a glob of the files to read within the directory")
    ins.add_argument("--partial-documents", action="store_true",
                     help="raw files may begin or end inside a document (not checked against --bos-id/--eos-id)")
    ins.add_argument("--full-fingerprint", action="store_true",
                     help="foreign files: hash every byte for the fingerprint (default: sampled blocks)")
    ins.add_argument("--seq-len", type=_row_length, help="also report how each packing strategy fills rows of this length")
    ins.add_argument("--seed", type=int, default=0, help="document shuffle seed for the packing report")
    ins.add_argument("--max-segments", type=_at_least(1), metavar="K",
                     help="with --seq-len: also plan with at most K documents (segments) a row, and show the fill "
                     "it costs (DataConfig.max_segments_per_row)")
    _storage_options(ins)
    ins.set_defaults(func=_inspect)

    de = sub.add_parser("demo", help="run the whole flow on a corpus that needs no download")
    de.add_argument("--workdir", default="forge-grain-demo", help="where to write (default: ./forge-grain-demo)")
    de.add_argument("--max-files", type=_at_least(1), default=600, help="standard library files in the corpus")
    de.add_argument("--num-proc", type=_at_least(1), default=2, help="tokenizer processes (default: 2)")
    de.add_argument("--steps", type=_at_least(1), default=60, help="training steps to simulate (default: 60)")
    de.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ForgeGrainError as e:
        config = getattr(args, "config", None)  # an error of what a config names says which config
        where = f"{config}: " if config and str(config) not in str(e) else ""
        print(f"forge-grain: error: {where}{e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `forge-grain inspect ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # a file named on the command line (or in a config) that cannot be read or written
        print(f"forge-grain: error: {_os_error(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug, not a bad argument: one line still, the traceback on request
        if os.environ.get("FORGE_GRAIN_TRACEBACK") == "1":
            raise
        print(f"forge-grain: internal error: {type(e).__name__}: {e} (FORGE_GRAIN_TRACEBACK=1 shows where; please "
              "report it)", file=sys.stderr)
        return 1
    return 0


def _os_error(e: OSError) -> str:
    """'PATH: what went wrong' (the path first, as every other error names its file)."""
    if e.filename is None:
        return str(e)
    return f"{e.filename}: {e.strerror or e}" + (f" (-> {e.filename2})" if e.filename2 else "")


if __name__ == "__main__":
    sys.exit(main())
