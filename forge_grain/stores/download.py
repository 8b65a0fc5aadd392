"""One object copied into the cache directory (`ObjectCache.get`'s work): its bytes read in
ranged parts on the process's request threads into a temporary name, reserved against
`cache_limit` first, checked (size, sha256, version), then renamed.

A prefetch that does not fit the cache whole is fetched as far as it fits and finished
when there is room (`room_ahead.Partial`): its rest, up to `STAGED` bytes, is read into
memory meanwhile and written then; a larger rest is asked for as soon as the room is there.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import mmap
import os
import threading
import time
from pathlib import Path

from forge_grain.errors import StoreError
from forge_grain.files import start_writeback, temporary
from forge_grain.stores.room_ahead import GROW_POLL_S
from forge_grain.stores.remote_dir import Damaged, check_unchanged
from forge_grain.stores.request_pool import read_slot

BLOCK = 1 << 23  # the most bytes one ranged read asks for (and holds in memory)
# an object is read in as many ranged parts as there are reads in flight (SPLIT at least), each of
# PART_MIN to BLOCK bytes: the shard a batch waits for arrives on every connection at once (a 24.7 MB
# shard behind a 10 MB/s-a-connection link: its first batch 1.16 s after the request, 1.79 s in parts
# of 4 MiB), and a large one in parts that each hold little memory. An object fetched ahead, which
# nothing waits for, is read in parts of at least PART_AHEAD while many are in flight: fewer requests,
# less CPU a byte. A 128-shard store of 3 MB shards behind 2 MB/s a connection (`bench_scale.py
# --link`), first batch and core-seconds a GB: every part of at least 256 KiB 0.79 s and 7.6 (LitData
# 6.1 in that run); parts ahead of at least 1 MiB 1.14 s and 6.2 (LitData 5.6)
# An object fetched ahead while few are in flight is cut finer, into parts of PART_LONE at least: a
# 16-shard store read under a cache_limit of 2 shards (one shard downloading at a time) behind 30 ms
# and 10 MB/s a connection took 4.26-4.34 s an epoch with parts of 256 KiB (71 a shard) and 3.89-4.01 s
# with parts of 512 KiB at least; with every part of 2 MiB at least (12 a shard) 4.9-5.1 s. At 2 MB/s a
# connection, every part of 512 KiB at least read it in 10.0 s, of 256 KiB in 10.4 s
# the rest of a prefetch that does not fit the cache yet (`room_ahead.Partial`) is read into memory
# meanwhile, where it is no more than STAGED bytes, and written once there is room: at a cache_limit of
# two shards, the rest (what the store's indices take of the limit, 1.6 MB) was asked for only once
# the shard was needed, and each shard waited a round trip for it
STAGED = 1 << 24
PART_MIN = 1 << 18
PART_LONE = 1 << 19
PART_AHEAD = 1 << 20
SPLIT = 8
# an object fetched ahead is cut into parts no smaller than what one connection to its endpoint was
# lately seen to carry in PART_SECONDS (`request_pool.Carried`): each part is a request, costing CPU in
# the client and the server, and a part of 0.15 s spends a fifth of it waiting for a 30 ms first byte.
# Behind 30 ms and 10 MB/s a connection that is about 1 MB: a LitData dataset of 16 chunks of 24.7 MB
# under a cache_limit of 2 / 4 / 8 chunks' worth, on two cores shared with the server and the link,
# read its epoch in 2.90-3.02 / 2.18-2.21 / 1.99-2.18 s, against 3.2-4.1 / 2.75-3.0 / 2.1-2.6 s in parts
# of 512 KiB (the unbounded 1.96-2.01 s); a store and a Megatron file gained as much. At 2 MB/s a
# connection the parts stay those the request threads call for (a part of 0.15 s is 0.3 MB there);
# from a bucket near the host (80 MB/s a connection) they reach BLOCK
PART_SECONDS = 0.15
# under a cache_limit, the next file is fetched beside the reader the whole epoch, so the reads that
# measure the link are all timed on a busy CPU, and a read's time counts its wait for the first byte:
# the smaller the parts, the less a connection is seen to carry, so the smaller the next. A LitData
# dataset at 2 chunks' worth (two cores shared with the server, 30 ms and 10 MB/s a connection) fell
# to parts of 0.57-0.8 MB, 500-780 GETs an epoch against 410 unbounded, and rounds at 0.73-0.80x the
# unbounded rate. There a part fetched ahead is at least BUSY_READS times what a connection carried
# (up to PART_AHEAD): 417 GETs, and 0.91-0.96x against 0.83-0.97x in the same runs. A link that binds
# (2 MB/s a connection) carries about a quarter of a MiB in PART_SECONDS, twice that about PART_LONE:
# its parts stay about as they were (734 GETs against 769, 0.99x both); a flat floor of PART_AHEAD
# there left threads idle that the link needed (0.76-0.81x)
BUSY_READS = 2
# under a cache_limit, a part fetched ahead is at least cache_limit / (IN_FLIGHT * request threads):
# with a part on every thread, 1 / IN_FLIGHT of the cache is in flight, and the rest holds the window
# being read and the blocks arrived. Behind 30 ms and 10 MB/s a connection, at a limit of 8 files'
# worth (198 MB), a 16-shard store took 266 GETs an epoch instead of 410 and read it in a median
# 1.99 s instead of 2.33 (4 rounds, each faster); a Megatron file 289 GETs instead of 448, 2.01 s
# instead of 2.26. At 2 and 4 files' worth the share is below what a connection carries: unchanged.
# Never more than ROOM_PARTS parts of PART_SECONDS (0.6 s of a connection): the pool starts with
# few threads, so a large share, and a Megatron file's first epoch at 4 files' worth behind 2 MB/s a
# connection took 6.1 s in parts of up to 1.5 s, against 5.1 s so bounded (4.3-4.5 s once the
# threads had grown)
IN_FLIGHT = 2
ROOM_PARTS = 4


class Download:
    """Object `name` (or its `size` bytes from `start`) copied to `local` in `cache`; see
    `ObjectCache.get` for the arguments (`keep`: a function giving the copies the next steps
    read)."""

    def __init__(self, cache, name: str, local: Path, sha256: str | None, size: int | None, keep, ahead: bool,
                 job: int | None, start: int, tag: str | None, guessed: bool = False):
        self.cache, self.name, self.local, self.sha256, self.size = cache, name, local, sha256, size
        self.guessed = guessed  # `size` is what the object should hold, not what the store said: see `_attempt`
        self.keep, self.ahead, self.job, self.start, self.tag = keep, ahead, job, start, tag
        self.tmp = temporary(local)
        self.whole: list = []  # an object got in one GET before its size was known
        self.partial = None
        # the parts' writes into the file, one at a time: ext4 (and xfs) let one buffered write into a
        # file run at a time, and the other writers spin on its lock while it copies, each on a core of
        # its own; here they sleep. 16 threads writing one file in 512 KiB parts on 2 cores: 19% of the
        # samples (`perf`) were that spin, none with this lock (kernel time 0.16-0.20 s -> 0.13-0.15 s
        # for 400 MB). A 2-core epoch from a shaped link is unchanged (one other core to spin on); the
        # spin grows with the cores running request threads at once
        self.writing = threading.Lock()

    def run(self) -> bool:
        """The copy made (True), or a prefetch skipped for want of room (False)."""
        c, name = self.cache, self.name
        if self.size is None and self.sha256 is not None:  # (an index) its sha256 checks it: no HEAD first
            self.whole.append(memoryview(c.retry(name, lambda: c.read_range(name, 0))))
            self.size = self.whole[0].nbytes
        elif self.size is None:  # neither the manifest nor the listing says: ask, so a cut-off read is never taken
            self.size = c.retry(name, lambda: c.size(name))
        if c.limit is None:
            self.tmp.write_bytes(b"")
        elif not c._make_room(self.size, self.keep(), self.tmp, self.ahead):
            self.partial = c._partial(self.local, self.tmp, self.size, self.keep) if self.ahead and not self.whole \
                else None
            if self.partial is None:
                return False
        if self.ahead:
            c.turns.end(self.job)  # (its room is reserved: the prefetch needed next may take its own)
        if self.job is None:
            self.job = c.requests.job()  # its parts are read before those of any object asked for later
        self.condition = c.conditional(self.tag)  # (a rewritten object: an error at the GET, or the HEAD after)
        flight, waited = c._in_flight, not self.ahead
        with flight[0]:
            flight[1] += 1
            flight[2] += waited
        try:
            made = c.retry(name, self._attempt, bound=False)  # each ranged read is bounded
        finally:
            with flight[0]:
                flight[1] -= 1
                flight[2] -= waited
            if self.partial is not None:
                self.partial.close()
            elif self.ahead:  # (hurried while it ran: the word is spent)
                c.heard(c._name(self.local))
            if self.tmp.exists():  # a failed (or given up) download: its reservation goes with it
                c._forget(self.tmp)
        if made:
            c.downloads += 1
        return made

    def _attempt(self) -> bool:
        """One try at the whole copy. Where the size was guessed (`guessed`), an object that
        proves another size (a part cut short, a checksum that differs) is `WrongSize` at once,
        not tried again at that size."""
        try:
            return self._attempt_parts()
        except Damaged as e:
            if self.guessed:
                raise WrongSize(f"{self.cache.url}/{self.name}: not the {self.size} bytes expected ({e})") from None
            raise

    def _attempt_parts(self) -> bool:
        p, size = self.partial, self.size
        first = size if p is None else p.held
        self.spans, self._reads = [], []
        fd = os.open(self.tmp, os.O_RDWR)  # (bare: `open` makes three system calls more, on every download)
        try:
            parts = self._submit(fd, 0, first, not self.ahead)
            if first < size:  # a partial prefetch: the rest as soon as the cache has room for it
                staged = self._submit(fd, first, size, False, staged=True) if size - first <= STAGED else []
                if not self._grow_beside(parts + staged):
                    self._collect(parts + staged)
                    return False
                for i, f in enumerate(staged):  # (its room is there: what arrived meanwhile is written)
                    a, _ = self.spans[len(parts) + i]
                    block = f.result()
                    with self.writing:
                        os.pwrite(fd, block, a)
                parts += staged or self._submit(fd, first, size, p.hurried())
            digest = hashlib.sha256()
            self._collect(parts, self._hashing(digest, fd) if self.sha256 is not None else None)
            os.fsync(fd)  # durable before the rename: a power loss leaves no short copy behind
        finally:  # a failed part: the others are not left writing into the file being retried, nor into the
            # descriptor once it is closed (or its next owner)
            for f in self._reads:
                f.cancel()
            concurrent.futures.wait(self._reads)
            os.close(fd)
        if self.sha256 is not None and digest.hexdigest() != self.sha256:
            raise Damaged("its sha256 does not match the manifest's: the object is corrupt or was replaced")
        if self.tag is not None and self.condition is None:  # a HEAD after the reads: a rewrite before or during
            check_unchanged(self.cache, self.name, self.tag)   # them is seen
        self.cache._commit(self.tmp, self.local, size)
        return True

    def _grow_beside(self, parts: list) -> bool:
        """Wait, while the first parts arrive, until the partial prefetch can take the rest's
        room: True once it has it; False when it is no longer wanted after its first parts
        arrived. A failed part raises."""
        p = self.partial
        while not p.try_grow():
            running = [f for f in parts if not f.done()]
            if any(f.exception() is not None for f in parts if f.done() and not f.cancelled()):
                self._collect(parts)  # (raises the failed part's error: the attempt is retried)
            if not running and not p.wanted():
                return False
            if running:
                concurrent.futures.wait(running, timeout=GROW_POLL_S, return_when=concurrent.futures.FIRST_COMPLETED)
            else:
                time.sleep(GROW_POLL_S)
        return True

    def _submit(self, fd: int, lo: int, hi: int, urgent: bool, staged: bool = False) -> list:
        """The ranged reads of bytes [lo, hi) into descriptor `fd`, queued on the request threads
        (`staged`: each giving its bytes, for `fd` once the cache has room for them)."""
        c, name, size, whole = self.cache, self.name, self.size, self.whole
        step = self._part_size(hi - lo, urgent)
        spans = [(0, size)] if whole else [(a, min(a + step, hi)) for a in range(lo, hi, step)]
        self.spans += spans
        one = len(spans) == 1 and spans[0] == (0, size)

        def part(span):  # one ranged GET (no HEAD first), written where it belongs
            a, b = span
            with read_slot():  # (a retry reads ranges: the whole object's bytes are used once)
                if whole:
                    block = whole.pop()
                else:
                    began = time.monotonic()
                    block = memoryview(c.read_bounded(name, self.start + a, self.start + b, self.condition))
                    c.carried.read(block.nbytes, time.monotonic() - began)
                if block.nbytes != b - a:
                    raise Damaged(f"{a + block.nbytes} bytes arrived of the {size} expected")
                if staged:
                    return block
                with self.writing:
                    os.pwrite(fd, block, a)
                start_writeback(fd, a, b - a)  # (so the fsync before the rename has little left)
            return block if one else None

        reads = [c.requests.submit(urgent, self.job, part, span, size=span[1] - span[0]) for span in spans]
        self._reads += reads
        return reads

    def _hashing(self, digest, fd: int):
        """What `_collect` does with each run of parts there in order: their bytes into
        `digest`, so the checksum is taken while the later parts arrive, not after the last
        (12 ms of a 24.7 MB shard, where a bounded cache fetches one shard at a time). A run
        is mapped from the file just written, not kept from the reads (one slow part would
        hold every later one in memory) nor copied, and hashed in one call: a shard's parts
        arrive within a few ms of one another, and each call waits for the GIL the reader
        holds. A part at a time, a 24.7 MB shard's fsync began a median 24 ms after its last
        part came (16-29 ms, at a cache_limit of two shards: on the path of the read waiting
        for it); a run at a time, 19 ms (2-27 ms)."""
        def each(i: int, j: int, block) -> None:
            if block is not None and j == i + 1:  # (an object read in one part: its bytes, kept)
                digest.update(block)
                return
            a, b = self.spans[i][0], self.spans[j - 1][1]
            start = a - a % mmap.ALLOCATIONGRANULARITY
            with mmap.mmap(fd, b - start, offset=start, access=mmap.ACCESS_READ) as run, memoryview(run) as view, \
                    view[a - start:] as ours:
                digest.update(ours)
        return each

    @staticmethod
    def _collect(parts: list, each=None) -> None:
        """Wait for the parts, in order (`each(i, j, result)` once parts [i, j) are there, as
        many as are by then, `result` part i's); a failed one raises (the others are stopped
        as the attempt ends: `_attempt_parts`)."""
        i = 0
        while i < len(parts):
            result, j = parts[i].result(), i + 1
            while each is not None and j < len(parts) and parts[j].done():
                parts[j].result()  # (a failed part raises here)
                j += 1
            if each is not None:
                each(i, j, result)
            i = j

    def _part_size(self, size: int, urgent: bool) -> int:
        """The bytes of one ranged part of `size` bytes to read: as many parts as request
        threads (SPLIT at least), of PART_MIN at least, shared among the downloads a read
        waits for that run at once (a LitData dataset's 16 chunks of 24.7 MB copied at its
        open, 8 at a time, each in 64 parts: 1,025 GETs, its epoch from a link of 10 MB/s a
        connection 3.15 s; shared, 199 GETs and 1.70 s). A download fetched ahead, which nothing
        waits for, is cut into parts of PART_AHEAD at least only while the downloads running
        and queued give every request thread two parts of that size (counting only those
        running, the first of 64 shards hinted at once were cut into parts of 256 KiB, and a
        128-shard store's first batch waited on 2.4x the requests); fewer objects (a bounded
        cache fetching one shard ahead) are cut finer, down to PART_LONE, so that the link
        stays full and the request threads grow (one 24.7 MB shard at a time behind a link of
        10 MB/s a connection: 1 MiB parts kept 16 connections busy, not the 32 the pool grew
        to); once the pool has stopped growing, in whole rounds of its threads (`whole_rounds`).
        Asked no smaller than what a connection carries in PART_SECONDS (under a cache_limit,
        twice that, up to PART_AHEAD: `BUSY_READS`), nor, under a cache_limit, than the limit's
        share for each request thread (`IN_FLIGHT`; that share no more than ROOM_PARTS such
        parts), then cut evenly (`even_parts`: each part between three
        quarters and one and a half of the size asked, or the whole object where it is smaller)."""
        c = self.cache
        workers = max(SPLIT, c.requests.workers)
        even = -(-size // workers)
        if urgent:  # (objects a read waits for, fetched together, share the threads)
            return min(BLOCK, max(PART_MIN, even * max(1, c._in_flight[2])))
        objects = c._in_flight[1] + c.turns.queued()  # (those queued count: they start in a moment)
        share = -(-size * objects // (2 * workers))
        carried = c.carried.bytes_in(PART_SECONDS)
        room = 0 if c.limit is None else min(c.limit // (IN_FLIGHT * workers), ROOM_PARTS * carried)
        least = PART_LONE if c.limit is None else max(PART_LONE, min(PART_AHEAD, BUSY_READS * carried))
        part = even_parts(size, min(BLOCK, max(least, min(max(PART_AHEAD, even), share), carried, room)))
        return whole_rounds(size, part, workers) if c.requests.growth.settled else part


def even_parts(size: int, part: int) -> int:
    """Parts of about `part` bytes for `size` bytes, all of one size: as many as `size / part`
    rounded to the nearest (one at least), not up, but never fewer than BLOCK allows (cut
    at BLOCK instead, 2.05 BLOCK was two whole parts and a sliver). A last part of a sliver
    is a request of its own (its wait for the first byte, its CPU at the client and at the
    server). A Megatron file's blocks of 3.09 MB at a cache_limit of 2 files' worth: once
    the client, the server and the link were busy, a connection carried 0.91-0.96 MB in
    PART_SECONDS, and each block took four GETs (the last of 0.2 MB), 495-583 an epoch;
    cut evenly, three. Two cores, 30 ms and 10 MB/s a connection, two runs of each version in turn, 5
    rounds a run: a median 439 GETs against 489, the bounded epoch 3.37 s against 3.54 s
    (0.93x the unbounded rate against 0.84x)."""
    return -(-size // max(1, int(size / part + 0.5), -(-size // BLOCK)))


def whole_rounds(size: int, part: int, workers: int) -> int:
    """`part` made larger, where `size` bytes in parts of `part` would end in a round of reads
    that leaves request threads idle, so that they are read in whole rounds of `workers` reads
    (never more than BLOCK): a part's time is mostly the wait for its first byte, so a last
    round half full costs a whole round trip. One shard at a time (a cache_limit of two
    shards) behind 30 ms and 10 MB/s a connection, 32 threads: 48 parts of 512 KiB took two
    rounds, 0.18 s a shard; 32 parts of 773 KiB one. Only once the pool has stopped growing:
    until then the parts beyond a round are the backlog that makes it grow."""
    rounds = max(1, -(-size // part) // workers)
    return min(BLOCK, max(part, -(-size // (rounds * workers))))


class WrongSize(StoreError):
    """An object whose size was guessed (`Download.guessed`) proved another: ask it, and read
    it again (never retried at the guess)."""
