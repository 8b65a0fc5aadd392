"""`SourceConfig`: one corpus, how it is read and packed, and its mixing weight; the
sources are built from it (`forge_grain.sources.factory`), the pipeline's config holds a list."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SourceConfig:
    """One corpus, its packing and its mixing weight.

    The corpus is a token store (`path`) or a Hugging Face dataset (`hf_dataset`: a name,
    or a builder such as "json" with `hf_data_files`), tokenized with `tokenizer` (a local
    path; default: the shipped one). `hf_streaming=False` tokenizes it once into a cached
    token store; `True` streams it, tokenizing on the fly and packing `window` documents
    at a time; its `hf_data_files` may then be JSON Lines or Parquet files at fsspec URLs
    (`s3://...`, globs allowed), read directly with `storage_options`.

    A `path` is opened as by `TokenStore.open`, in any format it reads in place (a
    forge-grain store, raw `.bin`/`.npy` files, Megatron, Hugging Face Arrow, LitData,
    MDS; `format` names it when detection should not decide), described by the options
    the files do not record: `dtype` (or `vocab_size`, or `tokenizer`, to decide it),
    `eos_id`/`bos_id` (to find documents in raw files; each file must then start with the
    BOS and end with the EOS, unless `whole_documents=False`), `fingerprint="full"` to hash
    every byte of foreign files into the state (not only sampled blocks), `file_pattern` to filter a
    directory, `split` to pick one split's files, `token_field` for the column of an
    Arrow or MDS dataset. A `path` that is a URL (`s3://bucket/store`, any fsspec URL)
    is a forge-grain store in object storage, read through a local cache:
    `storage_options` go to fsspec (credentials, `endpoint_url`), `cache_limit` bounds
    the cache's bytes, `object_cache` is its directory (see `forge_grain.stores.remote`).
    `shuffle_window=W` shuffles W planning chunks' rows at a time instead of the whole
    epoch's, bounding the shards a window reads (see `PackedDataset.rows_of`); it is data.
    """

    name: str
    path: str | None = None
    weight: float = 1.0
    strategy: str = "bestfit"
    stride: int | None = None
    hf_dataset: str | None = None
    hf_config: str | None = None
    hf_data_files: str | list | dict | None = None
    split: str | None = None  # Hugging Face sources: "train" when not given
    text_field: str = "text"
    tokenizer: str | None = None
    hf_streaming: bool = False
    add_bos: bool = True
    add_eos: bool = True
    window: int = 1000
    dtype: str | None = None
    eos_id: int | None = None
    bos_id: int | None = None
    vocab_size: int | None = None
    file_pattern: str | None = None
    whole_documents: bool | None = None
    fingerprint: str | None = None
    format: str | None = None
    token_field: str | None = None
    storage_options: dict | None = None
    cache_limit: int | None = None
    object_cache: str | None = None
    shuffle_window: int | None = None

    def store_options(self) -> dict:
        """Keyword arguments of `TokenStore.open` for a `path` source (those that are set)."""
        keys = ("dtype", "eos_id", "bos_id", "vocab_size", "file_pattern", "whole_documents", "fingerprint", "split",
                "tokenizer", "format", "token_field", "storage_options", "cache_limit", "object_cache")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
