"""Reading canonical streams: one pass of the underlying stream dealt to the streams a
process owns, each stream's cursor packing a window at a time, and the rows a pipeline
takes from them (see `forge_grain.sources.streaming` for the layout and the states).

A cursor's state is its window's start and the rows emitted from it; everything here is
rebuilt from that state, so a process that owns other streams, or restores on another
shard count, reads each stream exactly as one reading it alone would.
"""

from __future__ import annotations

import collections
import dataclasses
import json

import grain
import numpy as np

from forge_grain.errors import StateError
from forge_grain.packing import kernels
from forge_grain.packing.packed import empty_rows
from forge_grain.packing.plans import ROW_KEYS, PackingError, stream_key
from forge_grain.sources.streaming import START, StreamingSource, StreamLayout

AHEAD = 2  # windows a canonical stream reads and tokenizes ahead of the one it emits
MADE_ROWS = 1 << 14  # rows whose provenance a process keeps for `explain` (the last steps it made)


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
                          *(out[k] for k in ROW_KEYS), kernels.NO_MASKS, False)
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
