"""Reusing batch memory: fresh pages for every batch cost more than filling them.

A batch of 64 rows of 2048 tokens is a few MB; allocating it anew each step makes the
kernel page-fault on every page it writes (about a thousand faults per batch here), which
can cost more than the gather itself. `BufferPool` hands out blocks that no live array
uses any more: every array of a batch is a view of one block, a view keeps its block
alive, so a block whose only references are the pool's is free to refill. Nothing a
caller still holds (directly, through a torch tensor from `from_numpy`, or a slice) is
ever overwritten.
"""

from __future__ import annotations

import functools
import math
import sys
import threading

import numpy as np

_ALIGN = 64


class BufferPool:
    """Up to `max_blocks` reusable byte blocks; thread-safe."""

    def __init__(self, max_blocks: int = 8):
        self.max_blocks = max_blocks
        self._blocks: list[np.ndarray] = []
        self._lock = threading.Lock()

    def block(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for b in self._blocks:
                # references: the list, the loop variable, getrefcount's argument
                if b.nbytes == nbytes and sys.getrefcount(b) == 3:
                    return b
            b = np.empty(nbytes, np.uint8)
            if len(self._blocks) >= self.max_blocks:
                self._blocks.pop(0)
            self._blocks.append(b)
            return b

    def arrays(self, specs: tuple) -> dict[str, np.ndarray]:
        """Arrays of the given (key, shape, dtype) `specs`, all views of one free block."""
        nbytes, layout = _layout(specs)
        block = self.block(nbytes)
        return {key: np.ndarray(shape, dtype, buffer=block, offset=off) for key, off, shape, dtype in layout}

    def __getstate__(self):
        return {"max_blocks": self.max_blocks}

    def __setstate__(self, state):
        self.__init__(state["max_blocks"])


_COUNT = np.arange(4096, dtype=np.int64)


def count(n: int, start: int = 0) -> np.ndarray:
    """np.arange(start, start + n) (int64), every step's row places and numbers, from a range
    made once: `np.arange` lets go of the interpreter's lock to fill even eight numbers (an
    addition over fewer than 500 keeps it), and a reader sharing the lock with busy threads
    waits to take it back: 430 us a call beside two threads running Python, against 0.3 us."""
    return np.add(_COUNT[:n], start) if n <= len(_COUNT) else np.arange(start, start + n, dtype=np.int64)


@functools.lru_cache(maxsize=64)
def _layout(specs: tuple) -> tuple[int, tuple]:
    """The bytes of a block holding `specs`' arrays, and where each lies in it (found once
    per batch shape: laying it out every batch was a third of handing a batch its memory)."""
    layout, offset = [], 0
    for key, shape, dtype in specs:
        dtype = np.dtype(dtype)
        layout.append((key, offset, shape, dtype))
        offset += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    return offset, tuple(layout)
