"""Where forge-grain keeps what it computes once and reuses (indices, plans, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where forge-grain caches what it cannot keep beside the data (`FORGE_GRAIN_CACHE`)."""
    return Path(os.environ.get("FORGE_GRAIN_CACHE") or Path.home() / ".cache" / "forge_grain")


def is_url(path) -> bool:
    """A URL fsspec reads (`s3://...`); `file://` URLs and plain paths are local."""
    return "://" in str(path) and not str(path).startswith("file://")


def local_path(path) -> Path:
    """A plain path, or the path of a `file://` URL."""
    text = str(path)
    return Path(text[len("file://"):] if text.startswith("file://") else text)
