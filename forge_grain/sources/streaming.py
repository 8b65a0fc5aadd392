"""Streaming sources: documents tokenized as they are read, packed a window at a time,
dealt to canonical streams so that batches and states do not depend on the cluster.

Canonical streams. Row r of the underlying stream (a `datasets` streaming dataset, or
JSON Lines/Parquet files at URLs: `forge_grain.corpora.streams`) belongs to canonical stream
r mod C, C = G·P (`canonical_streams` G, `canonical_workers` P in the config). A
canonical stream reads its own rows in order, tokenizes them on a thread pool (results in
order: `forge_grain.sources.tokenize_pool`) and packs them `window` at a time with the planners of
stored sources; a window's rows are shuffled by a seed of (seed, stream, epoch, window).

Global batch s takes its streaming rows from the G streams of class s mod P: position j of
its B rows from stream (s mod P)·G + j·G/B, each stream yielding its rows in order. Shard k
of N holds positions [k·B/N, (k+1)·B/N), so it reads streams of groups [k·G/N, (k+1)·G/N)
only, for any N dividing G: the global batch does not depend on N. Likewise a DataLoader
worker w of W makes steps w, w+W, ..., of classes w mod W, so it reads only those classes'
streams, for any W dividing P. With G = N and P = 1 (the defaults) this is the dealing of
rows to shards of earlier versions, and gives the same batches.

State. A canonical stream's state is its position at the start of its current window (the
reader's marker and the row index there) and the rows already emitted from the window:
restoring re-reads and re-plans that one window. A pipeline state holds its shard's
streams; `pipeline.merge_states` joins all shards' states into one that restores on any
shard count dividing G. A process reads the underlying stream once per epoch for all the
streams it owns (`Dealer`), each row going to its stream's next window; a stream's windows
and positions are those it would see reading alone, so its state does not depend on which
streams a process owns.

Exact step count: a counting pass tokenizes the stream once (on the same pool) keeping only
document lengths (cached on disk, never tokens), then plans every canonical stream's
windows from lengths alone. Row counts do not depend on the window shuffle (every planner's
row count is a function of the multiset of lengths), so one pass serves every epoch,
canonical layout and packing setting.

This module holds the source, its layout and its counting pass; reading the canonical
streams (dealing, cursors, the rows a pipeline takes) is `forge_grain.sources.stream_cursors`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np

from forge_grain.sources.config import SourceConfig
from forge_grain.errors import ConfigError, PrepareError
from forge_grain.corpora.cache_keys import cache_root, digest, path_name, specials_key
from forge_grain.locks import file_lock
from forge_grain.stores.manifest import token_dtype
from forge_grain.files import save_npy_atomic, write_json_atomic
from forge_grain.packing.plans import PackingError, joined_stats, plan_offsets
from forge_grain.corpora.streams import FileTexts, texts_reader
from forge_grain.corpora.rows import document_text
from forge_grain.sources.tokenize_pool import TokenizePool

from forge_grain.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

COUNT_BATCH = 256  # texts per counting-pass task
START = {"epoch": 0, "window": 0, "stream": "null", "row_index": 0, "emitted": 0}


@dataclasses.dataclass(frozen=True)
class StreamLayout:
    """Which canonical stream each row of the global batch sequence comes from."""

    groups: int  # G: position groups of a batch (shard counts dividing it resume exactly)
    classes: int  # P: sets of streams steps take turns over (DataLoader worker counts dividing it)
    batches: object  # the `BatchSchedule`: each step's rows (G divides every size)

    @property
    def count(self) -> int:
        return self.groups * self.classes

    @property
    def canonical(self) -> list[int]:
        """[G, P], as summaries and states record the layout."""
        return [self.groups, self.classes]

    def stream_of(self, rows: np.ndarray) -> np.ndarray:
        """The canonical stream of global rows: by its step's class (step mod P) and the group
        of its position in the step's batch (G equal parts)."""
        step, position, size = self.batches.place(rows)
        return (step % self.classes) * self.groups + position // (size // self.groups)

    def steps_fitting(self, rows: np.ndarray) -> int:
        """The steps made from step 0 before a stream would need more rows than `rows` [P, G]
        (a stream of class p gives size/G rows to each step s = p mod P)."""
        cap = rows.min(axis=1)  # a class's steps take the same share of each of its G streams
        used = np.zeros(self.classes, np.int64)
        ends = [s for s, _ in self.batches.segments[1:]] + [None]
        for (a, size), e in zip(self.batches.segments, ends):
            share = size // self.groups
            first = a + (np.arange(self.classes) - a) % self.classes  # each class's first step from a
            fit = (cap - used) // share  # steps each class can still take
            fail = first + fit * self.classes  # the step that would take one share too many
            if e is None or (fail < e).any():
                return int(fail.min())
            used += (np.maximum(e - first, 0) + self.classes - 1) // self.classes * share

    def owned(self, shard: int, shards: int, worker: int = 0, workers: int = 1) -> list[int]:
        """The streams shard `shard` of `shards` reads; of those, worker `worker` of `workers`'s."""
        per = self.groups // shards
        return [p * self.groups + g for p in range(self.classes) if p % workers == worker
                for g in range(shard * per, (shard + 1) * per)]


class StreamingSource:
    """A streaming source's documents, tokenizer and packing, shared by its canonical streams."""

    def __init__(self, src: SourceConfig, seq_len: int, seed: int, cache_dir: str | Path | None = None,
                 max_segments: int | None = None, tokenize_threads: int | None = None):
        self.src, self.seq_len, self.seed, self.max_segments = src, seq_len, seed, max_segments
        self.cache_dir = cache_dir
        self.tok = load_tokenizer(src.tokenizer, bos=src.bos_token, eos=src.eos_token,
                                  special_tokens_in_text=src.special_tokens_in_text)
        self.bos = [self.tok.bos_id] if src.add_bos and self.tok.bos_id is not None else []
        self.eos = [self.tok.eos_id] if src.add_eos and self.tok.eos_id is not None else []
        self.vocab_size, self.bos_id, self.eos_id = self.tok.vocab_size, self.tok.bos_id, self.tok.eos_id
        self.tokenizer = self.tok.identity
        self.dtype = token_dtype(self.vocab_size)
        self.reader = texts_reader(src)  # checks it can be read: a clear error now, not at the first batch
        self.path = self.reader.name
        self.key = digest([*self.reader.identity, self.tok.sha256, src.add_bos, src.add_eos, specials_key(src)])
        self.tokenize_threads = tokenize_threads

    files_of = None  # with files dealt to canonical streams: each stream's files (`deal`); None: rows dealt

    def deal(self, count: int) -> None:
        """How the rows reach `count` canonical streams: whole files to each (`files_of`), so
        that each byte is read once across the processes, or row r to stream r mod count."""
        self.files_of = dealt_files(self.src, self.reader, count)

    def stream_reader(self, stream: int):
        """What canonical stream `stream` reads: its own files, or (rows dealt) the whole source."""
        return self.reader if self.files_of is None else self.reader.subset(self.files_of[stream])

    def row_stride(self, count: int) -> int:
        """The rows of a stream's reading between two of its own rows: 1 when it reads only its
        files, else the stream count (`_Pass` passes over the others' rows)."""
        return 1 if self.files_of is not None else count

    @property
    def _file_count(self) -> int:
        """Files of a source of files at URLs (whose counting pass records each one's rows), else 0."""
        return len(self.reader.files) if isinstance(self.reader, FileTexts) else 0

    @functools.cached_property
    def pool(self) -> TokenizePool:
        return TokenizePool(self.tokenize, self.tokenize_threads)

    def tokenize(self, texts: list) -> list[np.ndarray]:
        """Token arrays of texts (empty texts give empty arrays), BOS/EOS as configured."""
        try:
            texts = [document_text(t, lambda: f"{self.path}: a row's field {self.src.text_field!r}") for t in texts]
        except PrepareError as e:  # a local file's row: say which (the reader of URLs names them itself)
            locate = getattr(self.reader, "locate", None)
            raise PrepareError((locate and locate(self.src.text_field)) or str(e)) from None
        keep = [t for t in texts if t]
        ids = iter(self.tok.encode_batch(keep)) if keep else iter(())
        return [np.asarray(self.bos + next(ids) + self.eos, np.int64) if t else np.zeros(0, np.int64) for t in texts]

    def window_seed(self, epoch: int, window: int, stream: int) -> int:
        return int(digest([self.seed, stream, epoch, window]), 16) & 0x7FFFFFFF

    def plan_window(self, lengths: np.ndarray, epoch: int, window: int, stream: int):
        """The packing plan of one window of documents (None when it makes no row)."""
        lengths = lengths[lengths > 0]
        if len(lengths) == 0:
            return None
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        try:
            return plan_offsets(offsets, self.seq_len, self.src.strategy, seed=self.window_seed(epoch, window, stream),
                                stride=self.src.stride, name=self.path, max_segments=self.max_segments)
        except PackingError:
            return None  # too few tokens in this window for a row: the window's tail loss

    # -- the counting pass ------------------------------------------------------------------

    def _lengths_files(self) -> tuple[Path, Path, Path]:
        root = cache_root(self.cache_dir)
        stem = f"{path_name(self.src.name)}-{self.key}"
        return root / f"{stem}.lengths.npy", root / f"{stem}.lengths.json", root / f".{stem}.lengths.lock"

    def lengths(self, progress: bool = True) -> np.ndarray:
        """Token length of every row of the stream (0 for empty texts): cached, never tokens."""
        path, meta, lock = self._lengths_files()
        with file_lock(lock):
            cached = self._cached_lengths(path, meta)
            if cached is not None:
                return cached
            from tqdm.auto import tqdm

            t0 = time.perf_counter()
            lengths, file_rows = [], collections.Counter()
            with tqdm(desc=f"count {self.src.name}", unit="doc", disable=not progress) as bar:
                for docs in self.pool.map(self._batches(COUNT_BATCH, file_rows if self._file_count else None)):
                    lengths += [len(d) for d in docs]
                    bar.update(len(docs))
            lengths = np.asarray(lengths, np.int64)
            save_npy_atomic(path, lengths)
            write_json_atomic(meta, {"documents": len(lengths), "seconds": time.perf_counter() - t0,
                                     "key": self.key, "sha256": hashlib.sha256(lengths.tobytes()).hexdigest(),
                                     "file_rows": [file_rows[f] for f in range(self._file_count)]})
        return lengths

    def file_rows(self) -> list[int]:
        """Rows of each file of a source of files at URLs, from the counting pass."""
        self.lengths(progress=False)
        return json.loads(self._lengths_files()[1].read_text())["file_rows"]

    def _cached_lengths(self, path: Path, meta: Path) -> np.ndarray | None:
        """The cached counting pass, if it was made for this stream (its key) and is intact
        (its checksum): a tampered or foreign one would silently change the epoch."""
        if not meta.exists():
            return None
        try:
            info = json.loads(meta.read_text())
            lengths = np.load(path, allow_pickle=False)
            files = self._file_count
            intact = (isinstance(info, dict) and info.get("key") == self.key and len(lengths) == info.get("documents")
                      and hashlib.sha256(np.ascontiguousarray(lengths, np.int64).tobytes()).hexdigest() == info.get("sha256")
                      and len(info.get("file_rows", ())) == files and sum(info.get("file_rows", ())) in (0, len(lengths)))
        except (OSError, ValueError):
            intact = False
        if not intact:
            log.warning("forge-grain: the cached document count of %s (%s) is not this stream's or was changed; "
                        "counting again", self.src.name, path)
            return None
        return lengths.astype(np.int64, copy=False)

    def _batches(self, n: int, file_rows: collections.Counter | None = None):
        it, batch = self.reader.open(), []
        while True:
            try:
                batch.append(it.next())
            except StopIteration:
                break
            if file_rows is not None:  # files at URLs: `it.file` is the row's file
                file_rows[it.file] += 1
            if len(batch) == n:
                yield batch
                batch = []
        if batch:
            yield batch

    def counting_seconds(self) -> float:
        return json.loads(self._lengths_files()[1].read_text())["seconds"]

    def rows_per_stream(self, count: int, progress: bool = True) -> list[int]:
        """Rows each of `count` canonical streams yields in one epoch, planned from the cached
        lengths; the packing's figures of that epoch (fill, crop: `plans.joined_stats`) are
        kept in `epoch_stats`, a window too short for a row counting as lost tokens."""
        lengths = self.lengths(progress)
        if self.files_of is not None:  # a stream's rows: its files' rows, in its files' order
            per_file = self.file_rows()
            of_file = np.split(lengths, np.cumsum(per_file)[:-1])
        rows, parts = [], []
        for c in range(count):
            own = lengths[c::count] if self.files_of is None else np.concatenate(
                [of_file[f] for f in self.files_of[c]] or [np.zeros(0, np.int64)])
            n = 0
            for w in range(0, len(own), self.src.window):
                window = own[w : w + self.src.window]
                p = self.plan_window(window, 0, w // self.src.window, c)
                if p is not None:
                    n += p.num_rows
                    parts.append(p.stats)
                else:  # too few tokens for a row: the window's tokens are lost
                    lost = int(window.sum())
                    parts.append({"tokens": lost, "lost_tokens": lost})
            rows.append(n)
        self.epoch_stats = joined_stats(parts, self.seq_len, self.src.strategy)
        return rows


BALANCE = 1.02  # files are dealt by themselves ("auto") when the streams' bytes are this even


def dealt_files(src: SourceConfig, reader, count: int) -> list[list[int]] | None:
    """Each canonical stream's files when `src.dealing` (or "auto") deals whole files, else None
    (row r to stream r mod count). Files go largest first to the stream with the fewest bytes
    so far; a stream reads its files in the list's order. "auto" deals files when there are at
    least as many as streams and their bytes come out within 2% of each other: an uneven deal
    would end some streams' epochs well before others'."""
    mode = src.dealing or "auto"
    if mode == "rows" or count == 1:
        return None
    if not isinstance(reader, FileTexts) or len(reader.files) < count:
        if mode == "files":
            raise ConfigError(
                f"sources '{src.name}'.dealing = 'files' needs files at URLs (hf_data_files = [\"s3://...\"]), at least "
                f"as many as the {count} canonical streams; this source has "
                f"{len(reader.files) if isinstance(reader, FileTexts) else 'a datasets reader'}: use dealing = 'rows'")
        return None
    sizes = [int(i[1] or 0) for i in reader.identity]
    loads, dealt = [0] * count, [[] for _ in range(count)]
    for f in sorted(range(len(sizes)), key=lambda f: (-sizes[f], f)):
        c = min(range(count), key=lambda c: (loads[c], c))
        loads[c] += sizes[f]
        dealt[c].append(f)
    if mode == "auto" and max(loads) > BALANCE * min(loads):
        return None
    return [sorted(d) for d in dealt]


def rows_per_epoch(source: StreamingSource, layout: StreamLayout, progress: bool = True) -> int:
    """Rows of one epoch the mixture may count on: the rows of the steps made before any
    stream would start its second epoch (`StreamLayout.steps_fitting`). With one source,
    `num_epochs=1` is exactly those steps."""
    rows = np.array(source.rows_per_stream(layout.count, progress)).reshape(layout.classes, layout.groups)
    return layout.batches.row(layout.steps_fitting(rows))
