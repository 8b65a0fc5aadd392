"""Where a store's tokens are: contiguous runs of token arrays, and the lookups reads make in them.

A store's tokens, taken in order, are runs of memory-mapped arrays: one per file of raw
tokens or shard of a forge-grain store, one per Arrow record batch, LitData chunk or MDS
sample. `TokenRuns` finds a document's array and start, a range of tokens across runs, and
the tokens at given positions. It holds index arrays only, never the token arrays: every
lookup reads them through the store's `array(k)` (a store in object storage maps the
array first), so a store and its runs hold no reference cycle and its maps are freed with it.
"""

from __future__ import annotations

import bisect

import numpy as np

from forge_grain.stores import checks

MAX_BISECTED_RUNS = 1 << 16  # up to this many runs a read bisects them; beyond, a table per document
FEW_PIECES = "few"  # `_doc_start` when reads bisect the runs


class TokenRuns:
    """The runs of one store's tokens: `starts` (token start of each run, the end appended),
    `array` (each run's token array) and `base` (its start in that array)."""

    def __init__(self, starts: np.ndarray, array: np.ndarray, base: np.ndarray, offsets: np.ndarray,
                 num_arrays: int):
        self.starts, self.array, self.base = starts, array, base
        self.offsets, self.num_arrays = offsets, num_arrays
        self._doc_start = self._doc_array = None  # built on the first document read (`_index_documents`)

    @classmethod
    def of(cls, arrays: list, pieces, offsets: np.ndarray) -> "TokenRuns | None":
        """The runs of `arrays` (`pieces`: a format's (starts, array, base); None: one run per
        array, in order), or None for a store read a document at a time (no arrays)."""
        if not arrays:
            return None
        if pieces is None:
            sizes = [len(a) for a in arrays]
            starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            return cls(starts, np.arange(len(sizes), dtype=np.int64), np.zeros(len(sizes), np.int64), offsets,
                       len(arrays))
        starts, array, base = (np.asarray(x, np.int64) for x in pieces)
        return cls(starts, array, base, offsets, len(arrays))

    def document(self, i: int, array_of) -> np.ndarray:
        """Document `i` (in range), a view of its array `array_of(k)`."""
        if self._doc_start is None:
            self._index_documents()
        g, length = int(self.offsets[i]), int(self.offsets[i + 1] - self.offsets[i])
        if self._doc_start is FEW_PIECES:  # find the run: a bisection of a short list
            p = min(max(bisect.bisect_right(self._run_starts, g) - 1, 0), len(self._run_array) - 1)
            start = g - self._run_starts[p] + self._run_base[p]
            return array_of(self._run_array[p])[start : start + length]
        start = int(self._doc_start[i])
        return array_of(0 if self._doc_array is None else int(self._doc_array[i]))[start : start + length]

    def _index_documents(self) -> None:
        """How a read finds its document's array and start. One array: the offsets are the
        starts. A few runs (one per shard file, say): a bisection of their starts per read, so
        nothing per document is kept in memory. Many runs (a run per Arrow record batch or
        MDS sample): a start and an array index per document, two lookups per read."""
        starts, array, base = self.starts, self.array, self.base
        if len(array) == 1 and base[0] == 0:
            self._doc_start = self.offsets
        elif len(array) <= MAX_BISECTED_RUNS:
            self._run_starts, self._run_array, self._run_base = (x.tolist() for x in (starts, array, base))
            self._doc_start = FEW_PIECES
        else:
            p = np.searchsorted(starts, self.offsets[:-1], side="right") - 1
            p = np.minimum(p, len(array) - 1)
            self._doc_start = self.offsets[:-1] - starts[p] + base[p]
            if self.num_arrays > 1:
                self._doc_array = array[p].astype(np.int32)

    def tokens(self, a: int, b: int, array_of, dtype) -> np.ndarray:
        """Tokens [a, b) of the store's tokens in order (may span runs)."""
        starts, array, base = self.starts, self.array, self.base
        parts = []
        p = int(np.searchsorted(starts, a, side="right") - 1)
        while a < b and p < len(array):
            end = min(b, int(starts[p + 1]))
            if end > a:
                at = a - int(starts[p]) + int(base[p])
                parts.append(array_of(int(array[p]))[at : at + end - a])
            a = max(a, end)
            p += 1
        return np.concatenate(parts) if parts else checks.empty_tokens(dtype)

    def at(self, positions, array_of, dtype) -> np.ndarray:
        """Tokens at the given positions of the store's tokens in order."""
        positions = np.asarray(positions, np.int64)
        starts, array, base = self.starts, self.array, self.base
        p = np.searchsorted(starts, positions, side="right") - 1
        out = np.empty(len(positions), dtype)
        for a in np.unique(array[p]):
            sel = array[p] == a
            out[sel] = array_of(int(a))[positions[sel] - starts[p[sel]] + base[p[sel]]]
        return out
