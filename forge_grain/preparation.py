"""`forge-grain prepare`: tokenize a text corpus into a token store, in parallel and atomically.

Each shard covers a fixed, contiguous range of the corpus's rows, so its bytes depend
only on the inputs and options, never on the number of processes. A shard is written
under a temporary name and renamed when complete, then marked done; the manifest is
written last. A re-run with the same arguments skips the shards already done and
produces the same bytes as one uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np

from .errors import PrepareError
from .manifest import (
    LAYOUTS,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    fsync_rename,
    save_npy_atomic,
    sha256_file,
    token_dtype,
    write_json_atomic,
)
from .tokenizer import TextTokenizer, load_tokenizer

BATCH_DOCS = 512  # documents tokenized per call: large enough for the Rust batch path
SHARD_TARGET_BYTES = 64 << 20  # of text per shard by default


@dataclasses.dataclass(frozen=True)
class _Job:
    """What a shard worker needs; identical for every shard of one run."""

    out: str
    key: str
    text_field: str
    layout: str
    dtype: str
    vocab_size: int
    bos: tuple[int, ...]
    eos: tuple[int, ...]
    source: str


def prepare(
    source: str | Path,
    output: str | Path,
    *,
    tokenizer: str | Path | None = None,
    text_field: str = "text",
    split: str = "train",
    hf_config: str | None = None,
    text_unit: str = "document",
    data_files=None,
    add_bos: bool = True,
    add_eos: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    layout: str = "bin",
    num_shards: int | None = None,
    num_proc: int = 1,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Tokenize `source` (see `forge_grain.texts.load_texts`) into a token store at `output`.

    Every non-empty document becomes `[BOS] + tokens + [EOS]` (each optional). Returns
    the store's path; open it with `TokenStore.open`.
    """
    from .texts import load_texts

    if layout not in LAYOUTS:
        raise PrepareError(f"unknown layout {layout!r} (choose one of {LAYOUTS})")
    tok = load_tokenizer(tokenizer, bos=bos_token, eos=eos_token)
    for flag, tid, what in ((add_bos, tok.bos_id, "BOS"), (add_eos, tok.eos_id, "EOS")):
        if flag and tid is None:
            raise PrepareError(f"{tok.path}: no {what} token found; name one (--{what.lower()}-token) or disable it")
    ds = load_texts(source, text_field=text_field, split=split, hf_config=hf_config, text_unit=text_unit,
                    data_files=data_files)
    num_shards = num_shards or default_num_shards(ds.data.nbytes, len(ds))
    if not 1 <= num_shards <= len(ds):
        raise PrepareError(f"num_shards must be between 1 and the {len(ds)} documents, not {num_shards}")

    out = Path(output)
    dtype = token_dtype(tok.vocab_size)
    settings = {
        "input": str(source),
        "fingerprint": getattr(ds, "_fingerprint", None),
        "text_field": text_field,
        "split": split,
        "hf_config": hf_config,
        "text_unit": text_unit,
        "data_files": data_files,
        "bos": tok.bos_id if add_bos else None,
        "eos": tok.eos_id if add_eos else None,
        "tokenizer": tok.sha256,
        "layout": layout,
        "num_shards": num_shards,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    if _already_prepared(out, key, overwrite):
        return out
    out.mkdir(parents=True, exist_ok=True)
    _clean(out, remove_all=overwrite)

    job = _Job(
        str(out), key, text_field, layout, dtype.str, tok.vocab_size,
        (tok.bos_id,) if add_bos else (), (tok.eos_id,) if add_eos else (), str(source),
    )
    bounds = [len(ds) * i // num_shards for i in range(num_shards + 1)]
    ranges = list(zip(bounds[:-1], bounds[1:]))
    done = {i: info for i in range(num_shards) if (info := _done_info(out, i, key))}
    todo = [(i, *ranges[i]) for i in range(num_shards) if i not in done]
    with _Progress(len(ds), sum(b - a for i, a, b in todo), progress, out) as bar:
        for i, info in _run_shards(ds, tok, job, todo, num_proc, bar):
            done[i] = info
    shards = [ShardInfo(**{k: v for k, v in done[i].items() if k != "skipped"}) for i in range(num_shards)]
    num_docs = sum(s.num_documents for s in shards)
    if num_docs == 0:
        raise PrepareError(f"{source}: every document is empty; nothing to prepare")
    manifest = Manifest(
        layout=layout,
        dtype=dtype.str,
        vocab_size=tok.vocab_size,
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        tokenizer=tok.identity,
        num_documents=num_docs,
        num_tokens=sum(s.num_tokens for s in shards),
        shards=tuple(shards),
        source={**settings, "key": key, "skipped_empty": sum(done[i]["skipped"] for i in range(num_shards))},
    )
    manifest.save(out)
    for i in range(num_shards):
        _done_path(out, i).unlink(missing_ok=True)
    return out


def default_num_shards(text_bytes: int, num_docs: int) -> int:
    """About 64 MiB of text a shard, and at least 4 shards past 4 MiB so processes share the work."""
    n = math.ceil(text_bytes / SHARD_TARGET_BYTES)
    if text_bytes > 4 << 20:
        n = max(n, 4)
    return max(1, min(n, num_docs))


def shard_name(i: int, layout: str) -> str:
    return f"shard-{i:05d}." + ("bin" if layout == "bin" else "array_record")


def _done_path(out: Path, i: int) -> Path:
    return out / f"shard-{i:05d}.done.json"


def _already_prepared(out: Path, key: str, overwrite: bool) -> bool:
    if not (out / MANIFEST_NAME).exists():
        return False
    try:
        same = json.loads((out / MANIFEST_NAME).read_text()).get("source", {}).get("key") == key
    except json.JSONDecodeError:
        same = False
    if same and not overwrite:
        return True
    if not overwrite:
        raise PrepareError(
            f"{out}: already holds a token store prepared from other inputs or options; "
            "choose another output or pass --overwrite"
        )
    (out / MANIFEST_NAME).unlink()  # first: the store is incomplete from here on
    return False


def _clean(out: Path, remove_all: bool) -> None:
    """Remove temporaries of interrupted runs (and, with `remove_all`, every shard file)."""
    for f in out.iterdir():
        if f.name.startswith(".shard-") and ".tmp-" in f.name:
            f.unlink()
        elif remove_all and f.name.startswith("shard-"):
            f.unlink()


def _done_info(out: Path, i: int, key: str) -> dict | None:
    """The record of shard `i` if a run with these settings completed it, else None."""
    try:
        d = json.loads(_done_path(out, i).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    info = d.get("info", {})
    if d.get("key") != key or not (out / info.get("tokens", "")).exists():
        return None
    if sha256_file(out / info["tokens"]) != info["sha256"] or not (out / info["index"]).exists():
        return None
    return info


# -- workers ------------------------------------------------------------------------------

_WORKER: dict = {}


def _init_worker(ds, tok: TextTokenizer, job: _Job, queue) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _WORKER.update(ds=ds, tok=tok, job=job, report=queue.put)


def _worker_shard(task):
    return _write_shard(_WORKER["ds"], _WORKER["tok"], _WORKER["job"], task, _WORKER["report"])


def _run_shards(ds, tok, job, todo, num_proc, bar):
    """Yield (shard index, info) as shards complete, in this process or in `num_proc`."""
    if num_proc <= 1 or len(todo) <= 1:
        for task in todo:
            yield _write_shard(ds, tok, job, task, bar.update)
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    queue = ctx.Queue()
    with ctx.Pool(min(num_proc, len(todo)), _init_worker, (ds, tok, job, queue)) as pool:
        results = pool.imap_unordered(_worker_shard, todo)
        pending = len(todo)
        while pending:
            try:
                i, info = results.next(timeout=0.2)
                pending -= 1
                yield i, info
            except mp.TimeoutError:
                pass
            while not queue.empty():
                bar.update(queue.get())


def _documents(ds, tok: TextTokenizer, job: _Job, start: int, stop: int):
    """Yield, per batch, the (row, token ids) of its non-empty documents and its row count."""
    for lo in range(start, stop, BATCH_DOCS):
        texts = ds[lo : min(lo + BATCH_DOCS, stop)][job.text_field]
        keep = [(lo + j, t) for j, t in enumerate(texts) if t]
        ids = tok.encode_batch([t for _, t in keep]) if keep else []
        yield [(row, list(job.bos) + doc + list(job.eos)) for (row, _), doc in zip(keep, ids)], len(texts)


def _write_shard(ds, tok: TextTokenizer, job: _Job, task, report) -> tuple[int, dict]:
    i, start, stop = task
    out = Path(job.out)
    name = shard_name(i, job.layout)
    tmp = out / f".{name}.tmp-{os.getpid()}"
    dtype = np.dtype(job.dtype)
    lengths, skipped = [], 0
    sink = _BinSink(tmp) if job.layout == "bin" else _RecordSink(tmp)
    try:
        for docs, rows in _documents(ds, tok, job, start, stop):
            for row, doc in docs:
                arr = np.asarray(doc, dtype=np.int64)
                if len(arr) and (arr.max() >= job.vocab_size or arr.min() < 0):
                    raise PrepareError(
                        f"{job.source}: row {row} tokenizes to id {int(arr.max())}, at or past vocab_size "
                        f"{job.vocab_size}"
                    )
                sink.write(arr.astype(dtype))
                lengths.append(len(arr))
            skipped += rows - len(docs)
            report((rows, sum(len(d) for _, d in docs)))
        sink.close()
    except BaseException:
        sink.close()
        tmp.unlink(missing_ok=True)
        raise
    index_name = f"shard-{i:05d}.idx.npy"
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    save_npy_atomic(out / index_name, offsets)
    info = {
        "tokens": name,
        "index": index_name,
        "num_documents": len(lengths),
        "num_tokens": int(offsets[-1]),
        "sha256": sha256_file(tmp),
        "skipped": skipped,
    }
    fsync_rename(tmp, out / name)
    write_json_atomic(_done_path(out, i), {"key": job.key, "info": info})
    return i, info


class _BinSink:
    def __init__(self, path: Path):
        self.f = open(path, "wb")

    def write(self, tokens: np.ndarray) -> None:
        self.f.write(tokens.tobytes())  # the store's dtype is little-endian

    def close(self) -> None:
        self.f.close()


class _RecordSink:
    def __init__(self, path: Path):
        from array_record.python.array_record_module import ArrayRecordWriter

        self.w = ArrayRecordWriter(str(path), "group_size:1")

    def write(self, tokens: np.ndarray) -> None:
        self.w.write(tokens.tobytes())

    def close(self) -> None:
        if self.w is not None:
            self.w.close()
            self.w = None


class _Progress:
    """A tqdm bar over documents that also shows tokens and tokens/s."""

    def __init__(self, total_docs: int, todo_docs: int, enabled: bool, out: Path):
        from tqdm.auto import tqdm

        self.t0 = time.perf_counter()
        self.tokens = 0
        self.bar = tqdm(
            total=total_docs,
            initial=total_docs - todo_docs,
            unit="doc",
            desc=f"prepare {out.name}",
            disable=not enabled,
            dynamic_ncols=True,
        )

    def update(self, item) -> None:
        docs, tokens = item
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens:,} tok, {rate / 1e6:.2f} M tok/s", refresh=False)
        self.bar.update(docs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()
