"""What a file appears to be, from its magic bytes and layout.

A Parquet file, an ArrayRecord shard or a LitData chunk read as raw token ids gives
garbage documents that look plausible, and nothing downstream can notice. So before
forge-grain reads a file as tokens it asks `identify`; a file that is something else is
refused with a message saying how to read it. Only signatures that token data cannot
produce by accident are used (magic numbers, an offset table that ends exactly at the
file size, a sibling index of a known format).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

NPY_MAGIC = b"\x93NUMPY"
RIEGELI_MAGIC = b"\x83\xaf\x70\xd1\x0d\x88\x4a\x3f"  # the first bytes of every riegeli/ArrayRecord file
MEGATRON_IDX_MAGIC = b"MMIDIDX\x00\x00"
_MAGICS = (
    (b"PAR1", "a Parquet file", "prepare"),
    (RIEGELI_MAGIC, "an ArrayRecord (riegeli) file", "arrayrecord"),
    (MEGATRON_IDX_MAGIC, "a Megatron indexed-dataset index (.idx)", "megatron"),
    (b"ARROW1", "an Arrow IPC file", "arrow"),
    (b"\xff\xff\xff\xff", "an Arrow stream (a Hugging Face `save_to_disk` data file)", "arrow"),
    (b"PK\x03\x04", "a zip archive (an .npz?)", "archive"),
    (b"\x1f\x8b", "gzip-compressed data", "archive"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data", "archive"),
    (b"BZh", "bzip2-compressed data", "archive"),
    (b"\xfd7zXZ\x00", "xz-compressed data", "archive"),
    (b"\x80\x04\x95", "a Python pickle", "archive"),
    (b"\x80\x05\x95", "a Python pickle", "archive"),
)

ADVICE = {
    "prepare": "tokenize it with `forge-grain prepare FILE OUT` (a text column), or `prepare ... --token-field "
               "COLUMN --vocab-size N` if a column already holds token ids",
    "arrayrecord": "open the forge-grain store directory that holds it (with its manifest.json); for other "
                   "ArrayRecord data, write a store from its token arrays with `forge_grain.write_store`",
    "megatron": "Megatron data is indexed by its `.idx` file, not by EOS ids: open the prefix (or its .bin) with "
                "`TokenStore.open(PATH)`, which reads the index (format='megatron')",
    "arrow": "open a `save_to_disk` directory of token ids in place with `TokenStore.open(DIR)` (format='arrow', "
             "token_field=COLUMN), or tokenize a text column with `forge-grain prepare DIR OUT`",
    "archive": "unpack it first: forge-grain reads uncompressed token arrays only",
    "litdata": "LitData chunks carry their own headers: open the directory with its index.json in place with "
               "`TokenStore.open(DIR)` (format='litdata')",
    "mds": "MosaicML MDS shards carry their own headers: open the directory with its index.json in place with "
           "`TokenStore.open(DIR)` (format='mds', token_field=COLUMN)",
    "text": "tokenize it with `forge-grain prepare FILE OUT`",
    "config": "`forge-grain inspect CONFIG.toml` summarises the sources of a config (or a KempnerForge job file), "
              "and `DataConfig.from_toml` loads it; open the stores its sources name",
}


def identify(path: Path) -> tuple[str, str] | None:
    """(what the file appears to be, the advice key) for files that are not raw tokens or
    a `.npy` array; None when nothing but token data is recognised."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if head.startswith(NPY_MAGIC):
        return None
    for magic, what, advice in _MAGICS:
        if head.startswith(magic):
            return what, advice
    if path.suffix == ".bin" and megatron_index(path.with_suffix(".idx")):
        return f"the data of a Megatron indexed dataset (its index {path.with_suffix('.idx').name} is beside it)", "megatron"
    index = _sibling_index(path)
    if index == "litdata":
        return "a LitData chunk (its index.json is beside it)", "litdata"
    if index == "mds" or ".mds" in path.suffixes:
        return "a MosaicML Streaming (MDS) shard", "mds"
    if _has_sample_table(path, head):
        return "a chunk of samples with an offset table (LitData or MosaicML MDS layout)", "litdata"
    if path.suffix == ".toml" and _looks_like_text(head):
        return "a TOML file (a data config or a job file?)", "config"
    if _looks_like_text(head):
        return ("JSON text" if head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] in (b"{", b"[") else "text"), "text"
    return None


def describe(path: Path) -> str | None:
    """One sentence for an error message: what the file is and how to read it."""
    found = identify(path)
    if found is None:
        return None
    what, advice = found
    return f"{path}: this is {what}, not raw token ids; {ADVICE[advice]}"


def describe_directory(path: Path) -> str | None:
    """What a directory without token files holds, for the "nothing to open" error."""
    path = Path(path)
    if (path / "state.json").exists() and (path / "dataset_info.json").exists():
        return f"{path}: a Hugging Face `save_to_disk` dataset; {ADVICE['arrow']}"
    kind = index_kind(read_index(path / "index.json"))
    if kind:
        return f"{path}: a {'LitData' if kind == 'litdata' else 'MosaicML MDS'} dataset; {ADVICE[kind]}"
    # hidden files are never data: forge-grain's own caches (document indices, plans) are hidden
    suffixes = {f.suffix for f in path.iterdir() if f.is_file() and not f.name.startswith(".")} if path.is_dir() else set()
    data = sorted(suffixes & {".jsonl", ".json", ".parquet", ".txt", ".arrow", ".idx", ".mds"})
    if data:
        return f"{path}: holds {', '.join(data)} files, not token arrays; {ADVICE['prepare']}"
    return None


def megatron_prefix(path: Path) -> Path | None:
    """The dataset prefix when `path` is a Megatron prefix, its `.bin` or its `.idx`, else None."""
    path = Path(path)
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    return prefix if megatron_index(Path(f"{prefix}.idx")) else None


def megatron_index(idx: Path) -> bool:
    try:
        with open(idx, "rb") as f:
            return f.read(len(MEGATRON_IDX_MAGIC)) == MEGATRON_IDX_MAGIC
    except OSError:
        return False


def read_index(index: Path):
    """A sibling `index.json` as parsed JSON, or None."""
    try:
        return json.loads(index.read_text())
    except (OSError, ValueError):
        return None


def index_kind(d) -> str | None:
    """'litdata' or 'mds' for the index of those formats, else None."""
    if isinstance(d, dict) and "chunks" in d and "config" in d:
        return "litdata"
    if isinstance(d, dict) and isinstance(d.get("shards"), list):
        return "mds"
    return None


def _sibling_index(path: Path) -> str | None:
    """The format of an `index.json` beside `path` that lists this file."""
    d = read_index(path.parent / "index.json")
    kind = index_kind(d)
    return kind if kind and path.name in json.dumps(d) else None


def _has_sample_table(path: Path, head: bytes) -> bool:
    """uint32 n, then n+1 uint32 offsets from the table's end to exactly the file size:
    the header of LitData chunks and MDS shards (token data never ends so precisely)."""
    if len(head) < 8:
        return False
    n = int(np.frombuffer(head[:4], "<u4")[0])
    size = path.stat().st_size
    table_end = 4 * (n + 2)
    if n == 0 or table_end > size or table_end > 1 << 24:
        return False
    with open(path, "rb") as f:
        f.seek(4)
        offsets = np.frombuffer(f.read(4 * (n + 1)), "<u4")
    return bool(offsets[0] >= table_end and offsets[-1] == size and np.all(np.diff(offsets.astype(np.int64)) >= 0))


def _looks_like_text(head: bytes) -> bool:
    """UTF-8 without NUL bytes, almost all printable: token ids below 8,224 (which every
    real corpus has many of) put a control byte in every uint16 and a NUL in every uint32."""
    if len(head) < 16 or b"\x00" in head:
        return False
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # only a character cut at the 4 KiB boundary is forgiven
            return False
        text = head[: e.start].decode("utf-8")
    printable = sum(c.isprintable() or c in "\t\r\n" for c in text)
    return printable >= 0.99 * len(text)


def formats_named(names: set[str], index=None) -> dict[str, tuple[str, str]]:
    """The formats whose marker files are among the file `names` of a directory (`index`: its
    parsed `index.json`, if any): name -> (what, which files say so). Also for a listing of
    object storage, where a format that is not read remotely is then named."""
    found = {}
    if "manifest.json" in names:
        found["native"] = ("a forge-grain store", "manifest.json")
    kind = index_kind(index)
    if kind == "litdata":
        found["litdata"] = ("a LitData dataset", "index.json with chunks")
    elif kind == "mds":
        found["mds"] = ("a MosaicML MDS dataset", "index.json with shards")
    if {"state.json", "dataset_info.json"} <= names:
        found["arrow"] = ("a Hugging Face save_to_disk dataset", "state.json")
    elif "dataset_dict.json" in names:
        found["arrow"] = ("a Hugging Face save_to_disk DatasetDict", "dataset_dict.json")
    if any(n.endswith(".idx") for n in names):
        found["megatron"] = ("a Megatron indexed dataset", ".idx files")
    return found
