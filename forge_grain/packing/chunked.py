"""Planning a large store a chunk of documents at a time, in parallel processes.

A whole-corpus plan holds every document's runs in memory at once (about 100 bytes per
document while planning) on one core. Past `CHUNK_DOCS` documents, `pack` plans chunks of
contiguous documents instead: chunk k is documents [k * n / c, (k + 1) * n / c) of the
store's c = ceil(n / chunk_docs) chunks (equal sizes, so no chunk is a small remainder),
with its own seeded document order. Chunks are planned in worker processes, each saved
on its own as it finishes (a killed run re-plans only the missing ones), then streamed
into one plan in chunk order; a store small enough to be planned in this process by
default (`IN_PROCESS_DOCS`: about a second) is planned and joined in memory and saved
once. Rows are shuffled globally as always, so the chunking changes which documents can
share a row (never two from different chunks) and nothing else; with chunks of millions
of documents the fill and crop are those of the whole corpus to within a few thousandths
of a percent (`benchmarks/bench_planning.py`).

Peak memory is one chunk's planning and offsets per worker (they come through a pipe); the
parent maps the store's offsets. Peak disk is the final plan plus one chunk's part of one
array: the join removes each chunk's arrays as it copies them. The result does not depend on
the number of workers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from forge_grain.processes import usable_cores
from forge_grain.files import temporary
from forge_grain.stores.mapping import map_npy
from forge_grain.packing.plans import (ARRAY_SUFFIX, PLAN_ARRAYS, PLAN_VERSION, PackingError, PackingPlan,
                                       checksum_array, checksum_start, joined_stats, plan_offsets)

CHUNK_DOCS = 1 << 22  # documents per chunk by default: ~0.5 GB of planning memory per worker
# up to this many documents a store is planned in this process by default: about a second here,
# where two worker processes took a second to start and plan 200,000 documents (0.1 s in process)
IN_PROCESS_DOCS = 2_000_000


def chunk_bounds(num_docs: int, chunk_docs: int) -> np.ndarray:
    """Document boundaries of the chunks: c + 1 non-decreasing values from 0 to num_docs."""
    count = max(1, -(-num_docs // chunk_docs))
    return np.array([k * num_docs // count for k in range(count + 1)], np.int64)


def plan_chunked(offsets: np.ndarray, seq_len: int, strategy: str, directory: Path, *, seed: int = 0,
                 stride: int | None = None, chunk_docs: int = CHUNK_DOCS, workers: int | None = None,
                 name: str = "documents", progress: bool = True, max_segments: int | None = None,
                 bounds: np.ndarray | None = None) -> PackingPlan:
    """Plan `offsets` chunk by chunk in `workers` processes (default: in this process up to
    `IN_PROCESS_DOCS` documents, else one per core, at most one per chunk), and save the
    store's plan to `directory` (atomically); returns it, memory-mapped. Chunks finished by an
    earlier, interrupted run are reused (a store planned in this process by default is
    planned in memory: `_plan_in_memory`). `bounds`: the chunks' document bounds, when not
    `chunk_docs` documents each (chunks fitted to a cache: `forge_grain.packing.fitted`)."""
    t0 = time.perf_counter()
    offsets = np.asarray(offsets, np.int64)
    bounds = chunk_bounds(len(offsets) - 1, chunk_docs) if bounds is None else np.asarray(bounds, np.int64)
    job = dict(seq_len=seq_len, strategy=strategy, seed=seed, stride=stride, name=name, max_segments=max_segments)
    if workers is None and len(offsets) - 1 <= IN_PROCESS_DOCS:
        return _plan_in_memory(offsets, bounds, directory, job, progress, t0)
    parts = directory.with_name(directory.name + ".chunks")
    parts.mkdir(parents=True, exist_ok=True)
    jobs = [(k, int(bounds[k]), int(bounds[k + 1])) for k in range(len(bounds) - 1)]
    dirs = [_chunk_dir(parts, offsets, a, b, k, job) for k, a, b in jobs]
    todo = [(k, a, b, str(d)) for (k, a, b), d in zip(jobs, dirs) if _load_chunk(d) is None]
    for *_, d in todo:  # what a run cut short left of it (a join removes chunks' arrays as it goes)
        shutil.rmtree(d, ignore_errors=True)
    workers = max(1, min(workers or usable_cores(), len(todo)))
    with _bar(len(jobs), len(jobs) - len(todo), f"plan {name}", progress) as bar:
        if workers == 1:
            for k, a, b, d in todo:
                _plan_chunk(offsets[a : b + 1], k, Path(d), **job)
                bar.update(1)
        else:
            _run_workers(offsets, todo, workers, job, parts, bar)
    chunks = [_load_chunk(d, verify=False) for d in dirs]  # verified above, or written just now
    if any(c is None for c in chunks):
        raise PackingError(f"{name}: a chunk's plan in {parts} vanished or was damaged while planning; run again")
    stats = _join_stats(chunks, seq_len, strategy, time.perf_counter() - t0)
    del chunks  # their maps: the join removes each chunk's arrays as it copies them
    _join(dirs, seq_len, strategy, directory, stats)
    shutil.rmtree(parts, ignore_errors=True)
    return _planned(directory, offsets, name, seq_len)


def _planned(directory: Path, offsets: np.ndarray, name: str, seq_len: int) -> PackingPlan:
    """The plan just saved in `directory` (memory-mapped), refused if it has no row."""
    p = PackingPlan.load(directory, verify=False)
    if p.num_rows == 0:
        raise PackingError(f"{name}: {int(offsets[-1])} tokens cannot fill one row of {seq_len} + 1 tokens")
    return p


def _plan_in_memory(offsets: np.ndarray, bounds: np.ndarray, directory: Path, job: dict, progress: bool,
                    t0: float) -> PackingPlan:
    """A store of at most `IN_PROCESS_DOCS` documents planned by default (in this process, in
    about a second): its chunks planned and joined in memory and the plan saved once. Saving
    each chunk and joining them on disk is for a run of minutes that a kill must not undo;
    here it was nearly all of the planning: a Megatron file of 200,000 documents under a
    `cache_limit` of 2 blocks' worth (129 chunks fitted to the cache) took 0.5 s of its
    open's CPU, 2.5 ms for every chunk's five arrays and its directory, to plan 0.06 s."""
    name, seq_len, strategy = job["name"], job["seq_len"], job["strategy"]
    chunks = []
    with _bar(len(bounds) - 1, 0, f"plan {name}", progress) as bar:
        for k in range(len(bounds) - 1):
            chunks.append(_chunk_plan(offsets[int(bounds[k]) : int(bounds[k + 1]) + 1], k, **job))
            bar.update(1)
    stats = _join_stats(chunks, seq_len, strategy, time.perf_counter() - t0)
    plan = PackingPlan(strategy, seq_len, **joined_arrays(chunks), stats=stats)
    shutil.rmtree(directory, ignore_errors=True)  # (a plan found invalid: the caller holds the plan's lock)
    plan.save(directory)
    shutil.rmtree(directory.with_name(directory.name + ".chunks"), ignore_errors=True)  # (an earlier run's)
    return _planned(directory, offsets, name, seq_len)


def joined_arrays(chunks: list[PackingPlan]) -> dict:
    """The chunks' arrays as one plan's, as `_join` writes them (`_continued`), each array in
    its first chunk's dtype."""
    out = {}
    for name in PLAN_ARRAYS:
        dtype = np.asarray(getattr(chunks[0], name)).dtype
        out[name] = np.concatenate(list(_continued((getattr(c, name) for c in chunks), name, dtype)))
    return out


def _chunk_dir(parts: Path, offsets: np.ndarray, a: int, b: int, k: int, job: dict) -> Path:
    """A chunk's plan is cached under a key of its documents' offsets (relative to its start)
    and the planning parameters, so a directory reused with other ones re-plans."""
    h = hashlib.sha256(np.ascontiguousarray(offsets[a : b + 1] - offsets[a]).view(np.uint8))
    params = [job[key] for key in ("seq_len", "strategy", "seed", "stride")]
    params += [job["max_segments"]] if job.get("max_segments") else []  # (keys of uncapped plans unchanged)
    h.update(json.dumps([PLAN_VERSION, a, b, k, *params]).encode())
    return parts / f"chunk-{k:05d}-{h.hexdigest()[:16]}"


def _run_workers(offsets: np.ndarray, todo: list, workers: int, job: dict, parts: Path, bar) -> None:
    """Plan the chunks `todo` in `workers` processes, chunk k in worker k % workers.

    Workers are fresh interpreters (`python -m forge_grain.packing.chunked JOB`): no
    `if __name__ == "__main__"` guard is needed in the caller's script (multiprocessing's
    spawn would re-run it), and nothing is forked from a parent that may hold Grain or JAX
    threads. Each reads its chunks' offsets from its stdin, one chunk at a time as it gets to
    it (a thread a worker writes them; the pipe holds the writer back): no copy of the
    offsets on disk (8 bytes a document: 8 GB at a billion), and a worker holds one chunk's."""
    procs, feeders = [], []
    try:
        for w in range(workers):
            spec = parts / f"worker-{w}.json"
            spec.write_text(json.dumps({**job, "chunks": todo[w::workers]}))
            with open(parts / f"worker-{w}.log", "w") as log:  # a file, not a pipe that could fill and block
                procs.append(subprocess.Popen([sys.executable, "-m", "forge_grain.packing.chunked", str(spec)],
                                              stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT))
            feeders.append(threading.Thread(target=_feed, args=(procs[-1].stdin, offsets, todo[w::workers]),
                                            daemon=True))
            feeders[-1].start()
        done = 0
        while any(p.poll() is None for p in procs):
            with contextlib.suppress(subprocess.TimeoutExpired):  # back as soon as a worker ends
                next(p for p in procs if p.poll() is None).wait(timeout=0.2)
            now = sum((Path(d) / "plan.json").exists() for *_, d in todo)
            bar.update(now - done)
            done = now
        for w, p in enumerate(procs):
            if p.returncode:
                log = (parts / f"worker-{w}.log").read_text()[-2000:]
                raise PackingError(f"planning worker {w} failed (exit {p.returncode}); its log ends:\n{log}")
        bar.update(len(todo) - done)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in feeders:  # a killed worker's pipe is broken: its feeder ends
            f.join()


def _feed(pipe, offsets: np.ndarray, chunks: list) -> None:
    """Write each chunk's offsets to a worker's stdin, in the order it plans them."""
    try:
        with pipe:
            for _, a, b, _ in chunks:
                for at in range(a, b + 1, 1 << 20):  # a mapped slice at a time: no copy of the chunk here
                    pipe.write(memoryview(np.ascontiguousarray(offsets[at : min(b + 1, at + (1 << 20))])).cast("B"))
    except (BrokenPipeError, ValueError, OSError):
        pass  # the worker died or was killed: its exit status says why


def _plan_chunk(offsets, k, directory: Path, **job) -> None:
    """Plan one chunk (its documents in token positions of the store) and save it."""
    _chunk_plan(offsets, k, **job).save(directory)


def _chunk_plan(offsets, k, *, seq_len, strategy, seed, stride, name, max_segments=None) -> PackingPlan:
    """The plan of one chunk, its documents at `offsets` (token positions of the store)."""
    base = int(offsets[0])
    if offsets[-1] == base:  # a chunk of empty documents: no rows
        p = PackingPlan(strategy, seq_len, np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32),
                        np.zeros(0, np.int32), np.zeros(0, np.uint8), {"tokens": 0, "rows": 0})
    else:
        p = plan_offsets(offsets - base, seq_len, strategy, seed=seed, stride=stride, name=name, chunk=k,
                         max_segments=max_segments)
        p.seg_start = p.seg_start + base
    return p


def _load_chunk(directory: Path, verify: bool = True) -> PackingPlan | None:
    try:
        return PackingPlan.load(directory, verify)
    except (OSError, ValueError, KeyError):
        return None


def _join(dirs: list[Path], seq_len: int, strategy: str, directory: Path, stats: dict) -> None:
    """Write the chunks' plans (in `dirs`) as one, array by array in chunk order (the checksum
    is hashed as the bytes are written), renamed into place when complete. Each chunk's part
    of an array is removed once copied, so the disk holds the joined plan and one part more,
    not the plan twice; a join cut short leaves chunks without some arrays, which a re-run
    plans again (`_load_chunk` refuses them)."""
    tmp = temporary(directory)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for d in dirs:  # from here on the chunks are being consumed: none is a finished plan any more
        (d / "plan.json").unlink()
    h = checksum_start(strategy, seq_len)
    for name in PLAN_ARRAYS:
        files = [d / f"{name}{ARRAY_SUFFIX}" for d in dirs]
        dtype = map_npy(files[0]).dtype
        total = sum(_length(f) for f in files) - (len(files) - 1 if name == "row_ptr" else 0)
        checksum_array(h, name, dtype, total)
        with open(tmp / f"{name}{ARRAY_SUFFIX}", "wb") as f:
            np.lib.format.write_array_header_2_0(f, {"descr": dtype.str, "fortran_order": False, "shape": (total,)})
            for part in _parts(files, name, dtype):
                f.write(part)
                h.update(part)
    meta = {"strategy": strategy, "seq_len": seq_len, "stats": stats, "version": PLAN_VERSION,
            "checksum": h.hexdigest()}
    (tmp / "plan.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(directory, ignore_errors=True)
    os.rename(tmp, directory)


def _length(file: Path) -> int:
    return len(map_npy(file))


def _parts(files: list[Path], name: str, dtype: np.dtype):
    """The bytes of array `name` of the joined plan, a chunk at a time, each chunk's file
    removed once read."""
    def mapped():
        for file in files:
            yield map_npy(file)
            file.unlink()  # (once its part is written: the next is asked for)

    for part in _continued(mapped(), name, dtype):
        yield part.tobytes()


def _continued(parts, name: str, dtype: np.dtype):
    """Array `name` of the joined plan a chunk at a time, from the chunks' arrays `parts` in
    order: row pointers continue from the previous chunk's segments; the rest as they are."""
    base = 0
    if name == "row_ptr":
        yield np.zeros(1, dtype)
    for part in parts:
        if name == "row_ptr":
            yield (np.asarray(part[1:]) + base).astype(dtype)
            base += int(part[-1])
        else:
            yield np.ascontiguousarray(part, dtype)


def _join_stats(chunks: list[PackingPlan], seq_len: int, strategy: str, seconds: float) -> dict:
    """The store's stats from its chunks' counts."""
    return {**joined_stats([c.stats for c in chunks], seq_len, strategy), "chunks": len(chunks),
            "planning_seconds": round(seconds, 4),
            "chunk_rows": [c.num_rows for c in chunks]}  # rows of chunk k follow those of chunk k - 1


def _bar(total: int, done: int, desc: str, progress: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc=desc, unit="chunk", disable=not progress or total < 2)


def _worker(spec: Path) -> None:
    """A planning worker: plan the chunks its job file lists, their offsets read from stdin."""
    job = json.loads(spec.read_text())
    for k, a, b, directory in job.pop("chunks"):
        offsets = np.empty(b - a + 1, np.int64)
        view, got = memoryview(offsets).cast("B"), 0
        while got < len(view):
            n = sys.stdin.buffer.readinto(view[got:])
            if not n:
                raise SystemExit(f"chunk {k}: the planner's offsets ended after {got} of {len(view)} bytes")
            got += n
        _plan_chunk(offsets, k, Path(directory), **job)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
