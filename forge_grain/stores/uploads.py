"""Writing a prepared store to object storage so that no reader ever sees half of it.

Shards and indices go first and the manifest last (a store is complete only once its
manifest is there); a marker object names the manifest an unfinished upload is writing, so
a re-run uploads only what is missing and never takes an earlier store's files for its own.
`check_writable` finds a missing bucket or a read-only credential before hours of work.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from pathlib import Path

from forge_grain.errors import StoreError
from forge_grain.stores.manifest import MANIFEST_NAME, Manifest
from forge_grain.stores.remote_dir import RemoteDir, read_or_none, remote_sizes
from forge_grain.stores.request_pool import bounded

UPLOAD_MARKER = ".forge-grain-upload.json"  # names the manifest an unfinished upload is writing


def upload_store(local: Path, url: str, storage_options: dict | None = None, *, overwrite: bool = False,
                 progress: bool = True, threads: int = 8) -> None:
    """Copy the prepared store at `local` to `url`: shards and indices, then the manifest.

    An object store's PUT is atomic (an object present is whole), and the store is
    complete only once its manifest is there, so an interrupted upload leaves no store
    that looks complete; a re-run uploads only the files missing from this upload (a
    marker object names the manifest being uploaded, so files of an earlier store at
    the same URL are never taken for this one's). A URL holding another store is
    refused unless `overwrite`.
    """
    from tqdm.auto import tqdm

    remote = RemoteDir(url, storage_options)
    manifest = (local / MANIFEST_NAME).read_bytes()
    digest = hashlib.sha256(manifest).hexdigest()
    current = read_or_none(remote, MANIFEST_NAME)
    if current == manifest:
        return  # uploaded already
    if current is not None:
        if not overwrite:
            raise StoreError(f"{remote.url}: already holds another token store; choose another output or pass "
                             "--overwrite")
        remote.retry(MANIFEST_NAME, lambda: remote.fs.rm_file(remote.path(MANIFEST_NAME)))  # incomplete from here
    resuming = read_or_none(remote, UPLOAD_MARKER) == digest.encode()
    if not resuming:
        remote.retry(UPLOAD_MARKER, lambda: remote.fs.pipe_file(remote.path(UPLOAD_MARKER), digest.encode()))
    m = Manifest.load(local)
    files = [name for s in m.shards for name in (s.tokens, s.index, s.mask) if name is not None] + (
        [m.indices["file"]] if m.indices else [])
    present = remote_sizes(remote) if resuming else {}
    todo = [f for f in files if present.get(f) != (local / f).stat().st_size]
    with tqdm(total=sum((local / f).stat().st_size for f in todo), unit="B", unit_scale=True,
              desc=f"upload {remote.url}", disable=not progress) as bar:
        def put(name):
            remote.retry(name, lambda: remote.fs.put_file(str(local / name), remote.path(name)))
            bar.update((local / name).stat().st_size)

        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(put, todo))
    remote.retry(MANIFEST_NAME, lambda: remote.fs.pipe_file(remote.path(MANIFEST_NAME), manifest))
    remote.retry(UPLOAD_MARKER, lambda: remote.fs.rm_file(remote.path(UPLOAD_MARKER)))


def check_writable(url: str, storage_options: dict | None = None) -> None:
    """Write and remove a small object under `url`, so that a missing bucket or a read-only
    credential is reported before any work is done, not after hours of tokenizing."""
    remote = RemoteDir(url, storage_options)
    if read_or_none(remote, MANIFEST_NAME) is not None:
        return  # a store is there: the bucket exists (whether it may be replaced is decided on upload)
    name = f".forge-grain-write-check-{os.getpid()}"
    try:
        bounded(remote.fs.pipe_file, remote.path(name), b"")
        bounded(remote.fs.rm_file, remote.path(name))
    except Exception as e:  # a missing bucket, no permission, no such host: all say the same to the user
        raise StoreError(f"{remote.url}: cannot write there ({e.__class__.__name__}: {e}); check that the bucket "
                         "exists and the credentials may write to it (storage_options)") from None
