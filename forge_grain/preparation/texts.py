"""Corpora as Hugging Face `datasets.Dataset`s: local files, saved datasets, or hub names.

Nothing about the input is guessed. A directory of split files (`train.jsonl`,
`validation.jsonl`, ...) gives the split asked for, never all of them (see `splits`); a
text field must hold strings (lists only with an explicit separator), a token field lists
of integers; bytes that are not UTF-8 are reported with their file and line.
"""

from __future__ import annotations

import dataclasses
import glob as globlib
import json
import re
from pathlib import Path

from forge_grain import hub
from forge_grain.errors import PrepareError
from forge_grain.stores.manifest import FORMAT, MANIFEST_NAME
from forge_grain.splits import DEFAULT_SPLIT, select_named, split_of

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".md": "text", ".py": "text"}
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


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


def _refuse_token_store(path: Path) -> None:
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
) -> Corpus:
    """Load a corpus whose column `text_field` holds text (or `token_field` token ids).

    `source` is a file, a directory or glob of `.jsonl`/`.json`/`.parquet`/`.txt`
    files, a directory written by `Dataset.save_to_disk`, a dataset name on the Hugging
    Face Hub, or a builder name ("json", "parquet", "text") with `data_files`. Plain text
    files give one document per file by default (`text_unit="line"` or `"paragraph"`).
    `split` (default "train") picks the split of a directory of split files, a saved
    `DatasetDict` or a hub dataset. Files under `exclude` (the output being written, when
    it sits inside the input directory) are never input.
    """
    import datasets

    datasets.disable_progress_bars()  # forge-grain shows its own progress
    path = Path(source)
    corpus = Corpus(None, str(source))
    _refuse_token_store(path)
    if data_files is not None:
        corpus.files = local_data_files(data_files)  # (for naming the file of a row that fails to read)
        corpus.ds = _load(source, source, hf_config, data_files=data_files, split=split or DEFAULT_SPLIT,
                          streaming=streaming)
    elif path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        corpus.ds = _load_from_disk(path, split, streaming)
    elif path.exists() or any(c in str(source) for c in "*?["):
        files = _data_files(source, split, exclude)
        builder = _builder(files, source)
        kwargs = {"sample_by": text_unit} if builder == "text" else {}
        if all(f.stat().st_size == 0 for f in files):
            raise PrepareError(f"{source}: the corpus is empty (no documents)")
        corpus = Corpus(None, str(source), files, builder, kwargs)
        corpus.ds = _load(source, builder, None, data_files=[str(f) for f in files], split="train",
                          streaming=streaming, files=files, field=token_field or text_field,
                          tokens=token_field is not None, **kwargs)
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
        _check(corpus.ds, source, token_field or text_field, tokens=token_field is not None, joined=list_separator)
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


def _load(source, name, hf_config, files=None, field=None, tokens=False, **kwargs):
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
        mixed = re.search(r"Column\(/?([^)]*)\) changed from", " | ".join(map(str, _chain(e))))
        if mixed and name == "json" and not mixed.group(1) and files:  # a row that is not an object
            found = non_object_row(files)
            if found:
                raise PrepareError(found) from None
        if mixed and name == "json" and kwargs.get("on_mixed_types") != "use_json":
            if mixed.group(1) != field:
                return _load(source, name, hf_config, files, field, tokens, **{**kwargs, "on_mixed_types": "use_json"})
            raise PrepareError(
                (files and mixed_json_row(files, field)) or f"{source}: field {field!r} mixes value types ({e})"
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


def _chain(e: BaseException | None) -> list[BaseException]:
    """The exception and its causes."""
    out = []
    while e is not None and len(out) < 20:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def open_parquet(f, file: str):
    """A Parquet file's reader; a file that is not one (truncated, another format) is named."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(f)
    except (pa.ArrowInvalid, OSError) as e:
        raise PrepareError(f"{file}: not a readable Parquet file ({e}); it is truncated or not Parquet") from None


def _json_lines(files: list[Path]):
    """(file, row, value, error) of each non-blank line of JSON Lines files, rows counted as
    the loader counts them; `error` is the ValueError of a line that is not JSON (value None).
    Bytes that are not UTF-8 are replaced: this serves error messages, `invalid_utf8` names those."""
    for f in files:
        row = 0
        with open(f, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    yield f, row, json.loads(line), None
                except ValueError as e:
                    yield f, row, None, e
                row += 1


def _json_rows(files: list[Path]):
    """(file, row, value) of each JSON Lines row, up to the first line that is not JSON (leave
    that to the loader, or to `bad_json_row`)."""
    for f, row, value, error in _json_lines(files):
        if error is not None:
            return
        yield f, row, value


def mixed_json_row(files: list[Path], field: str) -> str | None:
    """The message of `document_text` for the first JSON row whose `field` is not text."""
    for f, row, value in _json_rows(files):
        if not isinstance(value, dict):
            return None  # not JSON Lines of objects: leave it to the generic message
        try:
            document_text(value.get(field), lambda: f"{f}, row {row}")
        except PrepareError as e:
            return str(e)
    return None


def missing_field_row(files: list[Path], field: str, tokens: bool) -> str | None:
    """'FILE, row R: ...' for the first JSON row without `field` (a file lacking the field
    altogether makes `datasets` fail to cast it), worded as the row's own check words it."""
    for f, row, value in _json_rows(files):
        if isinstance(value, dict) and value.get(field) is None:
            return f"{f}, row {row}: {NULL_TOKENS if tokens else NULL_TEXT}"
    return None


def non_object_row(files: list[Path]) -> str | None:
    """'FILE, row R: ...' for the first JSON Lines row that is not an object."""
    for f, row, value in _json_rows(files):
        if not isinstance(value, dict):
            return (f"{f}, row {row}: a JSON {type(value).__name__}, not an object; each line of JSON Lines must be "
                    "an object holding the text field")
    return None


def bad_json_row(files: list[Path]) -> str | None:
    """'FILE, row R: ...' for the first non-blank line of JSON Lines files that is not JSON."""
    for f, row, _, error in _json_lines(files):
        if error is not None:
            return f"{f}, row {row}: not a JSON value ({error}); the line is truncated or not JSON Lines"
    return None


def json_files(files) -> list[Path]:
    """The JSON Lines files among `files` (local paths; None for none)."""
    return [Path(f) for f in files or [] if Path(f).suffix in JSON_SUFFIXES]


def bad_field_row(files: list[Path], field: str) -> str | None:
    """'FILE, row R: ...' for the first JSON Lines row whose `field` is not text, or is missing."""
    return mixed_json_row(files, field) or missing_field_row(files, field, False)


def explain_read_failure(source, files, field: str, error: BaseException) -> str:
    """What failed while reading a corpus of local `files`, naming the file and row where the
    files tell it (bytes that are not UTF-8, a line that is not JSON, a field that is not
    text or is missing), else the error itself with the source."""
    lines = json_files(files)
    found = lines and (invalid_utf8(lines) or bad_json_row(lines) or non_object_row(lines)
                       or bad_field_row(lines, field))
    return found or f"{source}: cannot read ({type(error).__name__}: {error})"


NULL_TEXT = "the text is null (missing); fill it or filter such rows out before preparing"
NULL_TOKENS = "the token list is null (missing)"


def _caused_by(e: BaseException, kind: type) -> bool:
    return any(isinstance(x, kind) for x in _chain(e))


def invalid_utf8(files: list[Path]) -> str | None:
    """'FILE, line L (byte B): ...' for the first bytes that are not UTF-8 in `files`."""
    import codecs

    for f in files:
        decoder = codecs.getincrementaldecoder("utf-8")()
        line, offset = 1, 0
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as e:
                    bad = block[: e.start].count(b"\n") if e.start >= 0 else 0
                    return (f"{f}, line {line + bad} (byte {offset + max(e.start, 0)}): bytes that are not UTF-8 "
                            f"({e.reason}); re-encode the file as UTF-8 or remove those bytes")
                line += block.count(b"\n")
                offset += len(block)
    return None


def local_data_files(data_files) -> list[Path]:
    """The local files `data_files` (a path or glob, a list of them, or a dict of splits to
    them) names; URLs and what matches nothing are left out."""
    listed = list(data_files.values()) if isinstance(data_files, dict) else [data_files]
    listed = [x for item in listed for x in (item if isinstance(item, list) else [item])]
    found = []
    for item in listed:
        if isinstance(item, (str, Path)) and "://" not in str(item):
            try:
                found += _data_files(item, None)
            except (PrepareError, OSError):
                pass
    return found


def _data_files(source, split: str | None, exclude: Path | None = None) -> list[Path]:
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


def _builder(files: list[Path], source) -> str:
    kinds = {BUILDERS.get(f.suffix, "text") for f in files}
    if len(kinds) > 1:
        raise PrepareError(f"{source}: mixes file kinds {sorted(kinds)}; prepare each kind separately")
    return kinds.pop()


def refuse_missing_path(source) -> None:
    """A name that can only be a local path (a data suffix, or ./ ../ / ~) and does not exist."""
    s = str(source)
    if Path(s).suffix in BUILDERS or Path(s).suffix in (".bin", ".npy", ".arrow") or s.startswith(("/", "./", "../", "~")):
        raise PrepareError(f"{source}: no such file or directory")


# -- what a column must hold -------------------------------------------------------------------


def _check(ds, source, field: str, *, tokens: bool, joined: str | None) -> None:
    columns = ds.column_names
    first = None
    if columns is None:  # a stream whose features are not declared: look at its first row
        first = next(iter(ds), None)
        if first is None:
            raise PrepareError(f"{source}: the corpus is empty (no documents)")
        columns = list(first)
    option = "--token-field" if tokens else "--text-field"
    if field not in columns:
        ids = [c for c in columns if _is_token_feature(ds, c, first)]
        hint = f"; {ids} hold token ids: prepare them with --token-field {ids[0]} --vocab-size N" if ids and not tokens else ""
        what = "token" if tokens else "text"
        raise PrepareError(
            f"{source}: no {what} field {field!r}; the columns are {columns} (choose one with {option}){hint}"
        )
    if hasattr(ds, "__len__") and len(ds) == 0:
        raise PrepareError(f"{source}: the corpus is empty (no documents)")
    features = getattr(ds, "features", None)
    feature = features.get(field) if features else None
    if feature is None or type(feature).__name__ == "Json":
        return  # undeclared, or a JSON value of varying type: each row is checked as it is read
    kind = _feature_kind(feature)
    if tokens and kind != "ids":
        raise PrepareError(f"{source}: --token-field {field!r} must hold lists of integer ids, not {feature}")
    if not tokens and kind == "ids":
        raise PrepareError(
            f"{source}: field {field!r} holds token ids, not text; prepare it with --token-field {field} "
            "--vocab-size N (or --tokenizer PATH to take the vocabulary size from it)"
        )
    if not tokens and kind == "strings" and joined is None:
        raise PrepareError(
            f"{source}: field {field!r} holds lists of strings, not one text per row; pass --join-lists SEP "
            "(for example --join-lists '\\n\\n') to join each list into one document"
        )
    if not tokens and kind not in ("string", "strings"):
        raise PrepareError(f"{source}: field {field!r} must hold text (strings), not {feature}")


def _feature_kind(feature) -> str:
    """'string', 'strings' (a list of them), 'ids' (a list of integers), or 'other'."""
    import datasets

    if isinstance(feature, datasets.Value):
        return "string" if feature.dtype in ("string", "large_string") else "other"
    inner = getattr(feature, "feature", None)
    if isinstance(feature, (list, datasets.Sequence)) or type(feature).__name__ in ("List", "LargeList"):
        inner = feature[0] if isinstance(feature, list) else inner
        if isinstance(inner, datasets.Value):
            if inner.dtype in ("string", "large_string"):
                return "strings"
            if inner.dtype.startswith(("int", "uint")):
                return "ids"
    return "other"


def _is_token_feature(ds, column: str, first) -> bool:
    features = getattr(ds, "features", None)
    if features and column in features:
        return _feature_kind(features[column]) == "ids"
    value = (first or {}).get(column)
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) for v in value)


def document_text(value, where, list_separator: str | None = None) -> str:
    """The text of one row's field: '' for empty and whitespace-only documents (skipped and
    counted), a joined list with `list_separator`, and a clear error for anything else.
    `where()` names the row (called only for an error)."""
    if isinstance(value, str):
        return value if value.strip() else ""
    if isinstance(value, list) and list_separator is not None and all(isinstance(v, str) for v in value):
        text = list_separator.join(value)
        return text if text.strip() else ""
    if value is None:
        problem = NULL_TEXT
    elif isinstance(value, list):
        problem = ("holds a list of strings; pass --join-lists SEP to join it" if all(isinstance(v, str) for v in value)
                   else f"holds a list of {sorted({type(v).__name__ for v in value})}, not text")
    else:
        problem = f"holds the {type(value).__name__} value {str(value)[:40]!r}, not text"
    raise PrepareError(f"{where()}: {problem}")
