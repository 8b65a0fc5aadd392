"""Which split a data file belongs to, by the Hugging Face naming convention.

A directory holding `train.jsonl`, `validation.jsonl` and `test.jsonl` (or
`train.bin` and `val.bin`, or `data/train-00000-of-00004.parquet`) holds three splits,
not one corpus. `datasets.load_dataset(directory)` reads such names the same way: a
split keyword is a word of the file name, or the name of a parent directory, where
words are delimited by `-`, `.`, `_`, a space or a digit. Files that carry no split
keyword at all form the single split "train"; a directory that mixes the two kinds is
ambiguous and refused, so no file is ever silently dropped or merged into another split.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

# datasets.data_files.SPLIT_KEYWORDS (a test checks they stay equal); copied so that
# classifying token files does not import `datasets`
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
DEFAULT_SPLIT = "train"
_WORDS = re.compile(r"[-._ 0-9]+")
_KEYWORD_TO_SPLIT = {k: split for split, keys in SPLIT_KEYWORDS.items() for k in keys}


def split_of(path: Path, base: Path | None = None) -> str | None:
    """The split named by `path`'s file name or (below `base`) a parent directory, or None."""
    name_words = [w.lower() for w in _WORDS.split(path.name) if w]
    found = {_KEYWORD_TO_SPLIT[w] for w in name_words if w in _KEYWORD_TO_SPLIT}
    if not found and base is not None:
        try:
            parents = path.parent.relative_to(base).parts
        except ValueError:
            parents = ()
        for part in parents:
            found |= {_KEYWORD_TO_SPLIT[w] for w in _WORDS.split(part.lower()) if w in _KEYWORD_TO_SPLIT}
    if len(found) > 1:
        return "ambiguous:" + "+".join(sorted(found))
    return found.pop() if found else None


def select_named(
    files: list[Path], split: str | None, where, error: Callable[[str], Exception], *, base: Path | None = None,
    documents: bool = False,
) -> list[Path]:
    """The input files a user named for preparation. A glob's matches (`base` None) and a
    directory of documents (text, Markdown, code: a document a file, `documents`) are the
    user's files, every one of them: a `test_io.py` in a code corpus is code, not a "test"
    split. A directory of data files (JSON Lines, Parquet: a Hub-style dataset) follows the
    split convention (`select_split`), as does any input given `split`."""
    if split is None and (base is None or documents):
        return files
    return select_split(files, split, where, error, base=base)


def select_split(
    files: list[Path], split: str | None, where, error: Callable[[str], Exception], *, base: Path | None = None,
    default: str | None = DEFAULT_SPLIT,
) -> list[Path]:
    """The files of `split` among `files` (all of them when none is named for a split).

    `split=None` means `default`; with `default=None` a set of files spanning several
    splits is refused instead of choosing one. Raises `error(message)` naming `where`.
    """
    by_split: dict[str | None, list[Path]] = {}
    for f in files:
        by_split.setdefault(split_of(f, base), []).append(f)
    ambiguous = [f for s, fs in by_split.items() if s and s.startswith("ambiguous:") for f in fs]
    if ambiguous:
        raise error(
            f"{where}: {ambiguous[0]} is named for more than one split; rename it or name the files explicitly"
        )
    named = sorted(s for s in by_split if s is not None)
    if not named:  # no split names anywhere: all files are one split, "train" by the convention
        if split not in (None, DEFAULT_SPLIT):
            raise error(
                f"{where}: no file is named for split {split!r} (no file name carries a split keyword, so all "
                f"{len(files)} file(s) form the split 'train'); give the files of that split directly"
            )
        return files
    if None in by_split:
        stray = ", ".join(f.name for f in by_split[None][:3])
        raise error(
            f"{where}: some files are named for splits {named} and others for none ({stray}); "
            "move the others out, or name the files you want explicitly (a file or a glob)"
        )
    if split is None:
        split = default
        if split is None and len(named) == 1:
            split = named[0]
        if split is None:
            raise error(
                f"{where}: holds files of the splits {named}; choose one with split= (--split), "
                "so that files of different splits are never merged"
            )
    if split not in by_split:
        raise error(f"{where}: no files of split {split!r}; the splits here are {named}")
    return by_split[split]
