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

    def arrays(self, specs: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray]:
        """Arrays of the given shapes and dtypes, all views of one free block."""
        layout, offset = {}, 0
        for key, (shape, dtype) in specs.items():
            dtype = np.dtype(dtype)
            layout[key] = (offset, shape, dtype)
            offset += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        block = self.block(offset)
        return {
            key: np.ndarray(shape, dtype, buffer=block, offset=off) for key, (off, shape, dtype) in layout.items()
        }

    def __getstate__(self):
        return {"max_blocks": self.max_blocks}

    def __setstate__(self, state):
        self.__init__(state["max_blocks"])
