"""Peers' datasets in object storage (MosaicML MDS, LitData, Megatron, Hugging Face Arrow,
raw token files), read through the same local cache as forge-grain stores.

These formats keep where each document starts inside their data files (a sample table at the
head of every MDS shard and LitData chunk, record batches in Arrow files, one `.bin` per
Megatron `.idx`), so counting a dataset's documents reads every data file. Without a
`cache_limit` the dataset is copied into the cache whole when it opens (concurrently, each
file checked against the size the listing gives, written to a temporary name and renamed),
then read by the format's own local reader with the same checks as on disk. With a
`cache_limit`, MDS and Arrow datasets are read a data file at a time instead
(`mirror_parts.py`), and raw token files in ranges, blocks of whole documents
(`mirror_ranges.py`): no format is copied whole then. A Megatron dataset is read in blocks
and a LitData dataset a chunk at a time with or without a limit: a Megatron `.idx`, and the
head of an uncompressed LitData chunk, say where the documents are, so nothing needs the data
whole at the open (the first batch reads its documents in ranges, `fetched_parts.py`). The copy's directory is
named by the listing (names, sizes, ETags), so a dataset rewritten in place gets a new copy
and nothing stale is read; a copy made once is reused by every process of the host. A
forge-grain store (a `manifest.json`) is what fetches shards as the plan needs them:
`forge_grain.stores.remote`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
from pathlib import Path

from forge_grain.errors import StoreError
from forge_grain.stores import identify
from forge_grain.stores.base import TokenStore
from forge_grain.stores.manifest import MANIFEST_NAME
from forge_grain.stores.object_cache import ObjectCache
from forge_grain.stores.remote_dir import RemoteDir, changed_under, objects_at

REMOTE_OPTIONS = frozenset({"storage_options", "object_cache", "cache_limit"})
THREADS = 8  # concurrent downloads while copying a dataset


def remote_format(url: str, storage_options: dict | None = None) -> str:
    """The format of the dataset at `url`, from its listing: "native" for a forge-grain
    store (or when nothing is recognised: `RemoteStore` then says what is there)."""
    remote = RemoteDir(url, storage_options)
    if remote._fast is None:  # fsspec answers the size asked below from its cached listings where it holds one
        remote.fs.invalidate_cache(remote.root)
    if remote.probe_manifest(MANIFEST_NAME):  # (read whole: the store's open takes it)
        return "native"  # a manifest decides (as below), found without listing what may be 10,000s of objects
    _, files, stem = objects_at(url, storage_options)
    if stem is not None:  # a Megatron prefix (its .idx and .bin beside each other), or one token file
        if f"{stem}.idx" in files and f"{stem}.bin" in files:
            return "megatron"
        return "raw" if stem in files and stem.endswith((".bin", ".npy")) else "native"
    names = {name.split("/", 1)[0] for name in files}
    if MANIFEST_NAME in names:
        return "native"
    index = None
    if "index.json" in files:
        text = remote.retry("index.json", lambda: remote.fs.cat_file(remote.path("index.json")))
        try:
            index = json.loads(text)
        except ValueError:
            raise StoreError(f"{url}/index.json: not JSON ({len(text)} bytes): the index of a LitData or MosaicML MDS "
                             "dataset was not written completely; run optimize() / MDSWriter again")
    found = identify.formats_named(names, index)
    if len(found) > 1:
        raise StoreError(f"{url}: holds the files of {' and of '.join(f'{w} ({why})' for w, why in found.values())}; "
                         f"it cannot be read both ways: pass format= one of {', '.join(sorted(found))}")
    if found:
        return next(iter(found))
    if any(n.endswith((".bin", ".npy")) for n in names) and not any(n.startswith("shard-") for n in names):
        return "raw"
    return "native"


@functools.cache
def mirrored_class(base: type) -> type:
    """The store class reading `base`'s format at a URL: the local reader, on a copy in the cache."""
    name = f"Remote{base.__name__}"
    return type(name, (Mirrored, base), {"OPTIONS": base.OPTIONS | REMOTE_OPTIONS, "__module__": __name__,
                                         "__qualname__": name})


class Mirrored:
    """Mixed into a local format's store class (`mirrored_class`): `path` is a URL, copied
    into the cache before the format's reader opens the copy."""

    def __init__(self, path, storage_options=None, object_cache=None, cache_limit=None, **options):
        self.url = str(path).rstrip("/")
        remote = dict(storage_options=storage_options, object_cache=object_cache, cache_limit=cache_limit)
        home, base, prefix = copy_dataset(self.url, storage_options, object_cache)
        try:
            super().__init__(home / prefix if prefix else home, **options)
        except StoreError as e:  # name the objects, not their local copies
            raise StoreError(str(e).replace(str(home), base)) from None
        self._options = {**options, **{k: v for k, v in remote.items() if v is not None}}
        self._copy = home.name  # named by the listing (names, sizes, ETags): a rewritten dataset gets another

    def __reduce__(self):
        return (_reopen_mirrored, (self.format, self.url, self._options, self._copy))

    def __repr__(self) -> str:
        return super().__repr__().replace(repr(str(self.path)), repr(self.url), 1)


def _reopen_mirrored(format, url, options, copy=None):
    """The dataset at `url` opened again in another process (a spawned DataLoader worker), only
    if it is still the one the pipeline opened (its listing names the same copy)."""
    store = TokenStore.open(url, **{**options, "format": format})
    if copy is not None and store._copy != copy:
        raise changed_under(url)
    return store


def copy_dataset(url: str, storage_options=None, object_cache=None) -> tuple[Path, str, str | None]:
    """The local copy of the dataset at `url`, downloaded first where the cache lacks it:
    (the local directory, the URL it copies, the Megatron prefix or file in it when `url` is one)."""
    from tqdm.auto import tqdm

    url, found, prefix = objects_at(url, storage_options)  # (prefix: a Megatron prefix or one file)
    files = sorted((name, size, tag) for name, (size, tag) in found.items())
    cache = ObjectCache(url, storage_options, object_cache)
    digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]
    home = f"copy-{digest}"
    missing = [(n, s) for n, s, _ in files if not (cache.dir / home / n).exists()]
    with tqdm(total=sum(s for _, s in missing), unit="B", unit_scale=True, desc=f"copy {url}", disable=None,
              leave=False) as bar:
        def fetch(item):
            name, size = item
            cache.get(name, f"{home}/{name}", size=size)
            bar.update(size)

        with concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="forge-grain-copy") as pool:
            list(pool.map(fetch, missing))
    return cache.dir / home, url, prefix


