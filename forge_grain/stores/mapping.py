"""Read-only memory maps that hold no file descriptor.

`np.memmap` and `mmap.mmap` keep a duplicate of the file's descriptor open for as long as
the map lives (Python < 3.13), so a pipeline over thousands of shards and plans ran out
of descriptors (`ulimit -n` is 1024 on many clusters) although a mapping needs none once
made. Here the file is opened, mapped and closed at once: descriptors stay O(1) whatever
the number of shards and sources. The region is unmapped when the last array viewing it
is garbage-collected, so views handed out stay valid.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import os
import re
import sys
import weakref
from pathlib import Path

import numpy as np

_PAGE = mmap.ALLOCATIONGRANULARITY


SMALL = 1 << 16  # bytes up to which a file's part is read into memory rather than mapped


def map_bytes(path: str | Path, offset: int = 0, length: int | None = None) -> np.ndarray:
    """Bytes [offset, offset + length) of `path` (to its end by default) as a read-only uint8
    array backed by a memory map that holds no file descriptor. Parts of at most `SMALL`
    bytes are read instead: a process has a limited number of maps (`vm.max_map_count`,
    65,530 by default), which thousands of tiny sources' shards, indices and plans would use up."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        length = size - offset if length is None else length
        if length <= 0 or offset + length > size:
            if length == 0 or offset == size:
                return _empty()
            raise ValueError(f"{path}: bytes [{offset}, {offset + length}) lie past its end ({size} bytes)")
        if length <= SMALL:
            f.seek(offset)
            data = np.frombuffer(f.read(length), np.uint8)  # a read-only view of immutable bytes
            if len(data) != length:
                raise ValueError(f"{path}: shorter than its size while being read")
            return data
        start = offset - offset % _PAGE
        region = _map(f.fileno(), start, offset + length - start, path)
    return np.asarray(region)[offset - start :]


# the header numpy writes for a plain 1-D or n-D array (parsed without numpy's slower, general parser)
_PLAIN_HEADER = re.compile(rb"\{'descr': '([<>|=][a-zA-Z]\d+)', 'fortran_order': False, 'shape': \(([\d, ]*)\), \} *\n")


def map_npy(path: str | Path) -> np.ndarray:
    """A `.npy` file's array, memory-mapped read-only without a descriptor (as `np.load(mmap_mode="r")`)."""
    with open(path, "rb") as f:
        head = f.read(4096)
        plain = _PLAIN_HEADER.fullmatch(head[10 : 10 + int.from_bytes(head[8:10], "little")])
        if head[:8] == b"\x93NUMPY\x01\x00" and plain:  # a plain array, as the writers here save them
            dtype = np.dtype(plain[1].decode())
            shape, fortran = tuple(int(x) for x in plain[2].split(b",") if x.strip()), False
            header = 10 + int.from_bytes(head[8:10], "little")
        else:
            f.seek(0)
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            header = f.tell()
    if dtype.hasobject or (fortran and len(shape) > 1):
        raise ValueError(f"{path}: holds Python objects or a Fortran-ordered array; only plain arrays are mapped")
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.zeros(shape, dtype)
    raw = map_bytes(path, header, count * dtype.itemsize)
    return raw.view(dtype).reshape(shape)


def _empty() -> np.ndarray:
    arr = np.zeros(0, np.uint8)
    arr.setflags(write=False)
    return arr


if sys.version_info >= (3, 13):

    def _map(fd: int, offset: int, length: int, path):
        """A read-only buffer over the region; `trackfd=False` keeps no duplicate descriptor."""
        try:
            return np.frombuffer(mmap.mmap(fd, length, access=mmap.ACCESS_READ, offset=offset, trackfd=False), np.uint8)
        except OSError as e:
            raise _explained(e, path) from None

else:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    _MAP_FAILED = ctypes.c_void_p(-1).value

    class _Region:
        """A region mapped with the C library's `mmap`: numpy views it through the array
        interface (read-only) and keeps it alive; it is unmapped when collected."""

        _addr = None

        def __init__(self, fd: int, offset: int, length: int, path):
            addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
            if addr in (None, _MAP_FAILED):
                err = ctypes.get_errno()
                raise _explained(OSError(err, os.strerror(err), str(path)), path)
            self._addr, self._length = addr, length
            self.__array_interface__ = {"shape": (length,), "typestr": "|u1", "data": (addr, True), "version": 3}

        def __del__(self, _munmap=_libc.munmap):
            # bound at definition: a region collected at interpreter exit may find the module's
            # globals already cleared (`_libc` None)
            if self._addr is not None:
                _munmap(self._addr, self._length)

    def _map(fd: int, offset: int, length: int, path):
        return _Region(fd, offset, length, path)


def _explained(e: OSError, path) -> OSError:
    """Out of memory maps (ENOMEM) says which limit was reached and what to do."""
    if e.errno != errno.ENOMEM:
        return e
    try:
        limit = Path("/proc/sys/vm/max_map_count").read_text().strip()
    except OSError:
        limit = "the system's"
    return OSError(errno.ENOMEM, f"cannot map {path}: this process reached its limit of {limit} memory maps "
                   "(vm.max_map_count; each shard, index and plan of more than 64 KiB is one); raise it "
                   "(sysctl -w vm.max_map_count=262144) or use fewer, larger shards or sources", str(path))


class TokenArrays(collections.namedtuple("TokenArrays", "addresses lengths like")):
    """The token arrays `fill_rows` reads, given to it by address: where each array's first
    token is, its length, and a zero-length array of their (shared) dtype. One compiled
    gather then serves any number of arrays (a tuple is compiled anew for each count, and
    numba's typed list compiles its methods for half a second in every process that makes
    one). `arrays` (not passed to the kernel) keeps them alive while the addresses are used."""


def token_arrays(arrays) -> TokenArrays:
    """`TokenArrays` of `arrays` (one dtype: a gather writes one id type)."""
    arrays = [np.asarray(a) for a in arrays]
    _check(arrays)
    return _table(arrays, [a.ctypes.data for a in arrays], [len(a) for a in arrays])


def _table(arrays: list, addresses: list, lengths: list) -> TokenArrays:
    """The `TokenArrays` of `arrays`, found at `addresses`, of `lengths` tokens (it keeps them alive)."""
    out = TokenArrays(np.array(addresses, np.int64), np.array(lengths, np.int64),
                      arrays[0][:0] if arrays else np.zeros(0, np.uint16))
    out.arrays = arrays
    return out


def _check(arrays: list) -> None:
    if len({a.dtype for a in arrays}) > 1:
        raise TypeError(f"token arrays of one gather must share a dtype, not {sorted({str(a.dtype) for a in arrays})}")
    if any(a.ndim != 1 or not a.flags.c_contiguous for a in arrays):
        raise TypeError("token arrays must be one-dimensional and contiguous")


class Maps(dict):
    """A fetching store's token arrays mapped now (by shard, or part), counting its changes:
    a thread that found its arrays here at one count knows them still mapped, the same
    objects, while the count is unchanged (`Addresses.unchanged`). The stores change it by item,
    `del`, `pop` and `clear` only, which count."""

    changes = 0

    def __setitem__(self, key, value):
        self.changes += 1
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.changes += 1
        super().__delitem__(key)

    def pop(self, *args):
        self.changes += 1
        return super().pop(*args)

    def clear(self):
        self.changes += 1
        super().clear()


class Addresses:
    """`TokenArrays` over every token array of a store fetched on demand (a store in object
    storage), for one thread's gathers: the arrays a gather reads have their addresses set,
    every other's are 0, so the store's own pieces serve the gather as they are (renumbering
    them for the arrays of each gather copied all the pieces a step: a fifth of a Megatron
    epoch's CPU under a `cache_limit`). The arrays are held while the store's `Maps` are
    unchanged, so a step reading only arrays an earlier one read since finds the table as
    it is (`unchanged`: asking the store for its maps and setting the table were a sixth of
    a Megatron step under a limit; finding first which arrays the step reads, to check them
    held, took 0.15-0.2 s of the 2.5 s its consumer spent making an epoch's batches: the
    gather checks each address as it goes instead); once the maps change, only the last
    gather's arrays are
    held, so the map of a file evicted since is freed. Each array's address is remembered
    while the array lives: `a.ctypes.data` costs about a microsecond, and a global shuffle's
    batch of 16 rows from a 128-shard store reads about 40 shards (0.24 s of an epoch's 6,000
    steps went to finding the same addresses again); an array mapped again (evicted, then
    fetched anew) is a new object, looked at anew. One per thread: a gather reads the table
    while it runs."""

    def __init__(self, count: int, dtype):
        self._addresses, self._lengths = np.zeros(count, np.int64), np.zeros(count, np.int64)
        self._held: dict[int, np.ndarray] = {}  # array index -> the array (its address is set)
        self._known: dict[int, tuple] = {}  # array index -> (weak reference to the array, address, length)
        self._like = np.zeros(0, dtype)
        self._out = TokenArrays(self._addresses, self._lengths, self._like)
        self._out.arrays = self._held
        self._seen = (None, -1)  # (the store's maps, their change count) the held arrays were found at

    def unchanged(self, maps: Maps) -> TokenArrays | None:
        """The table as it is, if `maps` has not changed since its arrays were found there
        (None: ask the store, then `token_arrays`). A gather through it stops at the first
        array it holds no address of (`kernels.fill_rows`)."""
        seen, changes = self._seen
        return self._out if seen is maps and changes == maps.changes else None

    def token_arrays(self, keys, arrays: list, maps: Maps | None = None, changes: int = -1) -> TokenArrays:
        """The table with arrays `keys` (their indices) set to `arrays`, found in `maps` at its
        change count `changes`: the arrays held before stay if the maps had not changed since,
        else none but these."""
        held, addresses, lengths = self._held, self._addresses, self._lengths
        now = dict(zip(keys, arrays))
        seen, seen_changes = self._seen
        if maps is None or seen is not maps or seen_changes != changes:
            for k in [k for k in held if k not in now]:
                del held[k]
                addresses[k] = lengths[k] = 0
            self._seen = (maps, changes)
        for k, a in now.items():
            if held.get(k) is not a:
                held[k] = a
                _, addresses[k], lengths[k] = self._known_as(k, a)
        return self._out

    def _known_as(self, k: int, a: np.ndarray) -> tuple:
        hit = self._known.get(k)
        if hit is None or hit[0]() is not a:
            _check([self._like, a])
            hit = self._known[k] = weakref.ref(a), a.ctypes.data, len(a)
        return hit
