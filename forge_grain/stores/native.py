"""forge-grain's own stores: a directory with `manifest.json`, shards in the `bin` or `arrayrecord` layout.

`forge-grain prepare` and `write_store` write them; the manifest records the dtype, the
special ids, the tokenizer and a checksum per shard, so nothing needs declaring.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.paths import plan_cache_dir
from forge_grain.stores.manifest import MANIFEST_NAME, MASK_DTYPE, Manifest
from forge_grain.files import sha256_file
from forge_grain.stores.mapping import map_npy
from forge_grain.stores import arrayrecord
from forge_grain.stores import checks
from forge_grain.stores.base import TokenStore, join_offsets


class NativeStore(TokenStore):
    """A forge-grain store; options given for it must agree with its manifest."""

    format = "native"
    description = "a forge-grain store"
    OPTIONS = frozenset({"dtype", "eos_id", "bos_id", "vocab_size"})

    def _open(self, dtype=None) -> None:
        m = self.manifest = Manifest.load(self.path)
        self.dtype = np.dtype(m.dtype)
        self.vocab_size, self.bos_id, self.eos_id = m.vocab_size, m.bos_id, m.eos_id
        self.tokenizer = m.tokenizer
        self._check_declared({**self._declared, **({} if dtype is None else {"dtype": dtype})})
        self._files = [self.path / s.tokens for s in m.shards]
        self._records = None
        offsets = self._map_shards(m)
        if m.layout == "arrayrecord":
            self._records = arrayrecord.Records(self._files, [s.num_documents for s in m.shards],
                                                compressed=self.compressed)
        self._file_docs = [s.num_documents for s in m.shards]
        self._offsets = join_offsets(offsets, self._offsets_cache(m))
        # the shards' checksums, and their indices' where recorded (older stores keep their fingerprint)
        sums = [sh.sha256 + (f":{sh.index_sha256}" if sh.index_sha256 else "") + (f":{sh.mask_sha256}" if sh.mask
                else "") for sh in m.shards]
        self._fingerprint = hashlib.sha256("|".join(sums).encode()).hexdigest()[:16]

    def _validate(self) -> None:
        """Sampled token ids of every shard are valid for the recorded vocabulary, as for every
        format (a flipped token or an edited manifest is caught at open, not only by verify).
        The manifest's EOS/BOS ids are the tokenizer's, whether or not documents carry them."""
        for s, file in enumerate(self._files):
            lo, hi = int(self._file_doc_starts[s]), int(self._file_doc_starts[s + 1])
            if self._runs is None:  # ArrayRecord: a few documents of each shard
                sample = [self[i] for i in checks.spread(np.arange(lo, hi), 8)]
            else:
                sample = _read_blocks(file, self.dtype, self.manifest.shards[s].num_tokens)
            checks.check_arrays_ids(file, sample, self.vocab_size)

    def _offsets_cache(self, m: Manifest) -> Path | None:
        """Where several shards' joined offsets are kept (beside the store's plans), so a
        process maps them instead of holding 8 bytes a document."""
        if len(m.shards) < 2:
            return None
        directory = plan_cache_dir(self.path)  # the plans' directory: beside the store, else the user cache
        key = hashlib.sha256(json.dumps(m.to_json(), sort_keys=True).encode()).hexdigest()[:16]
        return directory / f"offsets-{key}.npy" if directory is not None else None

    def _check_declared(self, declared: dict) -> None:
        """Options given for a store must agree with its manifest."""
        recorded = {"dtype": self.dtype, "eos_id": self.eos_id, "bos_id": self.bos_id, "vocab_size": self.vocab_size}
        for key, value in declared.items():
            same = checks.declared_dtype(self.path, value) == self.dtype if key == "dtype" else value == recorded[key]
            if not same:
                raise StoreError(
                    f"{self.path}: {key}={value!r} was declared, but the store's {MANIFEST_NAME} records "
                    f"{recorded[key]!r}"
                )

    def _map_shards(self, m: Manifest) -> list[np.ndarray]:
        """Check every shard and its index, map `bin` shards; each shard's offsets."""
        offsets = []
        for shard, file in zip(m.shards, self._files):
            checks.require_regular(file, f"shard listed in {self.path / MANIFEST_NAME}")
            checks.require_regular(self.path / shard.index, f"index listed in {self.path / MANIFEST_NAME}")
            if m.layout == "bin":
                self._arrays.append(self._map_bin_shard(file, shard))
            if shard.mask is not None:
                self._mask_arrays.append(self._map_mask(self.path / shard.mask, shard))
            offsets.append(self._load_index(self.path / shard.index, shard))
            if m.layout == "arrayrecord":
                arrayrecord.check_records(file, shard, offsets[-1], self.dtype, self.compressed)
        return offsets

    @property
    def compressed(self) -> bool:
        """Whether the arrayrecord layout's records are compressed (stores prepared before the
        manifest recorded it hold zstd records)."""
        return self.manifest.compression != "none"

    def _map_bin_shard(self, file: Path, shard) -> np.ndarray:
        size = file.stat().st_size
        if size % self.dtype.itemsize:
            raise StoreError(
                f"{file}: {size} bytes is not a multiple of the {self.dtype} item size "
                f"({self.dtype.itemsize}); the shard is truncated or corrupt"
            )
        if size != shard.num_tokens * self.dtype.itemsize:
            raise StoreError(
                f"{file}: holds {size // self.dtype.itemsize} tokens, manifest says {shard.num_tokens}; "
                "the shard is truncated or was replaced"
            )
        return checks.map_array(file, self.dtype)

    def _map_mask(self, file: Path, shard) -> np.ndarray:
        """A shard's target mask: one byte a token, as many as the shard has tokens."""
        checks.require_regular(file, f"target mask listed in {self.path / MANIFEST_NAME}")
        if file.stat().st_size != shard.num_tokens * MASK_DTYPE.itemsize:
            raise StoreError(f"{file}: holds {file.stat().st_size} mask bytes, but its shard {shard.tokens} has "
                             f"{shard.num_tokens} tokens; the mask is truncated or belongs to another shard")
        return checks.map_array(file, MASK_DTYPE)

    @staticmethod
    def _load_index(file: Path, shard) -> np.ndarray:
        return NativeStore._check_index(NativeStore._map_index(file), file, shard)

    @staticmethod
    def _map_index(file: Path) -> np.ndarray:
        """A document index file, mapped (a store's indices are not copied into memory)."""
        try:
            return map_npy(file)
        except (FileNotFoundError, ValueError, OSError) as e:
            raise StoreError(f"{file}: document index missing or unreadable ({e})") from None

    @staticmethod
    def _check_index(idx: np.ndarray, file, shard) -> np.ndarray:
        """A shard's document index (`file`: where it was read, for messages), checked against its shard."""
        if idx.dtype.kind not in "iu":
            raise StoreError(f"{file}: document index holds {idx.dtype} values, not integer offsets")
        ok = (
            idx.ndim == 1
            and len(idx) == shard.num_documents + 1
            and idx[0] == 0
            and idx[-1] == shard.num_tokens
            and bool(np.all(np.diff(idx) >= 0))
        )
        if not ok:
            raise StoreError(
                f"{file}: document index disagrees with its shard {shard.tokens} "
                f"(expected {shard.num_documents + 1} non-decreasing offsets from 0 to {shard.num_tokens})"
            )
        return idx.astype(np.int64, copy=False)

    def _document(self, i: int) -> np.ndarray:
        return arrayrecord.read_document(self._records, i, self.dtype, self._files[self.shard_of(i)])

    def _verify_files(self) -> None:
        for shard, file in zip(self.manifest.shards, self._files):
            if sha256_file(file) != shard.sha256:
                raise StoreError(f"{file}: checksum mismatch; the shard is corrupt (re-run `forge-grain prepare`)")
            index = self.path / shard.index
            if shard.index_sha256 is not None and sha256_file(index) != shard.index_sha256:
                raise StoreError(f"{index}: checksum mismatch; the document index was changed (re-run `forge-grain "
                                 "prepare`)")
            if shard.mask is not None:
                self._verify_mask(self.path / shard.mask, shard.mask_sha256)
        joined = self.manifest.indices
        if joined is not None and sha256_file(self.path / joined["file"]) != joined["sha256"]:
            raise StoreError(f"{self.path / joined['file']}: checksum mismatch; the joined document index was changed "
                             "(re-run `forge-grain prepare`)")

    @staticmethod
    def _verify_mask(file: Path, sha256: str) -> None:
        if sha256_file(file) != sha256:
            raise StoreError(f"{file}: checksum mismatch; the target mask was changed (re-run `forge-grain prepare`)")
        values = np.unique(checks.map_array(file, MASK_DTYPE))
        if not set(values.tolist()) <= {0, 1}:
            raise StoreError(f"{file}: a target mask holds {sorted(set(values.tolist()) - {0, 1})[:3]}; "
                             "each byte must be 0 or 1")

    @property
    def layout(self) -> str:
        return self.manifest.layout

    @property
    def file_bytes(self) -> np.ndarray:
        """Each shard's file size: what a bounded cache holds of an ArrayRecord store, which pads
        a small shard (128 KiB for a few KB of tokens); `packing.fitted` plans in them, and
        `forge-grain plan` counts them (a `bin` shard is its tokens, planned from the offsets)."""
        return np.array([self._shard_size(s) for s in self.manifest.shards], np.int64)

    def _shard_size(self, shard) -> int:
        return (self.path / shard.tokens).stat().st_size

    def close(self) -> None:
        super().close()
        self._records = None


def _read_blocks(file: Path, dtype: np.dtype, n: int, blocks: int = checks.SAMPLE_BLOCKS, size: int = 2048):
    """Evenly spaced blocks of a shard's `n` tokens, read from the file (not through its map:
    the pages of hundreds of shards opened at once stay out of the process's memory)."""
    out = []
    with open(file, "rb") as f:
        for start in checks.spread(np.arange(0, n, size), blocks):
            out.append(np.frombuffer(os.pread(f.fileno(), min(size, n - int(start)) * dtype.itemsize,
                                              int(start) * dtype.itemsize), dtype))
    return out
