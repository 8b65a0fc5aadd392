"""The local runner of `prepare` (`forge_grain.preparation.runners`): tokenize a corpus into
a token store in processes of this machine, in parallel and atomically.

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
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from queue import Empty

import numpy as np

from forge_grain.errors import PrepareError
from forge_grain.stores.manifest import (
    MANIFEST_NAME, MASK_DTYPE, MASKED_VERSION, VERSION, Manifest, ShardInfo, token_dtype, write_joined_index,
)
from forge_grain.files import fsync_rename, save_npy_atomic, sha256_file, temporary, write_json_atomic
from forge_grain.locks import exclusive_or_refuse
from forge_grain.preparation.documents import documents
from forge_grain.processes import die_with_parent
from forge_grain.tokenizer import TextTokenizer

SHARD_TARGET_BYTES = 64 << 20  # of text per shard by default
LOCK_NAME = ".forge-grain-prepare.lock"


@dataclasses.dataclass(frozen=True)
class Job:
    """What a shard worker needs; identical for every shard of one run."""

    out: str
    key: str
    field: str  # the text field, or the token field when `tokens`
    tokens: bool
    list_separator: str | None
    layout: str
    dtype: str
    vocab_size: int
    bos: tuple[int, ...]  # ids added before each document
    eos: tuple[int, ...]
    starts_with: int | None  # a declared BOS every pre-tokenized document must already start with
    ends_with: int | None
    source: str
    piece_chars: int = 1 << 20  # longer texts are tokenized in pieces of about this many characters
    # conversations ("messages" or "prompt_completion": `corpora.chat`): the template, its special
    # tokens' strings and the roles whose turns train; each document then carries a target mask
    chat: str | None = None
    template: str | None = None
    specials: tuple = ()
    train_roles: tuple = ("assistant",)


def prepare_local(spec: Spec, num_shards: int | None, num_proc: int, overwrite: bool, progress: bool) -> Path:
    """The local runner: read the corpus, write the shards not done yet (in `num_proc`
    processes), then the manifest, under the output directory's lock."""
    from forge_grain.corpora.loading import load_corpus

    source, out = spec.source, spec.out
    corpus = load_corpus(source, text_field=spec.text_field, split=spec.split, hf_config=spec.hf_config,
                         text_unit=spec.text_unit, data_files=spec.data_files, token_field=spec.token_field,
                         list_separator=spec.list_separator, exclude=out, chat=spec.chat)
    tok = spec.tok
    ds = corpus.ds
    # local files are known by their sizes and times, as the Beam runner knows them without loading
    text_bytes = sum(f.stat().st_size for f in corpus.files) if corpus.files else ds.data.nbytes
    num_shards = num_shards or default_num_shards(text_bytes, len(ds))
    if not 1 <= num_shards <= len(ds):
        raise PrepareError(f"num_shards must be between 1 and the {len(ds)} documents, not {num_shards}")
    identity = files_identity(corpus.files) if corpus.files else getattr(ds, "_fingerprint", None)
    job, settings, recorded = spec.describe(identity, num_shards)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with exclusive_or_refuse(out / LOCK_NAME, str(out)):  # one writer per output directory
            if _already_prepared(out, job.key, settings, overwrite):
                if progress:
                    print(f"{out}: already complete (prepared earlier with these settings); nothing to do")
            else:
                clean(out, remove_all=overwrite)
                _write_store(corpus, tok, job, settings, recorded, num_shards, num_proc, progress)
    except OSError as e:  # a full disk, a read-only or vanished directory: name the file, keep what is done
        raise PrepareError(
            f"{e.filename or out}: {_cause(e)} while writing the store; the shards already finished are kept, "
            "and re-running the same command (once the cause is fixed) completes it"
        ) from None
    return out


def _cause(e: OSError) -> str:
    """What went wrong, in words: numpy reports a write cut short by a full disk as "N requested
    and M written", without the system's error."""
    text = str(e)
    if not e.strerror and "requested and" in text and "written" in text:
        return f"No space left on device (or over quota): a write was cut short, {text}"
    return e.strerror or text


@dataclasses.dataclass
class Spec:
    """A prepare run's options, checked, before the corpus is read: what the local and the
    Beam runners share, so both describe a store the same way."""

    source: object
    out: object
    tok: TextTokenizer | None
    vocab_size: int
    bos: int | None
    eos: int | None
    add_bos: bool
    add_eos: bool
    text_field: str
    token_field: str | None
    split: str | None
    hf_config: str | None
    text_unit: str
    data_files: object
    list_separator: str | None
    special_tokens_in_text: bool
    layout: str
    piece_chars: int
    chat: str | None = None
    template: tuple | None = None  # (the chat template, its special tokens' strings)
    train_roles: tuple = ("assistant",)

    @property
    def tokens(self) -> bool:
        """Pre-tokenized input (a token field), written without tokenizing."""
        return self.token_field is not None

    def describe(self, fingerprint, num_shards: int) -> tuple[Job, dict, dict]:
        """(the shard workers' job, the settings the manifest records, what the documents carry)
        for an input of this identity, in `num_shards` shards."""
        tokens, bos, eos = self.tokens, self.bos, self.eos
        settings = {
            "input": _input_name(self.source),
            "fingerprint": fingerprint,
            "text_field": None if tokens else self.text_field,
            "token_field": self.token_field,
            "vocab_size": self.vocab_size,
            "split": self.split,
            "hf_config": self.hf_config,
            "text_unit": self.text_unit,
            "data_files": self.data_files,
            "list_separator": self.list_separator,
            "special_tokens_in_text": self.special_tokens_in_text,
            "bos": bos if self.add_bos else None,
            "eos": eos if self.add_eos else None,
            "declared": [bos, eos],
            "tokenizer": self.tok.sha256 if self.tok else None,
            "layout": self.layout,
            "num_shards": num_shards,
        }
        if self.chat is not None:  # (absent otherwise: stores prepared before keep their key)
            settings.update(chat=self.chat, train_roles=list(self.train_roles),
                            chat_template=hashlib.sha256(self.template[0].encode()).hexdigest())
        if self.layout == "arrayrecord":  # shards an older version began (zstd) are not resumed into this store
            settings["records"] = RECORD_OPTIONS
        key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
        job = Job(
            str(self.out), key, self.token_field or self.text_field, tokens, self.list_separator, self.layout,
            token_dtype(self.vocab_size).str, self.vocab_size, (bos,) if self.add_bos else (),
            (eos,) if self.add_eos else (), bos if tokens and not self.add_bos else None,
            eos if tokens and not self.add_eos else None, str(self.source), self.piece_chars, self.chat,
            *((self.template[0], tuple(sorted(self.template[1].items()))) if self.chat else (None, ())),
            tuple(self.train_roles),
        )
        recorded = {  # what the documents carry: a --no-bos store records no BOS, so bos_bestfit refuses it
            "bos_id": bos if self.add_bos or job.starts_with is not None else None,
            "eos_id": eos if self.add_eos or job.ends_with is not None else None,
            "tokenizer": self.tok.identity if self.tok else {"path": None, "sha256": None, "vocab_size": self.vocab_size},
        }
        if self.layout == "arrayrecord":
            recorded["compression"] = "none"
        return job, settings, recorded


def files_identity(files) -> str:
    """The identity of local input files (path, size, modification time), as the manifest
    records it: a re-run over changed files is another store."""
    entries = [[os.path.abspath(f), (st := os.stat(f)).st_size, st.st_mtime_ns] for f in files]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _write_store(corpus, tok, job: Job, settings: dict, recorded: dict, num_shards: int, num_proc: int,
                 progress: bool) -> None:
    """Write the shards not done yet, then the manifest (under the output's lock)."""
    out, n = Path(job.out), len(corpus.ds)
    bounds = [n * i // num_shards for i in range(num_shards + 1)]
    done = {i: info for i in range(num_shards) if (info := done_info(out, i, job.key))}
    todo = [(i, bounds[i], bounds[i + 1]) for i in range(num_shards) if i not in done]
    with _Progress(n, sum(b - a for i, a, b in todo), progress, out) as bar:
        for i, info in _run_shards(corpus, tok, job, todo, num_proc, bar):
            done[i] = info
    write_manifest(job, settings, recorded, [done[i] for i in range(num_shards)])


def write_manifest(job: Job, settings: dict, recorded: dict, infos: list[dict]) -> None:
    """The manifest of a store whose shards are all written (`infos`, in order), then the
    shards' done markers go: the store is complete."""
    out, num_shards = Path(job.out), len(infos)
    shards = [ShardInfo(**{k: v for k, v in info.items() if k != "skipped"}) for info in infos]
    num_docs = sum(s.num_documents for s in shards)
    if num_docs == 0:
        raise PrepareError(f"{job.source}: every document is empty; nothing to prepare")
    Manifest(
        indices=write_joined_index(out, shards),
        layout=job.layout,
        dtype=job.dtype,
        vocab_size=job.vocab_size,
        num_documents=num_docs,
        num_tokens=sum(s.num_tokens for s in shards),
        shards=tuple(shards),
        source={**settings, "key": job.key, "skipped_empty": sum(d["skipped"] for d in infos)},
        version=MASKED_VERSION if job.chat else VERSION,
        **recorded,
    ).save(out)
    for i in range(num_shards):
        _done_path(out, i).unlink(missing_ok=True)


def special_ids(tok, tokens, vocab_size, bos_id, eos_id, named=(False, False)):
    """(vocab_size, bos id, eos id) from the loaded tokenizer `tok` (or None) and the options,
    checked against each other; `named`: whether --bos-token / --eos-token were given."""
    if tok is not None:
        if vocab_size is not None and vocab_size != tok.vocab_size:
            raise PrepareError(f"{tok.path}: vocab_size {vocab_size} was given, but the tokenizer has {tok.vocab_size} ids")
        vocab_size = tok.vocab_size
    if not tokens:
        for given, what in ((bos_id, "bos_id"), (eos_id, "eos_id")):
            if given is not None:
                raise PrepareError(f"{what} declares ids of pre-tokenized input (--token-field); for text, "
                                   f"name the token with --{what[:3]}-token")
        return vocab_size, tok.bos_id, tok.eos_id
    if tok is not None:  # pre-tokenized: a tokenizer gives the vocabulary, and special ids only when named
        bos_id = tok.bos_id if bos_id is None and named[0] else bos_id
        eos_id = tok.eos_id if eos_id is None and named[1] else eos_id
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise PrepareError(
            "pre-tokenized input (--token-field) needs the vocabulary size: pass --vocab-size N "
            "(or --tokenizer PATH to take it from the tokenizer that made the ids)"
        )
    for given, what in ((bos_id, "bos_id"), (eos_id, "eos_id")):
        if given is not None and not 0 <= given < vocab_size:
            raise PrepareError(f"{what} {given} is outside the vocabulary [0, {vocab_size})")
    return vocab_size, bos_id, eos_id


def default_num_shards(text_bytes: int, num_docs: int) -> int:
    """About 64 MiB of text a shard, and at least 4 shards past 4 MiB so processes share the work."""
    n = math.ceil(text_bytes / SHARD_TARGET_BYTES)
    if text_bytes > 4 << 20:
        n = max(n, 4)
    return max(1, min(n, num_docs))


def shard_name(i: int, layout: str) -> str:
    return f"shard-{i:05d}." + ("bin" if layout == "bin" else "array_record")


def done_name(i: int) -> str:
    """Shard i's done marker: written once the shard is complete, removed with the manifest."""
    return f"shard-{i:05d}.done.json"


def _done_path(out: Path, i: int) -> Path:
    return out / done_name(i)


def _input_name(source) -> str:
    """A local input by its absolute path (`./in/x` and `/abs/in/x` are one input); a hub name as given."""
    p = Path(source)
    return str(p.resolve()) if p.exists() else str(source)


def _already_prepared(out: Path, key: str, settings: dict, overwrite: bool) -> bool:
    path = out / MANIFEST_NAME
    text = path.read_text() if path.exists() else None
    return already_prepared(out, text, key, settings, overwrite, path.unlink)


def already_prepared(where, manifest_text: str | None, key: str, settings: dict, overwrite: bool, remove) -> bool:
    """True when the manifest at `where` (its text, None when absent) was written by a run
    with these settings; False when there is none, or `overwrite` allows replacing it
    (then `remove()` deletes it first: the store is incomplete from there on); an error
    naming what differs otherwise."""
    if manifest_text is None:
        return False
    try:
        recorded = json.loads(manifest_text).get("source", {})
    except (json.JSONDecodeError, AttributeError):
        recorded = {}
    same = recorded.get("key") == key
    if same and not overwrite:
        return True
    if not overwrite:
        differ = sorted(k for k in settings if recorded.get(k) != settings[k]) or ["(unknown: an older manifest)"]
        raise PrepareError(
            f"{where}: already holds a token store prepared with other settings (differing: {', '.join(differ)}); "
            "choose another output or pass --overwrite"
        )
    remove()
    return False


def clean(out: Path, remove_all: bool) -> None:
    """Remove temporaries of interrupted runs (and, with `remove_all`, every shard file)."""
    for f in out.iterdir():
        if f.name.startswith(".") and ".tmp-" in f.name:  # under the output's lock: no live writer owns it
            f.unlink()
        elif remove_all and f.name.startswith("shard-"):
            f.unlink()


def done_info(out: Path, i: int, key: str) -> dict | None:
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


def _init_worker(corpus, tok: TextTokenizer | None, job: Job, queue, parent: int) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    die_with_parent(parent)  # a worker ends when the prepare that started it dies (kill -9, OOM): no orphan
    # goes on writing into the output while a re-run starts
    _WORKER.update(corpus=corpus, tok=tok, job=job, report=queue.put)


def _worker_shard(task):
    return write_shard(_WORKER["corpus"], _WORKER["tok"], _WORKER["job"], task, _WORKER["report"])


def _run_shards(corpus, tok, job, todo, num_proc, bar):
    """Yield (shard index, info) as shards complete, in this process or in `num_proc`.

    Worker processes run under `ProcessPoolExecutor`, which notices a worker that dies
    (killed by the OOM killer, a signal, a crash): the others are stopped and the run ends
    with an error; the finished shards stay, and a re-run completes the rest.
    """
    if num_proc <= 1 or len(todo) <= 1:
        for task in todo:
            yield write_shard(corpus, tok, job, task, bar.update)
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    queue = ctx.Queue()
    pool = ProcessPoolExecutor(min(num_proc, len(todo)), ctx, _init_worker, (corpus, tok, job, queue, os.getpid()))
    try:
        pending = {pool.submit(_worker_shard, task): task[0] for task in todo}
        while pending:
            finished, _ = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(queue, bar)
            for future in finished:
                shard = pending.pop(future)
                try:
                    yield future.result()
                except BrokenProcessPool:
                    raise PrepareError(
                        f"{job.out}: a worker process died while writing shard {shard} (killed by a signal, or out of "
                        "memory?); the shards already finished are kept, and re-running the same command completes "
                        "the store"
                    ) from None
        _drain(queue, bar)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _drain(queue, bar) -> None:
    while True:
        try:
            bar.update(queue.get_nowait())
        except (Empty, OSError, EOFError):
            return


def write_shard(corpus, tok: TextTokenizer | None, job: Job, task, report) -> tuple[int, dict]:
    i, start, stop = task
    out = Path(job.out)
    name = shard_name(i, job.layout)
    tmp = temporary(out / name)
    dtype = np.dtype(job.dtype)
    lengths, skipped = [], 0
    sink = _BinSink(tmp) if job.layout == "bin" else _RecordSink(tmp)
    mask_name = f"shard-{i:05d}.mask"
    masks = _BinSink(temporary(out / mask_name)) if job.chat else None
    try:
        for docs, rows in documents(corpus, tok, job, start, stop):
            for row, arr, *mask in docs:
                if len(arr) and (arr.max() >= job.vocab_size or arr.min() < 0):
                    raise PrepareError(
                        f"{corpus.where(row)}: tokenizes to id {int(arr.max())}, at or past vocab_size {job.vocab_size}"
                    )
                sink.write(arr.astype(dtype, copy=False))
                if masks is not None:
                    masks.write(mask[0].astype(MASK_DTYPE))
                lengths.append(len(arr))
            skipped += rows - len(docs)
            report((rows, sum(len(d[1]) for d in docs)))
        sink.close()
        if masks is not None:
            masks.close()
    except BaseException:
        sink.close()
        tmp.unlink(missing_ok=True)
        if masks is not None:
            masks.close()
            masks.path.unlink(missing_ok=True)
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
        "index_sha256": sha256_file(out / index_name),
        "skipped": skipped,
    }
    if masks is not None:
        info.update(mask=mask_name, mask_sha256=sha256_file(masks.path))
        fsync_rename(masks.path, out / mask_name)
    fsync_rename(tmp, out / name)
    write_json_atomic(_done_path(out, i), {"key": job.key, "info": info})
    return i, info


class _BinSink:
    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "wb")

    def write(self, tokens: np.ndarray) -> None:
        self.f.write(tokens.tobytes())  # the store's dtype is little-endian

    def close(self) -> None:
        self.f.close()


# One record per document, uncompressed: ArrayRecord's zstd reader keeps a background thread
# (riegeli's recycling-pool cleaner) that a forked DataLoader worker does not have, and a worker
# forked after its parent read compressed records crashes decoding its own (stores/arrayrecord.py)
RECORD_OPTIONS = "group_size:1,uncompressed"


class _RecordSink:
    def __init__(self, path: Path):
        from array_record.python.array_record_module import ArrayRecordWriter

        self.w = ArrayRecordWriter(str(path), RECORD_OPTIONS)

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
