"""The token store's on-disk description, and the atomic file writes that keep it whole.

A store is a directory::

    manifest.json              written last: a store without it is incomplete
    shard-00000.bin            raw little-endian tokens (layout "bin"), or
    shard-00000.array_record   one record per document (layout "arrayrecord")
    shard-00000.idx.npy        int64 offsets, num_documents + 1 of them, into the
                               shard's tokens (for ArrayRecord: into their concatenation)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from .errors import StoreError

FORMAT = "forge-grain-token-store"
VERSION = 1
MANIFEST_NAME = "manifest.json"
LAYOUTS = ("bin", "arrayrecord")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32 (little-endian on disk)."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_rename(tmp: Path, final: Path) -> None:
    """Make `tmp` durable, then give it its final name in one atomic step."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    fsync_rename(tmp, path)


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
    fsync_rename(tmp, path)


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    tokens: str  # file name of the tokens (.bin) or records (.array_record)
    index: str  # file name of the offsets (.idx.npy)
    num_documents: int
    num_tokens: int
    sha256: str  # of the tokens / records file


@dataclasses.dataclass(frozen=True)
class Manifest:
    layout: str
    dtype: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    tokenizer: dict
    num_documents: int
    num_tokens: int
    shards: tuple[ShardInfo, ...]
    source: dict = dataclasses.field(default_factory=dict)
    version: int = VERSION

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["shards"] = [dataclasses.asdict(s) for s in self.shards]
        return {"format": FORMAT, **d}

    @classmethod
    def from_json(cls, d: dict, where: Path) -> "Manifest":
        if d.get("format") != FORMAT:
            raise StoreError(f"{where}: not a forge-grain token store manifest (format={d.get('format')!r})")
        if d.get("version") != VERSION:
            raise StoreError(
                f"{where}: manifest version {d.get('version')!r} is not supported "
                f"(this forge-grain reads version {VERSION}); re-run `forge-grain prepare` or upgrade forge-grain"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = fields - set(d) - {"source"}
        if missing:
            raise StoreError(f"{where}: manifest lacks {sorted(missing)}")
        if d["layout"] not in LAYOUTS:
            raise StoreError(f"{where}: unknown layout {d['layout']!r} (expected one of {LAYOUTS})")
        kw = {k: d[k] for k in fields if k in d}
        kw["shards"] = tuple(ShardInfo(**s) for s in d["shards"])
        return cls(**kw)

    @classmethod
    def load(cls, directory: Path) -> "Manifest":
        path = Path(directory) / MANIFEST_NAME
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise StoreError(f"{path}: no manifest; the store is incomplete (re-run `forge-grain prepare`)") from None
        except json.JSONDecodeError as e:
            raise StoreError(f"{path}: manifest is not valid JSON ({e})") from None
        return cls.from_json(d, path)

    def save(self, directory: Path) -> None:
        write_json_atomic(Path(directory) / MANIFEST_NAME, self.to_json())
