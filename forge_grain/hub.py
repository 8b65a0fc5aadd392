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


def snapshot(name: str, files: list[str], what: str) -> tuple[Path, str]:
    """(the local folder holding `files` of repository `name` (`repo` or `repo@revision`),
    `repo@commit`): from the cache when offline or when the Hub cannot be reached, else
    downloaded (only `files`). A miss says how to fetch it once."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

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
    return folder, f"{repo}@{folder.name}"


def _endpoint() -> tuple[str, int]:
    """(host, port) of the Hub, or of the mirror `HF_ENDPOINT` names."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    return url.hostname or HUB_HOST, url.port or (80 if url.scheme == "http" else 443)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
