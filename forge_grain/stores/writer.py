"""`write_store`: a token store from token arrays you already have (one shard, atomic)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.stores.manifest import MANIFEST_NAME, Manifest, ShardInfo, token_dtype
from forge_grain.files import fsync_rename, save_npy_atomic, sha256_file, temporary


def write_store(
    path: str | Path,
    documents: Iterable[np.ndarray],
    *,
    vocab_size: int,
    bos_id: int | None = None,
    eos_id: int | None = None,
    tokenizer: dict | None = None,
) -> Path:
    """Write `documents` (1-D integer arrays, already tokenized) as a `bin` token store.

    The shard is written under a temporary name and renamed; the manifest comes last.
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    dtype = token_dtype(vocab_size)
    tmp = temporary(out / "shard-00000.bin")
    lengths = []
    with open(tmp, "wb") as f:
        for i, doc in enumerate(documents):
            doc = np.asarray(doc)
            if len(doc) and (doc.min() < 0 or doc.max() >= vocab_size):
                tmp.unlink()
                raise StoreError(f"{out}: document {i} has token id {int(doc.max())} outside [0, {vocab_size})")
            f.write(doc.astype(dtype).tobytes())
            lengths.append(len(doc))
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    save_npy_atomic(out / "shard-00000.idx.npy", offsets)
    shard = ShardInfo("shard-00000.bin", "shard-00000.idx.npy", len(lengths), int(offsets[-1]), sha256_file(tmp),
                      sha256_file(out / "shard-00000.idx.npy"))
    fsync_rename(tmp, out / shard.tokens)
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
    ).save(out)
    return out
