"""Eager Hugging Face sources: the first use tokenizes the dataset (in parallel, with a
progress bar) into a token store under the cache directory, keyed by the dataset's
fingerprint, the tokenizer's hash and the BOS/EOS options. Every later use, in any process,
opens it; concurrent first uses serialize on a file lock, so one builds and the others wait.
Streaming sources (`forge_grain.sources.streaming`) share the cache keys
(`forge_grain.corpora.cache_keys`).
"""

from __future__ import annotations

from pathlib import Path

from forge_grain.corpora.cache_keys import cache_root, digest, path_name, specials_key
from forge_grain.corpora.loading import source_texts
from forge_grain.locks import file_lock
from forge_grain.preparation.runners import prepare
from forge_grain.tokenizer import load_tokenizer


def eager_store(src, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The token store of an eager Hugging Face source (a `SourceConfig` with `hf_dataset`):
    built on first use, then reused."""
    tok = load_tokenizer(src.tokenizer, bos=src.bos_token, eos=src.eos_token,
                         special_tokens_in_text=src.special_tokens_in_text)
    ds = source_texts(src, streaming=False)
    chat = [src.chat, src.train_roles] if src.chat else []  # (in the key only when set: old caches stay valid)
    bos_eos = dict(add_bos=False, add_eos=False) if src.chat else dict(add_bos=src.add_bos, add_eos=src.add_eos)
    key = digest([ds._fingerprint, src.hf_dataset, src.hf_config, src.split, src.text_field, tok.sha256,
                  src.add_bos, src.add_eos, specials_key(src), *chat])
    root = cache_root(cache_dir)
    out = root / f"{path_name(src.name)}-{key}"
    with file_lock(root / f".{path_name(src.name)}-{key}.lock"):
        prepare(src.hf_dataset, out, tokenizer=src.tokenizer, text_field=src.text_field, split=src.split,
                hf_config=src.hf_config, data_files=src.hf_data_files, **bos_eos,
                special_tokens_in_text=src.special_tokens_in_text, bos_token=src.bos_token, eos_token=src.eos_token,
                progress=progress, **({"chat": src.chat, "train_roles": tuple(src.train_roles or ["assistant"])}
                                      if src.chat else {}))
    return out
