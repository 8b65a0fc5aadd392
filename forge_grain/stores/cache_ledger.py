"""The object cache's files and their sizes, kept in a log instead of found by a walk.

A bounded cache must know, before each download, how many bytes it holds. Walking the cache
directory for that stats every file of every store ever cached, under the host's lock, once
per download (~12 ms with a few hundred files, and it grows with the cache). The ledger is
`.ledger` in the cache directory: one line per change (`+SIZE<TAB>NAME` when a file is
added or a download's bytes reserved, `-<TAB>NAME` when one goes), appended under the
cache's lock by whichever process made the change (those of one turn of the lock in one write, as
it is let go: `flush`). Each process replays only the lines
added since it last looked, so a download costs a few lines, not a walk. When the log has
grown well past the files it describes it is rewritten (to a temporary name, renamed); a
process that sees a new file reads it from the start. A missing or unreadable ledger is
rebuilt by one walk, as is one that says the cache is full when it may not be.

A new file is told by its inode, and so that no other file can have that inode meanwhile,
the file read is held open (in the process's pool of handles, `handles.POOL`: one dropped
from it is read anew from the start). ext4 gives a rewrite the inode that the rewrite before
it freed: two rewrites in a row left the ledger at an inode a process had seen, and it read
on from its old place in the old file. Two DataLoader workers sharing a Megatron file's cache
under a limit of two files' worth then held 1.1-1.6x the limit, each counting what the other
had added as gone.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path

from forge_grain.stores.handles import POOL

NAME = ".ledger"
_SERIALS = itertools.count(1)  # each ledger file opened, numbered: told apart even where inodes repeat


class _Held:
    """A ledger file held open (closed once the pool drops it and no `sync` reads it)."""

    __slots__ = ("file", "inode", "serial")

    def __init__(self, path: Path):
        self.file = open(path, "rb", buffering=0)  # noqa: SIM115 (its life is the pool's)
        self.inode, self.serial = os.fstat(self.file.fileno()).st_ino, next(_SERIALS)


class Ledger:
    """Files of a cache directory (relative name -> bytes), as its log says. Every method is
    called under the cache's accounting lock (`ObjectCache._accounting`)."""

    def __init__(self, directory: Path, walk):
        self.path, self._walk = Path(directory) / NAME, walk
        self._key = ("ledger", str(self.path))  # (its file's in `handles.POOL`)
        self.files: dict[str, int] = {}
        self._at, self._serial, self._lines = 0, None, 0  # (`_serial`: the `_Held` file read up to `_at`)
        self._unwritten: list[str] = []  # lines of this turn of the lock, written by `flush`

    def sync(self) -> dict[str, int]:
        """The files now: the lines other processes appended since this one last looked."""
        try:
            st = os.stat(self.path)
            held = self._held()
            if held.inode != st.st_ino:  # rewritten since it was opened
                POOL.drop(self._key)
                held = self._held()
        except FileNotFoundError:  # (removed by hand)
            return self.rebuild()
        if held.serial != self._serial:  # another file (or one the pool dropped): from the start
            self.files, self._at, self._serial, self._lines = {}, 0, held.serial, 0
        if st.st_size > self._at:
            data = os.pread(held.file.fileno(), st.st_size - self._at, self._at)
            end = data.rfind(b"\n") + 1  # a line being written by a process that died is not read
            for line in data[:end].decode("utf-8", "replace").splitlines():
                self._apply(line)
            self._at += end
        return self.files

    def rebuild(self) -> dict[str, int]:
        """The files as a walk of the directory finds them, written as a new ledger."""
        self.files = {str(path.relative_to(self.path.parent)): size for _, size, path in self._walk()}
        self._rewrite()
        return self.files

    def add(self, name: str, size: int) -> None:
        self._append(f"+{size}\t{name}\n")
        self.files[name] = size

    def drop(self, name: str) -> None:
        if self.files.pop(name, None) is not None:
            self._append(f"-\t{name}\n")

    def used(self) -> int:
        """The files' bytes and the ledger's own, at the most it can grow to (`reserve`)."""
        return sum(self.files.values()) + self.reserve()

    def reserve(self) -> int:
        """The most bytes the ledger holds before its next rewrite, with that rewrite's
        temporary beside it: it lives in the cache, so it counts against the limit."""
        line = max((len(name.encode()) for name in self.files), default=64) + 24
        return (3 * len(self.files) + 34) * line  # (the lines before a rewrite, and the rewrite's)

    def size(self) -> int:
        """The ledger's bytes on disk now (and a rewrite's temporary, if one is there)."""
        total = 0
        for path in (self.path, *self.path.parent.glob(f"{NAME}.tmp-*")):
            try:
                total += os.stat(path).st_size
            except FileNotFoundError:
                pass
        return total

    def _apply(self, line: str) -> None:
        op, _, name = line.partition("\t")
        self._lines += 1
        if op == "-":
            self.files.pop(name, None)
        elif op[:1] == "+" and op[1:].isdigit() and name:
            self.files[name] = int(op[1:])

    def _append(self, line: str) -> None:
        if self._lines > 2 * len(self.files) + 32:  # mostly history: the files alone, anew
            self._rewrite()
        self._unwritten.append(line)
        self._lines += 1

    def flush(self) -> None:
        """The lines of this turn of the lock appended in one write, before the lock is let go
        (a download adds four: its reservation, an eviction, and its copy in place of the
        reservation)."""
        if not self._unwritten:
            return
        data, self._unwritten = "".join(self._unwritten).encode(), []
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # (bare: `open` makes 4 calls more)
        try:
            view = memoryview(data)
            while view:  # (a full disk takes part of a write, then refuses the rest)
                view = view[os.write(fd, view):]
        except OSError as e:  # a line cut short would run into the next one
            raise self._dropped(e) from None
        finally:
            os.close(fd)
        self._at += len(data)

    def _rewrite(self) -> None:
        """The files as they are now written anew, to a temporary renamed over the ledger.
        A temporary already there is a rewrite that never finished (its process killed, or
        it failed): rewrites run under the lock, so none is in progress, and it goes."""
        self._unwritten = []  # (the files are written as they are now, these lines' changes included)
        text = "".join(f"+{size}\t{name}\n" for name, size in self.files.items()).encode()
        for stale in self.path.parent.glob(f"{NAME}.tmp-*"):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        tmp = self.path.with_name(f"{NAME}.tmp-{os.getpid()}")
        try:
            tmp.write_bytes(text)
            os.replace(tmp, self.path)
        except OSError as e:  # (a full disk): the ledger lacks this turn's lines
            raise self._dropped(e, tmp) from None
        POOL.drop(self._key)
        self._at, self._serial, self._lines = len(text), self._held().serial, len(self.files)

    def _held(self) -> _Held:
        """The ledger file this process holds open: the one at the path when it was opened."""
        return POOL.get(self._key, lambda: _Held(self.path))

    def _dropped(self, e: OSError, *also: Path) -> OSError:
        """After a failed write, the ledger (and `also`) removed, so the next look rebuilds it
        by a walk: the error to raise, naming the ledger."""
        for path in (*also, self.path):
            with contextlib.suppress(OSError):
                os.unlink(path)
        POOL.drop(self._key)
        self._serial = None
        return OSError(e.errno, e.strerror, str(self.path))

