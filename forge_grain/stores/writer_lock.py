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
            stale = _stale(holder, self.lease)
            if stale is None:
                raise LockedError(f"{self.remote.url} is being written by {_who(holder)}; wait for it to finish, or "
                                  f"choose another output. A lock whose holder died is taken over once its lease "
                                  f"runs out ({holder.get('lease_s', self.lease):g} s unrenewed), or at once on the "
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
        """(ETag, record) of the lock object now; (None, {}) when there is none or it is unreadable."""
        fs, path = self.remote.fs, self.remote.path(WRITER_LOCK)
        try:
            fs.invalidate_cache(path)
            etag = self.remote.retry(WRITER_LOCK, lambda: fs.info(path).get("ETag"), missing_ok=True)
            body = self.remote.retry(WRITER_LOCK, lambda: fs.cat_file(path), missing_ok=True)
            record = json.loads(body) if body else {}
        except ValueError:
            return etag, {}
        return etag, record if isinstance(record, dict) else {}


def _stale(holder: dict, default_lease: float) -> str | None:
    """Why the lock `holder` may be taken over (its process died on this host; its lease ran
    out), or None while it stands. A lock written before leases counts from its `since`."""
    try:
        pid, host = int(holder["pid"]), str(holder["host"])
        renewed = float(holder.get("renewed", holder["since"]))
        lease = float(holder.get("lease_s", default_lease))
    except (KeyError, TypeError, ValueError):
        return "it records no owner forge-grain can read"
    if host == socket.gethostname() and not process_alive(pid):
        return f"process {pid} no longer runs on this host"
    idle = time.time() - renewed
    if idle > lease:
        return f"its lease ran out ({idle:.0f} s since it was renewed; the lease is {lease:g} s)"
    return None


def _who(holder: dict) -> str:
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["since"])))
        return f"process {holder['pid']} on {holder['host']} (since {since})"
    except (KeyError, TypeError, ValueError):
        return "another job"
