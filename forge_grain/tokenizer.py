"""Loading a tokenizer (a local file or directory, or a Hugging Face Hub name), and its
identity (name, pinned to a commit for a Hub name, and hash) for manifests and caches."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import numpy as np

from forge_grain import hub
from forge_grain.errors import PrepareError

DEFAULT_TOKENIZER = Path(__file__).parent / "assets" / "tokenizer.json"
# what a Hub tokenizer is read from (downloaded only these, as `AutoTokenizer` would use them)
HUB_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
             "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt"]  # (the last four: a fast one built from them)

_CUTS = re.compile(r"(?<=\S) (?=\S)|\n(?=\S)")  # candidate cuts: before a lone space, after a newline
_CUT_CONTEXT = 256
_PIECES_AT_ONCE = 4

_BOS_NAMES = ("<|bos|>", "<|begin_of_text|>", "<s>", "<bos>", "[CLS]")
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "<|eos|>", "</s>", "<eos>", "[SEP]")


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
        """Token ids without the tokenizer's own special tokens (the store adds BOS/EOS).
        `encode_batch_fast` (tokenizers >= 0.21) skips character offsets: the same ids, ~1.8x
        faster here."""
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def encode_long(self, text: str, piece_chars: int, prefix=(), suffix=()) -> np.ndarray:
        """`prefix` + the ids of one long text + `suffix` as uint32, encoded in pieces of about
        `piece_chars` characters so memory is bounded by the piece, not the document (a
        whole-document encode holds ~170 bytes per character). Returns exactly the
        whole-document encode where cuts are found.

        A cut is made before a space that follows a non-space, or after a newline, and only
        where encoding the text on both sides of it apart gives the same ids as encoding it
        together (checked on `_CUT_CONTEXT` characters each side). For pre-tokenizers that
        split at such places (GPT-2-style byte-level BPE, Llama 3, the shipped tokenizer)
        that local check makes the pieces' ids the whole document's. A stretch with no such
        cut within a piece (no whitespace; or a tokenizer that marks every piece's start,
        such as SentencePiece's Metaspace) is encoded whole.
        """
        pieces, batch, start = [np.asarray(prefix, np.uint32)], [], 0
        while start < len(text):
            far = len(text) - start > piece_chars
            cut = self._find_cut(text, start + piece_chars, start + 2 * piece_chars) if far else None
            end = cut if cut is not None else len(text)
            batch.append(text[start:end])
            start = end
            if len(batch) == _PIECES_AT_ONCE or start == len(text):  # a few at once: the Rust side runs them in parallel
                pieces += [np.asarray(e.ids, np.uint32) for e in self.backend.encode_batch(batch, add_special_tokens=False)]
                batch = []
        pieces.append(np.asarray(suffix, np.uint32))
        out = np.empty(sum(len(p) for p in pieces), np.uint32)  # one allocation; each piece is freed once copied
        at = 0
        pieces.reverse()
        while pieces:
            p = pieces.pop()
            out[at : at + len(p)] = p
            at += len(p)
        return out

    def _find_cut(self, text: str, lo: int, hi: int) -> int | None:
        """A position in [lo, hi) where the text may be cut without changing its ids."""
        checked = 0
        for m in _CUTS.finditer(text, lo, min(hi, len(text))):
            i = m.start() if m.group() == " " else m.end()
            if not 0 < i < len(text):
                continue
            left, right = text[max(0, i - _CUT_CONTEXT) : i], text[i : i + _CUT_CONTEXT]
            apart = self.backend.encode_batch([left, right], add_special_tokens=False)
            if self.backend.encode(left + right, add_special_tokens=False).ids == apart[0].ids + apart[1].ids:
                return i
            checked += 1
            if checked >= 32:
                return None
        return None

    def __getstate__(self):
        return {"path": self.path, "bos_id": self.bos_id, "eos_id": self.eos_id,
                "special_tokens_in_text": self.special_tokens_in_text}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.backend = _load_backend(resolve(state["path"])[0])[0]
        self.__post_init__()


def load_tokenizer(
    path: str | Path | None = None, *, bos: str | None = None, eos: str | None = None,
    special_tokens_in_text: bool = False,
) -> TextTokenizer:
    """A local `tokenizer.json` or Hugging Face tokenizer directory, or a Hub name (`gpt2`,
    `meta-llama/Llama-3.1-8B`, `org/name@revision`: see `forge_grain.hub`; recorded as
    `name@commit`); the shipped one by default.

    `bos`/`eos` name the special tokens to use; otherwise the usual names are tried.
    `special_tokens_in_text=True` encodes special-token strings found in documents as
    their special ids (for corpora that really mean them); by default they are text.
    """
    local, path = resolve(path)
    backend, hf_bos, hf_eos = _load_backend(local)
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


def resolve(name) -> tuple[Path, str]:
    """(where the tokenizer's files are, the name to record): a local path as it is; a name
    that is no local path but a Hub repository id, from the Hugging Face cache or the Hub,
    recorded as `repo@commit`; the shipped tokenizer for None."""
    if not name:
        return DEFAULT_TOKENIZER, str(DEFAULT_TOKENIZER)
    path = Path(name)
    try:
        here = path.exists()
    except OSError:  # a name too long for a path ("File name too long"): not a local file
        here = False
    if here:  # recorded absolute: a store's tokenizer is found again from any directory
        return path, str(path.resolve())
    if not hub.looks_like_repo_id(str(name)):
        return path, str(name)
    return hub.snapshot(str(name), HUB_FILES, "tokenizer")


def _load_backend(path: Path):
    """(tokenizers.Tokenizer, bos token, eos token) from a file or a directory."""
    from tokenizers import Tokenizer

    if not path.exists():
        raise PrepareError(f"{path}: tokenizer not found (give a local tokenizer.json or tokenizer directory, or a "
                           "Hugging Face Hub name)")
    if path.is_file():
        try:
            backend = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON
            raise PrepareError(f"{path}: not a tokenizer.json ({e})") from None
        return (backend,) + _named_specials(path.parent)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        if (path / "tokenizer.json").exists():
            return (Tokenizer.from_file(str(path / "tokenizer.json")),) + _named_specials(path)
        raise PrepareError(f"{path}: loading a tokenizer directory needs `pip install forge-grain[hf]`") from None
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise PrepareError(f"{path}: cannot load a Hugging Face tokenizer from this directory ({e})") from None
    if not getattr(hf, "is_fast", False):
        raise PrepareError(f"{path}: only fast (Rust) tokenizers are supported; this one is {type(hf).__name__}")
    return hf.backend_tokenizer, hf.bos_token, hf.eos_token



def _named_specials(directory: Path) -> tuple[str | None, str | None]:
    """(bos_token, eos_token) as the `tokenizer_config.json` beside a `tokenizer.json` names them
    (a string, or an added token's `{"content": ...}`): plain JSON, read without `transformers`."""
    config = directory / "tokenizer_config.json"
    try:
        with open(config, encoding="utf-8") as f:
            data = json.loads(f.read(1 << 24))  # a config is kilobytes; one with a chat template, tens
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        raise PrepareError(f"{config}: cannot read it as JSON ({e})") from None

    if not isinstance(data, dict):
        raise PrepareError(f"{config}: not a tokenizer config (a JSON object), but {type(data).__name__}")

    def name(key):  # unset or null: not named; a token's string, or an added token's {"content": ...}
        value = data.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if value is not None and not isinstance(value, str):
            raise PrepareError(f"{config}: {key} is {value!r:.60}, not a token's string; fix it, or name the "
                               f"token to use (--{key.replace('_', '-')}, or {key} in a config's source)")
        return value or None

    return name("bos_token"), name("eos_token")
