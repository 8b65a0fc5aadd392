"""The texts of a streaming source, read in order, with a position to resume from.

Two readers with one interface: `open(marker)` returns an iterator whose `next(keep)`
returns the next row's text (None when `keep` is false: a row another canonical stream
owns is passed over without being parsed where the format allows), and whose `marker()`
is a JSON-able position before that row; `open(marker)` resumes there.

- `DatasetTexts`: a Hugging Face `datasets` streaming dataset; the marker is its
  `state_dict()`.
- `FileTexts`: JSON Lines or Parquet files at fsspec URLs (`s3://`, `gs://`, `hf://`),
  read directly: no local copy, no `datasets` download cache. Every ranged read goes
  through the retries of object-storage stores (`stores.remote_dir.RemoteDir.retry`); the
  marker is [file, row, byte offset] (JSON Lines resumes by seeking, Parquet by row group).
  Rows are counted as the local loader counts them (blank lines are not rows).
"""

from __future__ import annotations

import io
import json
import weakref

from forge_grain.errors import PrepareError
from forge_grain.paths import is_url
from forge_grain.corpora.files import JSON_SUFFIXES
from forge_grain.corpora.rows import bad_field_row, document_text, explain_read_failure, json_files

READ_BLOCK = 1 << 23  # bytes per ranged read of a remote file


def texts_reader(src):
    """The reader of a streaming `SourceConfig`: files at URLs are read directly, anything
    else through `datasets`."""
    files = src.hf_data_files
    listed = files if isinstance(files, list) else list(files.values()) if isinstance(files, dict) else [files]
    urls = [f for f in listed if f is not None and is_url(f)]
    if not urls:
        return DatasetTexts(src)
    if len(urls) != len(listed) or isinstance(files, dict):
        raise PrepareError(f"source '{src.name}': hf_data_files mixes URLs and local files, or names splits; give a "
                           "list of URLs (globs allowed) of one split")
    if src.hf_dataset not in ("json", "parquet"):
        raise PrepareError(f"source '{src.name}': files at URLs are streamed as hf_dataset 'json' (JSON Lines) or "
                           f"'parquet', not {src.hf_dataset!r}")
    return FileTexts(src.name, urls, src.hf_dataset, src.text_field, src.storage_options)


class DatasetTexts:
    """A `datasets` streaming dataset's rows."""

    def __init__(self, src):
        from forge_grain.corpora.files import files_identity
        from forge_grain.corpora.loading import source_texts

        self.src = src
        self.name = f"{src.hf_dataset} (streaming)"
        self.identity = [src.hf_dataset, src.hf_config, src.split, src.text_field, files_identity(src.hf_data_files)]
        self._load = lambda: source_texts(src, streaming=True)
        self._load()  # a clear error now for a missing field, an empty set, no network
        self.files = _local_files(src)

    def locate(self, field: str) -> str | None:
        """'FILE, row R: ...' for the first local row whose `field` is not text, if any."""
        return bad_field_row(json_files(self.files), field)

    def open(self, marker=None) -> "_DatasetIter":
        ds = self._load()
        if marker is not None:
            ds.load_state_dict(marker)
        return _DatasetIter(ds, self.src.text_field, marker, self)


class _DatasetIter:
    def __init__(self, ds, field: str, marker, texts: "DatasetTexts"):
        self.ds, self.field, self._it, self.texts = ds, field, _all_rows(ds), texts
        self._known = marker  # a restored stream reports its new position only once it is read
        # `datasets`' readers are generators: one left suspended until interpreter exit is
        # finalized after the modules it uses are gone, and prints a traceback. Closed when
        # this is collected, or at exit while the modules are still there.
        weakref.finalize(self, self._it.close)

    def next(self, keep: bool = True):
        try:
            row = next(self._it)
        except (StopIteration, PrepareError):
            raise
        except Exception as e:  # `datasets` and Arrow fail with many types; name the file and row
            raise PrepareError(explain_read_failure(self.texts.name, self.texts.files, self.field, e)) from None
        self._known = None
        return row[self.field] if keep else None

    def marker(self):
        return self._known if self._known is not None else self.ds.state_dict()

    def place(self):
        """The file and row of the row last read: `datasets` does not say (None)."""
        return None


def _local_files(src) -> list:
    """The local files a streaming source reads (for error messages), or [] for a Hub dataset."""
    from forge_grain.corpora.files import find_files, local_data_files

    if src.hf_data_files is not None:
        return local_data_files(src.hf_data_files)
    try:
        return find_files(src.hf_dataset, src.split)
    except (PrepareError, OSError, TypeError):
        return []


def _all_rows(ds):
    """Every row of a streaming dataset, also inside a DataLoader worker, where `iter(ds)`
    would give only that worker's share of the files (canonical streams divide the rows
    themselves, and a worker's stream must be the same rows as in any other process)."""
    prepare = getattr(ds, "_prepare_ex_iterable_for_iteration", None)
    if prepare is None or getattr(ds, "_formatting", None):
        return iter(ds)
    return (example for _, example in prepare())


class FileTexts:
    """JSON Lines or Parquet files at fsspec URLs, in the order of the list (globs sorted)."""

    def __init__(self, name: str, urls: list[str], kind: str, field: str, storage_options: dict | None = None):
        import fsspec

        self.field, self.kind = field, kind
        self.storage_options = storage_options or {}
        self.files: list[str] = []
        for url in urls:
            fs, _ = fsspec.core.url_to_fs(url, **self.storage_options)
            protocol = url.split("://", 1)[0]
            found = sorted(fs.glob(url)) if any(c in url for c in "*?[") else [url]
            if not found:
                raise PrepareError(f"{url}: no file matches (source '{name}')")
            self.files += [f if "://" in f else f"{protocol}://{f}" for f in found]
        self.name = self.files[0] if len(self.files) == 1 else f"{urls[0]} ({len(self.files)} files)"
        self._dirs = {}
        self.identity = []
        for f in self.files:
            remote, base = self._remote(f)
            info = remote.retry(base, lambda: remote.fs.info(remote.path(base)))
            suffix = f[f.rfind("."):].lower() if "." in f.rsplit("/", 1)[-1] else ""
            if (kind == "json") != (suffix in JSON_SUFFIXES) or (kind == "parquet" and suffix != ".parquet"):
                raise PrepareError(f"{f}: not a {'JSON Lines (.jsonl, .json)' if kind == 'json' else 'Parquet (.parquet)'}"
                                   f" file, as hf_dataset {kind!r} reads; list only such files")
            self.identity.append([f, info.get("size"), str(info.get("ETag") or info.get("etag") or info.get("mtime"))])
        self._check_field()

    def subset(self, indices: list[int]) -> "FileTexts":
        """The same reader over files `indices` only, in that order (what one canonical stream
        reads when files are dealt to streams): nothing is listed or read again."""
        part = object.__new__(FileTexts)
        part.__dict__.update(self.__dict__)
        part.files = [self.files[k] for k in indices]
        part.identity = [self.identity[k] for k in indices]
        return part

    def _remote(self, url: str):
        """(the `RemoteDir` of the file's directory, the file's name in it)."""
        from forge_grain.stores.remote_dir import RemoteDir

        parent, base = url.rsplit("/", 1)
        if parent not in self._dirs:
            self._dirs[parent] = RemoteDir(parent, self.storage_options)
        return self._dirs[parent], base

    def _check_field(self) -> None:
        it = self.open()
        try:
            it.next(True)
        except StopIteration:
            raise PrepareError(f"{self.name}: the corpus is empty (no documents)") from None

    def open(self, marker=None) -> "_FilesIter":
        return _FilesIter(self, *(marker or (0, 0, 0)))

    def reader(self, k: int) -> io.BufferedReader:
        remote, base = self._remote(self.files[k])
        return io.BufferedReader(_RangedFile(remote, base, self.identity[k][1]), buffer_size=READ_BLOCK)


class _FilesIter:
    def __init__(self, files: FileTexts, file: int, row: int, offset: int):
        self.files, self.file, self.row, self.offset = files, file, row, offset
        self._rows = None

    def marker(self):
        return [self.file, self.row, self.offset]

    def place(self) -> tuple[str, int]:
        """(file URL, row in that file) of the row last read."""
        return self.files.files[self.file], self.row - 1

    def next(self, keep: bool = True):
        while True:
            if self.file >= len(self.files.files):
                raise StopIteration
            if self._rows is None:
                self._rows = (self._json_lines if self.files.kind == "json" else self._parquet)()
            try:
                return next(self._rows)(keep)
            except StopIteration:
                self.file, self.row, self.offset, self._rows = self.file + 1, 0, 0, None

    def _json_lines(self):
        url, field = self.files.files[self.file], self.files.field
        f = self.files.reader(self.file)
        f.seek(self.offset)
        for line in f:
            self.offset += len(line)
            if not line.strip():
                continue
            row = self.row
            self.row += 1
            yield lambda keep, line=line, row=row: _json_text(line, url, row, field) if keep else None

    def _parquet(self):
        import pyarrow as pa

        from forge_grain.corpora.files import open_parquet

        url, field = self.files.files[self.file], self.files.field
        pf = open_parquet(self.files.reader(self.file), url)
        if field not in pf.schema_arrow.names:
            raise PrepareError(f"{url}: no text field {field!r}; the columns are {pf.schema_arrow.names}")
        kind = pf.schema_arrow.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise PrepareError(f"{url}: column {field!r} holds {kind}, not text")
        first = 0
        for g in range(pf.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if first + n > self.row:
                column = pf.read_row_group(g, columns=[field]).column(0).to_pylist()
                for text in column[self.row - first :]:
                    self.row += 1
                    yield lambda keep, text=text: text if keep else None
            first += n


def _json_text(line: bytes, url: str, row: int, field: str):
    try:
        value = json.loads(line)
    except UnicodeDecodeError:
        raise PrepareError(f"{url}, row {row}: bytes that are not UTF-8; fix the file's encoding") from None
    except ValueError as e:
        raise PrepareError(f"{url}, row {row}: not JSON ({e}); the file is truncated or not JSON Lines") from None
    if not isinstance(value, dict):
        raise PrepareError(f"{url}, row {row}: a JSON {type(value).__name__}, not an object with field {field!r}")
    if field not in value:
        raise PrepareError(f"{url}, row {row}: no text field {field!r}; the row has {sorted(value)[:10]}")
    return document_text(value[field], lambda: f"{url}, row {row}, field {field!r}")


class _RangedFile(io.RawIOBase):
    """A remote file read by ranges, each retried with backoff (a dropped connection or a
    server error mid-file costs a retry, not the stream)."""

    def __init__(self, remote, name: str, size: int):
        self.remote, self.name, self.size, self.pos = remote, name, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def readinto(self, buffer) -> int:
        end = min(self.size, self.pos + len(buffer))
        if end <= self.pos:
            return 0
        start, path = self.pos, self.remote.path(self.name)

        def attempt():
            data = self.remote.fs.cat_file(path, start=start, end=end)
            if len(data) != end - start:
                raise OSError(f"short read: {len(data)} of {end - start} bytes")
            return data

        data = self.remote.retry(self.name, attempt)
        buffer[: len(data)] = data
        self.pos = end
        return len(data)
