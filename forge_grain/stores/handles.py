"""One pool of open file handles per process, so descriptors stay bounded whatever the
number of shards and sources.

Memory maps hold no descriptor (`forge_grain.stores.mapping`). Readers that do (ArrayRecord's,
and each object cache's ledger, `cache_ledger`) are opened on first use and kept here, least
recently used dropped first past `FORGE_GRAIN_MAX_OPEN_FILES` (default 128, well under the
1024 clusters commonly allow, or a quarter of the process's `ulimit -n` where that is less).
A dropped handle is not closed by the pool: a thread still reading it keeps it alive,
and it closes its file when collected, so eviction never races a read.
"""

from __future__ import annotations

import collections
import os
import resource
import threading
from typing import Callable

from forge_grain.processes import per_process

DEFAULT_MAX_OPEN_FILES = 128


def share_of_descriptors(most: int, share: int = 16) -> int:
    """`most`, or fewer where this process may open few descriptors: a 1/`share` of its soft
    limit (`ulimit -n`, read now: a job may lower it before it builds a pipeline), 4 at least.
    What holds a descriptor for each of many things at once (downloads, each with its file and
    its lock; requests, each with a connection) takes no more than that, whatever the number
    of sources: a mixture of 12 sources in object storage, each downloading 64 shards ahead,
    ran out of the 1024 that clusters commonly allow."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return most if soft == resource.RLIM_INFINITY else max(4, min(most, soft // share))


class HandlePool:
    """Open handles by key, at most `capacity` kept (least recently used dropped first)."""

    def __init__(self, capacity: int | None = None):
        told = os.environ.get("FORGE_GRAIN_MAX_OPEN_FILES")
        self.capacity = capacity or (int(told) if told else share_of_descriptors(DEFAULT_MAX_OPEN_FILES, 4))

    @per_process
    def _mine(self) -> tuple[collections.OrderedDict, threading.Lock]:
        """This process's handles and their lock (a forked child's parent's handles share their
        file positions, and their native state may refer to threads the child does not have)."""
        return collections.OrderedDict(), threading.Lock()

    def get(self, key, opener: Callable[[], object]):
        """The open handle for `key`, opened by `opener()` when the pool holds none."""
        handles, lock = self._mine
        with lock:
            handle = handles.get(key)
            if handle is not None:
                handles.move_to_end(key)
                return handle
        handle = opener()
        with lock:
            handle = handles.setdefault(key, handle)
            handles.move_to_end(key)
            while len(handles) > self.capacity:
                handles.popitem(last=False)
        return handle

    def drop(self, key) -> None:
        """Forget `key`'s handle (its file was removed): it closes once no reader holds it."""
        handles, lock = self._mine
        with lock:
            handles.pop(key, None)

    def __len__(self) -> int:
        return len(self._mine[0])


POOL = HandlePool()
