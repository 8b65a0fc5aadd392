"""A step's documents read in ranges while the shards holding them are still downloading.

A step of a global shuffle reads a few documents from each of dozens of shards: the first
batch of a 128-shard store (shards of 3.1 MB) waited for 35 whole shards, 108 MB, to deliver
its 128 KB. While the shards a step reads are still arriving, `RemoteStore.read_ranges`
reads the token spans its rows take in ranged GETs instead (spans closer than `GAP` in one),
and the downloads go on for the steps after.

A range is not checked as it arrives (the manifest has a sha256 a shard, not a range): its
own sha256 is kept and compared with the shard's bytes once the shard's download, checked
against the manifest, lands; a range that differs is an error naming the object (it was
replaced while it was read), held by the download's future: raised by the next step that
reads the shard, or by the next change of the hints (`RemoteStore.prefetch`). The reads
are for the first batch only, and only where they cost less than the wait:
- only the first step of a window of prefetch hints that starts afresh (an iterator made, a
  state restored, a jump: `FetchWindow` says which step, as `first`): once downloads arrive,
  the prefetch is what keeps steps fed (where every step waiting read ranges, up to the
  budget, they held the downloads back: the epoch ran 0.8x as fast on 2 cores);
- only for shards whose downloads are under way (a prefetch asked for them: each lands, and
  its ranges are compared then);
- only in fewer requests than the downloads would take (a request a `REQUEST_BYTES` of the
  shards waited for) and fewer than 1/`RATIO` of their bytes: a step of a window order, which
  reads 30 documents of one or two shards, waits for them (in ranges its first batch took
  1.0 s behind a 30 ms link on 2 cores, against 0.6 s);
- at most `SHARE` of the store's bytes a process (and `MOST`): an epoch fetches at most that
  much more than the store;
- not under a `cache_limit`: its order reads few shards at once, and a prefetch there may be
  skipped for room, which would leave a range unchecked.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np

from forge_grain.errors import StoreError
from forge_grain.stores.object_cache import read_at_once
from forge_grain.stores.remote_dir import changed_under

SHARE = 0.01  # of the store's bytes, the most a process reads in ranges ahead of downloads ...
MOST = 64 << 20  # ... and at most this many bytes
RATIO = 16  # shards arriving must hold this many times the bytes a step needs of them ...
REQUEST_BYTES = 1 << 20  # ... and a download's request for each of the step's ranged GETs
# spans of one shard closer than this are read in one GET (they are read all at once, so joining
# saves requests, not time; joined, the bytes between count against the budget)
GAP = 1 << 12


def merged(spans, gap: int = GAP, most: int | None = None) -> list[tuple[int, int]]:
    """Byte spans [a, b), sorted, and joined where they overlap or lie within `gap` (into spans
    of at most `most` bytes, if given)."""
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1] + gap and (most is None or max(out[-1][1], b) - out[-1][0] <= most):
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def token_spans(got: dict[int, list], spans: dict[int, list], keys, dtype) -> dict[int, list[np.ndarray]]:
    """Each of `keys` (shards, blocks) -> the tokens of each of its `spans` (token [a, b)), in
    order, viewed in the bytes read (`got`: key -> [(a, b, bytes)], byte spans holding them)."""
    dtype = np.dtype(dtype)
    item, out = dtype.itemsize, {}
    for k in keys:
        at = [next(r for r in got[k] if r[0] <= a * item and b * item <= r[1]) for a, b in spans[k]]
        out[k] = [np.frombuffer(d, dtype, b - a, a * item - ja) for (a, b), (ja, _, d) in zip(spans[k], at)]
    return out


def read_joined(cache, joined: dict[int, list], where, conditions=None) -> dict[int, list]:
    """Byte spans of shards or token arrays (`joined`: key -> [(a, b)]) read at once, each of
    the object `where(k)` names from the byte it gives: key -> [(a, b, bytes)].
    `conditions`: `read_at_once`'s, by object."""
    order = [(k, a, b) for k, s in joined.items() for a, b in s]
    at = {k: where(k) for k in joined}
    data = read_at_once(cache, [(at[k][0], at[k][1] + a, at[k][1] + b) for k, a, b in order], conditions)
    got: dict[int, list] = {}
    for (k, a, b), d in zip(order, data):
        got.setdefault(k, []).append((a, b, d))
    return got


class DocumentRanges:
    """One process's ranged reads of a store's shards ahead of their downloads: what is left
    of its budget, and the sha256 of each range not yet compared with its shard."""

    def __init__(self, store_bytes: int, url: str):
        self.left, self.url = min(int(store_bytes * SHARE), MOST), url
        self.first: int | None = None  # the step a window of hints starts afresh at
        self._lock = threading.Lock()
        self._unchecked: dict[int, list] = {}  # shard -> [(a, b, sha256 of the bytes read)]
        self._landed: set[int] = set()  # shards whose checked copy has arrived

    @property
    def landed_shards(self) -> set[int]:
        """Shards whose downloads have landed in this process (their futures may be gone)."""
        return self._landed

    def may(self, step: int | None) -> bool:
        """Whether step `step` may read ranges at all: the first of a fresh window of hints,
        with budget left (asked before its spans are found, which a waiting step pays for)."""
        return step is not None and step == self.first and self.left > 0

    def take(self, spans: dict[int, list], arriving: int, step: int | None) -> dict[int, list] | None:
        """The byte spans (shard -> [(a, b)]) step `step` reads of shards of `arriving` bytes,
        still downloading, joined as they would be read (`merged`), if it reads them in ranges
        now (their bytes then taken from the budget); None: it waits for the downloads."""
        joined = {k: merged(s) for k, s in spans.items()}
        nbytes = sum(b - a for s in joined.values() for a, b in s)
        requests = sum(len(s) for s in joined.values())
        with self._lock:
            if (not self.may(step) or arriving < RATIO * nbytes or arriving < REQUEST_BYTES * requests
                    or nbytes > self.left):
                return None
            self.left -= nbytes
            return joined

    def read(self, cache, joined: dict[int, list], name_of, copy_of) -> dict[int, list]:
        """Byte spans of shards (`joined`: shard -> [(a, b)], from `take`), read at once:
        shard -> [(a, b, bytes)]. `name_of(k)`: the shard's object; `copy_of(k)`: the path of
        its checked copy, where it landed meanwhile (the ranges are compared with it now)."""
        got = read_joined(cache, joined, lambda k: (name_of(k), 0))
        records = {k: [(a, b, hashlib.sha256(d).digest()) for a, b, d in reads] for k, reads in got.items()}
        with self._lock:
            now = [k for k in records if k in self._landed]
            for k in records:
                if k not in self._landed:
                    self._unchecked.setdefault(k, []).extend(records[k])
        for k in now:
            self._compare(copy_of(k), records[k], name_of(k))
        return got

    def landed(self, k: int, path, name: str) -> None:
        """Shard `k`'s checked copy is at `path`: the ranges read of it before are compared."""
        with self._lock:
            self._landed.add(k)
            records = self._unchecked.pop(k, None)
        if records:
            self._compare(path, records, name)

    def _compare(self, path, records, name: str) -> None:
        with open(path, "rb") as f:
            for a, b, digest in records:
                f.seek(a)
                if hashlib.sha256(f.read(b - a)).digest() != digest:
                    raise StoreError(f"{changed_under(f'{self.url}/{name}')} (its bytes {a}-{b}, read in a "
                                     "ranged GET before its download, differ from the download, which matches "
                                     "the manifest's sha256)")
