"""Batches from DataLoader workers through reused shared-memory slots.

torch sends each tensor a worker returns through a fresh shared-memory segment: the worker
allocates and copies (a page fault per 4 KiB page written), the main process receives a
file descriptor over a socket round trip per storage, and frees the pages when the batch
dies. A 64 x 2048 batch of eight tensors cost the main process about 4 ms a step that way,
more than a fast training step leaves it.

Here each worker owns a ring of slots in one file under /dev/shm, made once and reserved
with `posix_fallocate` (a full /dev/shm is an error there, not a SIGBUS later), and locked
for the worker's life (a ring whose worker died before the main process mapped it goes
when the next is made: `sweep_stale`). A batch is
copied into a free slot and sent as its slot number and layout; the main process maps the
ring once and builds the tensors as views of the slot. The slot is free again only when
nothing in the main process references any of those tensors (a finalizer on their common
base sets its flag), so a batch the caller keeps is never overwritten. With no free slot
(the caller holds many batches), no /dev/shm, or a slot too small, the batch goes torch's
own way: slower, never wrong, never blocking.
"""

from __future__ import annotations

import contextlib
import glob
import math
import mmap
import os
import socket
import tempfile
import uuid
import weakref
from multiprocessing import util

import numpy as np
import torch

from forge_grain.errors import ConfigError
from forge_grain.locks import hold_for_life, process_alive, unheld

SHM_DIR = "/dev/shm"
PREFIX = "forge-grain-slots-"
SLOTS = 8  # per worker: the DataLoader's prefetch (2 by default), the batch in use, pinning, spare
_HOST = "".join(c for c in socket.gethostname() if c.isalnum())[:32] or "host"  # containers may share /dev/shm
_ALIGN = 64
_BIG = 1 << 16  # tensors from 64 KiB go through the slot; smaller ones (step, source_id, stream_states) by value
_HEADER = 4096  # one flag byte a slot: 1 while the main process may read it, 0 when free


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class SlotRing:
    """The worker's side: a ring of `SLOTS` slots of `slot_bytes` in one shared-memory file."""

    def __init__(self, slot_bytes: int, count: int = SLOTS):
        sweep_stale()
        self.slot_bytes, self.count = slot_bytes, count
        name = f"{PREFIX}{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = os.path.join(SHM_DIR, name)
        self._lock = hold_for_life(os.path.join(SHM_DIR, "." + name), self.path, os.O_EXCL)  # (open for life)
        try:
            size = _HEADER + slot_bytes * count
            os.posix_fallocate(self._lock, 0, size)  # reserve the pages now: ENOSPC here, not SIGBUS on a write
            self.map = mmap.mmap(self._lock, size)
        except BaseException:
            os.unlink(self.path)
            os.close(self._lock)
            raise
        self.flags = np.frombuffer(self.map, np.uint8, count=count)
        self.body = np.frombuffer(self.map, np.uint8, offset=_HEADER)
        self._next = 0

    def send(self, tensors: dict) -> dict:
        """`tensors` as a dict that pickles to its slot (or `tensors` itself when it cannot)."""
        big = {k: v for k, v in tensors.items() if torch.is_tensor(v) and v.numel() * v.element_size() >= _BIG}
        layout, offset = {}, 0
        for k, v in big.items():
            nbytes = v.numel() * v.element_size()
            layout[k] = (offset, nbytes, tuple(v.shape), v.numpy().dtype.str)
            offset += _aligned(nbytes)
        slot = self._free_slot()
        if offset > self.slot_bytes or slot is None:
            return tensors
        base = self.body[slot * self.slot_bytes:][:offset]
        for k, v in big.items():
            off, nbytes, shape, dtype = layout[k]
            torch.from_numpy(base[off:off + nbytes].view(dtype).reshape(shape)).copy_(v)
        self.flags[slot] = 1
        small = {k: (v.numpy() if torch.is_tensor(v) else v) for k, v in tensors.items() if k not in big}
        return SlotBatch(tensors, (self.path, slot, self.slot_bytes, layout, small))

    def _free_slot(self) -> int | None:
        for i in range(self.count):
            slot = (self._next + i) % self.count
            if self.flags[slot] == 0:
                self._next = slot + 1
                return slot
        return None


class SlotBatch(dict):
    """A batch in a slot: itself in the worker, its slot's address when pickled."""

    def __init__(self, tensors: dict, address: tuple):
        super().__init__(tensors)
        self.address = address

    def __copy__(self):  # the DataLoader's default_convert copies the batch before sending it
        return SlotBatch(self, self.address)

    def __reduce__(self):
        return _receive, self.address


_RINGS: dict[str, mmap.mmap] = {}  # in the main process: the rings it has mapped


def _receive(path: str, slot: int, slot_bytes: int, layout: dict, small: dict) -> dict:
    """In the main process: the batch as tensors viewing its slot, which frees when they all die."""
    ring = _RINGS.get(path)
    if ring is None:
        ring = _map(path)
    base = np.frombuffer(ring, np.uint8, count=slot_bytes, offset=_HEADER + slot * slot_bytes)
    weakref.finalize(base, _release, ring, slot)
    out = {k: torch.from_numpy(base[off:off + nbytes].view(dtype).reshape(shape))
           for k, (off, nbytes, shape, dtype) in layout.items()}
    out.update({k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in small.items()})
    return out


def _map(path: str) -> mmap.mmap:
    """Map a worker's ring, then remove its name: the mappings keep it, nothing else can find it."""
    _close_finished()
    fd = os.open(path, os.O_RDWR)
    try:
        ring = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    os.unlink(path)
    _RINGS[path] = ring
    return ring


def _release(ring: mmap.mmap, slot: int) -> None:
    if not ring.closed:
        ring[slot] = 0


def _close_finished() -> None:
    """Unmap the rings of workers that have exited and whose tensors are all gone."""
    for path, ring in list(_RINGS.items()):
        if not process_alive(_worker_pid(path)):
            try:
                ring.close()
            except BufferError:  # a batch from it is still referenced
                continue
            del _RINGS[path]


def _worker_pid(path: str) -> int:
    return int(os.path.basename(path)[len(PREFIX):].split("-")[1])


def sweep_stale() -> None:
    """Remove rings whose worker has exited before the main process mapped them (a loader
    abandoned mid-pass, a killed worker): nothing can reach them any more. A worker holds its
    ring's lock for its life, so a free one is a dead worker's, whatever pid namespace it ran
    in (containers of one pod share /dev/shm and a host name, not their pids)."""
    for path in glob.glob(os.path.join(SHM_DIR, f"{PREFIX}{_HOST}-*")):
        with unheld(path) as free:
            if free:
                with contextlib.suppress(OSError):
                    os.unlink(path)


def check_socket_dir() -> None:
    """In a DataLoader worker, before its first batch: torch hands a batch's tensors that go its
    own way (a small one, or no free slot) to the main process over a Unix socket it makes in
    the temporary directory (its `file_descriptor` sharing strategy). Linux takes socket paths
    of 107 bytes at most; a longer one fails in the worker's queue feeder thread, where no one
    sees it, and the DataLoader waits for that batch for ever. An error naming TMPDIR instead."""
    if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
        return
    path = os.path.join(util.get_temp_dir(), "listener-" + "x" * 8)  # (multiprocessing's own name for it)
    if len(os.fsencode(path)) > _SOCKET_PATH_MAX:
        raise ConfigError(f"the temporary directory {tempfile.gettempdir()} is too long a path for DataLoader workers: "
                          f"torch hands batches over Unix sockets made there ({path}, {len(os.fsencode(path))} "
                          f"bytes; Linux allows {_SOCKET_PATH_MAX}). Set TMPDIR to a shorter directory, such as /tmp")


_SOCKET_PATH_MAX = 107
_WORKER_RINGS: dict[int, SlotRing | None] = {}  # in a worker (by pid: forked workers make their own)


def worker_ring(tensors: dict, growth: float = 1.0) -> SlotRing | None:
    """This worker's ring, made on its first batch and sized for `growth` times it (batches
    that grow under a batch-size schedule); None where it cannot be."""
    pid = os.getpid()
    if pid not in _WORKER_RINGS:
        size = sum(_aligned(math.ceil(v.numel() * v.element_size() * growth)) for v in tensors.values()
                   if torch.is_tensor(v) and v.numel() * v.element_size() >= _BIG)
        try:
            _WORKER_RINGS[pid] = SlotRing(_aligned(size)) if size and os.path.isdir(SHM_DIR) else None
        except OSError:  # /dev/shm full or not writable: torch's own way
            _WORKER_RINGS[pid] = None
    return _WORKER_RINGS[pid]
