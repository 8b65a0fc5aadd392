"""Streaming sources: documents tokenized as they are read, packed a window at a time,
dealt to canonical streams so that batches and states do not depend on the cluster.

Canonical streams. Row r of the underlying stream (a `datasets` streaming dataset, or
JSON Lines/Parquet files at URLs: `forge_grain.sources.text_streams`) belongs to canonical stream
r mod C, C = G·P (`canonical_streams` G, `canonical_workers` P in the config). A
canonical stream reads its own rows in order, tokenizes them on a thread pool (results in
order: `forge_grain.preparation.tokenize_pool`) and packs them `window` at a time with the planners of
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

import grain
import numpy as np

from forge_grain.packing import kernels
from forge_grain.sources.config import SourceConfig
from forge_grain.errors import ConfigError, PrepareError, StateError
from forge_grain.sources.hf import _digest, cache_root, path_name, specials_key
from forge_grain.locks import file_lock
from forge_grain.stores.manifest import save_npy_atomic, token_dtype, write_json_atomic
from forge_grain.packing.packed import empty_rows
from forge_grain.packing.plans import ROW_KEYS, PackingError, joined_stats, plan_offsets, stream_key
from forge_grain.sources.text_streams import FileTexts, texts_reader
from forge_grain.preparation.texts import document_text
from forge_grain.preparation.tokenize_pool import TokenizePool

log = logging.getLogger(__name__)
from forge_grain.tokenizer import load_tokenizer

COUNT_BATCH = 256  # texts per counting-pass task
AHEAD = 2  # windows a canonical stream reads and tokenizes ahead of the one it emits
MADE_ROWS = 1 << 14  # rows whose provenance a process keeps for `explain` (the last steps it made)
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
        self.tok = load_tokenizer(src.tokenizer, special_tokens_in_text=src.special_tokens_in_text)
        self.bos = [self.tok.bos_id] if src.add_bos and self.tok.bos_id is not None else []
        self.eos = [self.tok.eos_id] if src.add_eos and self.tok.eos_id is not None else []
        self.vocab_size, self.bos_id, self.eos_id = self.tok.vocab_size, self.tok.bos_id, self.tok.eos_id
        self.tokenizer = self.tok.identity
        self.dtype = token_dtype(self.vocab_size)
        self.reader = texts_reader(src)  # checks it can be read: a clear error now, not at the first batch
        self.path = self.reader.name
        self.key = _digest([*self.reader.identity, self.tok.sha256, src.add_bos, src.add_eos, specials_key(src)])
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
        return int(_digest([self.seed, stream, epoch, window]), 16) & 0x7FFFFFFF

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


class Dealer:
    """One reading of a streaming source per epoch for all the canonical streams a process
    reads: each row read goes to its stream's next window, so a process reading k streams
    reads the source once, not k times. Windows of streams that are behind wait in memory
    (a few: the streams of a process advance together). A stream's windows, markers and row
    indices are exactly those it would see reading alone, so states do not depend on which
    streams a process reads."""

    def __init__(self, source: "StreamingSource", count: int):
        self.source, self.count = source, count
        self._starts: dict[int, tuple] = {}
        self._passes: dict[int, _Pass] = {}

    def position(self, starts: dict[int, tuple]) -> None:
        """The streams and where each starts, (epoch, marker, row), at a window's start."""
        self._starts, self._passes = dict(starts), {}

    def window(self, stream: int, epoch: int) -> tuple:
        """(marker, row index, texts, ended, places) of `stream`'s next window in `epoch`
        (places: each text's file and row in it, where the reader knows them). With files
        dealt, each stream reads its own files: a pass of its own, where it is member 0."""
        files = self.source.files_of is not None
        key, member = ((epoch, stream), 0) if files else (epoch, stream)
        p = self._passes.get(key)
        if p is None:  # every stream reads this epoch some time: from its start, or a restored place in it
            starts = {stream: self._starts[stream]} if files else self._starts
            members = {(0 if files else c): (m, r) if e == epoch else (None, 0) for c, (e, m, r) in starts.items()
                       if e <= epoch}
            p = self._passes[key] = _Pass(self.source.stream_reader(stream) if files else self.source.reader,
                                          self.source.src.window, 1 if files else self.count, members)
        w = p.window(member)
        if w[3]:  # the stream's epoch ended
            del p.members[member]
            if not p.members:
                del self._passes[key]
        return w


class _Member:
    """A stream's share of a pass: its window being filled and its finished windows."""

    def __init__(self, marker, row: int):
        self.marker, self.start, self.texts, self.places = marker, row, [], []
        self.ready: collections.deque = collections.deque()


class _Pass:
    """One epoch's reading of the source, from the earliest start of its streams."""

    def __init__(self, reader, window: int, count: int, members: dict[int, tuple]):
        self.count, self.n = count, window
        self.members = {c: _Member(m, r) for c, (m, r) in members.items()}
        self._marking = collections.defaultdict(list)  # row -> members whose window starts there, marker unknown
        for m in self.members.values():
            if m.marker is None:
                self._marking[m.start].append(m)
        first = min(members.values(), key=lambda mr: mr[1])
        self.it, self.row = reader.open(first[0]), first[1]

    def window(self, stream: int) -> tuple:
        m = self.members[stream]
        while not m.ready:
            self._read_row()
        return m.ready.popleft()

    def _read_row(self) -> None:
        waiting = self._marking.pop(self.row, None)
        if waiting:
            marker = self.it.marker()
            for m in waiting:
                m.marker = marker
        m = self.members.get(self.row % self.count)
        keep = m is not None and self.row >= m.start
        try:
            text = self.it.next(keep)
        except StopIteration:  # every stream's last window (possibly empty) ends the epoch
            for m in self.members.values():
                m.ready.append((m.marker, m.start, m.texts, True, m.places))
                m.texts, m.places = [], []
            return
        self.row += 1
        if keep:
            m.texts.append(text)
            m.places.append(self.it.place())
            if len(m.texts) == self.n:
                m.ready.append((m.marker, m.start, m.texts, False, m.places))
                m.texts, m.places, m.start = [], [], self.row
                self._marking[self.row].append(m)


class StreamCursor:
    """Canonical stream `index` of `count`: its packed rows in order, with an exact state.
    Its windows come from `dealer` (shared by the streams a process reads), else from a
    dealer of its own."""

    def __init__(self, source: StreamingSource, index: int, count: int, state: dict | None = None,
                 dealer: Dealer | None = None):
        self.source, self.index, self.count = source, index, count
        self.seq_len = source.seq_len
        self.pad_id = source.eos_id if source.eos_id is not None else 0
        self._own_dealer = dealer is None
        self.dealer = dealer or Dealer(source, count)
        self.set_state(state or START)

    def state(self) -> dict:
        # the reader's marker as JSON text: its structure changes as it runs, a string's does not
        return {"epoch": self.epoch, "window": self.window, "stream": json.dumps(self._marker),
                "row_index": self._row_index, "emitted": self.emitted}

    def set_state(self, state: dict) -> None:
        """Position at `state`; the windows are read and tokenized ahead, in the background."""
        self.epoch, self.window, self.emitted = state["epoch"], state["window"], state["emitted"]
        marker = json.loads(state["stream"]) if isinstance(state["stream"], str) else state["stream"]
        self._marker, self._row_index = marker, state["row_index"]
        if self._own_dealer:
            self.dealer.position({self.index: (self.epoch, marker, self._row_index)})
        self._reading = (self.epoch, self.window)  # the next window to read
        self._pending: collections.deque = collections.deque()
        self._plan, self._last = None, False
        self._fill()

    def _next_window(self) -> tuple:
        """(epoch, window, marker, row index, texts, last of its epoch, places) of the next window."""
        epoch, window = self._reading
        marker, row, texts, ended, places = self.dealer.window(self.index, epoch)
        self._reading = (epoch + 1, 0) if ended else (epoch, window + 1)
        return epoch, window, marker, row, texts, ended, places

    def _fill(self, cross: bool = False) -> None:
        """Read and submit windows up to `AHEAD` ahead, but not into the next epoch unless
        `cross`: a run that ends with the epoch would tokenize them for nothing."""
        while len(self._pending) < AHEAD:
            last = self._pending[-1][5] if self._pending else self._last
            if last and not cross:
                return
            cross = False
            epoch, window, marker, row, texts, last, places = self._next_window()
            self._pending.append((epoch, window, marker, row, self.source.pool.submit(texts), last, places))

    def _load_window(self) -> None:
        """Make the next window with rows current (the restored one first)."""
        epochs = set()
        while True:
            self._fill(cross=not self._pending)
            epoch, window, marker, row, encoded, self._last, places = self._pending.popleft()
            self._fill()  # keep the pool busy while this window is planned
            epochs.add(epoch)
            if len(epochs) > 2:
                raise PackingError(f"{self.source.path}: canonical stream {self.index} of {self.count} yields no row of "
                                   f"{self.seq_len} tokens in a whole epoch")
            docs = encoded.result()
            self.epoch, self.window, self._marker, self._row_index = epoch, window, marker, row
            lengths = np.array([len(d) for d in docs], np.int64)
            plan = self.source.plan_window(lengths, epoch, window, self.index)
            if plan is not None and self.emitted < plan.num_rows:
                self._plan = plan
                self._record = WindowRecord(self.index, self.source.row_stride(self.count), epoch, window, row,
                                            lengths, places, plan)
                self._pieces = kernels.one_piece(np.concatenate([d for d in docs if len(d)]).astype(self.source.dtype))
                key = stream_key("window-rows", self.source.window_seed(epoch, window, self.index))
                self._order = kernels.permutation(plan.num_rows, key)
                return
            self.emitted = 0

    def emit(self, out: dict, dest: int) -> tuple:
        """Write this stream's next row into row `dest` of `out`; returns where the row came
        from: (its window's `WindowRecord`, its row in the window's plan)."""
        if self._plan is None:
            self._load_window()
        p = self._plan
        made = (self._record, int(self._order[self.emitted]))
        kernels.fill_rows(self._order[self.emitted : self.emitted + 1], np.array([dest], np.int64), p.row_ptr,
                          p.seg_start, p.seg_len, p.seg_skip, p.seg_flags, *self._pieces, self.seq_len, self.pad_id,
                          *(out[k] for k in ROW_KEYS))
        self.emitted += 1
        if self.emitted == p.num_rows:
            self.emitted, self._plan = 0, None
            if self._last:  # the next window starts the next epoch: read it only when a row is wanted
                self.epoch, self.window, self._marker, self._row_index = self.epoch + 1, 0, None, 0
            else:
                self._load_window()  # so that the state is the next window's
        return made


@dataclasses.dataclass(frozen=True)
class WindowRecord:
    """What `explain` needs of a window a canonical stream packed: its place in the stream
    (texts at rows first, first + count, ... of the epoch's pass from `start`), the lengths
    of its documents, each document's file and row where the reader knows them, its plan."""

    stream: int
    count: int
    epoch: int
    window: int
    start: int
    lengths: np.ndarray
    places: list
    plan: object

    def explain(self, plan_row: int) -> dict:
        """The row's epoch, window, plan row and segments (each: `document`, the row of the
        stream's pass that held it; its `file` and `index_in_file` where known; `tokens`,
        `slots`, as for stored sources)."""
        offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        first = self.start + (self.stream - self.start) % self.count  # the window's first text's row
        segments = []
        for k, lo, slot, shown in self.plan.documents_of(plan_row, offsets):
            place = self.places[k]  # one per text of the window
            segments.append({"document": first + k * self.count, "file": place[0] if place else None,
                             "index_in_file": place[1] if place else None, "tokens": [lo, lo + shown],
                             "slots": [slot, slot + shown]})
        return {"epoch": self.epoch, "window": self.window, "plan_row": plan_row, "segments": segments}


class StreamRows:
    """A streaming source's rows as the mixture draws them: global row h comes from canonical
    stream `layout.stream_of(h)` (the mixture passes each row's global index: `sequential`).
    Only the streams this process owns are read; a cursor opens when first needed."""

    sequential = True

    def __init__(self, source: StreamingSource, layout: StreamLayout, rows_per_epoch: int, owned: list[int]):
        self.source, self.layout = source, layout
        self.seq_len, self.num_rows = source.seq_len, rows_per_epoch  # rows the mixture may count on per epoch
        self.stats = source.epoch_stats  # fill and crop of its packing, from the counting pass
        # files dealt to streams is other data than rows dealt: a state of one refuses the other
        self.plan_key = f"stream-{source.key}" + ("-files" if source.files_of is not None else "")
        self.pad_id = source.eos_id if source.eos_id is not None else 0
        self.made: collections.OrderedDict = collections.OrderedDict()  # global row -> (WindowRecord, plan row)
        self.own(owned)

    def own(self, owned: list[int]) -> None:
        """Read only streams `owned`, each from its start."""
        self.owned = list(owned)
        self._position({c: dict(START) for c in self.owned})

    def _position(self, states: dict[int, dict]) -> None:
        self._states, self._cursors = states, {}
        self._dealer = Dealer(self.source, self.layout.count)  # one reading for all of them
        self._dealer.position({c: (st["epoch"], json.loads(st["stream"]) if isinstance(st["stream"], str) else st["stream"],
                                   st["row_index"]) for c, st in states.items()})

    def states(self) -> dict[str, dict]:
        """Each owned stream's state, by stream index (as text: JSON object keys)."""
        return {str(c): self._cursors[c].state() if c in self._cursors else self._states[c] for c in self.owned}

    def set_states(self, states: dict) -> None:
        missing = [c for c in self.owned if str(c) not in states]
        if missing:
            raise StateError(
                f"{self.source.path}: the state has no position for canonical stream(s) {missing} of "
                f"{self.layout.count}, which this process reads; it holds {sorted(map(int, states))}. A state "
                "saved by one shard holds that shard's streams: join every shard's state with "
                "forge_grain.merge_states (the Orbax handler does) to resume on another shard count"
            )
        self._position({c: dict(states[str(c)]) for c in self.owned})

    def _cursor(self, c: int) -> StreamCursor:
        if c not in self._cursors:
            if c not in self._states:
                raise StateError(f"{self.source.path}: canonical stream {c} is not read by this process "
                                       f"(it reads {self.owned})")
            self._cursors[c] = StreamCursor(self.source, c, self.layout.count, self._states[c], self._dealer)
        return self._cursors[c]

    def get_batch(self, ranks, out: dict, dest, id_dtype=np.int32, rows=None) -> dict:
        """Write the next rows of the streams of global rows `rows` into rows `dest` of `out`."""
        streams = self.layout.stream_of(rows)
        for c in np.unique(streams):  # open them all first: their windows tokenize in parallel
            self._cursor(int(c))
        for h, c, d in zip(np.asarray(rows).tolist(), streams.tolist(), np.asarray(dest).tolist()):
            self.made[h] = self._cursors[c].emit(out, d)
        while len(self.made) > MADE_ROWS:
            self.made.popitem(last=False)
        return out

    def explain(self, row: int) -> dict | None:
        """Where global row `row` came from, if this process made it recently (a streaming
        row is known only once read): see `WindowRecord.explain`."""
        made = self.made.get(int(row))
        return None if made is None else made[0].explain(made[1])


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


class StreamingRows(grain.IterDataset):
    """One canonical stream's packed rows (default: all of the source's, as one stream), one
    row per element, as a Grain `IterDataset` whose iterator state is the stream's."""

    def __init__(self, source: StreamingSource, index: int = 0, count: int = 1):
        super().__init__()
        self.source, self.index, self.count = source, index, count

    def __iter__(self) -> "StreamingRowsIterator":
        return StreamingRowsIterator(StreamCursor(self.source, self.index, self.count))


class StreamingRowsIterator(grain.DatasetIterator):
    def __init__(self, cursor: StreamCursor):
        super().__init__()
        self.cursor = cursor

    def __next__(self) -> dict:
        out = empty_rows(1, self.cursor.seq_len)
        self.cursor.emit(out, 0)
        return {k: v[0] for k, v in out.items()}

    def get_state(self) -> dict:
        return self.cursor.state()

    def set_state(self, state: dict) -> None:
        self.cursor.set_state(state)
