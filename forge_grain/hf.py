"""Hugging Face sources: eager (tokenized once into a cached token store) and streaming.

Eager: the first use tokenizes the dataset (in parallel, with a progress bar) into a
token store under the cache directory, keyed by the dataset's fingerprint, the
tokenizer's hash and the BOS/EOS options. Every later use, in any process, opens it;
concurrent first uses serialize on a file lock, so one builds and the others wait.

Streaming: documents are read in order from `datasets.load_dataset(..., streaming=True)`
and dealt to shards round-robin (row g goes to shard g mod n). Each shard tokenizes its
own rows on the fly and packs them `window` rows at a time with the same planners and
gather kernel as stored sources; a window's documents and rows are shuffled by a seed of
(seed, shard, epoch, window). The state is the stream's own `state_dict()` at the start
of the current window, the row index there, and the rows already emitted from the
window: restoring re-reads and re-plans that one window, so resume is exact for the same
shard count. A different shard count deals rows differently: that is refused.

Exact step count: a counting pass tokenizes the stream once keeping only document
lengths (cached on disk as one int64 array, never tokens), then plans every shard's
windows from lengths alone. Row counts do not depend on the window shuffle (every
planner's row count is a function of the multiset of lengths), so one pass serves every
epoch, shard count and packing setting.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import re
import time
from pathlib import Path

import grain
import numpy as np

from . import kernels
from . import paths
from .errors import PrepareError
from .config import SourceConfig
from .locks import file_lock
from .manifest import save_npy_atomic, token_dtype, write_json_atomic
from .packed import empty_rows
from .packing import ROW_KEYS, PackingError, plan_offsets, stream_key
from .preparation import prepare
from .texts import document_text, load_texts
from .tokenizer import load_tokenizer

TOKENIZE_BATCH = 256


def cache_root(cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir or paths.cache_root()) / "hf"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PrepareError(
            f"{root}: cannot create the Hugging Face source cache ({e.strerror}); set FORGE_GRAIN_CACHE (or pass "
            "cache_dir=) to a writable directory"
        ) from None
    return root


def path_name(name: str) -> str:
    """A source name as one file-name component inside the cache root: `web/en` and
    `../../x` are made safe (with a hash of the original, so distinct names stay distinct)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".")
    return safe if safe == name else f"{safe or 'source'}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


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
    tok = load_tokenizer(src.tokenizer)
    ds = _texts(src, streaming=False)
    key = _digest([ds._fingerprint, src.hf_dataset, src.hf_config, src.split, src.text_field, tok.sha256,
                   src.add_bos, src.add_eos, "special-tokens-as-text"])
    root = cache_root(cache_dir)
    out = root / f"{path_name(src.name)}-{key}"
    with file_lock(root / f".{path_name(src.name)}-{key}.lock"):
        prepare(src.hf_dataset, out, tokenizer=src.tokenizer, text_field=src.text_field, split=src.split,
                hf_config=src.hf_config, data_files=src.hf_data_files, add_bos=src.add_bos, add_eos=src.add_eos,
                progress=progress)
    return out


# -- streaming --------------------------------------------------------------------------------


class StreamingSource:
    """One streaming Hugging Face source as seen by one shard (see the module docstring)."""

    def __init__(self, src: SourceConfig, seq_len: int, seed: int, shard_index: int, shard_count: int,
                 cache_dir: str | Path | None = None, max_segments: int | None = None):
        self.src, self.seq_len, self.seed, self.max_segments = src, seq_len, seed, max_segments
        self.shard_index, self.shard_count = shard_index, shard_count
        self.cache_dir = cache_dir
        self.tok = load_tokenizer(src.tokenizer)
        self.bos = [self.tok.bos_id] if src.add_bos and self.tok.bos_id is not None else []
        self.eos = [self.tok.eos_id] if src.add_eos and self.tok.eos_id is not None else []
        self.vocab_size, self.bos_id, self.eos_id = self.tok.vocab_size, self.tok.bos_id, self.tok.eos_id
        self.tokenizer = self.tok.identity
        self.dtype = token_dtype(self.vocab_size)
        self.path = f"{src.hf_dataset} (streaming)"
        self._check_readable()
        self.key = _digest([src.hf_dataset, src.hf_config, src.split, src.text_field, _files_identity(src.hf_data_files),
                            self.tok.sha256, src.add_bos, src.add_eos, "special-tokens-as-text"])

    def _check_readable(self) -> None:
        _texts(self.src, streaming=True)  # raises a clear error for a missing field, an empty set, no network

    def open(self, state: dict | None = None):
        ds = _texts(self.src, streaming=True)
        if state is not None:
            ds.load_state_dict(state)
        return ds

    def tokenize(self, texts: list[str]) -> list[np.ndarray]:
        """Token arrays of texts (empty texts give empty arrays), BOS/EOS as configured."""
        texts = [document_text(t, lambda: f"{self.path}: a row's field {self.src.text_field!r}") for t in texts]
        keep = [t for t in texts if t]
        ids = iter(self.tok.encode_batch(keep)) if keep else iter(())
        return [np.asarray(self.bos + next(ids) + self.eos, np.int64) if t else np.zeros(0, np.int64) for t in texts]

    def window_seed(self, epoch: int, window: int, shard: int | None = None) -> int:
        shard = self.shard_index if shard is None else shard
        return int(_digest([self.seed, shard, epoch, window]), 16) & 0x7FFFFFFF

    def plan_window(self, lengths: np.ndarray, epoch: int, window: int, shard: int | None = None):
        """The packing plan of one window of documents (None when it makes no row)."""
        lengths = lengths[lengths > 0]
        if len(lengths) == 0:
            return None
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        try:
            return plan_offsets(offsets, self.seq_len, self.src.strategy, seed=self.window_seed(epoch, window, shard),
                                stride=self.src.stride, name=self.path, max_segments=self.max_segments)
        except PackingError:
            return None  # too few tokens in this window for a row: the window's tail loss

    # -- the counting pass ------------------------------------------------------------------

    def lengths(self, progress: bool = True) -> np.ndarray:
        """Token length of every row of the stream (0 for empty texts): cached, never tokens."""
        root = cache_root(self.cache_dir)
        stem = f"{path_name(self.src.name)}-{self.key}"
        path, meta = root / f"{stem}.lengths.npy", root / f"{stem}.lengths.json"
        with file_lock(root / f".{stem}.lengths.lock"):
            if not meta.exists():
                from tqdm.auto import tqdm

                t0 = time.perf_counter()
                lengths, batch = [], []
                bar = tqdm(desc=f"count {self.src.name}", unit="doc", disable=not progress)
                for row in self.open():
                    batch.append(row[self.src.text_field])
                    if len(batch) == TOKENIZE_BATCH:
                        lengths += [len(d) for d in self.tokenize(batch)]
                        bar.update(len(batch))
                        batch = []
                lengths += [len(d) for d in self.tokenize(batch)]
                bar.update(len(batch))
                bar.close()
                save_npy_atomic(path, np.asarray(lengths, np.int64))
                write_json_atomic(meta, {"documents": len(lengths), "seconds": time.perf_counter() - t0})
        return np.load(path)

    def counting_seconds(self) -> float:
        meta = cache_root(self.cache_dir) / f"{path_name(self.src.name)}-{self.key}.lengths.json"
        return json.loads(meta.read_text())["seconds"]

    def rows_per_shard(self, progress: bool = True) -> list[int]:
        """Rows each shard's stream yields in one epoch, planned from the cached lengths."""
        lengths = self.lengths(progress)
        counts = []
        for k in range(self.shard_count):
            own = lengths[k :: self.shard_count]
            n = 0
            for w in range(0, len(own), self.src.window):
                p = self.plan_window(own[w : w + self.src.window], 0, w // self.src.window, shard=k)
                n += p.num_rows if p is not None else 0
            counts.append(n)
        return counts


class StreamCursor:
    """This shard's rows of a streaming source, in order, with an exact state.

    It has the interface the mixture reads packed datasets through (`get_batch`), but is
    sequential: each call returns the next rows, whatever indices it is given.
    """

    def __init__(self, source: StreamingSource, rows_per_epoch: int):
        self.source = source
        self.seq_len = source.seq_len
        self.num_rows = rows_per_epoch  # rows the mixture may count on per epoch
        self.plan_key = f"stream-{source.key}"
        self.pad_id = source.eos_id if source.eos_id is not None else 0
        self.set_state({"epoch": 0, "window": 0, "stream": None, "row_index": 0, "emitted": 0})

    # -- state ------------------------------------------------------------------------------

    def state(self) -> dict:
        # the stream's own state as JSON text: its structure changes as it runs, a string's does not
        return {"epoch": self.epoch, "window": self.window, "stream": json.dumps(self._window_stream_state),
                "row_index": self._window_row_index, "emitted": self.emitted}

    def set_state(self, state: dict) -> None:
        self.epoch, self.window, self.emitted = state["epoch"], state["window"], state["emitted"]
        stream = json.loads(state["stream"]) if isinstance(state["stream"], str) else state["stream"]
        self._window_row_index = state["row_index"]
        self._ds = self.source.open(stream)
        self._it = iter(self._ds)
        self._row_index = state["row_index"]  # global index of the next row the stream yields
        # a restored stream reports its new position only once it is read: keep the one we gave it
        self._load_window(known_stream_state=stream)

    # -- reading ----------------------------------------------------------------------------

    def _own_texts(self, n: int) -> tuple[list[str], bool]:
        """The next n rows dealt to this shard (fewer at the end of the stream)."""
        texts, k, count = [], self.source.shard_index, self.source.shard_count
        while len(texts) < n:
            try:
                row = next(self._it)
            except StopIteration:
                return texts, True
            if self._row_index % count == k:
                texts.append(row[self.source.src.text_field])
            self._row_index += 1
        return texts, False

    def _load_window(self, known_stream_state: dict | None = None) -> None:
        """Read, tokenize and plan the current window; move past windows without rows, and
        into the next epoch (the stream read again from its start) at the end."""
        wrapped = 0
        while True:
            stream_state = known_stream_state if known_stream_state is not None else self._ds.state_dict()
            self._window_stream_state, self._window_row_index, known_stream_state = stream_state, self._row_index, None
            texts, ended = self._own_texts(self.source.src.window)
            docs = self.source.tokenize(texts)
            self._plan = self.source.plan_window(np.array([len(d) for d in docs], np.int64), self.epoch, self.window)
            if self._plan is not None and self.emitted < self._plan.num_rows:
                self._tokens = np.concatenate([d for d in docs if len(d)]).astype(self.source.dtype)
                self._pieces = kernels.one_piece(self._tokens)
                key = stream_key("window-rows", self.source.window_seed(self.epoch, self.window))
                self._order = kernels.permutation(self._plan.num_rows, key)
                return
            self.window, self.emitted = self.window + 1, 0
            if ended:
                wrapped += 1
                if wrapped > 1:
                    raise PackingError(f"{self.source.path}: this shard's stream yields no row of {self.seq_len} tokens")
                self.epoch, self.window = self.epoch + 1, 0
                self._ds = self.source.open()
                self._it, self._row_index = iter(self._ds), 0

    def get_batch(self, ranks, out: dict, dest, id_dtype=np.int32) -> dict:
        """Write the next len(ranks) rows of the stream into rows `dest` of `out`."""
        dest = np.asarray(dest, np.int64)
        for d in dest:
            p = self._plan
            row = self._order[self.emitted : self.emitted + 1]
            kernels.fill_rows(row, np.array([d], np.int64), p.row_ptr, p.seg_start, p.seg_len, p.seg_skip, p.seg_flags,
                              *self._pieces, self.seq_len, self.pad_id,
                              *(out[k] for k in ROW_KEYS))
            self.emitted += 1
            if self.emitted == p.num_rows:
                self.window, self.emitted = self.window + 1, 0
                self._load_window()
        return out


class StreamingRows(grain.IterDataset):
    """A streaming source's packed rows for one shard, one row per element, as a Grain
    `IterDataset`; its iterator's state is the cursor's (exact for the same shard)."""

    def __init__(self, source: StreamingSource):
        super().__init__()
        self.source = source

    def __iter__(self) -> "StreamingRowsIterator":
        return StreamingRowsIterator(self.source)


class StreamingRowsIterator(grain.DatasetIterator):
    def __init__(self, source: StreamingSource):
        super().__init__()
        self.cursor = StreamCursor(source, 0)

    def __next__(self) -> dict:
        out = empty_rows(1, self.cursor.seq_len)
        self.cursor.get_batch([0], out, [0])
        return {k: v[0] for k, v in out.items()}

    def get_state(self) -> dict:
        return self.cursor.state()

    def set_state(self, state: dict) -> None:
        self.cursor.set_state(state)
