"""`SourceConfig`: one corpus, how it is read and packed, and its mixing weight; the
sources are built from it (`forge_grain.sources.factory`), the pipeline's config holds a list."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from forge_grain.errors import ConfigError
from forge_grain.packing.names import STRATEGIES


@dataclasses.dataclass
class SourceConfig:
    """One corpus, its packing and its mixing weight: a token store (`path`) or a Hugging
    Face dataset (`hf_dataset`), exactly one of the two. Each field's docstring is its entry
    in `docs/config.md` (generated; see `forge_grain.pipeline.reference`)."""

    name: str
    """The source's name: weights of phases refer to it, batches report tokens per source
    under it, and with the seed it decides the source's own shuffle (adding a source does
    not reorder the others). Unique within a config.
    Example: name = "web"
    """

    path: str | None = None
    """A token store, opened as by `TokenStore.open` in any format read in place: a
    forge-grain store, raw `.bin`/`.npy` files, Megatron, Hugging Face Arrow
    (`save_to_disk`), LitData, MDS. A URL (`s3://bucket/store`, any fsspec URL) is read
    through a local cache: a forge-grain store a shard at a time, a peer's dataset copied
    whole or, with `cache_limit`, a file (or a block of documents) at a time. Relative
    paths in a TOML file are taken from the file's directory.
    Example: path = "data/web"
    """

    weight: float = 1.0
    """Mixing weight, relative to the other sources' (renormalized; see
    `mix_temperature`); 0 leaves the source out until a phase gives it a weight.
    Example: weight = 0.7"""

    strategy: str = "bestfit"
    """How documents become rows of `seq_len`: "concat" (split the concatenated stream;
    rows cross documents), "bos_bestfit" (every row starts at a document's BOS; full rows,
    crops a little), "bestfit" (best-fit decreasing with padding; long documents split into
    windows, no token lost). `forge-grain inspect STORE --seq-len N` shows each one's
    fill and crop.
    Example: strategy = "bos_bestfit"
    """

    stride: int | None = None
    """With the "bestfit" strategy: long documents are split into windows starting every `stride`
    tokens (default `seq_len - 1`: windows overlap by the one token that carries the
    target across); a smaller stride repeats context, with the loss masked on the repeated
    positions. It is data.
    Example: stride = 1536"""

    hf_dataset: str | None = None
    """A Hugging Face dataset instead of a store: a local dataset directory or a builder
    such as "json" or "parquet" with `hf_data_files` (no Hub downloads at run time unless
    the `datasets` cache has it). Tokenized with `tokenizer`.
    Example: hf_dataset = "json"
    """

    hf_config: str | None = None
    """The dataset's configuration name, as `datasets.load_dataset(name, config)` takes it.
    Example: hf_config = "en"
    """

    hf_data_files: str | list | dict | None = None
    """Files of a builder dataset ("json", "parquet"): a path, a glob, a list, or a dict by
    split. Streaming sources also take fsspec URLs (`s3://bucket/part-*.parquet`), read
    with `storage_options`.
    Example: hf_data_files = ["data/part-0.jsonl", "data/part-1.jsonl"]"""

    split: str | None = None
    """The split to read: of a Hugging Face dataset (default "train"), or of a store
    directory holding several splits' files (a split not found is an error listing those
    there).
    Example: split = "validation"
    """

    text_field: str = "text"
    """The column of a Hugging Face dataset that holds the text.
    Example: text_field = "content"
    """

    tokenizer: str | None = None
    """A tokenizer: a `tokenizer.json` file, a Hugging Face tokenizer directory, or a Hub name
    (`gpt2`, `org/name@revision`, read through the Hugging Face cache and recorded pinned
    to its commit); default: the tokenizer shipped with forge-grain. For a raw `.bin` store its vocabulary
    can decide the dtype; every source of a pipeline must use the same tokenizer.
    Example: tokenizer = "tokenizers/llama3"
    """

    hf_streaming: bool = False
    """False: the dataset is tokenized once into a cached token store, then packed like a
    store. True: it is streamed, tokenized on the fly and packed `window` documents at a
    time; its documents are dealt to canonical streams (see `canonical_streams`).
    Example: hf_streaming = true"""

    add_bos: bool = True
    """Hugging Face sources: start every document with the tokenizer's BOS id (when it has
    one). Stores keep the tokens they were prepared with.
    Example: add_bos = false"""

    add_eos: bool = True
    """Hugging Face sources: end every document with the tokenizer's EOS id (when it has
    one), so the model learns where documents stop.
    Example: add_eos = true"""

    bos_token: str | None = None
    """Hugging Face sources: the BOS token, by name, when the tokenizer's own config does not
    name it and none of the usual names (`<|bos|>`, `<s>`, ...) is in its vocabulary (the
    `--bos-token` of `forge-grain prepare`).
    Example:
    hf_dataset = "json"
    bos_token = '<|startoftext|>'"""

    eos_token: str | None = None
    """Hugging Face sources: the EOS token, by name, when the tokenizer's own config does not
    name it and none of the usual names (`<|endoftext|>`, `<|eos|>`, `</s>`, ...) is in its
    vocabulary (the `--eos-token` of `forge-grain prepare`).
    Example:
    hf_dataset = "json"
    eos_token = '<|im_end|>'"""

    chat: str | None = None
    """Hugging Face sources: rows are conversations, "messages" (a `messages` list of
    role/content objects) or "prompt_completion" (`prompt` and `completion`), rendered with
    the tokenizer's chat template; only the assistant's turns (the completion) train (the
    `--chat` of `forge-grain prepare`). Tokenized once into a cached store (not with
    `hf_streaming`). The template writes the conversation's markers: `add_bos` and `add_eos`
    do not apply.
    Example:
    hf_dataset = "json"
    hf_data_files = "chat.jsonl"
    chat = "messages"
    """

    train_roles: list[str] | None = None
    """With `chat = "messages"`: the roles whose turns train (default: ["assistant"]).
    Example:
    hf_dataset = "json"
    chat = "messages"
    train_roles = ["assistant", "tool"]"""

    special_tokens_in_text: bool = False
    """Hugging Face sources: encode special-token strings written in a document (such as
    "<|endoftext|>") as their special ids, as `transformers` tokenizers do by default; off by
    default: text stays text, and the only special ids are the BOS/EOS added around documents.
    Example: special_tokens_in_text = true"""

    window: int = 1000
    """Streaming sources: documents packed together (the packing's look-ahead). Larger
    fills rows better and shuffles more widely, at the cost of memory and the time to the
    first batch. It is data.
    Example: window = 4000"""

    dealing: str | None = None
    """Streaming sources: how documents reach the canonical streams. "files": each stream
    reads whole files of its own, so each byte is read once across all processes (the
    egress of one pass, whatever the shard count); "rows": row r goes to stream r mod C, so
    every process reads every row and keeps its share. Unset ("auto"): "files" for files at
    URLs at least as many as the streams whose sizes deal evenly (within 2%), else "rows".
    It is data (a state records it).
    Example:
    hf_dataset = "json"
    hf_data_files = "https://example.com/web/*.jsonl"
    hf_streaming = true
    dealing = "files"
    """

    dtype: str | None = None
    """Raw `.bin` files: the width of a token id ("uint16", "uint32", "int32"). forge-grain
    never guesses it from the file: give `dtype`, `vocab_size` or `tokenizer`. A store
    that records its dtype is checked against it.
    Example: dtype = "uint32"
    """

    eos_id: int | None = None
    """Raw files: the EOS id that ends each document (documents are found by it); other
    formats: checked against their documents.
    Example: eos_id = 50256"""

    bos_id: int | None = None
    """Raw files: the BOS id that starts each document; checked as `eos_id` is.
    Example: bos_id = 1"""

    vocab_size: int | None = None
    """Raw files: the vocabulary size, which decides the dtype (uint16 up to 65,536 ids,
    else uint32) and bounds the ids (checked on samples at open).
    Example: vocab_size = 128256"""

    file_pattern: str | None = None
    """A glob that picks the token files of a store directory.
    Example: file_pattern = "train_*.npy"
    """

    label_masks: str | list[str] | None = None
    """Raw files: OLMo-core's `label_mask_paths`, one boolean array per token file (a byte a
    token, true where the token is a label): a glob relative to the store's directory, or a
    list of files, in the token files' order. Only the marked tokens train.
    Example: label_masks = "labels_mask_*.npy"
    """

    whole_documents: bool | None = None
    """Raw files with `eos_id`/`bos_id`: each file must start with the BOS and end with the
    EOS (default), or, false, files may be cut inside a document.
    Example: whole_documents = false"""

    fingerprint: str | None = None
    """How foreign files are fingerprinted into the resume state: "sampled" (default: files
    up to 8 MiB whole, larger ones by blocks and 2,048 seeded probes, with the boundaries; a
    change of 1% of a file passes with probability < 1.3e-9) or "full" (every byte, slower to
    open; catches any change).
    Example: fingerprint = "full"
    """

    format: str | None = None
    """The store's format when detection should not decide: "native", "raw", "megatron",
    "arrow", "litdata" or "mds" (a path that could be read two ways is refused until it
    is named).
    Example: format = "megatron"
    """

    token_field: str | None = None
    """The column of an Arrow or MDS dataset that holds the token ids (default
    "input_ids" or "tokens").
    Example: token_field = "ids"
    """

    storage_options: dict | None = None
    """Options for fsspec where the data is a URL (a `path` in object storage, or streaming
    `hf_data_files`): credentials, `endpoint_url`, and any other option of the filesystem.
    Example: storage_options = { endpoint_url = "http://127.0.0.1:9000", anon = false }"""

    cache_limit: int | None = None
    """A `path` in object storage: the most bytes of it kept in the local cache (default
    unbounded); the least recently used shards (a peer's files, blocks of a Megatron or raw
    file) no upcoming step needs are evicted.
    Example: cache_limit = 53687091200"""

    object_cache: str | None = None
    """A `path` in object storage: the local cache directory (default
    `$FORGE_GRAIN_CACHE/objects`), shared by the processes of a host.
    Example: object_cache = "/local/nvme/forge-grain"
    """

    fetch_threads: int | None = None
    """A `path` in object storage: ranged reads in flight at once, taken in order of need.
    Default: as many as the link gives: 16 to start, doubled while the throughput grows with
    them, up to 64 (a far region, tens of milliseconds to the first byte, needs many; a link
    already full gains nothing), and a doubling tried again from time to time while the
    reads are the limit. A number fixes it; each read holds at most 8 MiB.
    Example: fetch_threads = 32"""

    shuffle_window: int | None = None
    """Shuffle the rows of this many planning chunks at a time instead of the whole
    epoch's, so a store in object storage is read a few shards at a time (see
    `PackedDataset.rows_of`). It is data. `shuffle_bytes` (the default with `cache_limit`)
    fits the order to the cache instead.
    Example: shuffle_window = 4"""

    shuffle_bytes: int | None = None
    """Read the data in windows of whole data files (blocks of a Megatron or raw file)
    holding at most this many bytes of tokens (an ArrayRecord store: of its files, which
    ArrayRecord pads): each epoch visits the windows in a seeded
    order and shuffles the rows within each, so a bounded cache never evicts what the
    coming steps read. Data of at most twice this many bytes is shuffled whole. Default
    with `cache_limit`: a quarter of it (the window read and the next fetched ahead fit
    twice over). It is data: a run resumes with the same value (`forge-grain plan` prints
    it, and how many files a window interleaves); give it to a local copy to read that in
    the same order.
    Example: shuffle_bytes = 4000000000"""

    def fitted_bytes(self) -> int | None:
        """The `shuffle_bytes` in effect: its own, else a quarter of `cache_limit` (unless
        `shuffle_window` orders the reads instead)."""
        from forge_grain.stores.blocks import default_shuffle_bytes

        if self.shuffle_bytes is not None or self.shuffle_window is not None:
            return self.shuffle_bytes
        return default_shuffle_bytes(self.cache_limit)

    def store_options(self) -> dict:
        """Keyword arguments of `TokenStore.open` for a `path` source (those that are set)."""
        keys = ("dtype", "eos_id", "bos_id", "vocab_size", "file_pattern", "label_masks", "whole_documents",
                "fingerprint", "split", "tokenizer", "format", "token_field", "storage_options", "cache_limit",
                "object_cache", "fetch_threads")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}

    def where(self) -> str:
        """The source's data, for messages: its path, or `hf:` and its dataset."""
        return self.path if self.path is not None else f"hf:{self.hf_dataset}"

    def check(self, where: str) -> None:
        """Every field holds what it may (`where`: the source's place in the config, for messages)."""
        check_source(self, where)


def check_source(src, where: str) -> None:
    """`SourceConfig.check`."""
    if (src.path is None) == (src.hf_dataset is None):
        raise ConfigError(f"{where}: give exactly one of 'path' (a token store) and 'hf_dataset'")
    if src.hf_dataset is not None:
        wrong = [k for k in ("dtype", "eos_id", "bos_id", "vocab_size", "file_pattern", "label_masks",
                             "whole_documents", "fingerprint", "format", "token_field", "cache_limit",
                             "object_cache", "fetch_threads")
                 if getattr(src, k) is not None]
        if wrong:
            raise ConfigError(f"{where}: {wrong} describe token files of a 'path' source, not 'hf_dataset'")
        if src.storage_options is not None and not (src.hf_streaming and "://" in str(src.hf_data_files)):
            raise ConfigError(f"{where}.storage_options: only for streaming hf_data_files at URLs "
                              "(s3://...); this source has none")
    if src.path is not None and (src.bos_token is not None or src.eos_token is not None):
        raise ConfigError(f"{where}: bos_token and eos_token name the tokens a Hugging Face source adds; a "
                          "'path' source's store holds its tokens already (raw files: eos_id, bos_id)")
    _check_chat(src, where)
    for key in ("bos_token", "eos_token"):
        if getattr(src, key) is not None and not (isinstance(getattr(src, key), str) and getattr(src, key)):
            raise ConfigError(f"{where}.{key}: a token's string, as in the tokenizer's vocabulary, not "
                              f"{getattr(src, key)!r}")
    for key in ("shuffle_window", "fetch_threads", "shuffle_bytes"):
        if getattr(src, key) is not None:
            positive_int(f"{where}.{key}", getattr(src, key))
    if src.shuffle_window is not None and src.shuffle_bytes is not None:
        raise ConfigError(f"{where}: give one of shuffle_window (planning chunks) and shuffle_bytes (bytes of "
                          "data files) shuffled together, not both")
    if src.whole_documents is not None and not isinstance(src.whole_documents, bool):
        raise ConfigError(f"{where}.whole_documents: must be true or false, not {src.whole_documents!r}")
    if src.fingerprint not in (None, "sampled", "full"):
        raise ConfigError(f"{where}.fingerprint: must be 'sampled' or 'full', not {src.fingerprint!r}")
    for key in ("eos_id", "bos_id", "vocab_size", "cache_limit"):
        v = getattr(src, key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ConfigError(f"{where}.{key}: must be a non-negative integer, got {v!r}")
    if src.dtype is not None:
        try:
            np.dtype(src.dtype)
        except TypeError:
            raise ConfigError(f"{where}.dtype: {src.dtype!r} is not a numpy dtype (e.g. 'uint16')") from None
    if src.dealing is not None and (src.dealing not in ("auto", "files", "rows") or not src.hf_streaming):
        raise ConfigError(f"{where}.dealing: 'auto', 'files' or 'rows', for streaming sources only "
                          f"(hf_streaming = true); got {src.dealing!r}")
    if not (isinstance(src.window, int) and src.window >= 1):
        raise ConfigError(f"{where}.window: must be a positive integer, got {src.window!r}")
    if src.strategy not in STRATEGIES:
        raise ConfigError(f"{where}.strategy: {src.strategy!r} is not one of {STRATEGIES}")
    check_weight(f"{where}.weight", src.weight)


def _check_chat(src, where: str) -> None:
    """`chat` and `train_roles`: for eager Hugging Face sources."""
    if src.chat is None:
        if src.train_roles is not None:
            raise ConfigError(f"{where}.train_roles: goes with chat = \"messages\"")
        return
    if src.chat not in ("messages", "prompt_completion"):
        raise ConfigError(f"{where}.chat: \"messages\" or \"prompt_completion\", not {src.chat!r}")
    if src.hf_dataset is None:
        raise ConfigError(f"{where}.chat: conversations are rendered when a Hugging Face source is tokenized; a "
                          "'path' store holds tokens and masks already (forge-grain prepare --chat)")
    if src.hf_streaming:
        raise ConfigError(f"{where}.chat: conversations are tokenized once into a cached store in this version, "
                          "not streamed; set hf_streaming = false")
    roles = src.train_roles
    if roles is not None and not (isinstance(roles, list) and roles and all(isinstance(r, str) for r in roles)):
        raise ConfigError(f"{where}.train_roles: a list of role names, not {roles!r}")


def check_weight(key: str, w: Any) -> float:
    """A mixture weight as a float: a finite real number >= 0 (numpy and torch scalars too; a
    string, a bool or NaN is not one), else a ConfigError naming `key`. One rule for config
    files, phases, `set_weights` and the weights a state records."""
    f = float(w) if _real(w) else float("nan")
    if not f >= 0 or f == float("inf"):
        raise ConfigError(f"{key}: must be a finite number >= 0, got {w!r}")
    return f


def _real(w) -> bool:
    """A real number: an int or float, a numpy scalar, or a 0-d array or tensor holding one."""
    import numbers

    if isinstance(w, (bool, str, bytes)):
        return False
    if isinstance(w, numbers.Real):
        return True
    shape = getattr(w, "shape", None)
    return shape is not None and tuple(shape) == () and hasattr(w, "item") and _real(w.item())


def check_weight_sum(key: str, weights) -> None:
    """Weights (floats, each checked) that mix: their sum positive and finite (1e308 + 1e308 is
    inf, and every share then 0: "all zero")."""
    total = sum(weights)
    if not total > 0:
        raise ConfigError(f"{key}: the weights are all zero")
    if total == float("inf"):
        raise ConfigError(f"{key}: the weights sum past the largest float; give them on a smaller scale "
                          "(only their ratios matter)")


def positive_int(key: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"{key}: must be a positive integer, got {v!r}")
