"""Names on the Hugging Face Hub (`gpt2`, `meta-llama/Llama-3.1-8B`, `org/name@revision`),
resolved as `transformers` resolves them: the local Hugging Face cache (`HF_HOME`,
`HF_HUB_CACHE`), a download when the Hub is reachable and `HF_HUB_OFFLINE` is not set,
tokens from the usual environment (`HF_TOKEN`). What is recorded is the name pinned to
the commit it resolved to (`org/name@<40 hex>`), so that a later run against a moved
`main` is a different name, refused where settings or fingerprints are compared."""

from __future__ import annotations

import re
import socket
from pathlib import Path

from forge_grain.errors import PrepareError
from forge_grain.paths import env_flag

HUB_HOST = "huggingface.co"
_REPO_ID = re.compile(r"[\w.-]+(/[\w.-]+)?(@[\w./-]+)?")


def looks_like_repo_id(name: str) -> bool:
    """`gpt2`, `meta-llama/Llama-3.2-1B`, `org/name@v1.0`: a Hub repository id, not a path
    someone meant (no leading dot, no `.json` file name)."""
    return bool(_REPO_ID.fullmatch(name)) and not name.startswith(".") and not name.split("@")[0].endswith(".json")


def offline() -> bool:
    """Whether `HF_HUB_OFFLINE` forbids the Hub (as `huggingface_hub` reads it)."""
    return env_flag("HF_HUB_OFFLINE")


def reachable(host: str = HUB_HOST, port: int = 443, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


MAX_NAME = 256  # the Hub allows 96 characters a part of a repository id; revisions are git ref names
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def check_name(name: str) -> None:
    """A Hub name's revision is a branch or tag name or a commit (git's ref rules: no `..`, no
    leading `/`, only letters, digits and `._/-`), and the name is of a length a name can have:
    else a `PrepareError` naming it. (A revision of `../../` once read a ref outside the cache.)"""
    if len(name) > MAX_NAME:
        raise PrepareError(f"{name[:60]}...: a Hugging Face Hub name of {len(name)} characters (at most {MAX_NAME}); "
                           "check the name, or give a local path")
    repo, _, revision = name.partition("@")
    if "@" in name and not (_REVISION.fullmatch(revision) and ".." not in revision and "//" not in revision
                            and not revision.endswith(("/", ".", ".lock"))):
        raise PrepareError(f"{name}: {revision!r} is not a revision (a branch or tag name, or a 40-hex commit: "
                           "letters, digits and '._/-', no '..', no leading or trailing '/')")


def snapshot(name: str, files: list[str], what: str) -> tuple[Path, str]:
    """(the local folder holding `files` of repository `name` (`repo` or `repo@revision`),
    `repo@commit`): from the cache when offline or when the Hub cannot be reached, else
    downloaded (only `files`). A miss says how to fetch it once. What the cache gives is
    checked to lie inside it (`_inside_cache`)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    check_name(name)
    repo, _, revision = name.partition("@")
    local_only = offline() or not reachable(*_endpoint())
    try:
        folder = Path(snapshot_download(repo, revision=revision or None, allow_patterns=files,
                                        local_files_only=local_only))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline() else f"the Hub ({HUB_HOST}) cannot be reached"
        raise PrepareError(
            f"{name}: no local {what} of this name and not in the Hugging Face cache ({_cache_dir()}), and {why}. "
            f"Fetch it once where the Hub is reachable, into this cache: `hf download {repo} {' '.join(files[:3])}"
            f"{f' --revision {revision}' if revision else ''}` (or `AutoTokenizer.from_pretrained({repo!r})`), "
            "or give a local path") from None
    except Exception as e:  # a missing or gated repository, an unknown revision, refused credentials
        raise PrepareError(f"{name}: cannot resolve this Hugging Face Hub name ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); check the name, revision and HF_TOKEN") from None
    _inside_cache(name, repo, folder, files)
    return folder, f"{repo}@{folder.name}"


def _inside_cache(name: str, repo: str, folder: Path, files: list[str]) -> None:
    """The snapshot is a commit's folder of this repository's cache, not a link out of it; each
    of `files` in it resolves into the repository's `blobs/` (as huggingface_hub lays them out)
    or its own folder; and a blob's content hashes to its name (sha256 for large files, git's
    blob sha1 for the others). Else a `PrepareError` naming what is wrong: the cache, or a ref
    in it, was edited or planted."""
    base = Path(_cache_dir()) / f"models--{repo.replace('/', '--')}"
    snapshots, blobs = (base / "snapshots").resolve(), (base / "blobs").resolve()
    if not _COMMIT.fullmatch(folder.name) or folder.parent.resolve() != snapshots or \
            folder.resolve() != snapshots / folder.name:
        raise PrepareError(f"{name}: the Hugging Face cache gives {folder} for it, not a commit's folder of "
                           f"{base / 'snapshots'} (a ref or link in the cache was edited); fetch it again")
    for f in files:
        path = folder / f
        if not path.exists():
            continue
        real = path.resolve()
        if not (real.is_relative_to(blobs) or real.is_relative_to(snapshots / folder.name)):
            raise PrepareError(f"{name}: {path} leads to {real}, outside the repository's cache; fetch it again")
        if real.parent == blobs and not _blob_matches(real):
            raise PrepareError(f"{name}: {path}'s blob {real.name} does not hold what its name (its hash) says: "
                               "the cache is damaged or was edited; fetch it again")


def _blob_matches(blob: Path) -> bool:
    """Whether a blob's content hashes to its name: sha256 (64 hex, LFS files) or git's blob
    sha1 (40 hex); a blob named otherwise is not judged."""
    import hashlib

    data = blob.read_bytes()
    if len(blob.name) == 64:
        return hashlib.sha256(data).hexdigest() == blob.name
    if len(blob.name) == 40:
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob.name
    return True


def _endpoint() -> tuple[str, int]:
    """(host, port) of the Hub, or of the mirror `HF_ENDPOINT` names."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    return url.hostname or HUB_HOST, url.port or (80 if url.scheme == "http" else 443)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
