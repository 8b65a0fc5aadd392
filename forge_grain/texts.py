"""Text corpora as Hugging Face `datasets.Dataset`s: local files, saved datasets, or hub names."""

from __future__ import annotations

import glob as globlib
import os
import socket
from pathlib import Path

from .errors import PrepareError

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".md": "text", ".py": "text"}
HUB_HOST = "huggingface.co"


def load_texts(
    source: str | Path,
    *,
    text_field: str = "text",
    split: str = "train",
    hf_config: str | None = None,
    text_unit: str = "document",
    data_files=None,
    streaming: bool = False,
):
    """Load a corpus as a `datasets.Dataset` (or `IterableDataset` when `streaming`) with a
    string column `text_field`.

    `source` is a file, a directory or glob of `.jsonl`/`.json`/`.parquet`/`.txt`
    files, a directory written by `Dataset.save_to_disk`, a dataset name on the Hugging
    Face Hub, or a builder name ("json", "parquet", "text") with `data_files`. Plain text
    files give one document per file by default (`text_unit="line"` or `"paragraph"`).
    """
    import datasets

    datasets.disable_progress_bars()  # forge-grain shows its own progress
    path = Path(source)
    if data_files is not None:
        ds = _load(source, source, hf_config, data_files=data_files, split=split, streaming=streaming)
    elif path.is_dir() and (path / "state.json").exists():
        ds = datasets.load_from_disk(str(path))
        ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        ds = ds.to_iterable_dataset() if streaming else ds
    elif path.exists() or any(c in str(source) for c in "*?["):
        files = _data_files(source)
        builder = _builder(files, source)
        kwargs = {"sample_by": text_unit} if builder == "text" else {}
        if all(f.stat().st_size == 0 for f in files):
            raise PrepareError(f"{source}: the corpus is empty (no documents)")
        ds = _load(source, builder, None, data_files=[str(f) for f in files], split="train", streaming=streaming,
                   **kwargs)
        if builder == "text" and text_field != "text":
            ds = ds.rename_column("text", text_field)
    else:
        if os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false") and not _reachable(HUB_HOST):
            raise PrepareError(
                f"{source}: not a local path, and the Hugging Face Hub ({HUB_HOST}) cannot be reached to download "
                "it. Give a local file, directory or glob, or download the dataset first (or set HF_HUB_OFFLINE=1 "
                "to use a dataset already in the local Hugging Face cache)."
            )
        ds = _load(source, str(source), hf_config, split=split, streaming=streaming)
    _check(ds, source, text_field)
    return ds


def _load(source, name, hf_config, **kwargs):
    import datasets

    try:
        return datasets.load_dataset(name, hf_config, **kwargs)
    except Exception as e:  # datasets raises many kinds; name the input and the cause
        raise PrepareError(f"{source}: cannot load ({type(e).__name__}: {e})") from None


def _data_files(source) -> list[Path]:
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in BUILDERS)
    else:
        files = sorted(Path(f) for f in globlib.glob(str(source), recursive=True) if Path(f).is_file())
    if not files:
        raise PrepareError(f"{source}: no text, JSONL or Parquet files found")
    return files


def _builder(files: list[Path], source) -> str:
    kinds = {BUILDERS.get(f.suffix, "text") for f in files}
    if len(kinds) > 1:
        raise PrepareError(f"{source}: mixes file kinds {sorted(kinds)}; prepare each kind separately")
    return kinds.pop()


def _reachable(host: str, port: int = 443, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _check(ds, source, text_field: str) -> None:
    columns = ds.column_names
    if columns is None:  # a stream whose features are not declared: look at its first row
        first = next(iter(ds), None)
        if first is None:
            raise PrepareError(f"{source}: the corpus is empty (no documents)")
        columns = list(first)
    if text_field not in columns:
        raise PrepareError(
            f"{source}: no text field {text_field!r}; the columns are {columns} (choose one with --text-field)"
        )
    if hasattr(ds, "__len__") and len(ds) == 0:
        raise PrepareError(f"{source}: the corpus is empty (no documents)")
