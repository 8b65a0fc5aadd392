"""What a row must hold, and the row that does not: a text field holds strings (lists only
with an explicit separator), a token field lists of integers; a read that failed is
explained by the file and row that made it fail (bytes that are not UTF-8, a line that is
not JSON, a row that is not an object, a field of the wrong type or missing).
"""

from __future__ import annotations

import json
from pathlib import Path

from forge_grain.corpora.files import JSON_SUFFIXES
from forge_grain.errors import PrepareError


def chain(e: BaseException | None) -> list[BaseException]:
    """The exception and its causes."""
    out = []
    while e is not None and len(out) < 20:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


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


def conversation_row(files: list[Path], mode: str, field: str) -> str | None:
    """The message of `corpora.chat.conversation` for the first JSON row that holds no
    conversation (or prompt and completion)."""
    from forge_grain.corpora.chat import conversation

    for f, row, value in _json_rows(files):
        if not isinstance(value, dict):
            return None  # not JSON Lines of objects: leave it to the generic message
        try:
            conversation(mode, value, field, lambda: f"{f}, row {row}")
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


# -- what a column must hold -------------------------------------------------------------------


def check_column(ds, source, field: str, *, tokens: bool, joined: str | None, chat: bool = False) -> None:
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
    if chat:
        return  # conversations: each row's messages are checked as it is read (`corpora.chat`)
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
