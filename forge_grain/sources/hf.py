"""Hugging Face sources: eager (tokenized once into a cached token store); streaming ones
are `forge_grain.sources.streaming`'s, which shares the cache and the helpers here.

Eager: the first use tokenizes the dataset (in parallel, with a progress bar) into a
token store under the cache directory, keyed by the dataset's fingerprint, the
tokenizer's hash and the BOS/EOS options. Every later use, in any process, opens it;
concurrent first uses serialize on a file lock, so one builds and the others wait.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import re
from pathlib import Path

from forge_grain import paths
from forge_grain.errors import PrepareError
from forge_grain.sources.config import SourceConfig
from forge_grain.locks import file_lock
from forge_grain.preparation.runners import prepare
from forge_grain.preparation.texts import load_texts
from forge_grain.tokenizer import load_tokenizer


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


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def specials_key(src: SourceConfig) -> str:
    """How the source encodes special-token strings in its text, and the BOS/EOS it names, for
    its cache keys (the old key, for text kept as text and no token named, leaves the caches of
    earlier versions valid)."""
    key = "special-tokens-as-ids" if src.special_tokens_in_text else "special-tokens-as-text"
    named = (src.bos_token, src.eos_token)
    return key if named == (None, None) else f"{key} bos={named[0]} eos={named[1]}"  # (old keys stay valid)


def _files_identity(data_files) -> list:
    """Local data files by path, size and modification time (what changes when they do)."""
    if data_files is None:
        return []
    if isinstance(data_files, dict):
        items = list(data_files.values())
    elif isinstance(data_files, list):
        items = data_files
    else:
        items = [data_files]
    out = []
    for item in items:
        for f in sorted(globlib.glob(str(item))) or [str(item)]:
            p = Path(f)
            out.append([str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] if p.exists() else [str(item)])
    return out


def _texts(src: SourceConfig, streaming: bool):
    return load_texts(src.hf_dataset, text_field=src.text_field, split=src.split, hf_config=src.hf_config,
                      data_files=src.hf_data_files, streaming=streaming)


# -- eager ------------------------------------------------------------------------------------


def eager_store(src: SourceConfig, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The token store of an eager Hugging Face source: built on first use, then reused."""
    tok = load_tokenizer(src.tokenizer, bos=src.bos_token, eos=src.eos_token,
                         special_tokens_in_text=src.special_tokens_in_text)
    ds = _texts(src, streaming=False)
    key = _digest([ds._fingerprint, src.hf_dataset, src.hf_config, src.split, src.text_field, tok.sha256,
                   src.add_bos, src.add_eos, specials_key(src)])
    root = cache_root(cache_dir)
    out = root / f"{path_name(src.name)}-{key}"
    with file_lock(root / f".{path_name(src.name)}-{key}.lock"):
        prepare(src.hf_dataset, out, tokenizer=src.tokenizer, text_field=src.text_field, split=src.split,
                hf_config=src.hf_config, data_files=src.hf_data_files, add_bos=src.add_bos, add_eos=src.add_eos,
                special_tokens_in_text=src.special_tokens_in_text, bos_token=src.bos_token, eos_token=src.eos_token,
                progress=progress)
    return out
