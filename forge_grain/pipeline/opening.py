"""Opening a pipeline's sources: each at build, and deferred ones ahead of the steps that read them.

`open_sources` opens each source of a config, packed (its plan computed or taken from the
cache), with a seed of its own. A pipeline built from its source record
(`forge_grain.sources.deferred`) opens each source when a batch first reads it: about a
millisecond a source, paid by whichever batch gets there first. The steps to come are
known (the mixture says which source every row comes from), so a background thread opens
the sources of the next steps, in the order the steps read them, while the caller builds
its model or trains. It only moves work earlier: an open is the same full open, under the
same lock, and a source that fails to open stops the opener and is left for the batch
that reads it to report."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import threading
import weakref

import numpy as np

from forge_grain.packing.kernels.cache import warm_up
from forge_grain.paths import is_url
from forge_grain.pipeline.config import DataConfig
from forge_grain.processes import EXITING, stop_at_exit
from forge_grain.sources.deferred import SourceRecords, source_key
from forge_grain.sources.factory import fitted_args, open_source

AHEAD = 256  # steps the opener runs ahead of the last step made
OPENING = 16  # sources in object storage opened at once at a build
_IDLE_S = 1.0  # how often a waiting opener checks that its pipeline still exists
_NOTHING = contextlib.nullcontext()


def open_sources(config: DataConfig, shard_index: int, shard_count: int, cache_dir, plan_workers: int | None, layout,
                 tokenize_threads: int | None, progress: bool) -> list:
    """Each source's packed rows; stored sources whose files match their record are
    deferred (opened when first read; see `forge_grain.sources.deferred`)."""
    c = config
    remote = any(s.path is not None and is_url(s.path) for s in c.sources)
    warming = warm_up() if remote else None  # numba set up while the stores open over the network
    try:
        seeds = [source_seed(c.seed, s.name) for s in c.sources]
        keys = [source_key(s, c.seq_len, seed, c.plan_chunk_docs, c.max_segments_per_row)
                for s, seed in zip(c.sources, seeds)]
        records = SourceRecords(keys, cache_dir) if any(k is not None for k in keys) else None
        eager = None
        if any(s.hf_dataset is not None and not s.hf_streaming for s in c.sources):
            from forge_grain.preparation.hf_cache import eager_store as eager

        def open_one(j: int):
            return open_source(c.sources[j], c.seq_len, seeds[j], shard_index, shard_count, cache_dir,
                               c.plan_chunk_docs, plan_workers, records, keys[j], c.max_segments_per_row, layout,
                               tokenize_threads, progress, eager_store=eager)

        remote = [j for j, s in enumerate(c.sources) if keys[j] is None and s.path is not None and is_url(s.path)]
        opened = dict(zip(remote, opened_together(open_one, remote))) if len(remote) > 1 else {}
        opened = [opened[j] if j in opened else open_one(j) for j in range(len(c.sources))]
        if records is not None:
            records.save()
    finally:
        if warming is not None:  # (also when an open fails: no thread outlives the build)
            warming.join()
    return opened


def opened_together(open_one, sources: list[int]) -> list:
    """`open_one(j)` of each source `j` in object storage, `OPENING` at once: each open waits
    on a few requests (a manifest, an index), and one after another a mixture of 8 sources
    behind a 30 ms link took 1.2 s to build. A failed open raises (the first in source order)
    once the others are done."""
    threads = min(OPENING, len(sources))
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="forge-grain-open") as pool:
        futures = [pool.submit(open_one, j) for j in sources]
    return [f.result() for f in futures]


def pack_args(config: DataConfig, cache_dir, plan_workers: int | None, progress: bool) -> list[dict]:
    """What each source is packed with (`pack`'s arguments), for the other lengths of a
    `seq_lens` schedule (`forge_grain.packing.lengths`)."""
    c = config
    return [dict(strategy=s.strategy, cache_dir=cache_dir, chunk_docs=c.plan_chunk_docs, plan_workers=plan_workers,
                 max_segments=c.max_segments_per_row, progress=progress, **fitted_args(s)) for s in c.sources]


def source_seed(seed: int, name: str) -> int:
    """Each source shuffles differently, and adding a source does not change the others."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "little")


class AheadOpener:
    """The background opener of one pipeline's deferred sources."""

    def __init__(self, pipeline, first_step: int = 0):
        self._pipeline = weakref.ref(pipeline)
        self._pending = {i for i, d in enumerate(pipeline.datasets) if not getattr(d, "is_open", True)}
        self._made = first_step  # the consumer's position: the last step made, or where it will start
        self._busy = 0  # batches being made
        self._wake = threading.Condition()
        self.thread = threading.Thread(target=self._run, args=(first_step,), name="forge-grain-opener", daemon=True)
        if self._pending and first_step < pipeline.step_limit:
            # the kernels the thread calls are loaded here first: a process forked while the thread
            # loaded one would wait forever on numba's lock (opens are covered: see packed._OPENING)
            pipeline.order.shard_sources(first_step)
            self.thread.start()
            stop_at_exit(self.thread)  # not left inside a native open while the interpreter exits

    def making(self, step: int):
        """The consumer makes `step` inside this: the opener keeps within `AHEAD` steps of it, and
        pauses meanwhile (two threads opening at once, under one lock and the GIL, were slower
        than one: the opener only fills the time between batches). Once every source is open,
        nothing (no generator made every step)."""
        if not (self._pending and self.thread.is_alive()):
            return _NOTHING
        return self._making(step)

    @contextlib.contextmanager
    def _making(self, step: int):
        with self._wake:
            self._made = step
            self._busy += 1
        try:
            yield
        finally:
            with self._wake:
                self._busy -= 1
                self._wake.notify()

    def _run(self, step: int) -> None:
        while self._pending:
            step = self._wait(step)
            pipeline = self._pipeline()
            if step is None or pipeline is None or step >= pipeline.step_limit:
                return
            sources, _ = pipeline.order.shard_sources(step)
            first = np.unique(sources, return_index=True)[1]
            for i in sources[np.sort(first)].tolist():  # in the order the step reads them
                if i in self._pending and self._wait(step) is not None and not EXITING.is_set():
                    self._pending.discard(i)
                    try:
                        pipeline.datasets[i].open()
                    except Exception:  # noqa: BLE001 -- the batch that reads it opens it again and reports it
                        return  # a record that disagrees with its store: leave the rest to the reads
            del pipeline
            step += 1

    def _wait(self, step: int) -> int | None:
        """The step to open for next, once no batch is being made and it is within `AHEAD`; None
        when the pipeline is gone."""
        with self._wake:
            while self._busy or step > self._made + AHEAD:
                if EXITING.is_set() or (not self._wake.wait(_IDLE_S) and self._pipeline() is None):
                    return None
            return max(step, self._made)  # fallen behind: no use opening what was already read
