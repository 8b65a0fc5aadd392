"""A file's sampled content fingerprint, gathered from the blocks an epoch reads anyway
(and, for a LitData chunk indexed from its head, `mirror_parts`, taken from its copy when an
epoch first reads it: `Prints.give`).

Under a `cache_limit`, a Megatron or raw token file at a URL is read in blocks of whole
documents (`mirror_ranges`). Its content fingerprint (`checks.content_fingerprint`: 32
blocks of 4 KiB and 2,048 probes of 8 bytes at places spread over the file) took some
2,000 ranged GETs at the first open, most of that open's time: behind a local S3 server,
5 s of an 8 s epoch. The blocks an epoch downloads hold every one of those places, so the
fingerprint is taken from them as they arrive (`Harvest.take`); where it is asked for
first (a state saved, a worker started, a resume checked), the places not seen yet are
read then (`ranges`), in ranged GETs as before. Either way the bytes hashed are the
file's own, in the formula's order: the same fingerprint as a local copy's, so a state
resumes here and there alike.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from pathlib import Path

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.processes import per_process
from forge_grain.stores import checks
from forge_grain.stores.document_ranges import merged

log = logging.getLogger(__name__)
PRINTS = "prints.json"  # the content fingerprints gathered after a dataset's record was made
# places in an object closer than this are read in one ranged GET (a request costs what some
# 100s of KB take to arrive), while the bytes between add at most a fiftieth of the object
GAP = 1 << 18
RANGE = 1 << 20  # bytes of a range read for a fingerprint's places, at most


class Harvest:
    """The bytes a sampled fingerprint of a file of `size` bytes hashes, gathered from any
    ranges of the file (blocks partition it: a place may lie across two of them). The places
    are two arrays, the bytes seen a dict by place: a few hundred KB a file at most, freed
    once its fingerprint is taken."""

    def __init__(self, size: int):
        self.size = size
        blocks, probes = checks.sampled_places(size)
        spans = np.array(sorted(set(blocks + probes)), np.int64).reshape(-1, 2)
        self._a, self._b = spans[:, 0], spans[:, 1]
        self._pieces: dict[int, dict[int, bytes]] = {}  # place -> {start: bytes} of the parts seen
        self._whole: dict[int, bytes] = {}

    @property
    def complete(self) -> bool:
        return len(self._whole) == len(self._a)

    def missing(self) -> list[tuple[int, int]]:
        """The places not seen whole yet, as [start, end) pairs."""
        return [(int(self._a[i]), int(self._b[i])) for i in range(len(self._a)) if i not in self._whole]

    def ranges(self) -> list[tuple[int, int]]:
        """The places not seen yet, as the ranges to read them in (`frugal`)."""
        return frugal(self.missing(), self.size, RANGE)

    def take(self, start: int, data) -> None:
        """Bytes `data` (a buffer) of the file from byte `start`: the parts of places they hold."""
        view = memoryview(data).cast("B")
        end = start + view.nbytes
        first = int(np.searchsorted(self._a, start - checks.SAMPLE_BLOCK_BYTES))
        for i in range(first, int(np.searchsorted(self._a, end))):
            a, b = int(self._a[i]), int(self._b[i])
            if b <= start or i in self._whole:
                continue
            lo, hi = max(a, start), min(b, end)
            parts = self._pieces.setdefault(i, {})
            parts[lo] = bytes(view[lo - start : hi - start])
            whole = _joined(parts, a, b)
            if whole is not None:
                self._whole[i] = whole
                del self._pieces[i]

    def fingerprint(self) -> str:
        """`checks.content_fingerprint(file)` (sampled), once every place is seen."""
        if not self.complete:
            raise ValueError(f"{len(self.missing())} places of the fingerprint are not seen yet")
        seen = {(int(self._a[i]), int(self._b[i])): data for i, data in self._whole.items()}
        return checks.fingerprint_of(self.size, False, None, lambda spans: lambda a, n: seen[(a, a + n)])


def frugal(spans, size: int, most: int) -> list[tuple[int, int]]:
    """[a, b) `spans` of an object of `size` bytes, sorted, those close together (`GAP`) in one
    span of at most `most` bytes, so long as the bytes between them add at most a fiftieth of
    the object: the places an epoch reads anyway are not fetched twice over (a fingerprint's
    2,048 probes lie a 2,048th of the file apart: joined, they were the file)."""
    spans = list(spans)
    return merged(spans, min(GAP, size // (50 * max(1, len(spans)))), most)


def _joined(parts: dict[int, bytes], a: int, b: int) -> bytes | None:
    """Bytes [a, b) from `parts` ({start: bytes}, which may overlap: a place's end seen in one
    block, then the place read whole by `ranges`), or None while some are not seen."""
    out, at = bytearray(), a
    for lo in sorted(parts):
        if lo > at:
            return None
        out += parts[lo][at - lo :]
        at = max(at, lo + len(parts[lo]))
    return bytes(out[: b - a]) if at >= b else None


class Prints:
    """The content fingerprints of a dataset's files at a URL, by name: those its record
    holds (`known`, None where one waits for the data), or gathered (`Harvest`) and then kept
    in `path` (`write(path, bytes, upcoming)`: the cache's own record write), so a later open
    has them."""

    def __init__(self, names: list[str], known: list, sizes: dict, path: Path, write):
        saved = _saved(path, names) if None in known else {}
        self.names, self.path, self._write = names, path, write
        self._prints = {n: p or saved.get(n) for n, p in zip(names, known)}
        self._sizes = {n: sizes[n] for n, p in self._prints.items() if p is None}  # files whose print waits
        self._harvests: dict[str, Harvest] = {}  # ... and what they have seen (made at their first block)

    @per_process
    def _lock(self):
        return threading.Lock()

    @property
    def known(self) -> bool:
        return not self._sizes

    def _harvest(self, name: str) -> Harvest:
        if name not in self._harvests:
            self._harvests[name] = Harvest(self._sizes[name])
        return self._harvests[name]

    def values(self) -> list[str]:
        return [self._prints[n] for n in self.names]

    def take(self, name: str, start: int, data, keep=frozenset()) -> bool:
        """Bytes of file `name` from byte `start` have arrived: True once every print is known."""
        with self._lock:
            if name not in self._sizes:
                return self.known
            h = self._harvest(name)
            h.take(start, data)
            if h.complete:
                self._settle([name], keep)
            return self.known

    def waits(self, name: str) -> bool:
        """Whether file `name`'s print is still to be taken."""
        return name in self._sizes

    def give(self, name: str, value: str, keep=frozenset()) -> bool:
        """File `name`'s print, taken whole from its copy (a file read whole, `mirror_parts`):
        True once every print is known."""
        with self._lock:
            if name in self._sizes:
                self._prints[name] = value
                del self._sizes[name]
                self._kept(keep)
            return self.known

    def complete(self, read, keep=frozenset()) -> None:
        """Every print, reading the places not seen yet (`read(name, spans)`: their bytes)."""
        with self._lock:
            names = list(self._sizes)
            for name in names:
                h = self._harvest(name)
                spans = h.ranges()
                for (a, _), data in zip(spans, read(name, spans)):
                    h.take(a, data)
            self._settle(names, keep)

    def _settle(self, names: list[str], keep) -> None:
        for name in names:
            self._prints[name] = self._harvests.pop(name).fingerprint()
            del self._sizes[name]
        self._kept(keep)

    def _kept(self, keep) -> None:
        """Every print known: kept in `path` for later opens."""
        if not self.known:
            return
        try:  # (kept once, all together; a cache too full to hold it: the next open gathers them again)
            self._write(self.path, json.dumps(self._prints).encode(), keep)
        except (StoreError, OSError) as e:
            log.info("forge-grain: %s not kept (%s)", self.path, e)


def _saved(path: Path, names: list[str]) -> dict:
    """The prints a process kept at `path`, those of `names` that look like one (anything else
    is gathered again)."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict):
        return {}
    return {n: p for n, p in saved.items() if n in names and isinstance(p, str) and _HEX.fullmatch(p)}


_HEX = re.compile(r"[0-9a-f]{64}")
