"""`prepare` on Apache Beam: the store local `prepare` writes, built on an engine's workers.

`prepare(..., runner="beam", beam_options=[...])` (`forge-grain prepare --runner beam`) runs
two Beam pipelines with the options given (`--runner=DataflowRunner`, `FlinkRunner`,
`SparkRunner`; the local DirectRunner or PrismRunner by default):

1. **Count.** Each input file's rows are counted on a worker (JSON Lines: its non-blank
   lines; Parquet: its footer), and the counts come back in one small file.
2. **Write.** The launcher, holding only those counts, applies local `prepare`'s rule:
   shard i of S holds the corpus's rows [n·i/S, (n·(i+1))/S) in file order, S given or by
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

import dataclasses
import io
import json
import re
import time
from pathlib import Path

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import PipelineOptions

from .errors import PrepareError
from .locks import exclusive_or_refuse
from .manifest import write_json_atomic
from .preparation import (
    LOCK_NAME,
    _already_prepared,
    _clean,
    _done_info,
    _Job,
    _write_shard,
    default_num_shards,
    files_identity,
    write_manifest,
)
from .tokenizer import TextTokenizer

METRICS = "forge_grain"  # the namespace of the job's counters


def prepare_beam(spec, num_shards: int | None, overwrite: bool, options: list[str], progress: bool) -> Path:
    """`prepare` with the Beam runner (see the module docstring); `spec` is local prepare's
    checked options (`preparation._Spec`)."""
    files, builder = _inputs(spec)
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    with exclusive_or_refuse(out / LOCK_NAME, str(out)):
        identity = files_identity(files)
        counts = _counts(files, builder, out, identity, options)
        rows = sum(counts)
        if rows == 0:
            raise PrepareError(f"{spec.source}: the corpus is empty (no documents)")
        num_shards = num_shards or default_num_shards(sum(f.stat().st_size for f in files), rows)
        if not 1 <= num_shards <= rows:
            raise PrepareError(f"num_shards must be between 1 and the {rows} documents, not {num_shards}")
        job, settings, recorded = spec.describe(identity, num_shards)
        if _already_prepared(out, job.key, settings, overwrite):
            return out
        _clean(out, remove_all=overwrite)
        tasks = shard_tasks([str(f) for f in files], counts, num_shards)
        t0 = time.perf_counter()
        result = _run(options, lambda p: _write_pipeline(p, tasks, builder, job, settings, recorded,
                                                         _Shipped.of(spec.tok)))
        counts_record(out, identity).unlink(missing_ok=True)  # the store is complete: a re-run stops at its manifest
        if progress:
            print(summary(result, time.perf_counter() - t0))
    return out


def _inputs(spec) -> tuple[list[Path], str]:
    """The input files in local `prepare`'s order, and their kind ('json' or 'parquet')."""
    from .texts import _builder, _data_files

    if spec.data_files is not None or spec.hf_config is not None:
        raise PrepareError(f"{spec.source}: --runner beam reads files (a path, directory or glob of JSON Lines or "
                           "Parquet files); data_files and hub configurations are read by the local runner")
    path = Path(spec.source)
    if not (path.exists() or any(c in str(spec.source) for c in "*?[")) or (path / "state.json").exists() \
            or (path / "dataset_dict.json").exists():
        raise PrepareError(f"{spec.source}: --runner beam reads JSON Lines and Parquet files (a path, directory or "
                           "glob); hub datasets and saved datasets are read by the local runner")
    files = _data_files(spec.source, spec.split, exclude=Path(spec.out))
    builder = _builder(files, spec.source)
    if builder not in ("json", "parquet"):
        raise PrepareError(f"{spec.source}: --runner beam reads JSON Lines and Parquet files, not {builder} files; "
                           "prepare those with the local runner")
    if all(f.stat().st_size == 0 for f in files):
        raise PrepareError(f"{spec.source}: the corpus is empty (no documents)")
    return files, builder


def shard_tasks(files: list[str], counts: list[int], num_shards: int) -> list[tuple]:
    """Local `prepare`'s rule: (shard, [(file, first row, end row), ...] in order, rows before
    each file) for the corpus's rows [n·i/S, n·(i+1)/S)."""
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


def _run(options: list[str], build):
    """Build and run a pipeline with `options`; a failure on a worker becomes its message."""
    try:
        with beam.Pipeline(options=PipelineOptions(list(options))) as p:
            build(p)
        return p.result if hasattr(p, "result") else None
    except Exception as e:  # runners re-raise a worker's error with the step's name, or wrap its text
        found = [str(e)] if isinstance(e, PrepareError) else re.findall(r"PrepareError: (.+)", str(e))
        if found:
            raise PrepareError(re.sub(r"\s*\[while running '[^']*'\]", "", found[-1]).strip()) from None
        raise PrepareError(f"the Beam job failed: {type(e).__name__}: {str(e)[:2000]}") from None


def _counts(files: list[Path], builder: str, out: Path, identity: str, options: list[str]) -> list[int]:
    """Rows per input file, counted by a Beam job (kept beside the output, keyed by the
    files' identity, so a re-run does not count again)."""

    record = counts_record(out, identity)
    try:
        saved = json.loads(record.read_text())
        if saved.get("identity") == identity:
            return saved["counts"]
    except (OSError, ValueError, AttributeError):
        pass

    def build(p):
        (p | "files" >> beam.Create(list(enumerate(map(str, files))))
           | "spread" >> beam.Reshuffle()
           | "count" >> beam.Map(lambda item: (item[0], count_rows(item[1], builder)))
           | "gather" >> beam.combiners.ToList()
           | "save" >> beam.Map(_save_counts, str(record), identity, len(files)))

    _run(options, build)
    return json.loads(record.read_text())["counts"]


def counts_record(out: Path, identity: str) -> Path:
    return out / f".forge-grain-counts-{identity[:16]}.json"


def _save_counts(pairs, record: str, identity: str, n: int) -> None:
    counts = [0] * n
    for i, c in pairs:
        counts[i] = c
    write_json_atomic(Path(record), {"identity": identity, "counts": counts})


def _write_pipeline(p, tasks, builder: str, job: _Job, settings: dict, recorded: dict, tok) -> None:

    (p | "shards" >> beam.Create(tasks)
       | "spread" >> beam.Reshuffle()
       | "write" >> beam.ParDo(WriteShard(builder, job, tok))
       | "gather" >> beam.combiners.ToList()
       | "manifest" >> beam.Map(_finish, job, settings, recorded))


def _finish(results, job: _Job, settings: dict, recorded: dict) -> None:
    infos = dict(results)
    write_manifest(job, settings, recorded, [infos[i] for i in range(len(infos))])


class WriteShard(beam.DoFn):
    """One shard task to the shard's info: written now, or found done and verified."""

    def __init__(self, builder: str, job: _Job, tok):
        self.builder, self.job, self.tok = builder, job, tok

    def setup(self):
        self.documents = Metrics.counter(METRICS, "documents")
        self.tokens = Metrics.counter(METRICS, "tokens")
        self.written = Metrics.counter(METRICS, "shards_written")
        self.skipped = Metrics.counter(METRICS, "shards_skipped")
        self.shard_tokens = Metrics.distribution(METRICS, "tokens_per_shard")

    def process(self, task):
        i, pieces = task
        info = _done_info(Path(self.job.out), i, self.job.key)
        if info is not None:
            self.skipped.inc()
            yield i, info
            return
        corpus = ShardCorpus.read(pieces, self.builder, self.job.field)
        _, info = _write_shard(corpus, self.tok, self.job, (i, 0, corpus.num_rows), self._report)
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


def count_rows(file: str, builder: str) -> int:
    """Rows of one input file as the local loader reads them (JSON Lines skip blank lines)."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(file).metadata.num_rows
    n = 0
    with open(file, "rb") as f:
        for line in f:
            n += bool(line.strip())
    return n


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
    def read(cls, pieces, builder: str, field: str) -> "ShardCorpus":
        import datasets
        import pyarrow as pa

        tables = [_read_rows(f, builder, a, b, field) for f, a, b in pieces]
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
        return cls(datasets.Dataset(datasets.table.InMemoryTable(table)), pieces)

    def where(self, row: int) -> str:
        for f, a, b in self.pieces:
            if row < b - a:
                return f"{f}, row {a + row}"
            row -= b - a
        return f"row {row}"


def _read_rows(file: str, builder: str, lo: int, hi: int, field: str):
    """Rows [lo, hi) of one file, column `field` only (null where a row lacks it)."""
    import pyarrow as pa

    if builder == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(file)
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
        table = _read_json_lines(file, lo, hi, field)
    if field not in table.column_names:
        table = table.append_column(field, pa.nulls(table.num_rows))
    return table.select([field])


def _read_json_lines(file: str, lo: int, hi: int, field: str):
    """Non-blank lines [lo, hi) of a JSON Lines file, parsed as the local loader parses them
    (with its messages for bytes that are not UTF-8 and for a field of mixed types)."""
    import pyarrow as pa
    import pyarrow.json as paj

    from .texts import invalid_utf8, mixed_json_row

    chosen, n = [], 0
    with open(file, "rb") as f:
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
        message = invalid_utf8([Path(file)]) or mixed_json_row([Path(file)], field)
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
