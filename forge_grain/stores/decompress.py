"""Compressed shards of peers' formats (MosaicML MDS `zip_data`, LitData chunks written with
`compression=`), decompressed once into the cache and read in place from there.

A compressed file cannot be memory-mapped, so each is decompressed whole into
`$FORGE_GRAIN_CACHE/<kind>`, under a name keyed by the compressed file's content (a
changed file gets a new copy; a copy is written to a temporary name and renamed, so a
crash leaves none half-written). The algorithms are the peers' own: gzip and bz2 (the
standard library), zstd (a zstd frame, as `zstandard`/`zstd` write it), brotli and snappy
(the raw block format of `python-snappy`, as MosaicML's writer uses it), the last three
from the `forge-grain[compressed]` extra (`zstandard`, `brotli`, `cramjam`). Each is decompressed
as a stream that stops at the size the dataset's index promises: a small file that would expand
to gigabytes is an error, with its partial output removed, and memory stays a few MiB.
"""

from __future__ import annotations

import bz2
import gzip
from pathlib import Path

from forge_grain.errors import StoreError
from forge_grain.paths import cache_root, private_cache
from forge_grain.stores import checks
from forge_grain.files import temporary

ALGORITHMS = ("gz", "bz2", "zstd", "br", "brotli", "snappy")


BLOCK = 1 << 20  # output bytes decompressed at a time: a decompression's memory stays a few of these


def cached_copy(source: Path, algorithm: str, name: str, kind: str, size: int | None) -> Path:
    """The decompressed copy of `source` (compressed with `algorithm`, "zstd:3" as "zstd"),
    made once under the cache's `kind` directory as `<content key>-<name>`; `size`: the bytes
    the dataset's index promises it holds (see `decompress_into`)."""
    cached = private_cache(cache_root() / kind) / copy_name(source, name)
    if cached.exists():
        return cached
    tmp = temporary(cached)
    decompress_into(source, algorithm, tmp, size)
    tmp.replace(cached)
    return cached


def copy_name(source: Path, name: str) -> str:
    """The name of the decompressed copy of `source`: keyed by the compressed file's content."""
    return f"{checks.content_fingerprint(source, full=True)[:24]}-{Path(name).name}"


def decompress_into(source: Path, algorithm: str, dst: Path, size: int | None) -> None:
    """`source` (compressed with `algorithm`, "zstd:3" as "zstd") decompressed into `dst`, as a
    stream of `BLOCK`s: exactly `size` bytes, what the dataset's index promises (MDS
    `raw_data.bytes`, LitData `chunk_bytes`). A stream that would expand past it (a small file
    that takes gigabytes) stops there; one that ends short, or is damaged, is an error naming
    `source`, and leaves no `dst`."""
    algorithm = str(algorithm or "").split(":")[0]
    if size is None or isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise StoreError(f"{source}: its index gives no decompressed size for this {algorithm} file ({size!r}), "
                         "which bounds what it may expand to; rewrite the dataset's index, or the dataset uncompressed")
    decompress = _decompressor(algorithm, source)
    try:
        written = decompress(source, dst, size)
        if written != size:
            raise ValueError(f"it holds {written} bytes, not the {size} its index promises")
    except _PastSize:
        Path(dst).unlink(missing_ok=True)
        raise StoreError(f"{source}: this {algorithm} file expands past the {size} bytes its index promises; it is "
                         "damaged or not the file the index describes") from None
    except (OSError, EOFError, ValueError, RuntimeError, MemoryError) as e:  # each library names it its own way
        Path(dst).unlink(missing_ok=True)
        raise StoreError(f"{source}: cannot decompress this {algorithm} file ({type(e).__name__}: {e}); it is "
                         "truncated or damaged") from None


class _PastSize(Exception):
    """The output would pass the promised size."""


class _Bounded:
    """An output file that takes at most `size` bytes."""

    def __init__(self, dst, size: int):
        self.f, self.size, self.written = open(dst, "wb"), size, 0

    def write(self, data) -> None:
        self.written += len(data)
        if self.written > self.size:
            raise _PastSize()
        self.f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _decompressor(algorithm: str, source: Path):
    """A function (compressed path, output path, promised size) -> bytes written, for
    `algorithm`, or a StoreError saying what to install (or that the algorithm is unknown)."""
    if algorithm in ("gz", "bz2"):
        opener = gzip.open if algorithm == "gz" else bz2.open
        return lambda src, dst, size: _copy(opener(src, "rb"), dst, size)
    try:
        if algorithm == "zstd":
            import zstandard

            return lambda src, dst, size: _zstd(zstandard, src, dst, size)
        if algorithm in ("br", "brotli"):
            import brotli

            return _brotli(brotli)
        if algorithm == "snappy":
            import cramjam

            return lambda src, dst, size: _snappy(cramjam, src, dst, size)
    except ImportError:
        raise StoreError(f"{source}: a {algorithm}-compressed file; reading it needs "
                         "`pip install 'forge-grain[compressed]'` (zstandard, brotli and cramjam)") from None
    raise StoreError(f"{source}: compressed with {algorithm!r}, which forge-grain does not know (it reads "
                     f"{', '.join(ALGORITHMS)}); decompress it, or rewrite the dataset uncompressed")


def _zstd(zstandard, src, dst, size: int) -> int:
    """The frames of `src`, a block at a time. zstandard's stream reader ends a frame cut short
    without a word: the promised size catches it (a count short of it)."""
    with open(src, "rb") as f, _Bounded(dst, size) as out:
        reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
        while block := reader.read(BLOCK):
            out.write(block)
        return out.written


def _brotli(brotli):
    """A block of output at a time (`output_buffer_limit`), whatever the input holds."""
    def run(src, dst, size: int) -> int:
        d = brotli.Decompressor()
        with open(src, "rb") as f, _Bounded(dst, size) as out:
            while not d.is_finished():
                if d.can_accept_more_data():
                    data = f.read(1 << 16)
                    if not data:
                        raise EOFError("the brotli stream ends before its last block")
                else:
                    data = b""
                out.write(d.process(data, output_buffer_limit=BLOCK))
            return out.written
    return run


def _snappy(cramjam, src, dst, size: int) -> int:
    """Snappy's raw block format (MosaicML's) holds one block whose header says its length:
    checked against the promised size first, then decompressed from a map of the file into a
    map of the output (no copy of either in memory)."""
    import mmap

    import numpy as np

    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        data = np.frombuffer(m, np.uint8)
        try:  # (no view of a map may outlive it, an error's included)
            length = cramjam.snappy.decompress_raw_len(data)
            if length > size:
                raise _PastSize()
            with open(dst, "w+b") as out:
                out.truncate(length)
                if length:
                    with mmap.mmap(out.fileno(), length) as target:
                        view = np.frombuffer(target, np.uint8)
                        try:
                            written = cramjam.snappy.decompress_raw_into(data, view)
                        finally:
                            del view
                        if written != length:
                            raise ValueError(f"{written} bytes decompressed, its header says {length}")
        finally:
            del data
    return length


def _copy(reader, dst, size: int) -> int:
    with reader as src, _Bounded(dst, size) as out:
        while block := src.read(BLOCK):
            out.write(block)
        return out.written
