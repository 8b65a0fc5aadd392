"""`prepare` on Apache Beam: the store local `prepare` writes, built on an engine's workers.

`prepare(..., runner="beam", beam_options=[...])` (`forge-grain prepare --runner beam`) runs
two Beam pipelines with the options given (`--runner=DataflowRunner`, `FlinkRunner`,
`SparkRunner`, ...; Beam's local runner when none is named):

1. **Count.** Each input file's rows are counted on a worker (JSON Lines: its non-blank
   lines; Parquet: its footer), and the counts come back in one small file.
2. **Write.** The launcher, holding only those counts, applies local `prepare`'s rule:
   shard i of S holds the corpus's rows [n·i/S, n·(i+1)/S) in file order, S given or by
   the same default (64 MiB of input a shard). The rule depends on the inputs and options
   only, never on the workers, so each shard is a task any worker can run alone: it reads
   its rows from the files they lie in and writes the shard with local `prepare`'s own
   writer, to a temporary name renamed when complete, then a done marker. The last step
   writes the manifest from the shards' results.

So the shards and the manifest are byte-identical to local `prepare`'s. A re-run skips the
shards whose done marker and checksum verify; a failed job leaves no manifest. Bad input
fails the job with local `prepare`'s message, naming the file and row. Inputs are JSON Lines
(`.jsonl`, `.json`) and Parquet files (a file, a directory or a glob; split files are chosen
as locally); the tokenizer travels inside the job, serialized, so workers need no copy of it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path


@contextlib.contextmanager
def _without_apitools_warning():
    """Beam warns `apitools not found` on import wherever its GCP extra is absent (needed
    only for BigQuery), and the module-level `logging.warning` that says so installs a
    stderr handler on the root logger of the user's process. Neither outlives the import."""
    root = logging.getLogger()
    handlers = list(root.handlers)

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("apitools not found")

    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)
        for h in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(h)


with _without_apitools_warning():
    import apache_beam as beam
    from apache_beam.metrics import Metrics
    from apache_beam.options.pipeline_options import PipelineOptions

from forge_grain.errors import PrepareError
from forge_grain.locks import exclusive_or_refuse
from forge_grain.stores.manifest import JOINED_INDEX, MANIFEST_NAME
from forge_grain.files import fsync_rename, sha256_file, temporary
from forge_grain.paths import is_url
from forge_grain.preparation.local import (
    LOCK_NAME,
    clean,
    done_info,
    Job,
    write_shard,
    already_prepared,
    default_num_shards,
    done_name,
    files_identity,
    write_manifest,
)
from forge_grain.stores.remote_dir import RemoteDir, read_or_none
from forge_grain.stores.writer_lock import writer_lock
from forge_grain.corpora.files import is_documents, open_parquet
from forge_grain.tokenizer import TextTokenizer

METRICS = "forge_grain"  # the namespace of the job's counters


def check_options(options: list[str]) -> None:
    """Every option is one Beam knows, as `--name[=value]`: Beam itself drops the others with
    a log line and runs on (`--beam-option garbage` ran as if not given)."""
    import logging

    bare = [o for o in options if not str(o).startswith("--")]
    logger = logging.getLogger("apache_beam.options.pipeline_options")
    level, logger.level = logger.level, logging.ERROR  # (its "Discarding unparseable args" is said here)
    try:
        parsed = PipelineOptions(list(options))
        unknown = sorted(set(parsed.get_all_options(retain_unknown_options=True)) - set(parsed.get_all_options()))
    finally:
        logger.setLevel(level)
    if bare or unknown:
        raise PrepareError(f"Beam options {bare + [f'--{u}' for u in unknown]}: not options Beam knows (give them as "
                           "KEY=VALUE, e.g. runner=DataflowRunner, direct_num_workers=2; see Beam's pipeline options)")


def prepare_beam(spec, num_shards: int | None, overwrite: bool, options: list[str], progress: bool,
                 storage_options: dict | None = None) -> Path | str:
    """`prepare` with the Beam runner (see the module docstring); `spec` is local prepare's
    checked options (`preparation.Spec`); `storage_options` reach fsspec for URLs."""
    check_options(options)
    inputs = Inputs.find(spec, storage_options)
    out = Output(spec.out, storage_options)
    with out.lock():
        counts = _counts(inputs, out, options)
        rows = sum(counts)
        if rows == 0:
            raise PrepareError(f"{spec.source}: the corpus is empty (no documents)")
        num_shards = num_shards or default_num_shards(sum(inputs.sizes), rows)
        if not 1 <= num_shards <= rows:
            raise PrepareError(f"num_shards must be between 1 and the {rows} documents, not {num_shards}")
        job, settings, recorded = spec.describe(inputs.identity, num_shards)
        if out.already_prepared(job.key, settings, overwrite):
            if progress:
                print(f"{out.result}: already complete (prepared earlier with these settings); nothing to do")
            return out.result
        out.clean(overwrite)
        tasks = shard_tasks(inputs.files, counts, num_shards)
        t0 = time.perf_counter()
        result = _run(options, lambda p: _write_pipeline(p, tasks, inputs, out, job, settings, recorded,
                                                         _Shipped.of(spec.tok)))
        out.remove(counts_record(inputs.identity))  # the store is complete: a re-run stops at its manifest
        if progress:
            print(summary(result, time.perf_counter() - t0))
    return out.result


@dataclasses.dataclass
class Inputs:
    """The input files in local `prepare`'s order (paths, or URLs), their kind ('json' or
    'parquet'), sizes and identity, and the fsspec options that reach them."""

    files: list[str]
    builder: str
    sizes: list[int]
    identity: str
    storage_options: dict | None = None

    @classmethod
    def find(cls, spec, storage_options) -> "Inputs":
        if spec.data_files is not None or spec.hf_config is not None:
            raise PrepareError(f"{spec.source}: --runner beam reads files (a path, directory or glob of JSON Lines "
                               "or Parquet files); data_files and hub configurations are read by the local runner")
        if is_url(spec.source):
            return cls._remote(spec, storage_options)
        from forge_grain.corpora.files import builder_of, find_files

        path = Path(spec.source)
        if not (path.exists() or any(c in str(spec.source) for c in "*?[")) or (path / "state.json").exists() \
                or (path / "dataset_dict.json").exists():
            raise PrepareError(f"{spec.source}: --runner beam reads JSON Lines and Parquet files (a path, directory "
                               "or glob); hub datasets and saved datasets are read by the local runner")
        files = find_files(spec.source, spec.split, exclude=None if is_url(spec.out) else Path(spec.out))
        found = cls([str(f) for f in files], builder_of(files, spec.source), [f.stat().st_size for f in files],
                    files_identity(files))
        return found.checked(spec.source)

    @classmethod
    def _remote(cls, spec, storage_options) -> "Inputs":
        """Files at a URL: one object, every data file under a prefix, or a glob; split files
        are chosen by their names as locally."""
        from pathlib import PurePosixPath

        from forge_grain.splits import select_named
        from forge_grain.corpora.files import BUILDERS, builder_of

        remote = RemoteDir(str(spec.source), storage_options)
        fs, root = remote.fs, remote.root
        if any(c in root for c in "*?["):
            found, base = remote.retry("", lambda: fs.glob(root, detail=True)), None
        elif remote.retry("", lambda: fs.isdir(root)):
            found, base = remote.retry("", lambda: fs.find(root, detail=True)), PurePosixPath(root)
        else:
            found, base = {root: remote.retry("", lambda: fs.info(root))}, None
        infos = {PurePosixPath(name): info for name, info in sorted(found.items())
                 if info.get("type", "file") == "file" and (base is None or PurePosixPath(name).suffix in BUILDERS)}
        if not infos:
            raise PrepareError(f"{spec.source}: no JSONL or Parquet files found")
        chosen = select_named(list(infos), spec.split, spec.source, PrepareError, base=base,
                              documents=is_documents(list(infos)))
        urls = [fs.unstrip_protocol(str(f)) for f in chosen]
        entries = [[u, int(infos[f]["size"]), str(infos[f].get("ETag") or infos[f].get("mtime")
                                                   or infos[f].get("LastModified") or infos[f].get("updated"))]
                   for u, f in zip(urls, chosen)]
        identity = hashlib.sha256(json.dumps(entries).encode()).hexdigest()
        return cls(urls, builder_of(chosen, spec.source), [e[1] for e in entries], identity,
                   storage_options).checked(spec.source)

    def checked(self, source) -> "Inputs":
        if self.builder not in ("json", "parquet"):
            raise PrepareError(f"{source}: --runner beam reads JSON Lines and Parquet files, not {self.builder} "
                               "files; prepare those with the local runner")
        if not any(self.sizes):
            raise PrepareError(f"{source}: the corpus is empty (no documents)")
        return self

    def open(self, file: str):
        """A binary file object of one input (local or through fsspec)."""
        if is_url(file):
            import fsspec

            return fsspec.open(file, "rb", **(self.storage_options or {})).open()
        return open(file, "rb")


class Output:
    """The store being written: a local directory (written as local `prepare` writes it), or
    a URL, where each worker writes its shard in a local temporary directory and uploads
    it (the shard, its index, then its done marker); the manifest is uploaded last. An
    object's upload is atomic, so a store at a URL is complete exactly when its manifest is
    there."""

    def __init__(self, out, storage_options: dict | None = None):
        self.url = str(out).rstrip("/") if is_url(out) else None
        self.path = None if self.url else Path(out)
        self.remote = RemoteDir(self.url, storage_options) if self.url else None
        self.storage_options = storage_options

    @property
    def result(self):
        return self.url or self.path

    def lock(self):
        """One writer per output: a lock file for a local one, a lock object for a URL."""
        if self.url:
            return writer_lock(self.url, self.storage_options)
        self.path.mkdir(parents=True, exist_ok=True)
        return exclusive_or_refuse(self.path / LOCK_NAME, str(self.path))

    def read(self, name: str) -> bytes | None:
        if self.url:
            return read_or_none(self.remote, name)
        try:
            return (self.path / name).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, name: str, data: bytes) -> None:
        if self.url:
            self.remote.retry(name, lambda: self.remote.fs.pipe_file(self.remote.path(name), data))
        else:
            tmp = temporary(self.path / name)
            tmp.write_bytes(data)
            fsync_rename(tmp, self.path / name)

    def remove(self, name: str) -> None:
        if self.url:
            self.remote.retry(name, lambda: self.remote.fs.rm_file(self.remote.path(name)), missing_ok=True)
        else:
            (self.path / name).unlink(missing_ok=True)

    def already_prepared(self, key: str, settings: dict, overwrite: bool) -> bool:
        text = self.read(MANIFEST_NAME)
        return already_prepared(self.result, None if text is None else text.decode(), key, settings, overwrite,
                                lambda: self.remove(MANIFEST_NAME))

    def clean(self, overwrite: bool) -> None:
        if not self.url:
            return clean(self.path, remove_all=overwrite)
        if overwrite:
            fs = self.remote.fs
            names = self.remote.retry("", lambda: fs.ls(self.remote.root, detail=False), missing_ok=True) or []
            for name in names:
                if name.rsplit("/", 1)[-1].startswith("shard-"):
                    self.remote.retry(name, lambda n=name: fs.rm_file(n))

    def done_info(self, i: int, key: str) -> dict | None:
        """Shard i's info when a run with these settings finished it and it verifies."""
        if not self.url:
            return done_info(self.path, i, key)
        marker = self.read(done_name(i))
        done = json.loads(marker) if marker else {}
        info = done.get("info", {})
        if done.get("key") != key or self.read_sha256(info.get("tokens")) != info.get("sha256"):
            return None
        return info if self.read(info["index"]) is not None else None

    def read_sha256(self, name: str | None) -> str | None:
        """sha256 of an object, streamed; None when it is missing."""
        if not name:
            return None
        return self.remote.retry(name, lambda: sha256_file(self.remote.path(name), opener=self.remote.fs.open),
                                 missing_ok=True)

    def write_shard(self, corpus, tok, job: Job, task, report) -> dict:
        if not self.url:
            return write_shard(corpus, tok, job, task, report)[1]
        with tempfile.TemporaryDirectory(prefix="forge-grain-shard-") as tmp:
            _, info = write_shard(corpus, tok, dataclasses.replace(job, out=tmp), task, report)
            for name in (info["tokens"], info["index"], done_name(task[0])):
                self.remote.retry(name, lambda n=name: self.remote.fs.put_file(str(Path(tmp) / n),
                                                                                self.remote.path(n)))
        return info

    def finish(self, job: Job, settings: dict, recorded: dict, infos: list[dict]) -> None:
        """The manifest (last), then the done markers go."""
        if not self.url:
            return write_manifest(job, settings, recorded, infos)
        with tempfile.TemporaryDirectory(prefix="forge-grain-manifest-") as tmp:
            def get(name):  # the shards' indices, small, joined into the store's one index
                self.remote.retry(name, lambda: self.remote.fs.get_file(self.remote.path(name), str(Path(tmp) / name)))

            with concurrent.futures.ThreadPoolExecutor(8) as pool:  # 8 at a time, as uploads put files
                list(pool.map(get, [info["index"] for info in infos]))
            write_manifest(dataclasses.replace(job, out=tmp), settings, recorded, infos)
            self.write(JOINED_INDEX, (Path(tmp) / JOINED_INDEX).read_bytes())
            self.write(MANIFEST_NAME, (Path(tmp) / MANIFEST_NAME).read_bytes())
        for i in range(len(infos)):
            self.remove(done_name(i))


def shard_tasks(files: list[str], counts: list[int], num_shards: int) -> list[tuple]:
    """Local `prepare`'s rule: shard i of S holds the corpus's rows [n·i/S, n·(i+1)/S); as
    (i, [(file, first row, end row in that file), ...] in file order)."""
    starts, n = [0], 0
    for c in counts:
        n += c
        starts.append(n)
    tasks = []
    for i in range(num_shards):
        lo, hi = n * i // num_shards, n * (i + 1) // num_shards
        pieces = [(f, max(lo, a) - a, min(hi, b) - a) for f, a, b in zip(files, starts, starts[1:])
                  if max(lo, a) < min(hi, b)]
        tasks.append((i, pieces))
    return tasks


# -- the two pipelines ------------------------------------------------------------------------


# Beam's worker processes log at INFO (about 90 lines for a local run with 2 workers);
# their errors still show, and a `default_sdk_harness_log_level` option given wins
HARNESS_LOG_LEVEL = "--default_sdk_harness_log_level=ERROR"


def _run(options: list[str], build):
    """Build and run a pipeline with `options`; a failure on a worker becomes its message."""
    if not any("default_sdk_harness_log_level" in o for o in options):
        options = [HARNESS_LOG_LEVEL, *options]
    try:
        with _temporaries(), beam.Pipeline(options=PipelineOptions(list(options))) as p:
            build(p)
        return p.result if hasattr(p, "result") else None
    except Exception as e:  # runners re-raise a worker's error with the step's name, or wrap its text
        found = [str(e)] if isinstance(e, PrepareError) else re.findall(r"PrepareError: (.+)", str(e))
        if found:
            raise PrepareError(re.sub(r"\s*\[while running '[^']*'\]", "", found[-1]).strip()) from None
        raise PrepareError(f"the Beam job failed: {type(e).__name__}: {str(e)[:2000]}") from None


@contextlib.contextmanager
def _temporaries():
    """The job's temporary directories made in a directory of its own, and those left empty
    removed after it: Beam's local runner leaves seven empty directories in the system's
    temporary directory for every `prepare` (its SDK's staging, its job server's root, its
    requirements cache). Any that still holds a file is left (another thread of the process
    may have made it meanwhile: `tempfile.tempdir` is the process's)."""
    before = tempfile.tempdir
    root = tempfile.mkdtemp(prefix="forge-grain-beam-")
    tempfile.tempdir = root
    try:
        yield
    finally:
        tempfile.tempdir = before
        for here, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):  # (deepest first)
            with contextlib.suppress(OSError):
                os.rmdir(here)


def _counts(inputs: Inputs, out: Output, options: list[str]) -> list[int]:
    """Rows per input file, counted by a Beam job; kept in the output (keyed by the files'
    identity) until the store is complete, so a re-run does not count again."""
    name = counts_record(inputs.identity)
    saved = out.read(name)
    if saved is not None:
        return json.loads(saved)["counts"]

    def build(p):
        (p | "files" >> beam.Create(list(enumerate(inputs.files)))
           | "spread" >> beam.Reshuffle()
           | "count" >> beam.Map(lambda item: (item[0], count_rows(inputs, item[1])))
           | "gather" >> beam.combiners.ToList()
           | "save" >> beam.Map(_save_counts, out, name, len(inputs.files)))

    _run(options, build)
    return json.loads(out.read(name))["counts"]


def counts_record(identity: str) -> str:
    return f".forge-grain-counts-{identity[:16]}.json"


def _save_counts(pairs, out: Output, name: str, n: int) -> None:
    counts = [0] * n
    for i, c in pairs:
        counts[i] = c
    out.write(name, json.dumps({"counts": counts}).encode())


def _write_pipeline(p, tasks, inputs: Inputs, out: Output, job: Job, settings: dict, recorded: dict, tok) -> None:
    (p | "shards" >> beam.Create(tasks)
       | "spread" >> beam.Reshuffle()
       | "write" >> beam.ParDo(WriteShard(inputs, out, job, tok))
       | "gather" >> beam.combiners.ToList()
       | "manifest" >> beam.Map(_finish, out, job, settings, recorded))


def _finish(results, out: Output, job: Job, settings: dict, recorded: dict) -> None:
    infos = dict(results)
    out.finish(job, settings, recorded, [infos[i] for i in range(len(infos))])


class WriteShard(beam.DoFn):
    """One shard task to the shard's info: written now, or found done and verified."""

    def __init__(self, inputs: Inputs, out: Output, job: Job, tok):
        self.inputs, self.out, self.job, self.tok = inputs, out, job, tok

    def setup(self):
        self.documents = Metrics.counter(METRICS, "documents")
        self.tokens = Metrics.counter(METRICS, "tokens")
        self.written = Metrics.counter(METRICS, "shards_written")
        self.skipped = Metrics.counter(METRICS, "shards_skipped")
        self.shard_tokens = Metrics.distribution(METRICS, "tokens_per_shard")

    def process(self, task):
        i, pieces = task
        info = self.out.done_info(i, self.job.key)
        if info is not None:
            self.skipped.inc()
            yield i, info
            return
        corpus = ShardCorpus.read(self.inputs, pieces, self.job)
        info = self.out.write_shard(corpus, self.tok, self.job, (i, 0, corpus.num_rows), self._report)
        self.written.inc()
        self.shard_tokens.update(info["num_tokens"])
        yield i, info

    def _report(self, item):
        docs, tokens = item
        self.documents.inc(docs)
        self.tokens.inc(tokens)


def summary(result, seconds: float) -> str:
    """The job's counters, as local `prepare`'s progress bar ends."""
    totals = {}
    if result is not None:
        for kind in ("counters", "distributions"):
            for m in result.metrics().query().get(kind, []):
                if m.key.metric.namespace == METRICS:
                    value = m.committed if m.committed is not None else m.attempted
                    totals[m.key.metric.name] = value.sum if kind == "distributions" else value
    docs, tokens = totals.get("documents", 0), totals.get("tokens", 0)
    return (f"beam: {totals.get('shards_written', 0)} shard(s) written, {totals.get('shards_skipped', 0)} already done; "
            f"{docs:,} rows, {tokens:,} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9) / 1e6:.2f} M tok/s)")


# -- reading a shard's rows -------------------------------------------------------------------


def count_rows(inputs: Inputs, file: str) -> int:
    """Rows of one input file as the local loader reads them (JSON Lines skip blank lines)."""
    with inputs.open(file) as f:
        if inputs.builder == "parquet":
            return open_parquet(f, file).metadata.num_rows
        return sum(bool(line.strip()) for line in f)


@dataclasses.dataclass
class ShardCorpus:
    """A shard's rows as the shard writer reads a corpus: `ds` (a `datasets.Dataset`) and
    `where(row)` naming a row's file and row there, as local `prepare` names it."""

    ds: object
    pieces: list

    @property
    def num_rows(self) -> int:
        return len(self.ds)

    @classmethod
    def read(cls, inputs: Inputs, pieces, job: Job) -> "ShardCorpus":
        """The rows of `pieces`, each file's column checked as local `prepare` checks a
        corpus's (text, or lists of integer ids), so no value is read by guess."""
        import datasets
        import pyarrow as pa

        from forge_grain.corpora.rows import check_column

        tables = []
        for f, a, b in pieces:
            t = _read_rows(inputs, f, a, b, job.field)
            if not pa.types.is_null(t.schema.field(job.field).type):  # all missing: each row's check names it
                check_column(datasets.Dataset(datasets.table.InMemoryTable(t)), f, job.field, tokens=job.tokens,
                       joined=job.list_separator)
            tables.append(t)
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
        return cls(datasets.Dataset(datasets.table.InMemoryTable(table)), pieces)

    def where(self, row: int) -> str:
        for f, a, b in self.pieces:
            if row < b - a:
                return f"{f}, row {a + row}"
            row -= b - a
        return f"row {row}"


def _read_rows(inputs: Inputs, file: str, lo: int, hi: int, field: str):
    """Rows [lo, hi) of one file, column `field` only (null where a row lacks it)."""
    import pyarrow as pa

    with inputs.open(file) as f:
        if inputs.builder == "parquet":
            pf = open_parquet(f, file)
            groups, at = [], 0
            for g in range(pf.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if at < hi and at + n > lo:
                    groups.append((g, at))
                at += n
            columns = [field] if field in pf.schema_arrow.names else []
            table = pf.read_row_groups([g for g, _ in groups], columns=columns)
            table = table.slice(lo - groups[0][1], hi - lo)
        else:
            table = _read_json_lines(f, file, lo, hi, field)
    if field not in table.column_names:
        table = table.append_column(field, pa.nulls(table.num_rows))
    return table.select([field])


def _read_json_lines(f, file: str, lo: int, hi: int, field: str):
    """Non-blank lines [lo, hi) of a JSON Lines file, parsed as the local loader parses them
    (with its messages for bytes that are not UTF-8 and for a field of mixed types)."""
    import pyarrow as pa
    import pyarrow.json as paj

    from forge_grain.corpora.rows import invalid_utf8, mixed_json_row

    chosen, n = [], 0
    for line in f:
        if not line.strip():
            continue
        if lo <= n < hi:
            chosen.append(line if line.endswith(b"\n") else line + b"\n")
        n += 1
        if n >= hi:
            break
    try:
        return paj.read_json(io.BytesIO(b"".join(chosen)), read_options=paj.ReadOptions(block_size=1 << 24))
    except (pa.ArrowInvalid, UnicodeDecodeError) as e:
        local = None if is_url(file) else [Path(file)]
        message = local and (invalid_utf8(local) or mixed_json_row(local, field))
        raise PrepareError(message or f"{file}: cannot read rows {lo}-{hi} as JSON Lines ({e})") from None


class _Shipped(TextTokenizer):
    """A tokenizer pickled with its own definition, so Beam workers need no copy of its file."""

    @classmethod
    def of(cls, tok: TextTokenizer | None):
        return None if tok is None else cls(tok.path, tok.backend, tok.bos_id, tok.eos_id, tok.special_tokens_in_text)

    def __getstate__(self):
        return {**super().__getstate__(), "definition": self.backend.to_str()}

    def __setstate__(self, state):
        from tokenizers import Tokenizer

        state = dict(state)
        self.backend = Tokenizer.from_str(state.pop("definition"))
        self.__dict__.update(state)
        self.__post_init__()
