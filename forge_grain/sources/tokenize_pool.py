"""Tokenizing streamed documents in parallel, results taken in order.

A streaming source tokenizes as it reads; one thread tokenizes ~0.8 M tokens/s here, the
limit of the whole stream. `TokenizePool` encodes batches of texts on `size` threads and
hands results back in the order they were submitted, so the packed rows are the same
whatever the pool size (tested for 1, 2 and 4). Threads, not processes: Rust tokenizers
release the GIL while encoding, so threads scale with cores without pickling texts and
ids between processes (`benchmarks/bench_hf.py` measures both).

The tokenizer's own batch parallelism (Rayon) would compete with the pool's threads for
the same cores; the pool turns it off with `TOKENIZERS_PARALLELISM=false` unless that
variable is already set (it also keeps forked DataLoader workers from the tokenizer's
fork warning).
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Callable

import numpy as np

from forge_grain.processes import per_process, usable_cores

BATCH = 32  # texts a task encodes: small enough to spread a window over the threads


def default_size() -> int:
    """One thread per core this process may use."""
    return usable_cores()


class TokenizePool:
    """`submit(texts)` returns a handle whose `result()` is `encode(texts)`, computed on the
    pool's threads in batches of `BATCH`; size 0 encodes in the caller's thread, on `result()`."""

    def __init__(self, encode: Callable[[list], list[np.ndarray]], size: int | None = None):
        self.encode = encode
        self.size = default_size() if size is None else size
        if self.size < 0:
            raise ValueError(f"tokenize pool size must be >= 0, got {self.size}")
        if self.size:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    @per_process
    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        """This process's threads: a forked child (a DataLoader worker) inherits the parent's
        executor without its threads, and work submitted there would wait forever."""
        return concurrent.futures.ThreadPoolExecutor(self.size, thread_name_prefix="forge-grain-tok")

    def submit(self, texts: list) -> "Encoded":
        if not self.size:
            return Encoded([], lambda: self.encode(texts))
        pool = self._threads
        return Encoded([pool.submit(self.encode, texts[i : i + BATCH]) for i in range(0, len(texts), BATCH)])

    def map(self, batches, ahead: int = 4):
        """`encode` of each batch of an iterable, in order, up to `ahead` batches in flight."""
        pending = []
        for texts in batches:
            pending.append(self.submit(texts))
            if len(pending) > ahead:
                yield pending.pop(0).result()
        for p in pending:
            yield p.result()

    def close(self) -> None:
        executor = TokenizePool._threads.made(self)
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
            TokenizePool._threads.forget(self)

    def __getstate__(self):  # a copy in another process makes its own threads
        return {"encode": self.encode, "size": self.size}

    def __setstate__(self, state):
        self.__init__(state["encode"], state["size"])


class Encoded:
    """The pending encoding of one submission."""

    def __init__(self, futures: list, inline: Callable | None = None):
        self._futures, self._inline = futures, inline

    def result(self) -> list:
        if self._inline is not None:
            return self._inline()
        return [doc for f in self._futures for doc in f.result()]
