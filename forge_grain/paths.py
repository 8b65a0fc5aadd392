"""Where forge-grain keeps what it computes once and reuses (indices, plans, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where forge-grain caches what it cannot keep beside the data (`FORGE_GRAIN_CACHE`)."""
    return Path(os.environ.get("FORGE_GRAIN_CACHE") or Path.home() / ".cache" / "forge_grain")
