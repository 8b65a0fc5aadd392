"""Loading a local tokenizer, and its identity (name and hash) for manifests and caches."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from .errors import PrepareError

DEFAULT_TOKENIZER = Path(__file__).parent / "assets" / "tokenizer.json"

_BOS_NAMES = ("<|bos|>", "<|begin_of_text|>", "<s>", "<bos>", "[CLS]")
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


@dataclasses.dataclass
class TextTokenizer:
    """A fast (Rust) tokenizer plus what a token store records about it."""

    path: str
    backend: object  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    special_tokens_in_text: bool = False

    def __post_init__(self):
        # text stays text: "<|endoftext|>" written in a document is encoded as its characters,
        # so the only special ids in a store are the BOS/EOS that prepare adds
        self.backend.encode_special_tokens = not self.special_tokens_in_text

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def sha256(self) -> str:
        """Hash of what maps text to ids; padding, truncation and post-processing (unused
        here: the store adds BOS/EOS itself) are left out, so one tokenizer saved by
        `tokenizers` or by `transformers` has one identity."""
        spec = json.loads(self.backend.to_str())
        keys = ("added_tokens", "normalizer", "pre_tokenizer", "model")
        return hashlib.sha256(json.dumps({k: spec.get(k) for k in keys}, sort_keys=True).encode()).hexdigest()

    @property
    def identity(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "vocab_size": self.vocab_size}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids without the tokenizer's own special tokens (the store adds BOS/EOS)."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def __getstate__(self):
        return {"path": self.path, "bos_id": self.bos_id, "eos_id": self.eos_id,
                "special_tokens_in_text": self.special_tokens_in_text}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.backend = _load_backend(Path(state["path"]))[0]
        self.__post_init__()


def load_tokenizer(
    path: str | Path | None = None, *, bos: str | None = None, eos: str | None = None,
    special_tokens_in_text: bool = False,
) -> TextTokenizer:
    """A local `tokenizer.json` or Hugging Face tokenizer directory; the shipped one by default.

    `bos`/`eos` name the special tokens to use; otherwise the usual names are tried.
    `special_tokens_in_text=True` encodes special-token strings found in documents as
    their special ids (for corpora that really mean them); by default they are text.
    """
    path = Path(path) if path else DEFAULT_TOKENIZER
    backend, hf_bos, hf_eos = _load_backend(path)
    vocab = backend.get_vocab(with_added_tokens=True)

    def pick(explicit, hf_token, names, what):
        if explicit is not None:
            if explicit not in vocab:
                raise PrepareError(f"{path}: {what} token {explicit!r} is not in the tokenizer's vocabulary")
            return vocab[explicit]
        for name in ((hf_token,) if hf_token else ()) + names:
            if name in vocab:
                return vocab[name]
        return None

    return TextTokenizer(str(path), backend, pick(bos, hf_bos, _BOS_NAMES, "BOS"), pick(eos, hf_eos, _EOS_NAMES, "EOS"),
                         special_tokens_in_text)


def _load_backend(path: Path):
    """(tokenizers.Tokenizer, bos token, eos token) from a file or a directory."""
    from tokenizers import Tokenizer

    if not path.exists():
        raise PrepareError(f"{path}: tokenizer not found (give a local tokenizer.json or tokenizer directory)")
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path)), None, None
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise PrepareError(f"{path}: not a tokenizer.json ({e})") from None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        if (path / "tokenizer.json").exists():
            return Tokenizer.from_file(str(path / "tokenizer.json")), None, None
        raise PrepareError(f"{path}: loading a tokenizer directory needs `pip install forge-grain[hf]`") from None
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise PrepareError(f"{path}: cannot load a Hugging Face tokenizer from this directory ({e})") from None
    if not getattr(hf, "is_fast", False):
        raise PrepareError(f"{path}: only fast (Rust) tokenizers are supported; this one is {type(hf).__name__}")
    return hf.backend_tokenizer, hf.bos_token, hf.eos_token
