"""Files written whole or not at all, and the leftovers of writes that died.

Every file forge-grain writes (stores, plans, caches, records, configs) is written to a
temporary name, made durable and renamed in one atomic step, so a crash leaves either the
old file or the new one; the temporary names carry this host and process, so a later run
removes a dead process's leftovers and leaves a live one's work alone.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np

from forge_grain.locks import process_alive

_HOST = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"
_TEMPORARY = re.compile(r"^\..+\.(?:tmp|stale)-(?:(?P<host>[A-Za-z0-9_]+)-)?(?P<pid>\d+)$")


def sha256_file(path: Path, chunk: int = 1 << 24, opener=open) -> str:
    """sha256 of a file, read a block at a time (`opener`: e.g. an fsspec filesystem's `open`)."""
    h = hashlib.sha256()
    with opener(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_rename(tmp: Path, final: Path) -> None:
    """Make `tmp` durable, then give it its final name in one atomic step."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def temporary(path: Path, kind: str = "tmp") -> Path:
    """Where `path` is written before its rename: hidden, and named for this host and process,
    so a later run can tell a dead process's leftovers from a live one's work."""
    return path.with_name(f".{path.name}.{kind}-{_HOST}-{os.getpid()}")


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove temporaries (files or directories) that a process of this host left when it
    died (a kill, a full disk); those of live processes and of other hosts stay."""
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TEMPORARY.match(entry.name)
        if not m or (m["host"] or _HOST) != _HOST or process_alive(int(m["pid"])):
            continue
        try:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            removed.append(entry)
        except OSError:
            pass
    return removed


def write_text_atomic(path: Path, text: str) -> None:
    tmp = temporary(path)
    tmp.write_text(text)
    fsync_rename(tmp, path)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def npy_size(n: int, dtype: str = "<i8") -> int:
    """The bytes of the file `np.save` writes for `n` values of `dtype` in one dimension (its
    header, padded as numpy pads it, then the values)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": dtype, "fortran_order": False, "shape": (n,)})
    return header.tell() + n * np.dtype(dtype).itemsize


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    tmp = temporary(path)
    with open(tmp, "wb") as f:
        np.save(f, array)
    fsync_rename(tmp, path)
