"""Corpora as Hugging Face `datasets.Dataset`s: local files, saved datasets, or hub names.

Nothing about the input is guessed. A directory of split files (`train.jsonl`,
`validation.jsonl`, ...) gives the split asked for, never all of them (see `splits`); what
a column must hold is `corpora.rows`'s to check.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from forge_grain import hub
from forge_grain.corpora.files import builder_of, find_files, local_data_files, refuse_missing_path, refuse_token_store
from forge_grain.corpora.rows import (
    bad_json_row,
    chain,
    check_column,
    conversation_row,
    explain_read_failure,
    invalid_utf8,
    missing_field_row,
    mixed_json_row,
    non_object_row,
)
from forge_grain.errors import PrepareError
from forge_grain.splits import DEFAULT_SPLIT


@dataclasses.dataclass
class Corpus:
    """A loaded dataset and what is needed to say where one of its rows came from."""

    ds: object  # datasets.Dataset or IterableDataset
    source: str
    files: list[Path] | None = None  # local data files, in the order their rows appear
    builder: str | None = None
    builder_kwargs: dict = dataclasses.field(default_factory=dict)

    def where(self, row: int) -> str:
        """'FILE, row M' for a row of local files (found only when an error needs it), else 'SOURCE, row N'."""
        if self.files and len(self.files) == 1:
            return f"{self.files[0]}, row {row}"
        if self.files:
            import datasets

            seen = 0
            for f in self.files:
                n = len(datasets.load_dataset(self.builder, data_files=[str(f)], split="train", **self.builder_kwargs))
                if row < seen + n:
                    return f"{f}, row {row - seen}"
                seen += n
        return f"{self.source}, row {row}"


def load_texts(source, **kwargs):
    """The dataset of `load_corpus` (see there)."""
    return load_corpus(source, **kwargs).ds


def source_texts(src, streaming: bool):
    """The texts of a Hugging Face `SourceConfig` (eager or streaming; with `chat`, its
    conversations)."""
    chat = getattr(src, "chat", None)
    field = {None: src.text_field, "messages": "messages" if src.text_field == "text" else src.text_field,
             "prompt_completion": "prompt"}[chat]
    return load_texts(src.hf_dataset, text_field=field, split=src.split, hf_config=src.hf_config,
                      data_files=src.hf_data_files, streaming=streaming, chat=chat)


def load_corpus(
    source: str | Path,
    *,
    text_field: str = "text",
    split: str | None = None,
    hf_config: str | None = None,
    text_unit: str = "document",
    data_files=None,
    streaming: bool = False,
    token_field: str | None = None,
    list_separator: str | None = None,
    exclude: Path | None = None,
    chat: str | None = None,
) -> Corpus:
    """Load a corpus whose column `text_field` holds text (or `token_field` token ids).

    `source` is a file, a directory or glob of `.jsonl`/`.json`/`.parquet`/`.txt`
    files, a directory written by `Dataset.save_to_disk`, a dataset name on the Hugging
    Face Hub, or a builder name ("json", "parquet", "text") with `data_files`. Plain text
    files give one document per file by default (`text_unit="line"` or `"paragraph"`).
    `split` (default "train") picks the split of a directory of split files, a saved
    `DatasetDict` or a hub dataset. Files under `exclude` (the output being written, when
    it sits inside the input directory) are never input. `chat` ("messages" or
    "prompt_completion"): `text_field` holds conversations (or prompts), checked row by row
    as they are read (`corpora.chat`).
    """
    import datasets

    datasets.disable_progress_bars()  # forge-grain shows its own progress
    path = Path(source)
    corpus = Corpus(None, str(source))
    refuse_token_store(path)
    if data_files is not None:
        corpus.files = local_data_files(data_files)  # (for naming the file of a row that fails to read)
        corpus.ds = _load(source, source, hf_config, data_files=data_files, split=split or DEFAULT_SPLIT,
                          streaming=streaming)
    elif path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        corpus.ds = _load_from_disk(path, split, streaming)
    elif path.exists() or any(c in str(source) for c in "*?["):
        files = find_files(source, split, exclude)
        builder = builder_of(files, source)
        kwargs = {"sample_by": text_unit} if builder == "text" else {}
        if all(f.stat().st_size == 0 for f in files):
            raise PrepareError(f"{source}: the corpus is empty (no documents)")
        corpus = Corpus(None, str(source), files, builder, kwargs)
        corpus.ds = _load(source, builder, None, data_files=[str(f) for f in files], split="train",
                          streaming=streaming, files=files, field=token_field or text_field,
                          tokens=token_field is not None, chat=chat, **kwargs)
        if builder == "text" and text_field != "text":
            corpus.ds = corpus.ds.rename_column("text", text_field)
    else:
        refuse_missing_path(source)
        if not hub.offline() and not hub.reachable():
            raise PrepareError(
                f"{source}: no such local file or directory, and the Hugging Face Hub ({hub.HUB_HOST}) cannot be reached "
                "to download a dataset of that name. Give a local file, directory or glob, or download the dataset "
                "first (or set HF_HUB_OFFLINE=1 to use a dataset already in the local Hugging Face cache)."
            )
        corpus.ds = _load(source, str(source), hf_config, split=split or DEFAULT_SPLIT, streaming=streaming)
    try:
        check_column(corpus.ds, source, token_field or text_field, tokens=token_field is not None, joined=list_separator,
                     chat=chat is not None)
    except PrepareError:
        raise
    except Exception as e:  # a stream's first rows failed to parse: name the file and row
        raise PrepareError(explain_read_failure(source, corpus.files, token_field or text_field, e)) from None
    return corpus


def _load_from_disk(path: Path, split: str | None, streaming: bool):
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        want = split or DEFAULT_SPLIT
        if want not in ds:
            raise PrepareError(f"{path}: a saved DatasetDict without split {want!r}; its splits are {list(ds)}")
        ds = ds[want]
    elif split not in (None, DEFAULT_SPLIT):
        raise PrepareError(f"{path}: a saved Dataset has no splits; --split {split!r} cannot apply (leave it out)")
    return ds.to_iterable_dataset() if streaming else ds


def _load(source, name, hf_config, files=None, field=None, tokens=False, chat=None, **kwargs):
    """`datasets.load_dataset`, with its failures turned into errors that name the file.

    JSON is read with `on_mixed_types=None`: by default `datasets` JSON-encodes a field
    whose type varies (and, across files, casts it to string, so `"ok"` arrives with its
    quotes and `7` as "7"). A field other than ours may vary: then it is read the default
    way, which is safe for ours once ours was seen to be consistent.
    """
    import datasets

    if name == "json":
        kwargs.setdefault("on_mixed_types", None)
    try:
        return datasets.load_dataset(name, hf_config, **kwargs)
    except Exception as e:  # datasets raises many kinds; name the input and the cause
        if _caused_by(e, UnicodeDecodeError) and files:
            raise PrepareError(invalid_utf8(files) or f"{source}: bytes that are not UTF-8 ({e})") from None
        mixed = re.search(r"Column\(/?([^)]*)\) changed from", " | ".join(map(str, chain(e))))
        if mixed and name == "json" and not mixed.group(1) and files:  # a row that is not an object
            found = non_object_row(files)
            if found:
                raise PrepareError(found) from None
        if mixed and name == "json" and kwargs.get("on_mixed_types") != "use_json":
            if mixed.group(1) != field:
                return _load(source, name, hf_config, files, field, tokens, chat,
                             **{**kwargs, "on_mixed_types": "use_json"})
            raise PrepareError(
                (files and (conversation_row(files, chat, field) if chat else mixed_json_row(files, field)))
                or f"{source}: field {field!r} mixes value types ({e})"
            ) from None
        missing = name == "json" and files and field and missing_field_row(files, field, tokens)
        if missing:
            raise PrepareError(missing) from None
        broken = name == "json" and files and bad_json_row(files)
        if broken:
            raise PrepareError(broken) from None
        cause = e.__cause__ or e.__context__
        detail = f"{type(e).__name__}: {e}" + (f"; caused by {type(cause).__name__}: {cause}" if cause else "")
        raise PrepareError(f"{source}: cannot load ({detail})") from None


def _caused_by(e: BaseException, kind: type) -> bool:
    return any(isinstance(x, kind) for x in chain(e))
