"""`pack()` and `PackedDataset`: a Grain `MapDataset` of packed rows over a token store."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import grain
import numpy as np

from forge_grain.packing import kernels, row_parts
from forge_grain.paths import plan_cache_dir
from forge_grain.packing.buffers import BufferPool, count
from forge_grain.lazy import lazy
from forge_grain.files import remove_stale_temporaries, temporary
from forge_grain.locks import file_lock
from forge_grain.packing.chunked import CHUNK_DOCS, plan_chunked
from forge_grain.packing.fitted import fitted_chunks
from forge_grain.packing.plans import (PLAN_ARRAYS, PLAN_VERSION, ROW_KEYS, PackingPlan, key63, plan, require_bos,
                                       rows_holding)
from forge_grain.packing.windows import WindowOrder
from forge_grain.stores import TokenStore, step_reads
from forge_grain.stores.mapping import Addresses

log = logging.getLogger(__name__)
MASK_KEYS = ("loss_mask", "natural_stop")
_OPENING = threading.RLock()  # held while a deferred dataset opens its store and plan
# A process forked while another thread opens a dataset (the background opener, Grain's threads)
# would start with this lock, and whatever the open holds below it, taken by a thread it does
# not have: its first open would wait forever (a DataLoader worker hung so). A fork waits for
# the open in progress instead, and both sides go on with the lock as it was before the open
# (reentrant: a fork from within an open, by the thread that holds it, goes through).
os.register_at_fork(before=_OPENING.acquire, after_in_parent=_OPENING.release, after_in_child=_OPENING.release)


def empty_rows(n: int, seq_len: int, id_dtype=np.int32, pool: BufferPool | None = None) -> dict:
    """Output arrays for n rows: ids and positions in `id_dtype` (int32 by default; int64
    spares a torch bridge a conversion pass), masks as bool; from `pool` when given."""
    specs = _row_specs(n, seq_len, id_dtype)
    if pool is not None:
        return pool.arrays(specs)
    return {k: np.empty(shape, dtype) for k, shape, dtype in specs}


def _bounds(idx: np.ndarray) -> tuple[int, int]:
    """The least and greatest of `idx` ((0, -1) if empty): a batch's few in Python, where
    numpy's reductions took 5x as long (every step); more in numpy."""
    if len(idx) > 64:
        return int(idx.min()), int(idx.max())
    listed = idx.tolist()
    return (min(listed), max(listed)) if listed else (0, -1)


@functools.lru_cache(maxsize=64)
def _row_specs(n: int, seq_len: int, id_dtype) -> tuple:
    """(key, shape, dtype) of `empty_rows`' arrays (found once per shape: made every batch)."""
    return tuple((k, (n, seq_len), np.dtype(np.bool_ if k in MASK_KEYS else id_dtype)) for k in ROW_KEYS)


def pack(
    store: TokenStore | str | Path,
    seq_len: int,
    strategy: str = "bestfit",
    *,
    bos_id: int | None = None,
    seed: int = 0,
    stride: int | None = None,
    shuffle: bool = True,
    shuffle_window: int | None = None,
    num_epochs: int | None = 1,
    pad_id: int | None = None,
    cache_dir: str | Path | None = None,
    chunk_docs: int | None = None,
    plan_workers: int | None = None,
    max_segments: int | None = None,
    progress: bool = True,
    shuffle_bytes: int | None = None,
) -> "PackedDataset":
    """Pack a token store into rows of `seq_len`; the plan is cached on disk and reused.

    strategy: "concat" (split the concatenated stream; rows cross documents),
    "bos_bestfit" (every row starts at a document's BOS; 100% fill, crops little) or
    "bestfit" (best-fit decreasing with padding; long documents split, no token lost;
    `stride < seq_len` makes overlapping windows whose repeated head is loss-masked).
    `num_epochs=None` repeats forever; each epoch visits the rows in a new seeded order
    (`shuffle=False`: plan order). `shuffle_window=W` shuffles W planning chunks' rows at
    a time instead of the whole epoch's, so a store in object storage is read a few chunks
    at a time (see `PackedDataset.rows_of`).

    A store of more than `chunk_docs` documents (default `chunked.CHUNK_DOCS`, about 4 M)
    is planned a chunk at a time in `plan_workers` processes (default: one per core past
    `chunked.IN_PROCESS_DOCS` documents, else in this process); see
    `forge_grain.packing.chunked` for what that changes (nothing a trainer sees but the plan's
    memory and time). `max_segments`: at most this many segments (documents or parts of
    one) a row, for attention kernels that need a bound; rows that reach it are padded.
    `progress=False` hides the planning bar of a chunked store. `shuffle_bytes`: the order
    fits a bounded cache (`forge_grain.packing.fitted`: chunks of whole data files, as many
    shuffled together as hold `shuffle_bytes` bytes of their files; it replaces `shuffle_window`),
    unless the store holds at most twice that.
    """
    store = store if isinstance(store, TokenStore) else TokenStore.open(store)
    chunk_docs = chunk_docs or CHUNK_DOCS
    fit = fitted_chunks(store, shuffle_bytes, chunk_docs) if shuffle_bytes else None
    chunked = fit is not None or len(store) > chunk_docs
    cache = plan_cache_dir(store.path, cache_dir)
    if cache is not None:
        remove_stale_temporaries(cache)  # plans of processes that died while saving
    key = plan_key(store, seq_len, strategy, seed, stride, chunk_docs if chunked else None, max_segments,
                   fit.key if fit is not None else None)
    directory = cache / key if cache is not None else None
    p = _load_valid(directory, store, seq_len, strategy)
    if p is None and chunked:
        p = _plan_chunked(store, seq_len, strategy, directory, seed, stride, bos_id, chunk_docs, plan_workers,
                          max_segments, progress, fit.bounds if fit is not None else None)
    elif p is None:
        p = plan(store, seq_len, strategy, seed=seed, stride=stride, bos_id=bos_id, max_segments=max_segments)
        directory = _save(p, directory, store, seq_len, strategy)
        p = _load_valid(directory, store, seq_len, strategy) or p  # memory-mapped when saved
    if fit is not None:
        shuffle_window = fit.window
    dataset = PackedDataset(store, p, seed=seed, shuffle=shuffle, shuffle_window=shuffle_window, num_epochs=num_epochs,
                            pad_id=pad_id, plan_dir=directory)
    dataset.fitted = fit
    return dataset


def _plan_chunked(store, seq_len, strategy, directory, seed, stride, bos_id, chunk_docs, workers,
                  max_segments=None, progress=True, bounds=None) -> PackingPlan:
    """`chunked.plan_chunked` into the plan cache; without one, into a temporary directory
    and then memory (the plan must not depend on whether a cache could be written)."""
    require_bos(store, strategy, bos_id)
    args = dict(seed=seed, stride=stride, chunk_docs=chunk_docs, workers=workers, name=str(store.path),
                max_segments=max_segments, progress=progress, bounds=bounds)
    if directory is not None:
        try:
            # one planner per plan: processes planning the same store at once wait for the first
            # (each removing the chunks' directory when done would pull it from under the others)
            with file_lock(directory.with_name(f".{directory.name}.lock")):
                return (_load_valid(directory, store, seq_len, strategy, quiet=True)
                        or plan_chunked(store.offsets, seq_len, strategy, directory, **args))
        except OSError as e:  # a full or read-only cache: plan as without one
            log.warning("forge-grain: cannot write the plan of %s in %s (%s); planning in a temporary directory "
                        "and keeping the plan in memory", store.path, directory.parent, e.strerror or e)
            for leftover in (directory.with_name(directory.name + ".chunks"), temporary(directory)):
                shutil.rmtree(leftover, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        p = plan_chunked(store.offsets, seq_len, strategy, Path(tmp) / "plan", **args)
        return dataclasses.replace(p, **{name: np.array(getattr(p, name)) for name in PLAN_ARRAYS})


def plan_key(store: TokenStore, seq_len: int, strategy: str, seed: int, stride: int | None,
             chunk_docs: int | None = None, max_segments: int | None = None, chunks: str | None = None) -> str:
    """Fingerprint of everything a plan depends on: document lengths and the parameters
    (and the chunk size of a store planned in chunks, a cap on segments per row, and the
    key of chunks fitted to a cache)."""
    h = hashlib.sha256(np.ascontiguousarray(store.offsets).view(np.uint8))
    params = [PLAN_VERSION, seq_len, strategy, seed, stride] + ([chunk_docs] if chunk_docs is not None else [])
    params += [{"max_segments": max_segments}] if max_segments else []
    params += [{"chunks": chunks}] if chunks else []
    h.update(json.dumps(params).encode())
    return f"{strategy}-{seq_len}-{h.hexdigest()[:20]}"


def _save(p: PackingPlan, directory: Path | None, store, seq_len: int, strategy: str) -> Path | None:
    """Save a fresh plan unless another process saved a valid one meanwhile; None when it
    cannot be saved (a read-only or full disk: the plan stays in memory, with a warning)."""
    if directory is None:
        return None
    if _load_valid(directory, store, seq_len, strategy, quiet=True) is not None:
        return directory
    try:
        _discard(directory)
        p.save(directory)
        return directory
    except OSError as e:
        log.warning("forge-grain: cannot save the packing plan to %s (%s); it is kept in memory", directory, e)
        return None


def _load_valid(directory: Path | None, store: TokenStore, seq_len: int, strategy: str,
                quiet: bool = False) -> PackingPlan | None:
    """The cached plan if present, matching its checksum and parameters, and consistent with
    the store; else None (rebuild, logged)."""
    if directory is None or not (directory / "plan.json").exists():
        return None
    try:
        p = PackingPlan.load(directory)
        ends = np.asarray(p.seg_start) + np.asarray(p.seg_len)
        ok = (p.seq_len == seq_len and p.strategy == strategy and len(p.row_ptr) >= 1
              and p.row_ptr[-1] == len(p.seg_start) and not (len(ends) and ends.max() > store.num_tokens))
        problem = None if ok else "its parameters or extent disagree with the store"
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = str(e)
    if problem is None:
        return p
    if not quiet:
        log.warning("forge-grain: rebuilding the packing plan in %s (%s)", directory, problem)
    return None


def _discard(directory: Path) -> None:
    """Move an invalid cached plan out of the way (atomically), then delete it."""
    if directory.exists():
        trash = temporary(directory, "stale")
        try:
            os.rename(directory, trash)
        except OSError:
            return
        shutil.rmtree(trash, ignore_errors=True)


def seed_key(seed: int) -> int:
    """A 63-bit key for the row shuffle of a seed (the kernel mixes in the epoch)."""
    return key63(f"forge-grain-rows:{seed}")


class PackedDataset(grain.MapDataset):
    """Packed rows of a token store: element i is a dict of `seq_len` arrays.

    Keys: `inputs`, `targets` (next token), `segment_ids` (1-based per segment, 0 on
    padding), `positions` (within the segment), `loss_mask` (0 on padding, on targets
    that would cross into another segment, and on overlap heads), `natural_stop`
    (1 where the target is the last token of its document: its true end, not a crop
    or split). `get_batch(indices)` returns the same keys with a leading batch axis,
    gathered in one compiled call.
    """

    def __init__(self, store, packing_plan, *, seed=0, shuffle=True, shuffle_window=None, num_epochs=1, pad_id=None,
                 plan_dir=None):
        super().__init__()
        self._store, self._plan, self._opener = store, packing_plan, None
        self._plan_dir = plan_dir
        pad_id = pad_id if pad_id is not None else (store.eos_id if store.eos_id is not None else 0)
        self._describe(packing_plan.seq_len, packing_plan.num_rows, packing_plan.stats.get("chunk_rows"), pad_id,
                       plan_dir.name if plan_dir is not None else None, seed, shuffle, shuffle_window, num_epochs)

    def _describe(self, seq_len, num_rows, chunk_rows, pad_id, plan_key, seed, shuffle, shuffle_window, num_epochs):
        """What the mixture and the state fingerprint read without touching the store or plan."""
        self.seq_len, self._num_rows, self.pad_id, self.plan_key = seq_len, num_rows, pad_id, plan_key
        self.seed, self.shuffle, self.num_epochs = seed, shuffle, num_epochs
        self.shuffle_window = shuffle_window
        self.fitted = None  # the chunks fitted to a bounded cache (`pack`'s shuffle_bytes), if any
        self._chunk_rows = np.asarray(chunk_rows or [num_rows], np.int64)
        # the locality order of `shuffle_window` chunks at a time (None: the whole epoch's shuffle)
        windowed = shuffle and shuffle_window
        self._windows = WindowOrder(self._chunk_rows, num_rows, shuffle_window, seed_key(seed)) if windowed else None
        self._row_tokens = None  # loss positions per plan row, for `trained_tokens`
        self._plan_sha256 = None
        self._tables = threading.local()  # each thread's `Addresses` of the arrays it gathers from object storage

    @lazy
    def _seed_key(self) -> int:
        return seed_key(self.seed)

    @lazy
    def _pool(self) -> BufferPool:
        return BufferPool()

    @classmethod
    def deferred(cls, opener, *, seq_len, num_rows, chunk_rows, pad_id, plan_key, plan_sha256, **kwargs):
        """A dataset that opens its store and plan when first read: `opener()` returns the
        `PackedDataset` opened in full, which must agree with the description given here
        (see `forge_grain.sources.deferred`; a mixture of thousands of sources builds without
        opening them)."""
        self = cls.__new__(cls)
        grain.MapDataset.__init__(self)
        self._store = self._plan = self._plan_dir = None
        self._opener = opener
        self._describe(seq_len, num_rows, chunk_rows, pad_id, plan_key, **kwargs)
        self._plan_sha256 = plan_sha256
        return self

    @property
    def is_open(self) -> bool:
        """False for a deferred dataset not read yet."""
        return self._plan is not None

    def open(self) -> None:
        """Open a deferred dataset's store and plan now (a background opener runs ahead of reads)."""
        if self._plan is None:
            self._open()

    def _open(self) -> None:
        with _OPENING:  # one lock for all: a lock per dataset costs more than thousands of sources' build
            if self._plan is None:
                full = self._opener()
                self._store, self._plan_dir = full._store, full._plan_dir
                self._plan = full._plan  # last: other threads read `_plan` to see it is open

    @property
    def store(self) -> TokenStore:
        if self._plan is None:
            self._open()
        return self._store

    @property
    def plan(self) -> PackingPlan:
        if self._plan is None:
            self._open()
        return self._plan

    @property
    def plan_sha256(self) -> str:
        """The plan's checksum (for the state fingerprint), known without opening a deferred plan."""
        return self._plan_sha256 if self._plan is None else self._plan.checksum()

    @property
    def num_rows(self) -> int:
        """Rows in one epoch."""
        return self._num_rows

    @property
    def stats(self) -> dict:
        return dict(self.plan.stats)

    def __len__(self) -> int:
        return sys.maxsize if self.num_epochs is None else self.num_rows * self.num_epochs

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        batch = self.get_batch(np.array([index], np.int64))
        return {k: v[0] for k, v in batch.items()}

    @property
    def loss_positions(self) -> np.ndarray:
        """Loss positions (trained tokens) of each plan row; of a store with target masks, those
        whose target is marked one."""
        if self._row_tokens is None:
            p = self.plan
            s, none = self.store, np.zeros(1, np.int64)
            pieces = self._pieces[1:] if s.masked else (none, none, none)  # (read only with masks)
            self._row_tokens = kernels.row_loss_positions(p.row_ptr, p.seg_start, p.seg_len, p.seg_skip, self.seq_len,
                                                          s.masks, *pieces, s.masked)
        return self._row_tokens

    def trained_tokens(self, n: int) -> int:
        """Loss positions in the first `n` rows of this dataset's order (epochs included)."""
        per_row = self.loss_positions
        full, part = divmod(int(n), self.num_rows)
        total = full * int(per_row.sum())
        if part:
            total += int(per_row[self.rows_of(np.arange(full * self.num_rows, full * self.num_rows + part))].sum())
        return total

    def rows_of(self, indices) -> np.ndarray:
        """Plan rows of dataset indices: epoch e = i // num_rows, permuted by (seed, e)."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        first, last = _bounds(idx)
        if first < 0 or last >= len(self):
            raise IndexError(f"index out of range for a packed dataset of {len(self)} rows")
        if self._windows is not None:
            return self._windows.rows(idx, first, last)
        return kernels.epoch_rows(idx, self.num_rows, self._seed_key, self.shuffle)

    def windows_apart(self, lo, hi) -> np.ndarray:
        """Whether indices `lo[k]` and `hi[k]` lie in two windows of the locality order (`WindowOrder.apart`)."""
        return self._windows.apart(lo, hi) if self._windows is not None else np.zeros(len(lo), bool)

    def positions_of(self, plan_rows, epoch: int) -> np.ndarray:
        """The inverse of `rows_of` within one epoch: where in epoch `epoch` (dataset index
        minus epoch · num_rows) each of `plan_rows` is read."""
        rows = np.asarray(plan_rows, np.int64).reshape(-1)
        if self._windows is None:
            return kernels.epoch_positions(rows, self.num_rows, self._seed_key, int(epoch), self.shuffle)
        return self._windows.positions(rows, int(epoch))

    def rows_holding(self, documents) -> np.ndarray:
        """The plan rows (sorted) that hold any token of the store's `documents`."""
        return rows_holding(self.plan, self.store, documents)

    def get_batch(self, indices, out: dict | None = None, dest=None, id_dtype=np.int32) -> dict:
        """Rows `indices` as [len(indices), seq_len] arrays; into `out` when given, at
        rows `dest` of it (default: 0, 1, ...). Ids and positions are `id_dtype`."""
        rows = self.rows_of(indices)
        n = len(rows)
        out = out if out is not None else empty_rows(n, self.seq_len, id_dtype, self._pool if n > 1 else None)
        dest = count(n) if dest is None else np.asarray(dest, np.int64)
        gather = self._gather
        if gather is not None:
            self._fill(rows, dest, out, gather)
        elif self._pieces is None:
            rows, *read = self._read_segments(rows)
            self._fill(rows, dest, out, read)
        else:  # fetched from object storage: only the arrays these rows read
            self._fill_fetched(rows, dest, out)
        return out

    def _fill(self, rows, dest, out: dict, gather, held_only: bool = False) -> bool:
        """Rows `rows` into `out` at `dest`, from `gather` (the plan's segments and the pieces);
        `held_only`: False at a row reading an array `gather` holds no address of (else an error)."""
        row_ptr, start, length, skip, flags, pieces = gather
        done = kernels.fill_rows(rows, dest, row_ptr, start, length, skip, flags, *pieces, self.seq_len, self.pad_id,
                                 *(out[k] for k in ROW_KEYS), self.store.masks, self.store.masked)
        if done < len(rows) and not held_only:  # (never: the arrays are set before)
            raise RuntimeError(f"{self.store.path}: a row's token array was not mapped before the gather")
        return done == len(rows)

    def _fill_fetched(self, rows, dest, out: dict) -> None:
        """Rows of a store fetched from object storage. Under a `cache_limit`, where some of
        their shards are here and some still arrive, the rows of those here are filled first,
        and the shards only they read are told done (`step_reads`) before the rest wait: so
        that a step across a boundary of the read order that fits the cache frees the shard
        it leaves while the next one arrives."""
        p, store = self.plan, self.store
        segments = p.row_ptr, p.seg_start, p.seg_len, p.seg_skip, p.seg_flags
        table, maps = self._table(), store.maps
        found = table.unchanged(maps)  # (most steps read only arrays held there; one reading any other
        if found is not None and self._fill(rows, dest, out, (*segments, (found, *self._pieces[1:])), held_only=True):
            return  # goes the way below with all its rows: those of shards held are told done first)
        needed = self._arrays_of(rows)
        changes = maps.changes  # (before the store is asked: a map changed meanwhile counts)
        arrays = store.mapped(needed)  # (most other steps: all mapped)
        if arrays is None and store.may_read_ranges() and self._fill_ranges(rows, dest, out):
            return  # (the first steps: their shards still arriving)
        if arrays is None:
            if store.cache.limit is not None and len(rows) > 1:
                held = store.held(needed)
                if held.any() and not held.all():
                    rows, dest, needed = self._fill_held_first(rows, dest, out, segments, needed, held)
            arrays = store.arrays_for(needed)
        found = table.token_arrays(needed.tolist(), arrays, maps, changes)
        self._fill(rows, dest, out, (*segments, (found, *self._pieces[1:])))

    def _fill_held_first(self, rows, dest, out: dict, segments, needed, held) -> tuple:
        """Fill the rows reading only `needed[held]`, tell the arrays no other row reads done:
        the rows, places and arrays left."""
        waiting = needed[~held]
        ready = np.array([not np.isin(self._arrays_of(rows[i : i + 1]), waiting).any() for i in range(len(rows))])
        if not ready.any():
            return rows, dest, needed
        first = self._arrays_of(rows[ready])
        found = self._table().token_arrays(first.tolist(), self.store.arrays_for(first))
        self._fill(rows[ready], dest[ready], out, (*segments, (found, *self._pieces[1:])))
        later = self._arrays_of(rows[~ready])
        step_reads.done_reading(self.store, needed[held & ~np.isin(needed, later)])
        return rows[~ready], dest[~ready], later

    @lazy
    def _gather(self) -> tuple | None:
        """What the compiled gather reads, found once (a row read one at a time feels every
        attribute looked up: these lookups were a tenth of its time); None where a read must
        find its own (stores read a document at a time, or fetched from object storage)."""
        pieces = self._pieces
        if pieces is None or self.store.fetches:
            return None
        p = self.plan
        return p.row_ptr, p.seg_start, p.seg_len, p.seg_skip, p.seg_flags, pieces

    @property
    def _pieces(self):
        """The store's token runs for the gather (None: read a document at a time); the store
        builds them on the first gather, so a mixture of thousands of sources opens quickly."""
        return self.store.pieces

    def _arrays_of(self, rows, ends=None):
        """The token arrays plan rows `rows` read, once each, in the order the rows first read
        them (a segment never spans two arrays: it lies in one document); with `ends`, a list:
        those of each group of the rows (group k ends at `ends[k]`)."""
        arrays, starts, array, _ = self._pieces
        rows, p = np.asarray(rows, np.int64), self.plan
        if ends is None:
            return kernels.arrays_read(rows, p.row_ptr, p.seg_start, starts, array, len(arrays.addresses))
        out, out_ends = kernels.arrays_read_each(rows, np.asarray(ends, np.int64), p.row_ptr, p.seg_start, starts,
                                                 array, len(arrays.addresses))
        cuts = [0, *out_ends.tolist()]  # (slices: `np.split` took most of this call for a block of 16 steps)
        return [out[cuts[k] : cuts[k + 1]] for k in range(len(out_ends))]

    def _table(self) -> Addresses:
        """This thread's table of the store's token arrays, by address (`mapping.Addresses`)."""
        table = getattr(self._tables, "table", None)
        if table is None:
            table = self._tables.table = Addresses(self.store.num_arrays, self.store.dtype)
        return table

    def arrays_read(self, indices, ends=None):
        """The token arrays rows `indices` read, in reading order, for a store that fetches
        them ahead (`TokenStore.prefetch`); empty for any other store. With `ends`, a list:
        those of each group of `indices` (group k ends at `ends[k]`), found in one call (the
        hints' blocks of steps, each step's own at a boundary of a fitted order: a call a step
        was a tenth of a bounded consumer's time a step)."""
        if self._pieces is not None and self.store.fetches:
            return self._arrays_of(self.rows_of(indices), ends)
        none = np.zeros(0, np.int64)
        return none if ends is None else [none] * len(ends)

    def _read_segments(self, rows):
        """For stores read a document at a time (ArrayRecord, MDS): read the rows' segments
        into one buffer and describe them as a plan over that buffer."""
        seg = kernels.row_segments(rows, self.plan.row_ptr)
        parts = row_parts.document_parts(self.plan, self.store, seg)
        return row_parts.over_parts(self.plan, rows, seg, parts, self.store.dtype)

    def _fill_ranges(self, rows, dest, out: dict) -> bool:
        """Rows of a store in object storage whose shards are still arriving, their segments
        read in ranged GETs now (`stores.document_ranges`: the first steps of a global shuffle
        read a little of dozens of shards); False where the store says to wait instead."""
        seg = kernels.row_segments(rows, self.plan.row_ptr)
        parts = row_parts.ranged_parts(self.plan, self._pieces, self.store, seg)
        if parts is None:
            return False
        over, *read = row_parts.over_parts(self.plan, rows, seg, parts, self.store.dtype)
        self._fill(over, dest, out, read)
        return True

    def __reduce__(self):
        plan_ref = self._plan_dir if self._plan_dir is not None and (self._plan_dir / "plan.json").exists() else self.plan
        return (
            _restore,
            (self.store, plan_ref, dict(seed=self.seed, shuffle=self.shuffle, shuffle_window=self.shuffle_window,
                                        num_epochs=self.num_epochs, pad_id=self.pad_id)),
        )

    def __str__(self) -> str:
        return f"PackedDataset({self.plan.strategy}, seq_len={self.seq_len}, rows={self.num_rows}, epochs={self.num_epochs})"


def _restore(store, plan_ref, kwargs):
    p = PackingPlan.load(plan_ref) if isinstance(plan_ref, Path) else plan_ref
    return PackedDataset(store, p, plan_dir=plan_ref if isinstance(plan_ref, Path) else None, **kwargs)
