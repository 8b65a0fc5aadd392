"""Files written whole or not at all, and the leftovers of writes that died.

Every file forge-grain writes (stores, plans, caches, records, configs) is written to a
temporary name, made durable and renamed in one atomic step, so a crash leaves either the
old file or the new one; the temporary names carry this host and process, so a later run
removes a dead process's leftovers and leaves a live one's work alone.
"""

from __future__ import annotations

import ctypes
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


def _sync_file_range():
    """Linux's `sync_file_range`, or None where the C library has none."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError, TypeError):  # (TypeError: a platform that cannot load its C library by None)
        return None
    call.argtypes, call.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
    return call


_SYNC_FILE_RANGE = _sync_file_range()
_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start writing the range's dirty pages, wait for none


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing bytes [offset, offset + length) of `fd` to disk now,
    without waiting: the fsync before a download's rename then finds little left to write
    (a 24.7 MB shard's took 9-14 ms after its last part, on the path of a read waiting for
    it; about 1-2 ms with its parts' writeback started as each was written). Advisory: a
    file system or platform without it is left to the fsync."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _WRITE)


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
