"""File locks between processes (and hosts sharing a file system through flock).

`file_lock` waits for the holder (used where every process needs the same result, such
as one eager Hugging Face store built once); `exclusive_or_refuse` does not wait and
names the holder (used where two writers would be a mistake, such as two `prepare`
runs into one output directory). The latter is a POSIX record lock (`lockf`): it belongs
to the process, so worker processes forked while it is held do not inherit it, and it
is released the moment its holder dies, even if a worker outlives it.

`hold_for_life` and `unheld` mark what a process leaves in a shared directory (the torch
bridge's resume directories and shared-memory rings) as its own for its life, so that a
later process can remove what one stopped by a signal left: the kernel frees the lock at
the holder's death, in any pid namespace, whatever pid comes next.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from forge_grain.errors import ForgeGrainError


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs (one of another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LockedError(ForgeGrainError):
    """Another process holds the lock on what this one wants to write."""


@contextlib.contextmanager
def file_lock(path: Path):
    """Exclusive; waits for the holder. (A bare descriptor: `open` makes four system calls more,
    and a bounded object cache takes its lock a few times a download, on every download thread.)"""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def hold_for_life(tmp: str | Path, name: str | Path, flags: int = 0) -> int:
    """Create file `tmp` (with `os.open`'s extra `flags`), lock it for this process's life (and
    its forked children's: they share the lock), then rename it `name`; the open descriptor.
    Locked before it takes its name, so no sweep (`unheld`) ever finds it free."""
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.replace(tmp, name)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


@contextlib.contextmanager
def unheld(path: str | Path):
    """True, holding its lock meanwhile, if file `path` was locked by `hold_for_life` and its
    holder is gone; False if it is held, missing, or not this user's to open."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its holder (or a process forked from it) is running
            yield False
            return
        yield True
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive_or_refuse(path: Path, what: str):
    """Exclusive; raises `LockedError` naming the holder (pid, host, start time) if held.

    The lock file is removed on release, so nothing is left behind. A process that
    locked a file another one was removing notices (the path no longer names its file)
    and tries again, so two processes never both hold the lock.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN or EACCES, by platform
            os.close(fd)
            raise LockedError(f"{what} is being written by {_holder(path)}; wait for it to finish, or choose "
                              "another output") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # locked a file that was being removed: take the new one
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)  # releases the lock


def _holder(path: Path) -> str:
    try:
        d = json.loads(path.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["since"]))
        return f"process {d['pid']} on {d['host']} (since {since})"
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return "another process"
