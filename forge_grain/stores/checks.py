"""Checks every store format shares: declared dtypes, token-id ranges, content fingerprints,
document boundaries, and the file-level errors (missing or irregular files).

Each check names the file and says what to pass, so bytes are never silently misread.
"""

from __future__ import annotations

import functools
import hashlib
import stat
from pathlib import Path

import numpy as np

from forge_grain.stores import mapping, probe_stream
from forge_grain.errors import StoreError

MAX_TOKEN_ID = 2**31 - 1  # batches hold ids as int32 by default
SAMPLE_BLOCKS = 32  # blocks read for a file's content fingerprint: first, last and evenly spaced
SAMPLE_BLOCK_BYTES = 4096
PROBES, PROBE_BYTES = 2048, 8  # ... and probes at offsets spread over the file (see `content_fingerprint`)
WHOLE_BELOW = 8 << 20  # a file this small is hashed whole: its probes would touch most of its pages anyway
CHECK_ALL_BOUNDARIES = 1 << 20  # more documents than this: check an evenly spaced sample of them


def declared_dtype(path: Path, dtype) -> np.dtype:
    """`dtype` as a numpy dtype, or a `StoreError` naming what was passed."""
    try:
        return np.dtype(dtype)
    except TypeError:
        raise StoreError(f"{path}: dtype {dtype!r} is not a numpy dtype (e.g. 'uint16', 'uint32', 'int32')") from None


def check_declared_dtype(path: Path, declared, recorded: np.dtype, where: str) -> None:
    """A dtype the user declared must be the one the format records (`where` says where)."""
    if declared is not None and declared_dtype(path, declared) != recorded:
        raise StoreError(f"{path}: dtype={np.dtype(declared)} was declared, but {where} records {recorded}")


def integer_dtype(path: Path, dtype: np.dtype, where: str) -> np.dtype:
    """Token ids are integers: a float or other dtype, declared or recorded by a format
    (`where` says which), is refused."""
    if dtype.kind not in "iu":
        raise StoreError(f"{path}: dtype {dtype} ({where}) is not an integer type; token ids need one "
                         "(e.g. uint16, int32)")
    return dtype


def empty_tokens(dtype) -> np.ndarray:
    """A read-only empty token array: the same array type as a read-only memory map, so a
    tuple of shards that holds an empty one stays one type for the compiled gather."""
    arr = np.zeros(0, dtype)
    arr.setflags(write=False)
    return arr


def map_alignments(path: Path, dtype: np.dtype) -> list[np.ndarray]:
    """The file as `dtype` items starting at byte 0, 1, ..., itemsize - 1: views of one
    read-only memory map, for items at arbitrary byte offsets."""
    raw = mapping.map_bytes(path)
    if len(raw) == 0:
        return [empty_tokens(dtype)] * dtype.itemsize
    item = dtype.itemsize
    return [raw[r : r + max(0, len(raw) - r) // item * item].view(dtype) for r in range(item)]


def map_array(path: Path, dtype: np.dtype, offset: int = 0, count: int | None = None) -> np.ndarray:
    """`count` items of `dtype` (as many as fit by default) at byte `offset` of `path`,
    memory-mapped read-only (holding no file descriptor: see `forge_grain.stores.mapping`)."""
    raw = mapping.map_bytes(path, offset, None if count is None else count * dtype.itemsize)
    if len(raw) < dtype.itemsize:
        return empty_tokens(dtype)
    return raw[: len(raw) // dtype.itemsize * dtype.itemsize].view(dtype)


# -- content fingerprints ----------------------------------------------------------------------


def sample_offsets(size: int) -> list[int]:
    """Byte offsets of the fingerprint's blocks: the first, the last, and evenly spaced ones."""
    if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
        return list(range(0, size, SAMPLE_BLOCK_BYTES))
    last = size - SAMPLE_BLOCK_BYTES
    return sorted({last * k // (SAMPLE_BLOCKS - 1) for k in range(SAMPLE_BLOCKS)})


def content_fingerprint(path: Path, full: bool = False) -> str:
    """A hash of the file's size and content: of every byte with `full=True`, and by default
    (sampled) of every byte of a file up to `WHOLE_BELOW` (8 MiB), else of its `SAMPLE_BLOCKS`
    fixed blocks (the first and last 4 KiB among them: headers and trailers) and `PROBES` 8-byte
    probes at offsets drawn from a generator seeded by the size (`probe_offsets`).

    Why this catches a rewritten file: the probes' offsets are spread uniformly over the file
    and bear no relation to where a rewrite (re-tokenizing, another file of the same size, a
    corrupted range, a shifted document) changes bytes. If a change alters a fraction f of the
    bytes, each probe misses it with probability 1 - f, so all 2,048 miss it with probability
    (1 - f)^2048 = e^(-2048 f) at most: 1.3e-9 for f = 1%, 1.6e-18 for f = 2%, e^-2007 for a
    98% rewrite. Any change of size changes it always; with the document boundaries (see
    `TokenStore.fingerprint`) moved documents change it too. A change of a few bytes (under
    0.1% of a large file) can pass unseen: `full=True` detects every change, for a full read.
    Reads at most 128 KiB of blocks and 2,048 pages, whatever the size.
    """
    def whole():
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                yield block

    return fingerprint_of(path.stat().st_size, full, whole, lambda spans: _Mapped(path))


class _Mapped:
    """A file's bytes, mapped whole, as `fingerprint_of` reads them: any place by offset, and
    the probes in one gather (taken one slice at a time, a 24.7 MB file's fingerprint took
    8.2 ms, and a LitData dataset's open fingerprints 34 such files; gathered, 6.6 ms, the rest
    the pages the probes touch)."""

    def __init__(self, path: Path):
        self.path, self.raw = path, mapping.map_bytes(path)

    def __call__(self, offset: int, length: int) -> np.ndarray:
        return self.raw[offset : offset + length]

    def probes(self, size: int) -> bytes:
        """The probes' bytes of a file of `size` bytes, in the order they are hashed."""
        if self.raw.size != size:
            raise StoreError(f"{self.path}: changed while its fingerprint was taken "
                             f"({size} bytes, then {self.raw.size})")
        return self.raw[probe_starts(size)[:, None] + np.arange(PROBE_BYTES)].tobytes()


def fingerprint_of(size: int, full: bool, whole, at) -> str:
    """`content_fingerprint`'s formula over any reader of `size` bytes (a local file, an object
    read in ranges): `whole()` yields every byte in order, when the fingerprint covers them;
    `at(spans)`, given the sampled blocks and probes as [start, end) pairs, reads them and
    returns `get(offset, length)`."""
    h = hashlib.sha256(f"{'full' if full else 'sampled'}:{size}:".encode())
    if full or size <= WHOLE_BELOW:
        for block in whole():
            h.update(block)
        return h.hexdigest()
    h.update(b"blocks+probes:")
    blocks, probes = sampled_places(size)
    get = at(blocks + probes)
    for a, b in blocks:
        h.update(get(a, b - a))
    gather = getattr(get, "probes", None)  # (a mapped file's: in one call)
    h.update(gather(size) if gather is not None else b"".join(bytes(get(a, b - a)) for a, b in probes))
    return h.hexdigest()


@functools.lru_cache(maxsize=64)
def sampled_places(size: int) -> tuple[tuple, tuple]:
    """The sampled fingerprint's blocks and probes in a file of `size` bytes (more than
    `WHOLE_BELOW`), as [start, end) pairs, in the order it hashes them (what
    `harvest.Harvest` gathers from a file's blocks). Kept by size: the probes' 2,048 offsets
    are drawn in Python (10 ms), and a dataset's files mostly share a size (LitData's chunks,
    a store's shards), each fingerprinted at open and again as an epoch first reads it."""
    blocks = tuple((o, min(o + SAMPLE_BLOCK_BYTES, size)) for o in sample_offsets(size))
    return blocks, tuple((p, p + PROBE_BYTES) for p in probe_starts(size).tolist())


@functools.lru_cache(maxsize=64)
def probe_starts(size: int) -> np.ndarray:
    """`probe_offsets(size)`, kept (read-only: one array for each size, drawn once)."""
    starts = probe_offsets(size)
    starts.flags.writeable = False
    return starts


def probe_offsets(size: int) -> np.ndarray:
    """The sorted offsets of a sampled fingerprint's probes in a file of `size` bytes: uniform
    over the file, the same for every file of that size (so that a fingerprint is
    reproducible), from a generator no writer's layout follows: numpy's PCG64 stream of
    `default_rng([size, "FGPF"])`, spelled out in `probe_stream` so that no numpy upgrade
    moves an offset (and with it every sampled fingerprint)."""
    drawn = probe_stream.integers([size, 0x46475046], size - PROBE_BYTES + 1, PROBES)  # ("FGPF")
    return np.sort(np.array(drawn, np.int64))


def fingerprint_mode(path: Path, fingerprint: str) -> bool:
    """True for `fingerprint="full"`, False for "sampled"; anything else is an error."""
    if fingerprint not in ("sampled", "full"):
        raise StoreError(f"{path}: fingerprint must be 'sampled' or 'full', not {fingerprint!r}")
    return fingerprint == "full"


WIDTH_SURE = 40  # lower-lane values above every upper-lane value: beyond this, wider ids (odds < 2^-40 by chance)
WIDTH_DISTINCT = 8  # ... and of at least this many distinct ids (data repeating with the lanes' period proves nothing)
WIDTH_UNSURE = 20  # from here (or with every upper lane zero) a derived dtype cannot be trusted either way
LARGEST_VOCAB = 1 << 20  # no tokenizer in use has more ids; 32-bit values past it without a vocab_size are suspect


def aligned_sample(tokens: np.ndarray) -> np.ndarray:
    """The bytes of the fingerprint's sampled blocks, each moved to start at a multiple of 8
    bytes from the data's start and cut to a multiple of 8 bytes, so that every view of the
    sample (as 16-, 32- or 64-bit items) puts each item of the true width in the same lane."""
    item = tokens.dtype.itemsize
    parts = [np.ascontiguousarray(tokens[lo // item : hi // item]).view(np.uint8)
             for lo, hi in aligned_spans(len(tokens) * item)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def aligned_spans(nbytes: int) -> list[tuple[int, int]]:
    """The byte spans of `aligned_sample` in data of `nbytes` bytes (a reader of ranges reads them)."""
    spans = []
    for off in sample_offsets(nbytes):
        lo = off // 8 * 8
        hi = min(lo + SAMPLE_BLOCK_BYTES, nbytes) // 8 * 8
        if hi > lo:
            spans.append((lo, hi))
    return spans


def _lanes(raw: np.ndarray, item: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """The sample as little-endian `item`-byte values in groups of `group` bytes: (the lowest
    value of each group, the other values)."""
    values = raw[: len(raw) // group * group].view(f"<u{item}").reshape(-1, group // item)
    return values[:, 0], values[:, 1:]


def _exceeding(low: np.ndarray, high: np.ndarray) -> tuple[int, int]:
    """How many lower-lane values exceed every upper-lane value, and how many distinct ones.
    For items of the width read, the lanes are alike (a position's parity says nothing of its
    token), so a few at most; for wider ids read narrow, the upper lanes hold the ids' high
    halves (zero, or tiny) and the lower lanes the ids."""
    if not high.size:
        return 0, 0
    above = low[low > high.max()]
    return len(above), len(np.unique(above))


def check_width(path: Path, raw: np.ndarray, dtype: np.dtype, *, declared: bool, vocab_size: int | None = None) -> None:
    """Refuse a file whose bytes say its ids are wider or narrower than the `dtype` it is read
    with, judged on the whole of its `aligned_sample` (`raw`). A dtype the user declared is
    refused only when the evidence is beyond doubt; a derived one (from a vocabulary or a
    tokenizer) also when the sample cannot tell, asking for `dtype=` rather than guessing."""
    for wide in (8, 4, 2):
        if wide > dtype.itemsize:
            _check_not_wider(path, raw, dtype, wide, declared)
    if dtype.itemsize == 4:
        _check_not_narrower(path, raw, dtype, vocab_size)


def _check_not_wider(path: Path, raw: np.ndarray, dtype: np.dtype, wide: int, declared: bool) -> None:
    """`wide`-byte ids read as `dtype`: every group's upper values are the ids' high halves."""
    item = dtype.itemsize
    low, high = _lanes(raw, item, wide)
    k, distinct = _exceeding(low, high)
    top = int(high.max()) if high.size else 0
    bits, name = wide * 8, {8: "int64", 4: "int32", 2: "uint16"}[wide]
    # beyond doubt: many values, of many ids, above upper parts small enough to be ids' high halves
    if k >= WIDTH_SURE and distinct >= WIDTH_DISTINCT and top <= (LARGEST_VOCAB - 1) >> (8 * item):
        which = "every other token" if wide // item == 2 else f"{wide // item - 1} of every {wide // item} tokens"
        value = "0" if not top else f"at most {top} where the others reach {int(low.max())}"
        raise StoreError(
            f"{path}: read as {dtype}, {which} is {value} (in all {len(low)} sampled groups): the signature of "
            f"{bits}-bit ids read as {item * 8}-bit. Declare dtype='{name}'"
            + ("" if name == f"uint{bits}" else f" (or 'uint{bits}'), whichever wrote the file")
        )
    if not declared and k and (k >= WIDTH_UNSURE or not top):
        raise StoreError(
            f"{path}: read as {dtype} (derived from the vocabulary), the sample cannot tell it from {bits}-bit ids "
            f"read as {item * 8}-bit ({k} of its {len(low)} {bits}-bit groups fit either). Declare the dtype the "
            f"file was written with: dtype='{dtype}' or '{name}'"
        )


def _check_not_narrower(path: Path, raw: np.ndarray, dtype: np.dtype, vocab_size: int | None) -> None:
    """16-bit ids read as 32-bit: a value's two halves look alike, giving ids past the
    vocabulary (wider misreads give ids past int32, which `check_ids` names, as it names
    negative ids)."""
    values = raw[: len(raw) // 4 * 4].view(dtype)
    if not len(values) or values.min() < 0:
        return
    low, high = _lanes(raw, 2, 4)
    limit = vocab_size or LARGEST_VOCAB
    if int(high.max()) > (limit - 1) >> 16 and _exceeding(low, high)[0] < WIDTH_UNSURE:
        past = f"vocab_size {vocab_size:,}" if vocab_size else f"{LARGEST_VOCAB:,}, more than any tokenizer has"
        raise StoreError(
            f"{path}: read as {dtype}, the sample's values have upper halves like their lower halves (ids past "
            f"{past}): the signature of 16-bit ids read as 32-bit. Declare dtype='uint16'"
            + ("" if vocab_size else ", or give vocab_size= if the vocabulary really is that large")
        )


def check_arrays_ids(path: Path, arrays, vocab_size: int | None) -> None:
    """`check_ids` over the ids of `arrays` (any iterable; empty arrays are passed over)."""
    lo = hi = None
    for a in arrays:
        if len(a):
            lo = int(a.min()) if lo is None else min(lo, int(a.min()))
            hi = int(a.max()) if hi is None else max(hi, int(a.max()))
    if lo is not None:
        check_ids(path, lo, hi, vocab_size)


def check_ids(path: Path, lo: int, hi: int, vocab_size: int | None) -> None:
    """Token ids must be non-negative, fit int32 batches, and lie below `vocab_size`."""
    if lo < 0:
        raise StoreError(f"{path}: holds the negative token id {lo}; token ids are never negative (wrong dtype?)")
    if hi > MAX_TOKEN_ID:
        raise StoreError(f"{path}: holds token id {hi}, which does not fit the int32 ids of batches (wrong dtype?)")
    if vocab_size is not None and hi >= vocab_size:
        raise StoreError(f"{path}: token id {hi} is at or past vocab_size {vocab_size}")


def spread(values: np.ndarray, limit: int = CHECK_ALL_BOUNDARIES) -> np.ndarray:
    """All of `values`, or `limit` of them evenly spaced (the first and last included)."""
    if len(values) <= limit:
        return values
    return values[np.linspace(0, len(values) - 1, limit).astype(np.int64)]


def check_special_ids(path: Path, dtype: np.dtype, vocab_size: int | None, eos_id, bos_id) -> None:
    """A declared EOS/BOS id must be a token the files can hold and the vocabulary has: one
    that cannot occur would leave every file one document, silently."""
    top = np.iinfo(dtype).max if dtype.kind in "iu" else None
    for name, value in (("eos_id", eos_id), ("bos_id", bos_id)):
        if value is None:
            continue
        if top is not None and value > top:
            raise StoreError(f"{path}: {name}={value} cannot occur in {dtype} tokens (at most {top}); "
                             "check the id, or the dtype")
        if vocab_size is not None and value >= vocab_size:
            raise StoreError(f"{path}: {name}={value} is not in the vocabulary of {vocab_size} ids; "
                             "check the id, or vocab_size")


def check_special_ends(path: Path, tokens_at, offsets: np.ndarray, eos_id, bos_id,
                       remedy: str = "check the id, or leave it out", limit: int = CHECK_ALL_BOUNDARIES) -> None:
    """Documents found by the format's own index must end with a declared EOS id and start
    with a declared BOS id (all documents, or an evenly spaced sample of `limit`, a million);
    `tokens_at(positions)` reads the tokens at positions of the store."""
    starts, ends = offsets[:-1], offsets[1:]
    nonempty = np.flatnonzero(ends > starts)
    for name, special, at, what in (("eos_id", eos_id, ends - 1, "end with"), ("bos_id", bos_id, starts, "start with")):
        if special is None or not len(nonempty):
            continue
        picked = spread(nonempty, limit)
        values = np.asarray(tokens_at(at[picked]))
        bad = np.flatnonzero(values != special)
        if len(bad):
            doc = int(picked[bad[0]])
            raise StoreError(
                f"{path}: {name}={special} was declared, but document {doc} "
                f"does not {what} it (it has {int(values[bad[0]])}); {remedy}"
            )


# -- files -----------------------------------------------------------------------------------------


def inside(directory: Path, name, index: str) -> Path:
    """`directory / name` for a file name a dataset's `index` lists, refused when the name is
    not a string or leads out of the directory (absolute, `..`, a link out): an index must not
    make another dataset's file (or any file) read as this one's data."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise StoreError(f"{directory / index}: lists a file name {name!r}, not a file name")
    file = directory / name
    if Path(name).is_absolute() or ".." in Path(name).parts or not file.resolve().is_relative_to(directory.resolve()):
        raise StoreError(f"{directory / index}: lists {name!r}, a file outside the dataset's directory; an index "
                         "may only name the dataset's own files")
    return file


def require_regular(file: Path, what: str) -> None:
    """A regular file (after links), never a device, a FIFO or a directory that would hang or mislead reads."""
    try:
        mode = file.stat().st_mode
    except FileNotFoundError:
        raise StoreError(f"{file}: {what} is missing") from None
    if not stat.S_ISREG(mode):
        raise StoreError(f"{file}: {what} is not a regular file")
