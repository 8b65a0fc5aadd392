"""Iterating a pipeline's batches: in this thread, ahead in threads, or in Grain's worker processes.

`PipelineIterator` is the Grain `DatasetIterator` over one shard's batches from a step; its
state is the pipeline's state at the next step. How batches are made ahead (threads, or
`mp_prefetch` processes) changes neither the batches nor the state. This module owns the
threads and processes it starts, and stops them: on `close`, on `set_state`, and at exit
(before interpreter teardown, while the modules Grain's finalizers use are still there).
It never decides which rows a step trains: every batch is `Pipeline.batch(step)`.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import sys
import weakref

import grain
import numpy as np

from forge_grain.pipeline.config import ConfigError
from forge_grain.pipeline.live import adopting

# Iterators whose worker processes are running: closed at exit, while the modules Grain's
# finalizers use are still there (left to interpreter teardown, each shared-memory batch and
# queue prints "Exception ignored ... AttributeError" and the workers' memory is reported leaked)
_WITH_WORKERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_workers() -> None:
    for it in list(_WITH_WORKERS):
        it.close()


class PipelineIterator(grain.DatasetIterator):
    """Iterates this shard's batches from a step; state = {step, fingerprint}."""

    def __init__(self, pipeline, step: int = 0):
        super().__init__()
        self.pipeline = pipeline
        self._step = step
        if pipeline.positions is not None and pipeline.positions.step != step:
            pipeline.seek(step)
        self._pool = None
        self._mp_iter = None
        self._fetch_first()

    def _fetch_first(self) -> None:
        """Start downloading the shards of the first steps of sources in object storage now: an
        iterator is made to be read, and the trainer's own setup (model, compilation) then hides
        the downloads. (A pipeline built only to describe or explain the run downloads nothing.)"""
        p = self.pipeline
        if p.fetching.active and p.worker_count == 0 and self._step < p.step_limit:
            p.fetching.advance(self._step)

    def __next__(self) -> dict:
        p = self.pipeline
        if self._step >= p.step_limit:  # the run's last step (or the last the arithmetic reaches)
            raise StopIteration
        if p.worker_count > 0:
            # out of Grain's shared memory into arrays the caller owns: a batch a caller keeps
            # (to exit) then pins no segment of /dev/shm, nor finalizes one after its modules
            batch = {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in next(self._processes()).items()}
        elif p.num_threads > 0:
            batch = self._threads().pop_next()
        else:
            batch = p.batch(self._step)
        self._step += 1
        return batch

    def _threads(self):
        if self._pool is None:
            self._pool = _ThreadPrefetch(self.pipeline, self._step)
        return self._pool

    def _processes(self):
        if self._mp_iter is None:
            from forge_grain.absl_flags import ensure_absl_flags_parsed

            ensure_absl_flags_parsed()
            p = self.pipeline
            end = p.num_steps if p.num_steps is not None else sys.maxsize
            # one thread per worker process: Grain's default (16 threads, 500 elements ahead)
            # would hold hundreds of whole batches in each worker
            read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=max(p.prefetch, 1))
            ds = grain.MapDataset.range(self._step, end).map(p.batch).to_iter_dataset(read)
            self._mp_iter = iter(ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=p.worker_count)))
            _WITH_WORKERS.add(self)
        return self._mp_iter

    def get_state(self) -> dict:
        return self.pipeline.state_at(self._step)

    def set_state(self, state: dict) -> None:
        self.pipeline = adopting(self.pipeline, state)  # a state with weights set live
        step = self.pipeline.check_state(state)
        self.close()
        self.pipeline.seek(step, state.get("streams"))
        self._step = step
        self._fetch_first()

    def set_weights(self, weights, at_step: int | None = None) -> None:
        """Mix with `weights` (by source name, or a list in source order) from step `at_step`
        on (default: the next batch's), without repeating or skipping a row: see
        `Pipeline.with_weights`. Every rank must call it with the same arguments; the states
        then record the change, and a checkpoint names ranks that made another."""
        at = self._step if at_step is None else at_step
        if isinstance(at, int) and not isinstance(at, bool) and at < self._step:
            raise ConfigError(f"set_weights at step {at}: this iterator already gave step {self._step - 1}; "
                              f"change the weights at step {self._step} or later")
        changed = self.pipeline.with_weights(weights, at)
        self.close()  # batches made ahead with the old weights (steps before `at` are the same in both)
        self.pipeline = changed
        self._fetch_first()

    @property
    def step(self) -> int:
        """The step of the next batch."""
        return self._step

    def close(self, _finalizing=sys.is_finalizing) -> None:
        # bound at definition: at interpreter exit module globals such as `sys` may already be None
        if _finalizing():  # called from __del__ at exit: threads and processes are going anyway
            return
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._mp_iter is not None:
            getattr(self._mp_iter, "close", lambda: None)()
            self._mp_iter = None
            _WITH_WORKERS.discard(self)
        self.pipeline.fetching.stop()  # (its downloads ahead not yet begun: none is needed now)


class _ThreadPrefetch:
    """Batches for steps ahead of the consumer, assembled by worker threads, in order."""

    def __init__(self, pipeline, start: int):
        self.pipeline = pipeline
        self.next_submit = start
        self.executor = concurrent.futures.ThreadPoolExecutor(pipeline.num_threads, thread_name_prefix="forge-grain")
        self.futures: collections.deque = collections.deque()
        self._fill()

    def _fill(self) -> None:
        p = self.pipeline
        while len(self.futures) < max(p.prefetch, 1) and (p.num_steps is None or self.next_submit < p.num_steps):
            self.futures.append(self.executor.submit(p.batch, self.next_submit))
            self.next_submit += 1

    def pop_next(self) -> dict:
        batch = self.futures.popleft().result()
        self._fill()
        return batch

    def close(self) -> None:
        for f in self.futures:
            f.cancel()
        # wait for a batch being made: it must not run on while the pipeline is repositioned
        self.executor.shutdown(wait=True, cancel_futures=True)
