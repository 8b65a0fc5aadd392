"""Compressed shards of peers' formats (MosaicML MDS `zip_data`, LitData chunks written with
`compression=`), decompressed once into the cache and read in place from there.

A compressed file cannot be memory-mapped, so each is decompressed whole into
`$FORGE_GRAIN_CACHE/<kind>`, under a name keyed by the compressed file's content (a
changed file gets a new copy; a copy is written to a temporary name and renamed, so a
crash leaves none half-written). The algorithms are the peers' own: gzip and bz2 (the
standard library), zstd (a zstd frame, as `zstandard`/`zstd` write it), brotli and snappy
(the raw block format of `python-snappy`, as MosaicML's writer uses it), the last three
from the `forge-grain[compressed]` extra (`zstandard`, `cramjam`).
"""

from __future__ import annotations

import bz2
import gzip
import shutil
from pathlib import Path

from forge_grain.errors import StoreError
from forge_grain.paths import cache_root, private_cache
from forge_grain.stores import checks
from forge_grain.stores.manifest import temporary

ALGORITHMS = ("gz", "bz2", "zstd", "br", "brotli", "snappy")


def cached_copy(source: Path, algorithm: str, name: str, kind: str) -> Path:
    """The decompressed copy of `source` (compressed with `algorithm`, "zstd:3" as "zstd"),
    made once under the cache's `kind` directory as `<content key>-<name>`."""
    cached = private_cache(cache_root() / kind) / copy_name(source, name)
    if cached.exists():
        return cached
    tmp = temporary(cached)
    decompress_into(source, algorithm, tmp)
    tmp.replace(cached)
    return cached


def copy_name(source: Path, name: str) -> str:
    """The name of the decompressed copy of `source`: keyed by the compressed file's content."""
    return f"{checks.content_fingerprint(source, full=True)[:24]}-{Path(name).name}"


def decompress_into(source: Path, algorithm: str, dst: Path) -> None:
    """`source` (compressed with `algorithm`, "zstd:3" as "zstd") decompressed into `dst`; a
    damaged stream is an error naming `source` (and leaves no `dst`)."""
    algorithm = str(algorithm or "").split(":")[0]
    decompress = _decompressor(algorithm, source)
    try:
        decompress(source, dst)
    except (OSError, EOFError, ValueError, RuntimeError) as e:  # each library names a damaged stream its own way
        Path(dst).unlink(missing_ok=True)
        raise StoreError(f"{source}: cannot decompress this {algorithm} file ({type(e).__name__}: {e}); it is "
                         "truncated or damaged") from None


def _decompressor(algorithm: str, source: Path):
    """A function (compressed path, output path) for `algorithm`, or a StoreError saying what
    to install (or that the algorithm is unknown)."""
    if algorithm in ("gz", "bz2"):
        opener = gzip.open if algorithm == "gz" else bz2.open
        return lambda src, dst: _copy(opener(src, "rb"), dst)
    try:
        if algorithm == "zstd":
            import zstandard

            return lambda src, dst: _zstd(zstandard, src, dst)
        if algorithm in ("br", "brotli", "snappy"):
            import cramjam

            whole = cramjam.brotli.decompress if algorithm != "snappy" else cramjam.snappy.decompress_raw
            return lambda src, dst: Path(dst).write_bytes(bytes(whole(Path(src).read_bytes())))
    except ImportError:
        raise StoreError(f"{source}: a {algorithm}-compressed file; reading it needs "
                         "`pip install 'forge-grain[compressed]'` (zstandard and cramjam)") from None
    raise StoreError(f"{source}: compressed with {algorithm!r}, which forge-grain does not know (it reads "
                     f"{', '.join(ALGORITHMS)}); decompress it, or rewrite the dataset uncompressed")


def _zstd(zstandard, src, dst) -> None:
    """The frames of `src` decompressed into `dst`; a stream cut inside a frame is an error
    (zstandard's reader would give the part before the cut without a word)."""
    with open(src, "rb") as f, open(dst, "wb") as out:
        d = zstandard.ZstdDecompressor().decompressobj()
        while block := f.read(1 << 24):
            out.write(d.decompress(block))
            while d.eof and d.unused_data:  # another frame follows
                rest, d = d.unused_data, zstandard.ZstdDecompressor().decompressobj()
                out.write(d.decompress(rest))
        if not d.eof:
            raise ValueError("the zstd stream ends inside a frame")


def _copy(reader, dst) -> None:
    with reader as src, open(dst, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 24)
