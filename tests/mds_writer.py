"""A MosaicML Streaming MDS writer from the published layout (streaming.base.format.mds).

`mosaicml-streaming` installs here but cannot import (its torchvision pin against this
torch), so tests write MDS with this writer, which follows MDSWriter byte for byte:
columns in sorted name order; a sample is the uint32 sizes of its variable-size columns,
then each column's encoding; a shard is uint32 n, n + 1 uint32 sample offsets, the JSON
config, then the samples; `index.json` lists the shards.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np

def _brotli(data: bytes) -> bytes:
    import brotli

    return brotli.compress(data, quality=11)


def _snappy(data: bytes) -> bytes:
    import snappy

    return snappy.compress(data)


def _zstd(data: bytes) -> bytes:
    import zstd

    return zstd.compress(data, 3)


# streaming.base.compression: the libraries and default levels MosaicML's writer uses
COMPRESS = {"gz": lambda data: gzip.compress(data, 9), "br": _brotli, "snappy": _snappy, "zstd": _zstd}

_VALUE_DTYPES = {"uint8": 8, "int8": 9, "uint16": 16, "int16": 17, "uint32": 32, "int32": 33, "uint64": 64,
                 "int64": 65}


def _encode(encoding: str, value) -> bytes:
    kind, _, rest = encoding.partition(":")
    if kind == "bytes":
        return bytes(value)
    if kind == "str":
        return value.encode()
    if kind == "int":
        return np.int64(value).tobytes()
    assert kind == "ndarray"
    dtype, _, shape = rest.partition(":")
    arr = np.asarray(value)
    parts = []
    if not dtype:
        parts.append(bytes([_VALUE_DTYPES[arr.dtype.name]]))
    if not shape:
        dims = np.array(arr.shape, np.int64)
        width = 0 if dims.max() < 1 << 8 else 1 if dims.max() < 1 << 16 else 2
        parts.append(bytes([(arr.ndim << 2) | width]))
        parts.append(dims.astype(["uint8", "uint16", "uint32"][width]).tobytes())
    parts.append(arr.tobytes())
    return b"".join(parts)


def _fixed_size(encoding: str) -> int | None:
    kind, _, rest = encoding.partition(":")
    if kind == "int":
        return 8
    dtype, _, shape = rest.partition(":")
    if kind == "ndarray" and dtype and shape:
        return int(np.prod([int(x) for x in shape.split(",")])) * np.dtype(dtype).itemsize
    return None


def write_mds(out: Path, columns: dict[str, str], samples: list[dict], samples_per_shard: int = 100,
              compression: str | None = None) -> Path:
    """Write `samples` (dicts of column values) as MDS shards and index.json under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    names = sorted(columns)
    encodings = [columns[n] for n in names]
    sizes = [_fixed_size(e) for e in encodings]
    shards = []
    for k, lo in enumerate(range(0, len(samples), samples_per_shard)):
        chunk = samples[lo : lo + samples_per_shard]
        config = {"version": 2, "format": "mds", "compression": compression, "hashes": ["sha1"],
                  "size_limit": 1 << 26, "column_names": names, "column_encodings": encodings, "column_sizes": sizes}
        config_data = json.dumps(config, sort_keys=True).encode()
        encoded = []
        for sample in chunk:
            data = [_encode(e, sample[n]) for n, e in zip(names, encodings)]
            head = np.array([len(d) for d, s in zip(data, sizes) if s is None], np.uint32).tobytes()
            encoded.append(head + b"".join(data))
        offsets = np.array([0] + [len(e) for e in encoded]).cumsum().astype(np.uint32)
        offsets += 4 + len(offsets.tobytes()) + len(config_data)
        shard = np.uint32(len(chunk)).tobytes() + offsets.tobytes() + config_data + b"".join(encoded)
        basename = f"shard.{k:05d}.mds"
        raw = {"basename": basename, "bytes": len(shard), "hashes": {"sha1": hashlib.sha1(shard).hexdigest()}}
        zipped = None
        if compression:  # as MDSWriter: the shard compressed whole with the library MosaicML uses
            algorithm = compression.split(":")[0]
            zipped = {"basename": f"{basename}.{algorithm}", "bytes": 0, "hashes": {}}
            (out / zipped["basename"]).write_bytes(COMPRESS[algorithm](shard))
        else:
            (out / basename).write_bytes(shard)
        shards.append({**config, "raw_data": raw, "samples": len(chunk), "zip_data": zipped})
    (out / "index.json").write_text(json.dumps({"version": 2, "shards": shards}, sort_keys=True))
    return out
