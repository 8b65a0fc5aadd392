"""One writer per store URL, across hosts, with a lease: a lock object that recovers.

The lock is an object (`.forge-grain-writer.lock`) created only if absent (S3's conditional
PUT, `If-None-Match: *`). It records its owner (a random id, the pid, the host, the start
time) and a lease: the holder rewrites it every quarter of `lease_s` seconds (default 300,
`FORGE_GRAIN_LOCK_LEASE`) while its job runs, and removes it when the job ends. A job that
dies cannot remove it, so a later job takes it over, and says so, when

- the holder ran on this host and its process is gone (at once), or
- the lease has run out: not renewed for `lease_s` seconds (the holder's clock against this
  host's: hosts' clocks must agree to well within a lease, as NTP keeps them).

A takeover replaces the lock only if it is still the object read (`If-Match` on its ETag), so
of two jobs taking over one dead lock, one wins and the other is refused; a live holder
renews its lease and is never taken over. Filesystems without conditional creation are
written without this lock (with a warning).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid

from forge_grain.locks import LockedError, process_alive

log = logging.getLogger(__name__)
WRITER_LOCK = ".forge-grain-writer.lock"


def lease_seconds() -> float:
    """How long a lock stands without being renewed (`FORGE_GRAIN_LOCK_LEASE`, default 300 s)."""
    return float(os.environ.get("FORGE_GRAIN_LOCK_LEASE", 300))


@contextlib.contextmanager
def writer_lock(url: str, storage_options: dict | None = None):
    """Hold the writer lock of `url` for the block (see the module's docstring)."""
    from forge_grain.stores.remote_dir import RemoteDir

    remote = RemoteDir(url, storage_options)
    if not hasattr(remote.fs, "call_s3"):
        log.warning("forge-grain: %s cannot be locked against a second writer (no conditional create); run one "
                    "job per output", url)
        yield
        return
    lock = _Lease(remote)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


class _Lease:
    """The lock object of one URL, held by this process and renewed by a thread."""

    def __init__(self, remote):
        self.remote = remote
        self.bucket, self.key, _ = remote.fs.split_path(remote.path(WRITER_LOCK))
        self.where = f"{remote.url}/{WRITER_LOCK}"
        self.lease = lease_seconds()
        self.record = {"owner": uuid.uuid4().hex, "pid": os.getpid(), "host": socket.gethostname(),
                       "since": time.time(), "lease_s": self.lease}
        self.etag: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> None:
        if not self.remote.retry(WRITER_LOCK, lambda: self._put(IfNoneMatch="*")):
            etag, holder = self._holder()
            stale = _stale(holder, self.lease, self.written)
            if stale is None:
                raise LockedError(f"{self.remote.url} is being written by {_who(holder)}; wait for it to finish, or "
                                  f"choose another output. A lock whose holder died is taken over once its lease "
                                  f"runs out ({_lease_words(holder, self.lease)} unrenewed), or at once on the "
                                  f"holder's host; to end it sooner, remove {self.where} and run again")
            if etag is None or not self.remote.retry(WRITER_LOCK, lambda: self._put(IfMatch=etag)):
                raise LockedError(f"{self.remote.url}: another job took over the stale lock of {_who(holder)} first")
            log.warning("forge-grain: %s: took over the writer lock of %s: %s", self.remote.url, _who(holder), stale)
        self._renewer = threading.Thread(target=self._renew, name="forge-grain-lock-lease", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        _, holder = self._holder()
        if holder.get("owner") == self.record["owner"]:  # (never another job's, after a takeover)
            self.remote.retry(WRITER_LOCK, lambda: self.remote.fs.rm_file(self.remote.path(WRITER_LOCK)),
                              missing_ok=True)

    def _put(self, **condition) -> bool:
        """Write the lock with `renewed` now under `condition`; False when the condition fails."""
        body = json.dumps({**self.record, "renewed": time.time()}).encode()
        try:
            answer = self.remote.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=body, **condition)
        except FileExistsError:  # If-None-Match: there is a lock
            return False
        except OSError as e:  # If-Match: it is not the lock read (s3fs gives a 412 as EINVAL)
            if "condition" in str(e).lower():
                return False
            raise
        self.etag = answer.get("ETag")
        return True

    def _renew(self) -> None:
        """Rewrite the lock every quarter lease while it is ours; say so if it was taken over."""
        while not self._stop.wait(self.lease / 4):
            try:
                if not self._put(IfMatch=self.etag):
                    log.error("forge-grain: %s: the writer lock was taken over by another job (this one did not "
                              "renew it within its %g s lease); two jobs may now write this output", self.where,
                              self.lease)
                    return
            except Exception as e:  # a network blip: the next renewal tries again, well within the lease
                log.warning("forge-grain: %s: renewing the writer lock failed (%s: %s)", self.where,
                            type(e).__name__, e)

    def _holder(self) -> tuple[str | None, dict]:
        """(ETag, record) of the lock object now; (None, {}) when there is none; the record {} when
        it is unreadable. `self.written`: the store's time of its last write (None: unknown)."""
        fs, path = self.remote.fs, self.remote.path(WRITER_LOCK)
        etag, self.written = None, None
        try:
            fs.invalidate_cache(path)
            info = self.remote.retry(WRITER_LOCK, lambda: fs.info(path), missing_ok=True) or {}
            etag, modified = info.get("ETag"), info.get("LastModified")
            self.written = modified.timestamp() if hasattr(modified, "timestamp") else None
            body = self.remote.retry(WRITER_LOCK, lambda: fs.cat_file(path), missing_ok=True)
            record = json.loads(body) if body else {}
        except ValueError:
            return etag, {}
        return etag, record if isinstance(record, dict) else {}


MAX_LEASE_S = 7 * 86400  # a lease longer than a week is no lease a job renews
CLOCK_SKEW_S = 300  # a renewal this far in the future is a clock's error, not a forged lock


def _stale(holder: dict, default_lease: float, written: float | None = None) -> str | None:
    """Why the lock `holder` may be taken over (its process died on this host; its lease ran
    out), or None while it stands. A lock written before leases counts from its `since`. A
    record that cannot be read as a lease (a lease of `inf`, NaN or past a week, a time past
    the largest float or in the future) counts as expired `default_lease` seconds after the
    lock object was last written (`written`, the store's time for it), and the reason says so."""
    now = time.time()
    try:
        pid, host, renewed, lease = _lease(holder, default_lease, now)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        why = f"its record is not a valid lease ({e})"
        idle = None if written is None else now - written
        if idle is None or idle > default_lease:
            return f"{why}; counted as expired {default_lease:g} s (the default lease) after it was written"
        return None
    if host == socket.gethostname() and not process_alive(pid):
        return f"process {pid} no longer runs on this host"
    idle = now - renewed
    if idle > lease:
        return f"its lease ran out ({idle:.0f} s since it was renewed; the lease is {lease:g} s)"
    return None


def _lease(holder: dict, default_lease: float, now: float) -> tuple[int, str, float, float]:
    """(pid, host, when renewed, lease) of a lock's record, each checked (a ValueError says which)."""
    pid, host = holder["pid"], holder["host"]
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 1 << 32 or not isinstance(host, str):
        raise ValueError(f"pid {pid!r:.40} on host {host!r:.40}")
    renewed = _number(holder, "renewed" if "renewed" in holder else "since")
    lease = _number(holder, "lease_s") if "lease_s" in holder else default_lease
    if not 0 < lease <= MAX_LEASE_S:
        raise ValueError(f"lease_s {lease!r} is not in (0, {MAX_LEASE_S}]")
    if renewed > now + CLOCK_SKEW_S:
        raise ValueError(f"it was renewed {renewed - now:.0f} s in the future")
    return pid, host, renewed, lease


def _number(holder: dict, key: str) -> float:
    """A finite number of the record (a JSON number only: "inf" as a string is not one)."""
    v = holder[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{key} {v!r:.40} is not a number")
    f = float(v)  # (OverflowError for an integer past the largest float)
    if f != f or f in (float("inf"), float("-inf")):
        raise ValueError(f"{key} {v!r:.40} is not finite")
    return f


def _lease_words(holder: dict, default_lease: float) -> str:
    try:
        return f"{_lease(holder, default_lease, time.time())[3]:g} s"
    except (KeyError, TypeError, ValueError, OverflowError):
        return f"{default_lease:g} s after the lock was written: its record is not a valid lease"


def _who(holder: dict) -> str:
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["since"])))
        return f"process {str(holder['pid'])[:40]} on {str(holder['host'])[:60]} (since {since})"
    except (KeyError, TypeError, ValueError, OverflowError, OSError):
        return "another job"
