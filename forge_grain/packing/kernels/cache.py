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


def _without_scipy_blas() -> None:
    """Import numba's array math, which a process's first kernel imports with the rest of
    numba's target, without loading the scipy BLAS it only probes for: `_check_blas` imports
    `scipy.linalg.cython_blas` to learn whether BLAS is there. Loading it (and scipy.linalg)
    took 0.22 s of a core here, 0.12 s of it scipy's OpenBLAS starting a thread for each other
    core, each spinning until it sleeps; a 128-shard epoch from object storage spends 2.0-2.4
    core-seconds in all. The probe is answered by whether scipy is installed, as it was
    answered before (but for a broken scipy); numba's functions that use BLAS still import it
    when they are first compiled (`ensure_blas`, put back)."""
    import importlib.util
    import sys

    if "numba.np.arraymath" in sys.modules or "scipy.linalg" in sys.modules:
        return
    from numba.core.compiler_lock import global_compiler_lock
    from numba.np import linalg

    def installed() -> None:
        if importlib.util.find_spec("scipy") is None:
            raise ImportError("scipy 0.16+ is required for linear algebra")

    probe = getattr(linalg, "ensure_blas", None)
    if probe is None:  # (a numba that probes otherwise: left as it is)
        return
    with global_compiler_lock:
        linalg.ensure_blas = installed
        try:
            from numba.np import arraymath
        finally:
            linalg.ensure_blas = probe
        arraymath.ensure_blas = probe


CACHE = _numba_cache()
_without_scipy_blas()


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
