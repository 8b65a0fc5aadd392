"""Deferred opening: a pipeline of thousands of stored sources builds without opening them.

A pipeline's build needs only a few facts of each source: its rows per epoch, the keys of
its data and plan (for the state fingerprint), its vocabulary (mixed sources must share one)
and its pad id. Opening a store and its plan to learn them reads a dozen small files, about
1.5 ms a source: 15 s of every start over 10,000 sources, in every process.

So after a build opens its sources, it keeps those facts in one record file per set of
sources (`sources-<key>.json`, in the plan cache directory given to the pipeline, else
`$FORGE_GRAIN_CACHE/sources`), with the size, modification and change times and inode of
every file each store was opened from. A later build takes a source's facts from the record
when all its files still match, and the source is opened when a batch first reads it.

The record is a hint, never trusted: the first read opens the store and its plan in full
(every check of an ordinary open, the plan's checksum included) and compares what it finds
with what the build used. A difference (a record edited or copied from elsewhere; a file
changed without its change time moving, which the kernel does not allow) is an error
naming the source, never a batch of other data, and removes the record so the next build
opens every source again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

from forge_grain.errors import StoreError
from forge_grain.files import write_json_atomic
from forge_grain.paths import cache_root, is_url, private_cache
from forge_grain.stores import TokenStore

log = logging.getLogger(__name__)
RECORD_VERSION = 1
FACTS = ("data_id", "vocab_size", "tokenizer_sha256", "pad_id", "seq_len", "num_rows", "chunk_rows", "plan_key",
         "plan_sha256")


def source_key(src, seq_len: int, seed: int, chunk_docs: int | None, max_segments: int | None = None) -> str | None:
    """What a stored source's facts depend on besides its files; None for a source that is
    never deferred (Hugging Face datasets, object storage: their files are not stat-able here;
    `shuffle_bytes`)."""
    if src.hf_dataset is not None or src.path is None or is_url(src.path) or src.shuffle_bytes is not None:
        return None  # (an order fitted to a cache: its window is found from the store's files when opened)
    path = _absolute(src.path)
    options = sorted((k, str(v)) for k, v in src.store_options().items())
    return json.dumps([path, options, src.strategy, src.stride, seq_len, seed, chunk_docs]
                      + ([{"max_segments": max_segments}] if max_segments else []))


def _absolute(path) -> str:
    """A local path or `file://` URL as an absolute path string (no `Path`: this runs per source)."""
    text = os.fspath(path)
    return os.path.abspath(text[len("file://"):] if text.startswith("file://") else text)


def signature(path: str, files: list[str]) -> list:
    """(path, size, mtime, ctime, inode) of every visible entry of the store's directory (or
    of the store's file) and of its data files: what changes when a store is rewritten. The
    ctime is the kernel's (no one can set it back), so a file rewritten in place at the same
    size with its mtime restored still shows."""
    out, others = [], list(files)
    try:
        with os.scandir(path) as entries:
            for e in entries:
                if e.name[0] != ".":
                    st = e.stat()
                    out.append([e.path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    except NotADirectoryError:
        others.insert(0, path)  # a file store (a raw file, an .arrow file)
    except FileNotFoundError:
        pass  # a Megatron prefix: its files are the data files
    seen = {e[0] for e in out}
    for f in others:
        if f not in seen:
            st = os.stat(f)
            out.append([f, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
            seen.add(f)
    out.sort()
    return out


@dataclasses.dataclass
class Record:
    """A source's facts (`FACTS`), and the files and signature they were read with."""

    files: list[str]
    signature: list
    facts: dict

    def current(self, path: str) -> bool:
        try:
            return signature(path, self.files) == self.signature
        except OSError:
            return False


class SourceRecords:
    """The record file of one set of sources (their keys, in config order)."""

    def __init__(self, keys: list[str | None], cache_dir: str | Path | None):
        digest = hashlib.sha256(json.dumps([RECORD_VERSION] + keys).encode()).hexdigest()[:20]
        directory = private_cache(Path(cache_dir) if cache_dir is not None else cache_root() / "sources")
        self.file = directory / f"sources-{digest}.json"
        self.changed = False
        self.records: dict[str, Record] = self._load()

    def _load(self) -> dict[str, Record]:
        try:
            data = json.loads(self.file.read_text())
            if data.get("version") != RECORD_VERSION:
                return {}
            records = {k: Record(r["files"], r["signature"], {f: r["facts"][f] for f in FACTS})
                       for k, r in data["records"].items()}
            for k, r in records.items():
                _check_record(k, r)
            return records
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            # ignored (and rewritten by this build): a bad record must not fail every later build
            log.warning("forge-grain: ignoring the unreadable source record %s (%s); it is rewritten", self.file, e)
            self.changed = True
            return {}

    def find(self, key: str | None, path) -> Record | None:
        """The record of a source whose files have not changed since it was written."""
        r = self.records.get(key) if key is not None else None
        return r if r is not None and r.current(_absolute(path)) else None

    def add(self, key: str | None, store, dataset) -> None:
        """Record a source this build opened in full."""
        if key is None or not dataset.plan_key:
            return  # a plan kept in memory is rebuilt by every process: nothing to defer to
        files = [_absolute(f) for f in [*store.files, *store.index_files]]
        try:
            sig = signature(_absolute(store.path), files)
        except OSError:
            return
        facts = facts_of(store, dataset)
        old = self.records.get(key)
        if old is None or old.signature != sig or old.facts != facts:
            self.records[key] = Record(files, sig, facts)
            self.changed = True

    def save(self) -> None:
        """Write the records (atomically; a read-only cache only costs the next build time)."""
        if not self.changed:
            return
        data = {"version": RECORD_VERSION,
                "records": {k: dataclasses.asdict(r) for k, r in self.records.items()}}
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.file, data)
            self.changed = False
        except OSError as e:
            log.warning("forge-grain: cannot write the source record %s (%s); the next build opens every source",
                        self.file, e)

    def discard(self) -> None:
        try:
            self.file.unlink()
        except OSError:
            pass


FACT_TYPES = {"data_id": str, "vocab_size": (int, type(None)), "tokenizer_sha256": (str, type(None)),
              "pad_id": int, "seq_len": int, "num_rows": int, "chunk_rows": list, "plan_key": str, "plan_sha256": str}


def _check_record(key: str, r: Record) -> None:
    """A record as `add` writes it, or a TypeError naming what is not."""
    if not (isinstance(r.files, list) and all(isinstance(f, str) for f in r.files) and isinstance(r.signature, list)):
        raise TypeError(f"record {key[:60]}: files and signature must be lists")
    for name, kind in FACT_TYPES.items():
        value = r.facts[name]
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            raise TypeError(f"record {key[:60]}: {name} is {value!r:.40}")
    if not all(isinstance(n, int) and n >= 0 for n in r.facts["chunk_rows"]):
        raise TypeError(f"record {key[:60]}: chunk_rows must be counts")


def identity_of(store) -> dict:
    """What a build checks and fingerprints of a source: `data_id` (a store's content
    fingerprint, or a streaming source's key), and its `vocabulary_of`."""
    return {"data_id": store.fingerprint if isinstance(store, TokenStore) else store.key, **vocabulary_of(store)}


def vocabulary_of(store) -> dict:
    """A source's `vocab_size` and `tokenizer_sha256`: what a build checks before its data's
    identity is asked for (a store's fingerprint may wait for its data: `stores.harvest`)."""
    return {"vocab_size": store.vocab_size, "tokenizer_sha256": (store.tokenizer or {}).get("sha256")}


def facts_of(store, dataset) -> dict:
    """The facts of a source opened in full, as a record keeps them."""
    return {
        **identity_of(store),
        "pad_id": int(dataset.pad_id),
        "seq_len": dataset.seq_len,
        "num_rows": dataset.num_rows,
        "chunk_rows": [int(n) for n in dataset._chunk_rows],
        "plan_key": dataset.plan_key,
        "plan_sha256": dataset.plan.checksum(),
    }


def checked_opener(name: str, path, record: Record, records: SourceRecords, open_full):
    """`open_full()` (the source opened in full) for a deferred dataset, checked against the
    facts the build used: a difference is an error, and drops the record file."""

    def opener():
        store, dataset = open_full()
        facts = facts_of(store, dataset)
        differ = [k for k in FACTS if facts[k] != record.facts[k]]
        if differ:
            records.discard()
            raise StoreError(
                f"source '{name}' ({path}) changed after this pipeline was built from the record in {records.file} "
                f"(differing: {', '.join(differ)}); its batches would not be those the pipeline's state describes. "
                "The record is removed: build the pipeline again (and resume from a state saved with this data)."
            )
        return dataset

    return opener
