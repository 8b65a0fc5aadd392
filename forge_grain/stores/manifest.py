"""The token store's on-disk description (its files written whole: `forge_grain.files`).

A store is a directory::

    manifest.json              written last: a store without it is incomplete
    shard-00000.bin            raw little-endian tokens (layout "bin"), or
    shard-00000.array_record   one record per document (layout "arrayrecord")
    shard-00000.idx.npy        int64 offsets, num_documents + 1 of them, into the
                               shard's tokens (for ArrayRecord: into their concatenation)
    shards.idx.npy             every shard's offsets, joined in shard order (the manifest's
                               `indices`, with its sha256): a store in object storage opens
                               with one request for them, whatever its shard count; stores
                               prepared before it have none and read the shards' own
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.files import save_npy_atomic, sha256_file, write_json_atomic

FORMAT = "forge-grain-token-store"
VERSION = 1
# a store whose tokens carry target masks (`ShardInfo.mask`): readers that know only version 1
# refuse it by its version, rather than train every token of it
MASKED_VERSION = 2
MASK_DTYPE = np.dtype("u1")  # one byte a token: 1 where the token is a target (is trained), else 0
MANIFEST_NAME = "manifest.json"
JOINED_INDEX = "shards.idx.npy"
LAYOUTS = ("bin", "arrayrecord")
DTYPES = ("<u2", "<u4")  # what `token_dtype` writes
COMPRESSIONS = ("none", "zstd")  # of the arrayrecord layout's records


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32 (little-endian on disk)."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    tokens: str  # file name of the tokens (.bin) or records (.array_record)
    index: str  # file name of the offsets (.idx.npy)
    num_documents: int
    num_tokens: int
    sha256: str  # of the tokens / records file
    index_sha256: str | None = None  # of the offsets file (stores prepared before it was recorded lack it)
    mask: str | None = None  # the shard's target mask: one byte a token (MASK_DTYPE), in token order
    mask_sha256: str | None = None


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
    # the `arrayrecord` layout's record compression: "none" (what prepare writes), or absent in
    # stores prepared before it was recorded, whose records are zstd-compressed (ArrayRecord's default)
    compression: str | None = None
    # {"file": JOINED_INDEX, "sha256": ...}: every shard's index in one file (absent in older stores)
    indices: dict | None = None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        for key in ("compression", "indices"):
            if d[key] is None:
                del d[key]
        optional = ("index_sha256", "mask", "mask_sha256")
        d["shards"] = [{k: v for k, v in dataclasses.asdict(s).items() if not (k in optional and v is None)}
                       for s in self.shards]
        return {"format": FORMAT, **d}

    @classmethod
    def from_json(cls, d: Any, where: Path) -> "Manifest":
        """Parse and validate: every key present with its type, shard files confined to the
        store directory and listed once, counts that add up. Messages name the key."""
        if not isinstance(d, dict):
            raise StoreError(f"{where}: a manifest is a JSON object, not a {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise StoreError(f"{where}: not a forge-grain token store manifest (format={d.get('format')!r})")
        if d.get("version") not in (VERSION, MASKED_VERSION):
            raise StoreError(
                f"{where}: manifest version {d.get('version')!r} is not supported "
                f"(this forge-grain reads versions {VERSION} and {MASKED_VERSION}); re-run `forge-grain prepare` or "
                "upgrade forge-grain"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = fields - set(d) - {"source", "compression", "indices"}
        if missing:
            raise StoreError(f"{where}: manifest lacks {sorted(missing)}")
        extra = set(d) - fields - {"format"}
        if extra:
            raise StoreError(f"{where}: manifest has unknown key(s) {sorted(extra)}")
        check = _Checker(where)
        check.choice("layout", d["layout"], LAYOUTS)
        if "compression" in d:
            if d["layout"] != "arrayrecord":
                check.fail("compression", f"applies to the arrayrecord layout only, not {d['layout']!r}")
            check.choice("compression", d["compression"], COMPRESSIONS)
        check.choice("dtype", d["dtype"], DTYPES)
        check.count("vocab_size", d["vocab_size"], minimum=1)
        for key in ("bos_id", "eos_id"):
            if d[key] is not None:
                check.count(key, d[key])
                if d[key] >= d["vocab_size"]:
                    raise StoreError(f"{where}: {key} {d[key]} is not below vocab_size {d['vocab_size']}")
        check.kind("tokenizer", d["tokenizer"], dict)
        check.kind("source", d.get("source", {}), dict)
        check.count("num_documents", d["num_documents"])
        check.count("num_tokens", d["num_tokens"])
        check.kind("shards", d["shards"], list)
        shards = tuple(check.shard(i, s) for i, s in enumerate(d["shards"]))
        check.masks(d["version"], d["layout"], shards)
        if "indices" in d:
            check.indices(d["indices"])
        names = [n for s in shards for n in (s.tokens, s.index, s.mask) if n is not None] + ([d["indices"]["file"]] if "indices" in d else [])
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise StoreError(f"{where}: shards list {repeated} more than once")
        for key, total in (("num_documents", sum(s.num_documents for s in shards)),
                           ("num_tokens", sum(s.num_tokens for s in shards))):
            if d[key] != total:
                raise StoreError(f"{where}: {key} is {d[key]}, but its shards add up to {total}")
        kw = {k: d[k] for k in fields if k in d}
        kw["shards"] = shards
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


class _Checker:
    """Type checks for manifest values; each failure names the key and the manifest."""

    def __init__(self, where: Path):
        self.where = where

    def fail(self, key: str, problem: str):
        raise StoreError(f"{self.where}: {key} {problem}")

    def kind(self, key: str, value, kind: type) -> None:
        if not isinstance(value, kind):
            self.fail(key, f"must be a {kind.__name__}, not {type(value).__name__} {str(value)[:60]!r}")

    def count(self, key: str, value, minimum: int = 0) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            self.fail(key, f"must be an integer >= {minimum}, not {value!r}")

    def choice(self, key: str, value, choices) -> None:
        if value not in choices:
            self.fail(key, f"is {value!r}; this forge-grain reads {list(choices)}")

    def file_name(self, key: str, value) -> None:
        """A plain file name in the store directory: no directories, no way out of it."""
        self.kind(key, value, str)
        if not value or value in (".", "..") or "/" in value or "\\" in value or "\x00" in value:
            self.fail(key, f"must name a file inside the store directory, not {value!r}")

    def sha256(self, key: str, value) -> None:
        if not (isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)):
            self.fail(key, f"must be 64 lowercase hex digits, not {value!r}")

    def indices(self, value) -> None:
        self.kind("indices", value, dict)
        if set(value) != {"file", "sha256"}:
            self.fail("indices", f"must have exactly the keys ['file', 'sha256'], not {sorted(value)}")
        self.file_name("indices.file", value["file"])
        self.sha256("indices.sha256", value["sha256"])

    def shard(self, i: int, s) -> ShardInfo:
        key = f"shards[{i}]"
        self.kind(key, s, dict)
        want = {f.name for f in dataclasses.fields(ShardInfo)}
        if not want - {"index_sha256", "mask", "mask_sha256"} <= set(s) <= want:
            self.fail(key, f"must have exactly the keys {sorted(want)} (index_sha256, mask and mask_sha256 "
                           f"optional), not {sorted(s)}")
        if ("mask" in s) != ("mask_sha256" in s):
            self.fail(key, "must have both mask and mask_sha256, or neither")
        self.file_name(f"{key}.tokens", s["tokens"])
        self.file_name(f"{key}.index", s["index"])
        if "mask" in s:
            self.file_name(f"{key}.mask", s["mask"])
        self.count(f"{key}.num_documents", s["num_documents"])
        self.count(f"{key}.num_tokens", s["num_tokens"])
        for k in ("sha256", "index_sha256", "mask_sha256"):
            self.sha256(f"{key}.{k}", s.get(k, "0" * 64))
        return ShardInfo(**s)

    def masks(self, version: int, layout: str, shards) -> None:
        """Target masks: every shard has one in a store of `MASKED_VERSION` (bin layout), none
        in a store of version 1."""
        masked = [s.mask is not None for s in shards]
        if version == MASKED_VERSION and not all(masked):
            self.fail("shards", f"of a version {MASKED_VERSION} store must each name a target mask")
        if version == MASKED_VERSION and layout != "bin":
            self.fail("layout", f"of a store with target masks must be 'bin', not {layout!r}")
        if version != MASKED_VERSION and any(masked):
            self.fail("version", f"is {version}, but shards name target masks (a store with them is version "
                                 f"{MASKED_VERSION})")


def write_joined_index(directory: Path, shards) -> dict:
    """Every shard's index (files in `directory`) joined in shard order into `JOINED_INDEX`,
    written atomically; the manifest's `indices` entry for it."""
    parts = [np.load(Path(directory) / s.index, mmap_mode="r") for s in shards]
    save_npy_atomic(Path(directory) / JOINED_INDEX, np.concatenate(parts).astype("<i8", copy=False))
    return {"file": JOINED_INDEX, "sha256": sha256_file(Path(directory) / JOINED_INDEX)}


def split_joined_index(joined: np.ndarray, shards, where) -> list[np.ndarray]:
    """The shards' indices out of the joined one (views), or an error naming `where` when its
    length is not theirs."""
    sizes = [s.num_documents + 1 for s in shards]
    if joined.ndim != 1 or len(joined) != sum(sizes):
        raise StoreError(f"{where}: holds {joined.size} offsets in {joined.ndim} dimension(s), the shards' indices "
                         f"{sum(sizes)} in one; the file is corrupt or belongs to another store")
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [joined[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
