"""The data flight recorder: which documents a batch holds, and a fingerprint of what it trained.

Every row is a pure function of (config, seed, global row): global row h of step s is
mixture row h = s·B + i, which the mixture's closed form maps to (source, row of that
source), the source's epoch permutation to a row of its packing plan, and the plan to
segments, each a run of one document's tokens at a place in the row. `explain` follows
that chain for the rows of a step without making the batch (no token is read unless
`decode=True`); `batch_hash` digests a global batch's content, the same on any shard count
and from any bridge (`hash_batch` takes the arrays a trainer received).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from forge_grain.errors import ConfigError
from forge_grain.packing.lengths import LengthSchedule
from forge_grain.packing.packed import PackedDataset
from forge_grain.pipeline.states import step_number

HASHED = ("inputs", "targets", "loss_mask")


def explain(pipeline, step: int, shard: int | None = None, decode: bool = False,
            tokenizer: str | None = None) -> list[dict]:
    """For each row of global batch `step` (or of shard `shard`'s slice of it, under the
    pipeline's shard count): its place (`row` in the global batch, `shard`), `source`,
    `epoch` (of that source), `source_row` (its index in the source's stream) and `plan_row`,
    and `segments`: per run of one document, the `document` (its index in the store), the
    store `file` holding it and the document's `index_in_file`, the `tokens` [lo, hi) of
    the document that fill the row's input `slots` [a, b). `decode=True` adds each
    segment's `text`, decoded with the source's tokenizer (`tokenizer`: this one instead, for
    every source; checked against the hash the store records).

    A streaming source's rows are known once read: they are explained for the steps this
    process made recently (its `canonical_stream`, `epoch`, `window`, and per segment the
    `document` as the row of the stream's pass that held it, with its `file` and
    `index_in_file` where the reader knows them: files at URLs), else their segments are
    None; `forge-grain explain --state` makes the steps from a saved state first."""
    p = pipeline
    step = step_number(step, p.step_limit)
    rows, first = p.global_rows(step), 0
    if shard is not None:
        shard = step_number(shard, p.shard_count, what="shard")
        first = shard * p.local_size(step)
        rows = rows[first : first + p.local_size(step)]
    src, rank = p.order.locate(rows)
    out, tokenizers = [], {}
    for i, (h, s, r) in enumerate(zip(rows.tolist(), src.tolist(), rank.tolist()), start=first):
        d = p.mixture.datasets[s]
        row = {"step": step, "row": i, "shard": i // p.local_size(step), "source": p.source_names[s],
               "source_row": r}
        if isinstance(d, (PackedDataset, LengthSchedule)):
            if decode and s not in tokenizers:
                configured = p.config.sources[s].tokenizer if s < len(p.config.sources) else None
                tokenizers[s] = _tokenizer(d.store, tokenizer or configured)
            row.update(_packed_row(d, r, tokenizers.get(s)))
        else:  # a streaming source: known once read, so only for rows this process made
            row.update(epoch=None, plan_row=None, segments=None)
            if hasattr(d, "layout"):
                row["canonical_stream"] = int(d.layout.stream_of(np.array([h]))[0])
                row.update(d.explain(h) or {})
                if decode:
                    raise ConfigError(f"source '{p.source_names[s]}' is streaming: its tokens are not kept after "
                                      "the batch is made, so explain cannot decode them; decode the batch's inputs "
                                      "at the slots explain names (forge-grain replay writes them)")
        out.append(row)
    return out


def _runs(mask: np.ndarray, offset: int) -> list[list[int]]:
    """[a, b) runs of true in `mask`, shifted by `offset`."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [[int(a) + offset, int(b) + offset] for a, b in zip(edges[::2], edges[1::2])]


def _packed_row(d, rank: int, tok) -> dict:
    epoch = None
    if isinstance(d, LengthSchedule):  # the piece of its length schedule the row is in
        d, rank, epoch = d.locate(rank)
    plan_row = int(d.rows_of([rank])[0])
    segments = []
    for doc, lo, slot, shown in d.plan.documents_of(plan_row, d.store.offsets):
        if shown == 0:  # a document whose first token is only the row's last (masked) target: no slot holds it
            continue
        file, index_in_file = d.store.place_of(doc)
        seg = {"document": doc, "file": None if file is None else str(file), "index_in_file": index_in_file,
               "tokens": [lo, lo + shown], "slots": [slot, slot + shown]}
        if d.store.masked:  # the document's tokens the data marks as targets: [a, b) runs
            seg["targets"] = _runs(d.store.target_mask(doc)[lo : lo + shown], lo)
        if tok is not None:
            seg["text"] = tok.backend.decode(d.store[doc][lo : lo + shown].tolist(), skip_special_tokens=False)
        segments.append(seg)
    epoch = rank // d.num_rows if epoch is None else epoch
    return {"epoch": epoch, "plan_row": plan_row, "segments": segments}


def _tokenizer(store, configured: str | None):
    """The tokenizer a store was made with: the source's `tokenizer`, else the one its
    manifest records, checked against the hash it records; with neither, refused (text
    decoded with a guessed tokenizer would be wrong without a word)."""
    from forge_grain.tokenizer import load_tokenizer

    recorded = getattr(getattr(store, "manifest", None), "tokenizer", None) or {}
    path, sha = configured or recorded.get("path"), recorded.get("sha256")
    if not path:
        raise ConfigError(f"{store.path}: the store records no tokenizer; decoding needs the one that made it "
                          "(give the source a 'tokenizer', or --tokenizer PATH, or explain without decode)")
    if not configured and not Path(path).is_absolute() and not Path(path).exists():
        # a store prepared before paths were recorded absolute: the path as typed, from wherever prepare ran
        beside = [p for p in (Path(store.path) / path, Path(store.path).parent / path) if p.exists()]
        if not beside:
            raise ConfigError(f"{store.path}: the store records its tokenizer as {path!r}, relative to the directory "
                              "prepare ran in, which is not this one: give --tokenizer PATH (or the source's "
                              "'tokenizer')")
        path = beside[0]
    tok = load_tokenizer(path)
    if sha and tok.sha256 != sha:
        raise ConfigError(f"{store.path}: the tokenizer at {path} is not the one the store was made with "
                          f"(sha256 {tok.sha256[:12]} != {sha[:12]})")
    return tok


def hash_batch(batch: dict) -> str:
    """A digest of a global batch's content (`inputs`, `targets`, `loss_mask`, row by row):
    numpy, torch or JAX arrays alike, whatever their integer width."""
    h = hashlib.sha256()
    for key in HASHED:
        a = np.asarray(batch[key])
        a = a.astype(np.uint8) if key == "loss_mask" else a.astype("<i8")
        h.update(key.encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:32]


def batch_hash(pipeline, step: int) -> str:
    """`hash_batch` of global batch `step`, made from the config alone (stored sources)."""
    return hash_batch(pipeline.global_batch(step))
