"""Where forge-grain keeps what it computes once and reuses (indices, plans, compiled kernels)."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

from forge_grain.errors import ForgeGrainError

log = logging.getLogger(__name__)


class UntrustedCacheError(ForgeGrainError):
    """A cache directory another user could write: what it holds is not loaded."""


BESIDE_DATA = ".forge-grain"  # the one hidden directory a data directory may hold (cache_beside_data)


def cache_root() -> Path:
    """Where forge-grain keeps every cache: packing plans, foreign files' document indices,
    source records (`FORGE_GRAIN_CACHE`, default `~/.cache/forge_grain`)."""
    return Path(os.environ.get("FORGE_GRAIN_CACHE") or Path.home() / ".cache" / "forge_grain")


def env_flag(name: str) -> bool:
    """Whether environment variable `name` is set to a true value ("1", "true", "yes", "on")."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def cache_beside_data() -> bool:
    """Whether caches go beside the data, under one hidden directory (`BESIDE_DATA`), where
    the data's directory is writable: `FORGE_GRAIN_CACHE_BESIDE_DATA=1`. Off by default: a
    user's data directory is written only by `prepare` (its own output), so that other tools'
    globs (`*.npy`, `*.bin`) never meet forge-grain's files there."""
    return env_flag("FORGE_GRAIN_CACHE_BESIDE_DATA")


def private_cache(path) -> Path:
    """`path` as a cache directory this process may read from and write to: made (mode 0700)
    if missing; refused, naming it, when it is a link, or owned by another user, or writable
    by group or others (another user could plant data there, or, for compiled kernels, code).
    A directory that cannot be made is returned as it is (the caller's write fails and it
    falls back to memory, as for a read-only disk)."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return path
    root = cache_root()
    strict = [path, *(p for p in path.parents if p == root or root in p.parents)]  # up to the root: 0700-like
    above = [p for p in path.resolve().parents if p not in {d.resolve() for d in strict}]  # ... then up to /
    for directory, problem in [*((d, _untrusted(d)) for d in strict), *((d, _unsafe_parent(d)) for d in above)]:
        if problem:
            raise UntrustedCacheError(
                f"{directory}: {problem}, so another user could have written what a cache there holds; forge-grain does not "
                "load it. Point FORGE_GRAIN_CACHE (or cache_dir=) at a directory of your own (chmod 700), or fix this one"
            )
    return path


def _unsafe_parent(path: Path) -> str | None:
    """Why a directory above a cache lets another user replace what is below it (as `ssh`
    checks the parents of `authorized_keys`): owned by someone other than this user or root,
    or writable by group or others without the sticky bit (which keeps them from renaming
    entries they do not own, as in /tmp)."""
    try:
        st = path.stat()
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if st.st_uid not in (os.getuid(), 0):
        return f"(a parent of the cache) is owned by another user (uid {st.st_uid})"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return (f"(a parent of the cache) is writable by group or others without the sticky bit "
                f"(mode {stat.S_IMODE(st.st_mode):o})")
    return None


def plan_cache_dir(store_path: Path, cache_dir=None) -> Path | None:
    """Where the plans of the store at `store_path` are cached: `cache_dir`, else under the
    cache root, keyed by the store's path (with `cache_beside_data()`: first beside the store,
    in `.forge-grain/plans`); None (plans stay in memory, with a warning) when none can be
    written. An existing read-only directory that only its owner (or the store's) writes is
    used to read plans saved earlier."""
    store_path = Path(store_path)
    if cache_dir is not None:
        candidates = [Path(cache_dir)]
    else:
        home = store_path if store_path.is_dir() else store_path.parent
        tag = hashlib.sha256(str(store_path.resolve()).encode()).hexdigest()[:16]
        candidates = [home / BESIDE_DATA / "plans"] if cache_beside_data() else []
        candidates.append(cache_root() / "plans" / tag)
    for k, directory in enumerate(candidates):
        if k == len(candidates) - 1:  # cache_dir, or the cache root: refused, naming it, if another user can write it
            private_cache(directory)
        if private_directory(directory):  # beside the store: skipped if another user could plant plans there
            return directory
    existing = [c for c in candidates if c.is_dir() and trusted_directory(c, owner_of=store_path)]
    if existing:  # read-only, but may hold plans saved earlier (a fresh plan stays in memory)
        return existing[0]
    log.warning("forge-grain: no writable plan cache (%s); plans of %s are kept in memory and rebuilt by each process",
                ", ".join(map(str, candidates)), store_path)
    return None


def private_directory(path: Path) -> bool:
    """Whether `path` is (or is now made, mode 0700) a real directory of this user that no one
    else can write. In a shared place such as /tmp another user can create it first."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return False
    return _untrusted(path) is None and os.access(path, os.W_OK)


def trusted_directory(path: Path, owner_of: Path | None = None) -> bool:
    """Whether caches found in an existing `path` may be read: a real directory that only its
    owner can write, the owner being this user, root, or the owner of `owner_of` (the data
    the cache describes: its owner could change the data itself)."""
    extra = ()
    if owner_of is not None:
        try:
            extra = (Path(owner_of).stat().st_uid,)
        except OSError:
            pass
    return _untrusted(path, extra) is None


def _untrusted(path: Path, owners: tuple = ()) -> str | None:
    try:
        st = path.lstat()
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory (a link or a file)"
    if st.st_uid not in (os.getuid(), 0, *owners):
        return f"is owned by another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def is_url(path) -> bool:
    """A URL fsspec reads (`s3://...`); `file://` URLs and plain paths are local."""
    return "://" in str(path) and not str(path).startswith("file://")


def local_path(path) -> Path:
    """A plain path, or the path of a `file://` URL."""
    text = str(path)
    return Path(text[len("file://"):] if text.startswith("file://") else text)
