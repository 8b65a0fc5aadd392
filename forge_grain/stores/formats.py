"""Which format a path holds, from what is on disk; a path that could be read two ways is refused."""

from __future__ import annotations

import importlib
from pathlib import Path

from forge_grain.errors import StoreError
from forge_grain.paths import is_url, local_path
from forge_grain.stores import identify
from forge_grain.stores.base import TokenStore

# format name -> (module, class)
FORMATS = {
    "native": ("native", "NativeStore"),
    "raw": ("raw", "RawStore"),
    "megatron": ("megatron", "MegatronStore"),
    "arrow": ("arrow", "ArrowStore"),
    "litdata": ("litdata", "LitDataStore"),
    "mds": ("mds", "MDSStore"),
}


def store_class(path, format: str | None = None, options: dict | None = None):
    """The `TokenStore` subclass for `path`: `format` when given (it must be one of the formats
    the directory's marker files show, if any), else the one detected. A URL (`s3://...`) is
    detected from its listing (`options`' `storage_options` reach it): a forge-grain store
    fetches its shards as the plan needs them, a Megatron dataset in blocks of documents, a
    LitData dataset a chunk at a time, and another peer's dataset is copied into the cache
    (with a `cache_limit`, read a data file at a time, or a raw file in blocks of documents)."""
    if is_url(path):
        from forge_grain.stores.mirror import mirrored_class, remote_format
        from forge_grain.stores.mirror_parts import PARTED, parted_class
        from forge_grain.stores.mirror_ranges import RANGED, ranged_class
        from forge_grain.stores.remote import RemoteStore

        if format is not None and format not in FORMATS:
            raise StoreError(f"{path}: unknown format {format!r}; one of {', '.join(FORMATS)}")
        name = format or remote_format(str(path), (options or {}).get("storage_options"))
        if name == "native":
            return RemoteStore
        if name in PARTED and (name == "litdata" or (options or {}).get("cache_limit") is not None):
            return parted_class(_load(name))  # a file at a time (LitData chunks say where their documents are)
        if name == "megatron" or (name in RANGED and (options or {}).get("cache_limit") is not None):
            return ranged_class(_load(name))  # blocks of documents (a Megatron .idx lists them: no copy at open)
        return mirrored_class(_load(name))
    path = local_path(path)
    name = format or detect(path)
    if name not in FORMATS:
        raise StoreError(f"{path}: unknown format {name!r}; one of {', '.join(FORMATS)}")
    found = _directory_formats(path) if format is not None and path.is_dir() else {}
    if found and format not in found:
        raise StoreError(
            f"{path}: format={format!r} was given, but this is "
            f"{' and '.join(f'{what} ({why})' for what, why in found.values())}"
        )
    return _load(name)


def _load(name: str):
    module, cls = FORMATS[name]
    return getattr(importlib.import_module(f".{module}", __package__), cls)


TokenStore.resolve = staticmethod(store_class)


def detect(path: Path) -> str:
    """The format of `path`: a directory's marker files, or a file's own signature."""
    path = Path(path)
    if path.is_dir():
        _check_index_json(path)
        found = _directory_formats(path)
        if len(found) > 1:
            raise StoreError(
                f"{path}: holds the files of {' and of '.join(f'{what} ({why})' for what, why in found.values())}; "
                f"it cannot be read both ways: pass format= one of {', '.join(sorted(found))}, or separate them"
            )
        return next(iter(found), "raw")
    if identify.megatron_prefix(path) is not None:
        return "megatron"
    _refuse_broken_megatron_index(path)
    if path.suffix == ".arrow" and path.is_file():
        return "arrow"
    return "raw"


def _refuse_broken_megatron_index(path: Path) -> None:
    """A Megatron prefix (or its .bin/.idx) whose `.idx` is not an index: say that, not that
    no token files were found or that the .bin has no dtype."""
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    idx = Path(f"{prefix}.idx")
    if idx.is_file() and (path.suffix in (".bin", ".idx") or not path.exists()):
        size = idx.stat().st_size
        raise StoreError(f"{idx}: a Megatron index without its header ({size} bytes{', empty' if not size else ''}): "
                         "the preprocessing did not finish or the file was cut; run Megatron's preprocess_data.py "
                         "again")


def _check_index_json(path: Path) -> None:
    """An `index.json` (LitData, MDS) that is empty or not JSON: an index written incompletely."""
    index = path / "index.json"
    if index.is_file() and identify.read_index(index) is None:
        size = index.stat().st_size
        raise StoreError(f"{index}: {'empty' if not size else f'not JSON ({size} bytes)'}: the index of a LitData or "
                         "MosaicML MDS dataset was not written completely; run optimize() / MDSWriter again")


def _directory_formats(path: Path) -> dict[str, tuple[str, str]]:
    """The formats whose marker files `path` holds: name -> (what, which files say so)."""
    names = {p.name for p in path.iterdir() if p.suffix != ".idx"}
    names |= {p.name for p in path.glob("*.idx") if identify.megatron_index(p)}  # real Megatron indices only
    return identify.formats_named(names, identify.read_index(path / "index.json"))


