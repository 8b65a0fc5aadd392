"""`LengthSchedule`: one source's rows under a sequence-length schedule.

A source's rows are one sequence (row j of it is what the mixture's j-th draw from the
source trains). Under a schedule its rows change length at given rows (the rows the
source has given when the change's step starts: the mixture says, in closed form). The
sequence is then made of pieces, each a `PackedDataset` read over a range of it:

- the source packed at one length, read from an epoch's row on (its own seeded shuffles);
- at a change inside an epoch, the rest of that epoch: the rows not yet read, taken apart
  into the targets they would have trained and planned afresh at the new length
  (`forge_grain.packing.rest`), read in a seeded order; then the next epoch packed whole
  at the new length.

So the rows before a change are exactly what they were, and each epoch trains each
document once across it. Pieces are worked out as rows past a change are first asked for
(the rest of an epoch is planned then, once per process), so a pipeline builds without
planning lengths it does not reach yet.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import logging
import os
import threading

import numpy as np

from forge_grain.locks import file_lock
from forge_grain.packing.epoch_counts import tally
from forge_grain.packing.packed import PackedDataset, empty_rows, pack
from forge_grain.packing.plans import PackingPlan, stream_key
from forge_grain.packing.rest import rest_plan
from forge_grain.paths import plan_cache_dir

log = logging.getLogger(__name__)
# Held while a schedule works out its pieces (planning the rest of an epoch can take seconds). A
# process forked meanwhile (a DataLoader worker, while a prefetch thread plans) would start with
# it taken by a thread it does not have, and wait forever: a fork waits for the planning instead,
# as for `packed._OPENING`. One lock for all schedules: changes are few.
_PLANNING = threading.RLock()
os.register_at_fork(before=_PLANNING.acquire, after_in_parent=_PLANNING.release, after_in_child=_PLANNING.release)


@dataclasses.dataclass
class Piece:
    """Rows [start, end) of the source are dataset indices base + (j - start); `epoch` is
    the source's epoch they belong to; `rest` marks the rest of an epoch at a new length."""

    start: int
    end: int | None
    dataset: PackedDataset
    base: int
    epoch: int
    rest: bool = False


class LengthSchedule:
    """The rows of one packed source whose length changes at source rows `changes`
    ([(first row, length)], the first at row 0; `add_change` appends one). `base` is the
    source packed at one of the lengths (its store is shared); `pack_args` are what `pack` is
    given for the others."""

    sequential = False

    def __init__(self, base: PackedDataset, changes: list[tuple[int, int]], pack_args: dict, seed: int):
        self.base, self.changes, self.pack_args, self.seed = base, [(int(c), int(n)) for c, n in changes], pack_args, seed
        self.seq_len = self.changes[0][1]  # (the mixture's length of reference: the first)
        self._init_runtime()

    def add_change(self, row: int, seq_len: int) -> None:
        """Rows from `row` on (at or after the last change's) are `seq_len` long."""
        if row < self.changes[-1][0]:
            raise ValueError(f"a change at row {row} before the last one, at {self.changes[-1][0]}")
        self.changes.append((int(row), int(seq_len)))

    def _init_runtime(self) -> None:
        self._holding: dict = {}  # (dataset id, documents' digest) -> the dataset's plan rows holding them
        self._by_length: dict[int, PackedDataset] = {}
        self._pieces: list[Piece] | None = None
        self._applied = 0  # changes worked out into pieces

    def __getstate__(self):  # pieces are worked out again where it is unpickled (plans are cached on disk)
        return {"base": self.base, "changes": self.changes, "pack_args": self.pack_args, "seed": self.seed,
                "seq_len": self.seq_len}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_runtime()

    # -- what a Mixture and a pipeline read ---------------------------------------------------

    store = property(lambda self: self.base.store)
    plan_key = property(lambda self: self.base.plan_key)
    plan_sha256 = property(lambda self: self.base.plan_sha256)
    is_open = property(lambda self: self.base.is_open)

    def open(self) -> None:
        self.base.open()

    @property
    def stats(self) -> dict:
        """The packing of the first length (`forge-grain plan`)."""
        return self.at_length(self.seq_len).stats

    @property
    def num_rows(self) -> int:
        """Rows of the first epoch at the first length."""
        return self.at_length(self.seq_len).num_rows

    def at_length(self, seq_len: int) -> PackedDataset:
        """The source packed whole at `seq_len` (planned, or read from the plan cache)."""
        if seq_len == self.base.seq_len:
            return self.base
        if seq_len not in self._by_length:
            self._by_length[seq_len] = pack(self.base.store, seq_len, seed=self.base.seed,
                                            shuffle_window=self.base.shuffle_window, num_epochs=None,
                                            pad_id=self.base.pad_id, **self.pack_args)
        return self._by_length[seq_len]

    def seq_len_at(self, j: int) -> int:
        """The length of source row `j`."""
        return self.changes[bisect.bisect_right([c for c, _ in self.changes], j) - 1][1]

    def get_batch(self, indices, out: dict | None = None, dest=None, id_dtype=np.int32) -> dict:
        idx = np.asarray(indices, np.int64).reshape(-1)
        if out is None:
            out = empty_rows(len(idx), self.seq_len_at(int(idx.max())) if len(idx) else self.seq_len, id_dtype)
        dest = np.arange(len(idx), dtype=np.int64) if dest is None else np.asarray(dest, np.int64)
        for piece, sel in self._by_piece(idx):
            if piece.dataset.seq_len != out["inputs"].shape[1]:
                raise ValueError(f"rows of {piece.dataset.seq_len} tokens asked for a batch of "
                                 f"{out['inputs'].shape[1]}: a batch mixes rows of two lengths")
            piece.dataset.get_batch(piece.base + idx[sel] - piece.start, out=out, dest=dest[sel], id_dtype=id_dtype)
        return out

    def arrays_read(self, indices, ends=None):
        """The token arrays rows `indices` read, in reading order (object storage's hints);
        with `ends`, a list: those of each group of `indices` (group k ends at `ends[k]`)."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        if ends is not None:
            cuts = np.concatenate([[0], ends]).astype(np.int64)
            return [self.arrays_read(idx[cuts[k] : cuts[k + 1]]) for k in range(len(ends))]
        parts = [piece.dataset.arrays_read(piece.base + idx[sel] - piece.start) for piece, sel in self._by_piece(idx)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def windows_apart(self, lo, hi) -> np.ndarray:
        """Whether source rows `lo[k]` and `hi[k]` lie in two windows of a piece's locality
        order (`PackedDataset.windows_apart`), or in two pieces (a length changed between)."""
        lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
        out = np.ones(len(lo), bool)
        pieces = self._pieces_to(int(hi.max()) + 1) if len(hi) else []
        starts = np.array([p.start for p in pieces], np.int64)
        a, b = np.searchsorted(starts, lo, side="right") - 1, np.searchsorted(starts, hi, side="right") - 1
        for i in np.unique(a[a == b]).tolist():
            sel, p = np.flatnonzero((a == i) & (b == i)), pieces[i]
            out[sel] = p.dataset.windows_apart(p.base + lo[sel] - p.start, p.base + hi[sel] - p.start)
        return out

    def trained_tokens(self, n: int) -> int:
        """Loss positions in the first `n` rows."""
        total = 0
        for piece in self._pieces_to(n):
            hi = n if piece.end is None else min(n, piece.end)
            if hi > piece.start:
                d = piece.dataset
                total += d.trained_tokens(piece.base + hi - piece.start) - d.trained_tokens(piece.base)
        return total

    def holding_count(self, documents: np.ndarray, lo: int, hi: int, weighed: bool = False) -> int:
        """Rows in [lo, hi) holding any of `documents` (`weighed`: their trained tokens), each
        piece's rows found in its own plan (skipping documents: `forge_grain.pipeline.skips`)."""
        total = 0
        for piece in self._pieces_to(hi):
            a, b = max(lo, piece.start), hi if piece.end is None else min(hi, piece.end)
            if b > a:
                d, rows = piece.dataset, self._rows_holding(piece.dataset, documents)
                a, b = piece.base + a - piece.start, piece.base + b - piece.start
                total += tally(d.num_rows, rows, a, b, d.loss_positions if weighed else None,
                               lambda e, d=d, rows=rows: d.positions_of(rows, e))
        return total

    def holds(self, j: np.ndarray, documents: np.ndarray) -> np.ndarray:
        """Whether each of rows `j` holds any of `documents`."""
        j = np.asarray(j, np.int64)
        out = np.zeros(len(j), np.bool_)
        for piece, sel in self._by_piece(j):
            d = piece.dataset
            out[sel] = np.isin(d.rows_of(piece.base + j[sel] - piece.start), self._rows_holding(d, documents))
        return out

    def _rows_holding(self, d: PackedDataset, documents: np.ndarray) -> np.ndarray:
        key = (id(d), hashlib.sha256(np.ascontiguousarray(documents, np.int64).tobytes()).hexdigest())
        held = self._holding.get(key)
        if held is None or held[0] is not d:  # (the dataset kept with its rows: an id is not reused meanwhile)
            held = self._holding[key] = (d, d.rows_holding(documents))
        return held[1]

    def locate(self, j: int) -> tuple[PackedDataset, int, int]:
        """(dataset, its index, the source's epoch) of source row `j` (for `explain`)."""
        for piece, _ in self._by_piece(np.array([j], np.int64)):
            i = piece.base + j - piece.start
            return piece.dataset, i, piece.epoch if piece.rest else i // piece.dataset.num_rows
        raise IndexError(j)

    def epochs(self, n: int) -> float:
        """Epochs the first `n` rows cover (the rest of an epoch counts as what it completes)."""
        pieces = self._pieces_to(n)
        piece = next(p for p in reversed(pieces) if p.start <= n)
        if not piece.rest:
            return (piece.base + n - piece.start) / piece.dataset.num_rows
        done = piece.epoch + (piece.base + n - piece.start) / max(piece.dataset.num_rows, 1)
        return min(done, piece.epoch + 1)

    # -- pieces -------------------------------------------------------------------------------

    def _by_piece(self, idx: np.ndarray):
        """(piece, positions of `idx` in it) for each piece `idx` reads."""
        if not len(idx):
            return
        pieces = self._pieces_to(int(idx.max()) + 1)
        starts = np.array([p.start for p in pieces], np.int64)
        k = np.searchsorted(starts, idx, side="right") - 1
        for i in np.unique(k).tolist():
            yield pieces[i], np.flatnonzero(k == i)

    def _pieces_to(self, n: int) -> list[Piece]:
        """The pieces covering rows [0, n), changes up to row n worked out."""
        applied = self._applied  # (read before the pieces: a change sets them, then counts itself)
        pieces = self._pieces
        if pieces is not None and (applied == len(self.changes) or self.changes[applied][0] >= n):
            return pieces  # every batch but those reaching a change: no lock, no copy
        with _PLANNING:
            if self._pieces is None:
                self._pieces = [Piece(0, None, self.at_length(self.seq_len), 0, 0)]
                self._applied = 1
            while self._applied < len(self.changes) and self.changes[self._applied][0] < n:
                self._change(*self.changes[self._applied])
                self._applied += 1
            return self._pieces  # (never changed in place: a change makes a new list)

    def _change(self, row: int, seq_len: int) -> None:
        """Rows from `row` on are `seq_len` long: the rest of the epoch planned at it, then whole epochs."""
        pieces = [p for p in self._pieces if p.start <= row]  # (a rest's next epoch may start past it)
        last = pieces[-1]
        if last.dataset.seq_len == seq_len:
            return
        d, i = last.dataset, last.base + row - last.start
        n = d.num_rows
        epoch, position = (last.epoch, i) if last.rest else divmod(i, n)
        if row == last.start:
            pieces.pop()  # nothing of it was read
        else:
            pieces[-1] = dataclasses.replace(last, end=row)  # (other threads may hold the old list)
        whole = self.at_length(seq_len)
        if position == 0 and not last.rest:  # at an epoch's start: the new length's epoch
            pieces.append(Piece(row, None, whole, epoch * whole.num_rows, epoch))
        else:
            key = stream_key("rest-of-epoch", self.seed, row, seq_len)
            q = self._rest(d, 0 if last.rest else epoch * n, position, seq_len, key)
            if q.num_rows:  # (read a window of chunks at a time where the source's order fits a bounded cache)
                window = self.base.fitted.window if self.base.fitted is not None else None
                rest = PackedDataset(d.store, q, seed=key, shuffle=True, shuffle_window=window, num_epochs=1,
                                     pad_id=d.pad_id)
                pieces.append(Piece(row, row + q.num_rows, rest, 0, epoch, rest=True))
            pieces.append(Piece(row + q.num_rows, None, whole, (epoch + 1) * whole.num_rows, epoch + 1))
        self._pieces = pieces

    def _rest(self, d: PackedDataset, first: int, position: int, seq_len: int, key: int) -> PackingPlan:
        """The rest of the epoch of `d` starting at its index `first`, from `position` on, planned
        at `seq_len`: from the plan cache, else planned and saved there (processes that reach the
        change together wait for the first: DataLoader workers and ranks plan it once a host)."""
        fit = self.base.fitted

        def plan() -> PackingPlan:
            unread = d.rows_of(np.arange(first + position, first + d.num_rows, dtype=np.int64))
            return rest_plan(d.plan, unread, d.store.offsets, seq_len, key, self.pack_args.get("max_segments"),
                             fit.bounds if fit is not None else None)

        cache = plan_cache_dir(d.store.path, self.pack_args.get("cache_dir"))
        if cache is None:
            return plan()
        what = [d.plan.checksum(), d.seed, d.shuffle, d.shuffle_window, first, position, seq_len, key,
                self.pack_args.get("max_segments")] + ([fit.key] if fit is not None else [])
        name = f"rest-{seq_len}-{hashlib.sha256(json.dumps(what).encode()).hexdigest()[:20]}"
        directory = cache / name
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with file_lock(cache / f".{name}.lock"):
                if (directory / "plan.json").exists():
                    try:
                        return PackingPlan.load(directory)
                    except (OSError, ValueError, KeyError) as e:
                        log.warning("forge-grain: planning the rest of an epoch again: %s (%s)", directory, e)
                        return plan()
                q = plan()
                q.save(directory)
                return q
        except OSError as e:  # a read-only or full cache: planned here, kept in memory
            log.warning("forge-grain: cannot cache the rest of an epoch in %s (%s); planned in memory", cache, e)
            return plan()
