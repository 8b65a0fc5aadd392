"""Packing plans and packed datasets: documents into fixed-length rows, planned from lengths alone.

`pack(store, seq_len, strategy)` plans once (a compiled kernel over document lengths; no
token is read), caches the plan on disk keyed by a fingerprint of the store's document
lengths and the parameters, and returns a `PackedDataset`: a Grain `MapDataset` with an
exact length whose element i is row i, and whose `get_batch(indices)` gathers many rows
into preallocated arrays in one call.

Epochs reuse the one plan: epoch e visits its rows in a permutation seeded by
(seed, e). Re-planning per epoch would change which documents share a row but not the
fill or the crop, and would cost a planning pass and a plan's worth of disk per epoch;
with one plan, any row of any epoch is O(1) to find, which exact resume relies on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from forge_grain.packing import kernels
from forge_grain.errors import ForgeGrainError
from forge_grain.files import temporary
from forge_grain.stores.mapping import map_npy
from forge_grain.stores import TokenStore
from forge_grain.packing.names import STRATEGIES  # noqa: F401  (the planner's names, re-exported)
PLAN_VERSION = 3  # 2: plan.json carries a checksum; 3: own document permutation, bestfit windows overlap by one
ROW_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "natural_stop")
# plan arrays are .npy files named `.array`, which no token-file glob (`*.npy`) matches
ARRAY_SUFFIX = ".array"
PLAN_ARRAYS = ("row_ptr", "seg_start", "seg_len", "seg_skip", "seg_flags")


class PackingError(ForgeGrainError):
    """Packing parameters that cannot work for this store."""


@dataclasses.dataclass
class PackingPlan:
    """Which token runs make up each row; see `forge_grain.packing.kernels` for the layout."""

    strategy: str
    seq_len: int
    row_ptr: np.ndarray
    seg_start: np.ndarray
    seg_len: np.ndarray
    seg_skip: np.ndarray
    seg_flags: np.ndarray
    stats: dict

    @property
    def num_rows(self) -> int:
        return len(self.row_ptr) - 1

    def documents_of(self, row: int, offsets) -> list[tuple[int, int, int, int]]:
        """Per segment of plan row `row`: (document, first token of it, first input slot,
        tokens in input slots), the documents starting at `offsets` in the planned tokens (a
        segment may add one target past the row, which fills no input slot)."""
        out, slot = [], 0
        for s in range(int(self.row_ptr[row]), int(self.row_ptr[row + 1])):
            g, n = int(self.seg_start[s]), int(self.seg_len[s])
            doc = int(np.searchsorted(offsets, g, side="right") - 1)
            out.append((doc, g - int(offsets[doc]), slot, max(0, min(n, self.seq_len - slot))))
            slot += n
        return out

    def save(self, directory: Path) -> None:
        """Write atomically: a temporary directory renamed into place (first writer wins).

        `plan.json` carries a checksum of the arrays and the parameters; `load` refuses a
        plan that does not match it, so an edited or damaged plan is never used.
        """
        tmp = temporary(directory)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for name in PLAN_ARRAYS:
                with open(tmp / f"{name}{ARRAY_SUFFIX}", "wb") as f:  # (np.save of a path would add .npy)
                    np.save(f, getattr(self, name))
            meta = {"strategy": self.strategy, "seq_len": self.seq_len, "stats": self.stats, "version": PLAN_VERSION,
                    "checksum": self.checksum()}
            (tmp / "plan.json").write_text(json.dumps(meta, indent=2))
            os.rename(tmp, directory)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (directory / "plan.json").exists():
                raise  # not a lost race with another writer: a full disk, a read-only directory
        # else another process saved the same plan first

    def checksum(self) -> str:
        """sha256 of the parameters and arrays: the plan's content (computed once)."""
        if "_checksum" in self.__dict__:
            return self.__dict__["_checksum"]
        h = checksum_start(self.strategy, self.seq_len)
        for name in PLAN_ARRAYS:
            a = np.ascontiguousarray(getattr(self, name))
            checksum_array(h, name, a.dtype, len(a))
            h.update(memoryview(a).cast("B"))
        self.__dict__["_checksum"] = h.hexdigest()
        return self.__dict__["_checksum"]

    @classmethod
    def load(cls, directory: Path, verify: bool = True) -> "PackingPlan":
        """The plan saved in `directory`, memory-mapped (holding no file descriptor: a pipeline
        may hold thousands of plans); `verify=False` skips the checksum, for a plan this
        process has just written."""
        meta = json.loads((directory / "plan.json").read_text())
        arrays = {name: map_npy(directory / f"{name}{ARRAY_SUFFIX}") for name in PLAN_ARRAYS}
        p = cls(meta["strategy"], meta["seq_len"], stats=meta["stats"], **arrays)
        if meta.get("version") != PLAN_VERSION:
            raise ValueError(f"{directory}: a plan of version {meta.get('version')}, not {PLAN_VERSION}")
        if not verify:
            p.__dict__["_checksum"] = meta["checksum"]
        elif meta.get("checksum") != p.checksum():
            raise ValueError(f"{directory}: the plan does not match its checksum")
        return p


def rows_holding(plan: PackingPlan, store: TokenStore, documents) -> np.ndarray:
    """The rows (sorted) of `store`'s `plan` that hold any token of its `documents`: a segment
    is one document's run of tokens, so a row holds document d where a segment starts within
    d's tokens. The plan is read in blocks (it may be memory-mapped and large)."""
    docs = np.unique(np.asarray(documents, np.int64))
    offsets = store.offsets
    if len(docs) and (docs[0] < 0 or docs[-1] >= len(offsets) - 1):
        raise IndexError(f"document {int(docs[0] if docs[0] < 0 else docs[-1])} is not in {store.path} "
                         f"({len(offsets) - 1} documents)")
    lo, hi = np.asarray(offsets[docs], np.int64), np.asarray(offsets[docs + 1], np.int64)
    hits, block = [], 1 << 24
    for a in range(0, len(plan.seg_start), block):
        start = np.asarray(plan.seg_start[a : a + block], np.int64)
        k = np.searchsorted(lo, start, side="right") - 1
        inside = (k >= 0) & (start < hi[np.maximum(k, 0)])
        hits.append(a + np.flatnonzero(inside))
    segments = np.concatenate(hits) if hits else np.zeros(0, np.int64)
    return np.unique(np.searchsorted(np.asarray(plan.row_ptr), segments, side="right") - 1)


def checksum_start(strategy: str, seq_len: int):
    """The plan checksum's hash, started with the parameters (arrays follow, in `PLAN_ARRAYS` order)."""
    return hashlib.sha256(json.dumps([PLAN_VERSION, strategy, seq_len]).encode())


def checksum_array(h, name: str, dtype: np.dtype, length: int) -> None:
    """What precedes an array's bytes in the plan checksum."""
    h.update(f"{name}:{np.dtype(dtype).str}:{(length,)}".encode())


def plan(
    store: TokenStore,
    seq_len: int,
    strategy: str = "bestfit",
    *,
    seed: int = 0,
    stride: int | None = None,
    bos_id: int | None = None,
    max_segments: int | None = None,
) -> PackingPlan:
    """Plan rows from the store's document lengths (never its tokens)."""
    require_bos(store, strategy, bos_id)
    return plan_offsets(store.offsets, seq_len, strategy, seed=seed, stride=stride, name=str(store.path),
                        max_segments=max_segments)


def require_bos(store: TokenStore, strategy: str, bos_id: int | None) -> None:
    if strategy == "bos_bestfit" and bos_id is None and store.bos_id is None:
        raise PackingError(
            f"{store.path}: 'bos_bestfit' starts every row at a document's BOS, but the store has no BOS id "
            "(prepare it with BOS, or pass bos_id=)"
        )


def plan_offsets(
    offsets: np.ndarray,
    seq_len: int,
    strategy: str = "bestfit",
    *,
    seed: int = 0,
    stride: int | None = None,
    name: str = "documents",
    chunk: int | None = None,
    max_segments: int | None = None,
    filler: np.ndarray | None = None,
    documents: np.ndarray | None = None,
) -> PackingPlan:
    """Plan rows for documents [offsets[i], offsets[i + 1]) of a token space.

    Deterministic in (offsets, arguments): document order is a permutation seeded by `seed`
    (and `chunk`, the index of a chunk planned on its own: see `forge_grain.packing.chunked`).
    `max_segments`: at most this many segments (documents or parts of one) a row, for
    kernels that need a bound (MaxText, TransformerEngine); rows that reach it are padded.
    `filler` (bos_bestfit; a bool per document): these only fill gaps, as long documents'
    tails do, never start a row (the rest of an epoch: runs starting inside a document).
    `documents`: plan only these (the others are gaps of the token space, never read).
    """
    offsets = np.asarray(offsets, np.int64)
    _check_args(offsets, seq_len, strategy, stride, name)
    if max_segments is not None and (not isinstance(max_segments, (int, np.integer)) or max_segments < 1):
        raise PackingError(f"max_segments_per_row must be a positive integer, not {max_segments!r}")
    k = int(max_segments or 0)
    t0 = time.perf_counter()
    key = stream_key("document-order", seed) if chunk is None else stream_key("document-order", seed, chunk)
    if documents is None:
        order = kernels.permutation(len(offsets) - 1, key)
    else:
        documents = np.asarray(documents, np.int64)
        order = documents[kernels.permutation(len(documents), key)]
    if strategy == "concat" and k:
        row_ptr, start, length, skip, flags, lost = kernels.plan_concat_capped(offsets, order, seq_len, k)
        cropped = 0
    elif strategy == "concat":
        row_ptr, start, length, skip, flags, lost = kernels.plan_concat(offsets, order, seq_len)
        cropped = 0
    elif strategy == "bestfit":
        start, length, skip, flags = kernels.split_items(offsets, order, seq_len, stride or default_stride(seq_len))
        row_ptr, (start, length, skip, flags), _ = _best_fit_rows(seq_len, start, length, skip, flags, k)
        lost = cropped = 0
    else:
        tails = None
        if filler is not None:  # (filler in the seeded order too)
            tails = offsets[:-1][order][filler[order]], np.diff(offsets)[order][filler[order]]
            order = order[~filler[order]]
        row_ptr, start, length, skip, flags, cropped = _plan_bos_bestfit(offsets, order, seq_len + 1, k, tails)
        lost = cropped
    total = int(offsets[-1] - offsets[0]) if documents is None else int(np.diff(offsets)[documents].sum())
    if len(row_ptr) < 2 and chunk is None:  # a chunk may be too small for a row: the store's plan may not
        raise PackingError(f"{name}: {total} tokens cannot fill one row of {seq_len} + 1 tokens")
    stats = _stats(total, seq_len, strategy, row_ptr, length, skip, int(cropped), int(lost), k)
    stats["planning_seconds"] = round(time.perf_counter() - t0, 4)
    return PackingPlan(strategy, seq_len, row_ptr, start, length.astype(np.int32), skip.astype(np.int32), flags, stats)


def key63(text: str) -> int:
    """A 63-bit key from the sha256 of `text` (a seed for the compiled shuffles)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def stream_key(purpose: str, *parts) -> int:
    """A 63-bit key for one of the stream's random choices, from its purpose and seeds."""
    return key63(json.dumps(["forge-grain", purpose, *parts]))


def default_stride(seq_len: int) -> int:
    """bestfit's default: windows of `seq_len` tokens overlapping by one, so the token at each
    border is the last input of one window and the first target of the next, and every
    token after a document's first is a target exactly once (plain chunks, stride = seq_len,
    never train the target at a border)."""
    return max(seq_len - 1, 1)


def _check_args(offsets, seq_len, strategy, stride, name) -> None:
    if strategy not in STRATEGIES:
        raise PackingError(f"unknown packing strategy {strategy!r} (choose one of {STRATEGIES})")
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise PackingError(f"seq_len must be a positive integer, not {seq_len!r}")
    if len(offsets) < 2 or offsets[-1] == 0:
        raise PackingError(f"{name}: the store is empty; nothing to pack")
    if stride is not None and (strategy != "bestfit" or not 1 <= stride <= seq_len):
        raise PackingError(f"stride applies to 'bestfit' only and must be in [1, seq_len], not {stride!r}")


def _best_fit_rows(cap, start, length, skip, flags, max_items=0):
    """Best-fit decreasing: items sorted by length (stable, so the seeded order breaks ties),
    at most `max_items` a row when positive.

    Returns row_ptr, the items reordered by row, and each row's fill."""
    by_len = np.argsort(-length, kind="stable")
    item_bin, fill = kernels.best_fit(length[by_len], cap, max_items)
    order, row_ptr = kernels.group_by_bin(item_bin, len(fill))
    pick = by_len[order]
    return row_ptr, (start[pick], length[pick], skip[pick], flags[pick]), fill


def _plan_bos_bestfit(offsets, order, cap, max_items=0, tails=None):
    """Rows of exactly `cap` = seq_len + 1 tokens, each starting at a document start (with
    `max_items`, at most that many segments a row: a row that reaches it keeps its gap as
    padding).

    Documents longer than a row give their first `cap` tokens a row of their own; the
    rest is best-fit decreasing. The gaps best-fit leaves are filled with slices of the
    long documents' tails (tokens no BOS-aligned row could start with); only if those
    run short are the least-filled rows dissolved into filler. Tokens of the filler left
    over are the cropped ones. `tails`: (start, length) of more pieces for the filler.
    """
    lengths = np.diff(offsets)[order]
    starts = offsets[:-1][order]
    keep = lengths > 0
    lengths, starts = lengths[keep], starts[keep]
    long = lengths >= cap
    head_start, head_natural = starts[long], (lengths[long] == cap).astype(np.uint8)
    has_tail = lengths > cap
    tail_start, tail_len = starts[has_tail] + cap, lengths[has_tail] - cap
    if tails is not None:
        tail_start, tail_len = np.concatenate([tail_start, tails[0]]), np.concatenate([tail_len, tails[1]])
    whole_start, whole_len = starts[~long], lengths[~long]
    row_ptr, (w_start, w_len, _, _), fill = _best_fit_rows(
        cap, whole_start, whole_len, np.zeros(len(whole_len), np.int32), np.ones(len(whole_len), np.uint8), max_items
    )
    pool = tail_len.sum()
    room = max_items - np.diff(row_ptr) if max_items else np.full(len(fill), len(tail_len) + len(whole_len) + 1)
    gaps = np.where(room > 0, cap - fill, 0)  # a row at the cap cannot take filler
    keep_rows = np.ones(len(fill), bool)
    if pool < gaps.sum():  # dissolve the emptiest rows into filler until the gaps can be filled
        need, acc = gaps.sum() - pool, 0
        for r in np.argsort(fill, kind="stable"):
            keep_rows[r] = False
            acc += cap  # dissolving removes its gap and adds its tokens: both count toward the need
            if acc >= need:
                break
    seg_row = np.repeat(np.arange(len(fill)), np.diff(row_ptr))
    in_kept = keep_rows[seg_row]
    filler_start = np.concatenate([tail_start, w_start[~in_kept]])
    filler_len = np.concatenate([tail_len, w_len[~in_kept]])
    filler_natural = np.ones(len(filler_len), np.uint8)
    kept_fill = fill[keep_rows]
    p_start, p_len, p_flags, p_bin = kernels.fill_gaps(kept_fill, cap, filler_start, filler_len, filler_natural,
                                                       room[keep_rows].astype(np.int64))
    cropped = int(filler_len.sum() - p_len.sum())
    # rows: the long documents' heads, then the kept best-fit rows with their filler pieces
    n_heads = len(head_start)
    new_row = np.cumsum(keep_rows) - 1 + n_heads
    seg_rows = np.concatenate([np.arange(n_heads), new_row[seg_row[in_kept]], p_bin + n_heads])
    seg_start = np.concatenate([head_start, w_start[in_kept], p_start])
    seg_len = np.concatenate([np.full(n_heads, cap, np.int64), w_len[in_kept], p_len])
    seg_flags = np.concatenate([head_natural, np.ones(in_kept.sum(), np.uint8), p_flags])
    by_row = np.argsort(seg_rows, kind="stable")
    n_rows = n_heads + int(keep_rows.sum())
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(seg_rows, minlength=n_rows))]).astype(np.int64)
    return row_ptr, seg_start[by_row], seg_len[by_row], np.zeros(len(by_row), np.int32), seg_flags[by_row], cropped


def _stats(total, seq_len, strategy, row_ptr, length, skip, cropped, lost, max_segments=0) -> dict:
    rows = len(row_ptr) - 1
    slots = rows * seq_len
    if strategy == "bestfit":
        real = int(length.sum())
    elif max_segments and rows:  # rows at the cap hold fewer tokens: count each row's inputs
        per_row = np.add.reduceat(np.append(length, 0), row_ptr[:-1]) * (np.diff(row_ptr) > 0)
        real = int(np.minimum(per_row, seq_len).sum())
    else:  # rows hold seq_len + 1 tokens; the last is a target only
        real = slots
    extra = {"max_segments_per_row": int(max_segments)} if max_segments else {}
    return {**extra,
        "strategy": strategy,
        "seq_len": seq_len,
        "rows": rows,
        "fill": real / slots if slots else 0.0,
        "padding": 1 - real / slots if slots else 0.0,
        "cropped_share": cropped / total,
        "lost_share": lost / total,
        "docs_per_row": (len(length) / rows) if rows else 0.0,
        "loss_positions": int(np.sum(np.maximum(length - 1 - skip, 0))),
        # the counts behind the shares, so plans of chunks add up (`forge_grain.packing.chunked`)
        "tokens": total, "real_tokens": real, "segments": len(length), "cropped_tokens": cropped, "lost_tokens": lost,
    }


def joined_stats(parts: list[dict], seq_len: int, strategy: str) -> dict:
    """The stats of a plan made in parts (a store's chunks, a stream's windows) from the
    parts' counts, with `_stats`'s definitions."""
    add = lambda key: sum(int(p.get(key, 0)) for p in parts)  # noqa: E731
    rows, total, real, segments = add("rows"), add("tokens"), add("real_tokens"), add("segments")
    slots = rows * seq_len
    return {
        "strategy": strategy, "seq_len": seq_len, "rows": rows,
        "fill": real / slots if slots else 0.0, "padding": 1 - real / slots if slots else 0.0,
        "cropped_share": add("cropped_tokens") / total if total else 0.0,
        "lost_share": add("lost_tokens") / total if total else 0.0,
        "docs_per_row": segments / rows if rows else 0.0, "loss_positions": add("loss_positions"),
        "tokens": total, "real_tokens": real, "segments": segments, "cropped_tokens": add("cropped_tokens"),
        "lost_tokens": add("lost_tokens"),
    }


def min_crop_share(lengths: np.ndarray, seq_len: int) -> float:
    """The share of tokens no BOS-aligned row can hold: those past seq_len + 1 of each document."""
    return float(np.maximum(lengths - (seq_len + 1), 0).sum() / max(lengths.sum(), 1))
