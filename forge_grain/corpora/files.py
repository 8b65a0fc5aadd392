"""Finding a corpus's files: which files a path, directory or glob names, what kind each
is, and what is refused before anything is read (a token store given as text, a path that
does not exist). Read by preparation and by streaming sources alike.
"""

from __future__ import annotations

import glob as globlib
import json
from pathlib import Path

from forge_grain.errors import PrepareError
from forge_grain.splits import select_named, split_of
from forge_grain.stores.manifest import FORMAT, MANIFEST_NAME

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".md": "text", ".py": "text"}
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


def refuse_token_store(path: Path) -> None:
    """A forge-grain token store given as input is already prepared: say so (its manifest
    would otherwise be read as a JSON corpus and fail with an Arrow cast error)."""
    manifest = path / MANIFEST_NAME
    if path.is_dir() and manifest.is_file():
        try:
            is_store = json.loads(manifest.read_text()).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            is_store = False
        if is_store:
            raise PrepareError(
                f"{path}: is already a forge-grain token store (its {MANIFEST_NAME} says so), not text to prepare; "
                "use it as it is: TokenStore.open(path), or `path` of a source in the config"
            )


def local_data_files(data_files) -> list[Path]:
    """The local files `data_files` (a path or glob, a list of them, or a dict of splits to
    them) names; URLs and what matches nothing are left out."""
    listed = list(data_files.values()) if isinstance(data_files, dict) else [data_files]
    listed = [x for item in listed for x in (item if isinstance(item, list) else [item])]
    found = []
    for item in listed:
        if isinstance(item, (str, Path)) and "://" not in str(item):
            try:
                found += find_files(item, None)
            except (PrepareError, OSError):
                pass
    return found


def find_files(source, split: str | None, exclude: Path | None = None) -> list[Path]:
    path = Path(source)
    if path.is_file():
        named = split_of(path)
        if split is not None and named is not None and named != split:
            raise PrepareError(f"{path}: this file is named for split {named!r}, but --split {split!r} was asked for")
        return [path]
    if path.is_dir():  # every visible file: one of a kind forge-grain does not read is named, not skipped
        files = sorted(f for f in path.rglob("*") if f.is_file()
                       and not any(part.startswith(".") for part in f.relative_to(path).parts))
    else:
        files = sorted(Path(f) for f in globlib.glob(str(source), recursive=True) if Path(f).is_file())
    if exclude is not None:
        outside = Path(exclude).resolve()
        files = [f for f in files if outside not in f.resolve().parents]
    unread = [f for f in files if f.suffix not in BUILDERS] if path.is_dir() else []
    if unread:
        raise PrepareError(
            f"{source}: holds {len(unread)} file(s) of a kind prepare does not read ({', '.join(map(str, unread[:3]))}"
            f"{', ...' if len(unread) > 3 else ''}); it reads {', '.join(sorted(BUILDERS))}. Move them out, or give a "
            f"glob of the files to read ({Path(source) / '**' / ('*' + files[0].suffix if files else '*.txt')})")
    if not files:
        raise PrepareError(f"{source}: no text, JSONL or Parquet files found")
    return select_named(files, split, source, PrepareError, base=path if path.is_dir() else None,
                        documents=is_documents(files))


def is_documents(files: list[Path]) -> bool:
    """Files read as a document each (text, Markdown, code), not as rows of a dataset."""
    return all(BUILDERS.get(f.suffix, "text") == "text" for f in files)


def builder_of(files: list[Path], source) -> str:
    kinds = {BUILDERS.get(f.suffix, "text") for f in files}
    if len(kinds) > 1:
        raise PrepareError(f"{source}: mixes file kinds {sorted(kinds)}; prepare each kind separately")
    return kinds.pop()


def refuse_missing_path(source) -> None:
    """A name that can only be a local path (a data suffix, or ./ ../ / ~) and does not exist."""
    s = str(source)
    if Path(s).suffix in BUILDERS or Path(s).suffix in (".bin", ".npy", ".arrow") or s.startswith(("/", "./", "../", "~")):
        raise PrepareError(f"{source}: no such file or directory")


def open_parquet(f, file: str):
    """A Parquet file's reader; a file that is not one (truncated, another format) is named."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(f)
    except (pa.ArrowInvalid, OSError) as e:
        raise PrepareError(f"{file}: not a readable Parquet file ({e}); it is truncated or not Parquet") from None


def files_identity(data_files) -> list:
    """Local data files by path, size and modification time (what changes when they do)."""
    if data_files is None:
        return []
    if isinstance(data_files, dict):
        items = list(data_files.values())
    elif isinstance(data_files, list):
        items = data_files
    else:
        items = [data_files]
    out = []
    for item in items:
        for f in sorted(globlib.glob(str(item))) or [str(item)]:
            p = Path(f)
            out.append([str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] if p.exists() else [str(item)])
    return out
