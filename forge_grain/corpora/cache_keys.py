"""Where a Hugging Face corpus's tokens are cached, and under which key: one store per
dataset, tokenizer and tokenizing options, in a private directory under the cache root.
Shared by eager sources (tokenized once into a store) and streaming ones (their counting
pass's lengths).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from forge_grain import paths
from forge_grain.errors import PrepareError


def cache_root(cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir or paths.cache_root()) / "hf"
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise PrepareError(
            f"{root}: cannot create the Hugging Face source cache ({e.strerror}); set FORGE_GRAIN_CACHE (or pass "
            "cache_dir=) to a writable directory"
        ) from None
    return paths.private_cache(root)


def path_name(name: str) -> str:
    """A source name as one file-name component inside the cache root: `web/en` and
    `../../x` are made safe (with a hash of the original, so distinct names stay distinct)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")
    return safe if safe == name else f"{safe or 'source'}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def specials_key(src) -> str:
    """How the source encodes special-token strings in its text, and the BOS/EOS it names, for
    its cache keys (the old key, for text kept as text and no token named, leaves the caches of
    earlier versions valid)."""
    key = "special-tokens-as-ids" if src.special_tokens_in_text else "special-tokens-as-text"
    named = (src.bos_token, src.eos_token)
    return key if named == (None, None) else f"{key} bos={named[0]} eos={named[1]}"  # (old keys stay valid)
