"""One factory from a `SourceConfig` to what the mixture draws rows from.

A `path` source is a `TokenStore` in any format it reads in place, packed by `pack`;
a Hugging Face source is tokenized once into a cached store (`hf_streaming=False`) and
packed the same way, or streamed and packed a window at a time. `Pipeline` builds its
sources here and nowhere else; it hands in the builder of eager sources' stores
(`forge_grain.preparation.hf_cache.eager_store`), since sources never import preparation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from forge_grain.errors import MissingFilesError
from forge_grain.sources.config import SourceConfig
from forge_grain.sources.deferred import SourceRecords, checked_opener, identity_of, vocabulary_of
from forge_grain.packing.packed import PackedDataset, pack
from forge_grain.stores import TokenStore


@dataclasses.dataclass
class OpenedSource:
    """`dataset`: the packed rows the mixture indexes; `stream`: the cursor of a streaming
    source, else None; `record`: the facts a deferred source was built from (see
    `forge_grain.sources.deferred`), else None and `opened` is its store (a `TokenStore`, or a
    streaming source)."""

    dataset: object
    stream: object = None
    opened: object = None
    record: object = None

    @property
    def store(self):
        """The source's documents (opening a deferred source)."""
        return self.opened if self.record is None else self.dataset.store

    @property
    def identity(self) -> dict:
        """What the build checks and fingerprints: `data_id`, `vocab_size`, `tokenizer_sha256`."""
        return self.record.facts if self.record is not None else identity_of(self.opened)

    @property
    def vocabulary(self) -> dict:
        """`identity` without `data_id` (`vocabulary_of`): what the build checks first."""
        if self.record is not None:
            return {k: self.record.facts[k] for k in ("vocab_size", "tokenizer_sha256")}
        return vocabulary_of(self.opened)

    @property
    def fetches(self) -> bool:
        """Its store fetches files on demand (object storage; never deferred)."""
        return self.record is None and getattr(self.opened, "fetches", False)


def open_source(src: SourceConfig, seq_len: int, seed: int, shard_index: int, shard_count: int,
                cache_dir: str | Path | None = None, chunk_docs: int | None = None,
                plan_workers: int | None = None, records: SourceRecords | None = None,
                key: str | None = None, max_segments: int | None = None, layout=None,
                tokenize_threads: int | None = None, progress: bool = True, eager_store=None) -> OpenedSource:
    """The packed rows of one source; `seed` is the source's own (see `Pipeline`);
    `chunk_docs`, `plan_workers` and `max_segments` go to `pack`. With `records` and the source's `key`
    there (`deferred.source_key`), a stored source whose files match its record is
    deferred, and one opened in full is recorded. A streaming source deals its documents by
    `layout` (a `streaming.StreamLayout`) and tokenizes on `tokenize_threads` threads.
    `progress=False` hides the bars of first-use work (tokenizing, counting, planning).
    `eager_store(src, cache_dir, progress)`: the path of an eager Hugging Face source's token
    store, built on first use (needed only for such a source)."""
    if src.hf_dataset is not None and src.hf_streaming:
        from forge_grain.sources.stream_cursors import StreamRows
        from forge_grain.sources.streaming import StreamingSource, rows_per_epoch

        source = StreamingSource(src, seq_len, seed, cache_dir, max_segments, tokenize_threads)
        source.deal(layout.count)
        rows = StreamRows(source, layout, rows_per_epoch(source, layout, progress), layout.owned(shard_index, shard_count))
        return OpenedSource(rows, rows, source)

    def open_full():
        if src.hf_dataset is not None:
            store = TokenStore.open(eager_store(src, cache_dir, progress))
        else:
            try:
                store = TokenStore.open(src.path, **src.store_options())
            except MissingFilesError as e:  # a mistyped path: which source of the config holds it
                raise MissingFilesError(f"source '{src.name}': {e}") from None
        return store, pack(store, seq_len, src.strategy, seed=seed, stride=src.stride, num_epochs=None,
                           cache_dir=cache_dir, chunk_docs=chunk_docs, plan_workers=plan_workers,
                           shuffle_window=src.shuffle_window, max_segments=max_segments, progress=progress,
                           **fitted_args(src))

    record = records.find(key, src.path) if records is not None else None
    if record is not None:
        f = record.facts
        opener = checked_opener(src.name, src.path, record, records, open_full)
        dataset = PackedDataset.deferred(
            opener, seq_len=f["seq_len"], num_rows=f["num_rows"], chunk_rows=f["chunk_rows"], pad_id=f["pad_id"],
            plan_key=f["plan_key"], plan_sha256=f["plan_sha256"], seed=seed, shuffle=True,
            shuffle_window=src.shuffle_window, num_epochs=None)
        return OpenedSource(dataset, record=record)
    store, dataset = open_full()
    if records is not None:
        records.add(key, store, dataset)
    return OpenedSource(dataset, opened=store)


def fitted_args(src: SourceConfig) -> dict:
    """`pack`'s arguments for an order fitted to a bounded cache (`forge_grain.packing.fitted`)."""
    shuffle_bytes = src.fitted_bytes()
    return dict(shuffle_bytes=shuffle_bytes) if shuffle_bytes else {}
