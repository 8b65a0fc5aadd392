"""`write_store`: a token store from token arrays you already have (one shard, atomic)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.stores.manifest import MANIFEST_NAME, MASK_DTYPE, MASKED_VERSION, VERSION, Manifest, ShardInfo, token_dtype
from forge_grain.files import fsync_rename, save_npy_atomic, sha256_file, temporary


def write_store(
    path: str | Path,
    documents: Iterable[np.ndarray],
    *,
    vocab_size: int,
    bos_id: int | None = None,
    eos_id: int | None = None,
    tokenizer: dict | None = None,
    masks: Iterable[np.ndarray] | None = None,
) -> Path:
    """Write `documents` (1-D integer arrays, already tokenized) as a `bin` token store.

    `masks`: one array per document, as long as it, true (or 1) where the token is a target
    (is trained: the assistant's turns of a conversation, a completion), false elsewhere. A
    store with masks trains only those targets, and a forge-grain that reads no masks refuses
    it by its manifest's version rather than train every token; without, every token is a
    target.

    The shard is written under a temporary name and renamed; the manifest comes last.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    dtype = token_dtype(vocab_size)
    tmp, tmp_mask = temporary(out / "shard-00000.bin"), temporary(out / "shard-00000.mask")
    masks = iter(masks) if masks is not None else None
    lengths = []
    with open(tmp, "wb") as f, (open(tmp_mask, "wb") if masks is not None else contextlib.nullcontext()) as fm:
        for i, doc in enumerate(documents):
            doc = np.asarray(doc)
            if len(doc) and (doc.min() < 0 or doc.max() >= vocab_size):
                _discard(tmp, tmp_mask)
                raise StoreError(f"{out}: document {i} has token id {int(doc.max())} outside [0, {vocab_size})")
            f.write(doc.astype(dtype).tobytes())
            if masks is not None:
                fm.write(_mask_bytes(next(masks, None), doc, i, out, (tmp, tmp_mask)))
            lengths.append(len(doc))
    if masks is not None and next(masks, None) is not None:
        _discard(tmp, tmp_mask)
        raise StoreError(f"{out}: masks has more arrays than there are documents ({len(lengths)})")
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    save_npy_atomic(out / "shard-00000.idx.npy", offsets)
    shard = ShardInfo("shard-00000.bin", "shard-00000.idx.npy", len(lengths), int(offsets[-1]), sha256_file(tmp),
                      sha256_file(out / "shard-00000.idx.npy"),
                      *(("shard-00000.mask", sha256_file(tmp_mask)) if masks is not None else ()))
    fsync_rename(tmp, out / shard.tokens)
    if masks is not None:
        fsync_rename(tmp_mask, out / shard.mask)
    else:
        (out / "shard-00000.mask").unlink(missing_ok=True)  # (a masked store written here before)
    Manifest(
        layout="bin",
        dtype=dtype.str,
        vocab_size=vocab_size,
        bos_id=bos_id,
        eos_id=eos_id,
        tokenizer=tokenizer or {"path": None, "sha256": None, "vocab_size": vocab_size},
        num_documents=len(lengths),
        num_tokens=int(offsets[-1]),
        shards=(shard,),
        source={"writer": "write_store"},
        version=MASKED_VERSION if masks is not None else VERSION,
    ).save(out)
    return out


def _mask_bytes(mask, doc: np.ndarray, i: int, out: Path, temporaries) -> bytes:
    """Document `i`'s target mask as the store holds it, or an error naming the document."""
    problem = None
    if mask is None:
        problem = "has no mask (masks ran out before the documents)"
    else:
        mask = np.asarray(mask)
        if mask.shape != doc.shape:
            problem = f"has {len(doc)} tokens but a mask of shape {mask.shape}"
        elif mask.dtype != np.bool_ and not np.isin(mask, (0, 1)).all():
            problem = "has a mask holding values other than 0 and 1 (true and false)"
    if problem is not None:
        _discard(*temporaries)
        raise StoreError(f"{out}: document {i} {problem}")
    return mask.astype(MASK_DTYPE).tobytes()


def _discard(*files: Path) -> None:
    for f in files:
        f.unlink(missing_ok=True)
