"""One factory from a `SourceConfig` to what the mixture draws rows from.

A `path` source is a `TokenStore` in any format it reads in place, packed by `pack`;
a Hugging Face source is tokenized once into a cached store (`hf_streaming=False`) and
packed the same way, or streamed and packed a window at a time. `Pipeline` builds its
sources here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .config import SourceConfig
from .packed import pack
from .stores import TokenStore


@dataclasses.dataclass
class OpenedSource:
    """`store`: its documents (a `TokenStore`, or a streaming source); `dataset`: the packed
    rows the mixture indexes; `stream`: the cursor of a streaming source, else None."""

    store: object
    dataset: object
    stream: object = None


def open_source(src: SourceConfig, seq_len: int, seed: int, shard_index: int, shard_count: int,
                cache_dir: str | Path | None = None, chunk_docs: int | None = None,
                plan_workers: int | None = None) -> OpenedSource:
    """The packed rows of one source; `seed` is the source's own (see `Pipeline`);
    `chunk_docs` and `plan_workers` go to `pack`."""
    if src.hf_dataset is not None and src.hf_streaming:
        from .hf import StreamCursor, StreamingSource

        source = StreamingSource(src, seq_len, seed, shard_index, shard_count, cache_dir)
        cursor = StreamCursor(source, rows_per_epoch=shard_count * min(source.rows_per_shard()))
        return OpenedSource(source, cursor, cursor)
    if src.hf_dataset is not None:
        from .hf import eager_store

        store = TokenStore.open(eager_store(src, cache_dir))
    else:
        store = TokenStore.open(src.path, **src.store_options())
    dataset = pack(store, seq_len, src.strategy, seed=seed, stride=src.stride, num_epochs=None, cache_dir=cache_dir,
                   chunk_docs=chunk_docs, plan_workers=plan_workers, shuffle_window=src.shuffle_window)
    return OpenedSource(store, dataset)
