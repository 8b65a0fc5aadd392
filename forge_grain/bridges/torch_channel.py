"""How a `GrainIterableDataset` talks to its copies in DataLoader workers: a state loaded in the
main process, the epoch `set_epoch` chose, live weight changes, and where streaming sources
stand at a pass's end, through a small directory every copy shares (`ResumeChannel`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import weakref
from pathlib import Path

from forge_grain.locks import file_lock, hold_for_life, unheld

PREFIX = "forge-grain-resume-"


class ResumeChannel:
    """Hands a loaded global state to exactly the processes that start the next pass.

    The next pass runs in this process (num_workers=0), in workers the DataLoader starts for
    it, or in persistent workers started long before: no copy of the dataset taken at fork
    or spawn time can say which. So every pass start, in any process, takes a number from a
    counter in a small directory (under a file lock); a posted state records the number it
    was posted at and applies to the W pass starts that follow it (W: the workers of the
    pass), and to no later pass.

    The directory goes at the creator's exit. A job stopped by a signal (SIGTERM at a
    preemption, SIGKILL) runs no exit handler, so the creator also holds a lock on the
    directory's `owner` file for its life, and the next channel made on the host removes
    every channel directory whose lock is free: its creator, and any worker forked from it,
    is gone.
    """

    def __init__(self):
        _remove_abandoned()
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX))
        owner = hold_for_life(self.dir / f".owner.{os.getpid()}", self.dir / "owner")
        self._cleanup = weakref.finalize(self, _remove_if_owner, str(self.dir), os.getpid(), owner)

    def post(self, state: dict | None) -> None:
        with file_lock(self.dir / "lock"):
            self._write("posted.json", {"state": state, "at": self._read("calls.json", 0)})

    def set_epoch(self, epoch: int) -> None:
        """The epoch `set_epoch` chose, for every process that starts a pass from now on."""
        with file_lock(self.dir / "lock"):
            self._write("epoch.json", epoch)

    def epoch(self) -> int:
        return self._read("epoch.json", 0)

    def hand_over(self, step: int, streams: list[dict]) -> None:
        """Record where this process's canonical streams stand at `step` (the end of its pass), for
        the processes that start the next pass: each process adds the streams it read."""
        with file_lock(self.dir / "lock"):
            name = f"streams-{step}.json"
            known = self._read(name, [{} for _ in streams])
            self._write(name, [{**k, **mine} for k, mine in zip(known, streams)])

    def handed_over(self, step: int) -> list[dict] | None:
        """The streams' positions at `step` handed over by the processes of the pass before, if any."""
        with file_lock(self.dir / "lock"):
            return self._read(f"streams-{step}.json", None)

    def take(self, num_workers: int) -> dict | None:
        """Count one pass start; the posted state if this start belongs to the pass after it."""
        return self._next(num_workers, count=True)

    def peek(self, num_workers: int) -> dict | None:
        """The posted state the next pass start would take (`take`), without counting it."""
        return self._next(num_workers, count=False)

    def _next(self, num_workers: int, count: bool) -> dict | None:
        with file_lock(self.dir / "lock"):
            n = self._read("calls.json", 0)
            if count:
                self._write("calls.json", n + 1)
            posted = self._read("posted.json", None)
        if posted is None or not posted["at"] <= n < posted["at"] + num_workers:
            return None
        return posted["state"]

    def add_change(self, at_step: int, weights: dict) -> int:
        """Record a live weight change for every process; the number of changes now."""
        with file_lock(self.dir / "lock"):
            changes = self._read("changes.json", []) + [[at_step, weights]]
            self._write("changes.json", changes)
        return len(changes)

    def changes(self) -> list:
        """The live weight changes, in the order they were made: read again only when the file
        was replaced (asked before every batch: a stat, ~1 us)."""
        try:
            st = os.stat(os.path.join(self.dir, "changes.json"))
        except FileNotFoundError:
            return []
        key = (st.st_ino, st.st_mtime_ns, st.st_size)  # (replaced whole, never edited in place)
        if getattr(self, "_changes_key", None) != key:
            self._changes_key, self._changes_seen = key, self._read("changes.json", [])
        return self._changes_seen

    def _read(self, name: str, default):
        try:
            return json.loads((self.dir / name).read_text())
        except FileNotFoundError:
            return default

    def _write(self, name: str, value) -> None:
        tmp = self.dir / f".{name}.{os.getpid()}"
        tmp.write_text(json.dumps(value))
        os.replace(tmp, self.dir / name)

    def __getstate__(self):
        return {"dir": self.dir}  # workers share the directory; only the creator removes it

    def __setstate__(self, state):
        self.dir = state["dir"]


def _remove_abandoned() -> None:
    """Remove the channel directories in the temporary directory whose owner lock is free (their
    creator was stopped by a signal). One without an owner file (being made) is left alone."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            if name.startswith(PREFIX):
                _remove_if_free(os.path.join(root, name))


def _remove_if_free(directory: str) -> None:
    with unheld(os.path.join(directory, "owner")) as free:  # (no owner file: being made, or another user's)
        if free:
            shutil.rmtree(directory, ignore_errors=True)


def _remove_if_owner(directory: str, owner: int, fd: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(fd)
