"""Where compiled kernels are cached: numba's `cache=True`, made safe for read-only installs."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numba as nb


def _numba_cache() -> bool:
    """Whether compiled kernels can be cached, choosing a writable place for them first.

    numba caches beside this module (`__pycache__`) or in a per-user directory; in a
    read-only deployment (package and home both read-only) neither works and every
    `cache=True` kernel would fail at first use. Then the cache goes to
    `$NUMBA_CACHE_DIR` if set, else `$FORGE_GRAIN_CACHE/numba`, else a temporary directory;
    with none writable, kernels compile on each start without caching. A cache holds code
    numba loads and runs (pickled), so a directory another user could have made or can
    write is never used (see `private_directory`).
    """
    if nb.config.CACHE_DIR:
        return True
    here = Path(__file__).parent
    if os.access(here / "__pycache__" if (here / "__pycache__").is_dir() else here, os.W_OK):
        return True
    from forge_grain.paths import cache_root, private_directory

    for candidate in (cache_root() / "numba", Path(tempfile.gettempdir()) / f"forge_grain-numba-{os.getuid()}"):
        if private_directory(candidate):
            nb.config.CACHE_DIR = str(candidate)
            return True
    return False


CACHE = _numba_cache()


@nb.njit(cache=CACHE)
def _ready(x):
    return x + 1


def warm_up():
    """Start numba's compiler in a background thread, returned: join it before the work it
    overlaps ends (a fork while it holds numba's compiler lock would leave the lock held in
    the child). A process's first kernel, whatever it is, spends about half a second
    setting numba up (importing its target's registries); a pipeline over object storage
    would spend it on the way to its first downloads (the lookahead that names them is a
    kernel), and starting it while the stores open over the network hides it."""
    import threading

    thread = threading.Thread(target=_ready, args=(1,), daemon=True, name="forge-grain-numba")
    thread.start()
    return thread
