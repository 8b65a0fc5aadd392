"""Stores in object storage, against a real S3-compatible server (moto) on 127.0.0.1, reached
through s3fs, with faults injected by an HTTP proxy between the two (tests/s3server.py)."""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import io
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from forge_grain import ConfigError, DataConfig, Pipeline, PrepareError, StoreError, TokenStore, prepare  # noqa: E402
from s3server import S3Server  # noqa: E402


@pytest.fixture(scope="module")
def s3():
    with S3Server("bucket") as server:
        yield server


@pytest.fixture(scope="module")
def local_stores(tmp_path_factory, s3):
    """A store of 30 shards in each layout, on disk and uploaded to s3://bucket/<layout>."""
    base = tmp_path_factory.mktemp("stores")
    rng = np.random.default_rng(0)
    with open(base / "docs.jsonl", "w") as f:
        for _ in range(3000):
            f.write(json.dumps({"ids": [0, *rng.integers(2, 1000, int(rng.integers(5, 200))).tolist()]}) + "\n")
    out = {}
    for layout in ("bin", "arrayrecord"):
        out[layout] = prepare(base / "docs.jsonl", base / layout, token_field="ids", vocab_size=1000, bos_id=0,
                              layout=layout, num_shards=30, progress=False)
        s3.fs().put(str(out[layout]), f"bucket/{layout}", recursive=True)
    return out


def source(path, **extra):
    return dict(name="web", path=str(path), strategy="bestfit", shuffle_window=2, **extra)


def config(src) -> DataConfig:
    return DataConfig.from_dict(dict(sources=[src], seq_len=64, global_batch_size=8, seed=1, plan_chunk_docs=300,
                                     num_epochs=1))


LEDGER_ROOM = 8_000  # the cache's own ledger counts against its limit: tests' limits of a few shards leave room for it


def same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in a)


def assert_disk_stream(got: list, local: Path) -> None:
    """`got` (an epoch's batches from object storage) is the epoch of the store at `local`."""
    disk = list(Pipeline(config(dict(name="web", path=str(local))), 0, 1).iterator())
    assert len(got) == len(disk) and all(same(a, b) for a, b in zip(got, disk))


def no_aws_credentials(monkeypatch, nowhere: Path) -> None:
    """boto's credential chain finds nothing: no keys or profile in the environment, the shared
    files at `nowhere`, the instance's role not asked."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(nowhere))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(nowhere))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize("layout", ["bin", "arrayrecord"])
def test_a_store_in_object_storage_gives_the_disk_stream_within_its_cache_limit(tmp_path, s3, local_stores, layout):
    limit = 400_000 if layout == "bin" else 900_000  # about 45% of the store (ArrayRecord shards are larger)
    remote = source(f"s3://bucket/{layout}", storage_options=s3.options(), object_cache=str(tmp_path / "objects"),
                    cache_limit=limit)
    disk = Pipeline(config(source(local_stores[layout])), 0, 1, cache_dir=tmp_path / "plans")
    pipe = Pipeline(config(remote), 0, 1)
    store = pipe.stores[0]
    assert store.fingerprint == TokenStore.open(local_stores[layout]).fingerprint
    a, b = disk.iterator(), pipe.iterator()
    for step in range(disk.num_steps):
        assert same(next(a), next(b)), step
        assert store.cache.used() <= limit
    assert store.cache.downloads < 2 * 30 + 30  # each shard about once per pass (indices once), not per batch


def test_a_bounded_cache_keeps_its_bytes_in_a_ledger_not_a_walk_per_download(tmp_path, s3, local_stores,
                                                                              monkeypatch):
    """A bounded cache knows what it holds from its ledger: after the one walk that builds the
    ledger, no download walks the cache directory (it evicts by the ledger), and the ledger's
    bytes equal what is on disk. Files removed behind its back are found, not counted."""
    from forge_grain.stores.object_cache import ObjectCache

    walks, walk = [], ObjectCache._cached
    monkeypatch.setattr(ObjectCache, "_cached", lambda self: walks.append(1) or walk(self))
    limit = 400_000
    remote = source("s3://bucket/bin", storage_options=s3.options(), object_cache=str(tmp_path / "objects"),
                    cache_limit=limit)
    disk = Pipeline(config(source(local_stores["bin"])), 0, 1, cache_dir=tmp_path / "plans")
    pipe = Pipeline(config(remote), 0, 1)
    cache = pipe.stores[0].cache
    a, b = disk.iterator(), pipe.iterator()
    for step in range(disk.num_steps):
        assert same(next(a), next(b)), step
    assert cache.downloads > 30 and len(walks) == 1  # evictions happened, the directory walked once
    b.close()
    assert settled(cache) <= limit
    for copy in list(cache.dir.rglob("shard-*.bin")):  # removed by hand: the ledger learns it at the next room-making
        copy.unlink()
    walks.clear()
    pipe = Pipeline(config(remote), 0, 1)
    a, b = disk.iterator(), pipe.iterator()
    for step in range(3):
        assert same(next(a), next(b)), step
    b.close()
    assert settled(pipe.stores[0].cache) <= limit


def test_a_full_cache_evicts_the_least_recently_used_copy_the_next_steps_do_not_read(tmp_path, s3):
    """What a full bounded cache gives up: the least recently used copy of those the next steps
    do not read, even where a copy they read was used longer ago; only when nothing else is
    left, the least recently used of theirs."""
    from forge_grain.stores.object_cache import ObjectCache

    size = 10_000
    for name in "abcdef":
        s3.fs().pipe(f"bucket/lru/{name}", name.encode() * size)
    cache = ObjectCache("s3://bucket/lru", s3.options(), tmp_path, limit=3 * size + 4_000)  # three copies
    held = lambda: {p.stem for p in (cache.dir / "copy").glob("?.bin")}  # noqa: E731
    for age, name in zip((300, 200, 100), "bca"):  # b used longest ago, then c, then a
        os.utime(cache.get(name, f"copy/{name}.bin", size=size), (time.time() - age,) * 2)
    assert cache.get("d", "copy/d.bin", size=size, upcoming={"copy/b.bin"}).read_bytes() == b"d" * size
    assert held() == {"a", "b", "d"}  # c went, not b: the next steps read b
    os.utime(cache.dir / "copy/a.bin", (time.time() - 400,) * 2)  # a, set back: now the least recently used
    assert cache.get("f", "copy/f.bin", size=size, upcoming={"copy/a.bin", "copy/b.bin", "copy/d.bin"}).read_bytes() \
        == b"f" * size
    assert held() == {"b", "d", "f"}  # with nothing else to give up: the least recently used of theirs, a


def test_a_full_cache_finds_copies_removed_behind_its_back_in_a_directory_of_many(tmp_path, s3):
    """Where a directory holds many copies, eviction lists it once instead of looking each
    copy up: copies removed by hand (one of them read by the next steps) are still found,
    their bytes freed from the count before anything is evicted, and what it evicts then is
    still the least recently used."""
    from forge_grain.stores.cache_room import LISTED
    from forge_grain.stores.object_cache import ObjectCache

    size, names = 10_000, "abcdefgh"
    for name in names:
        s3.fs().pipe(f"bucket/many/{name}", name.encode() * size)
    held = LISTED + 2
    cache = ObjectCache("s3://bucket/many", s3.options(), tmp_path, limit=held * size + 4_000)
    on_disk = lambda: {p.stem for p in (cache.dir / "copy").glob("?.bin")}  # noqa: E731
    for age, name in zip(range(held, 0, -1), names[:held]):  # a used longest ago, then b, ...
        os.utime(cache.get(name, f"copy/{name}.bin", size=size), (time.time() - 100 * age,) * 2)
    first = set(names[:held])
    assert on_disk() == first
    for gone in "be":  # removed by hand; the next steps read e
        (cache.dir / f"copy/{gone}.bin").unlink()
    upcoming = {"copy/e.bin", "copy/a.bin"}
    assert cache.get("g", "copy/g.bin", size=size, upcoming=upcoming).read_bytes() == b"g" * size
    assert on_disk() == first - {"b", "e"} | {"g"}  # the room of b and e was enough: nothing evicted
    counted = sum(cache.ledger.sync().values())
    assert counted == cache.used() - cache.ledger.size() == len(on_disk()) * size
    cache.get("e", "copy/e.bin", size=size)
    assert cache.get("h", "copy/h.bin", size=size, upcoming=upcoming).read_bytes() == b"h" * size
    assert on_disk() == first - {"b", "c"} | {"g", "h"}  # c: the least recently used the next steps do not read


LEDGER_OF_ANOTHER_PROCESS = """
import os, sys
from pathlib import Path
from forge_grain.stores.object_cache import ObjectCache
cache = ObjectCache("s3://bucket/x", {"endpoint_url": "http://127.0.0.1:9"}, Path(sys.argv[1]), 10**9)
with cache._accounting():
    cache.ledger.sync()
    for k in range(8):
        (cache.dir / f"copy/new{k}.bin").write_bytes(b"1234567")
        cache.ledger.add(f"copy/new{k}.bin", 7)
for k in range(100):  # rewrites until one has the inode the other process read (ext4 gives it back)
    with cache._accounting():
        cache.ledger.sync()
        cache.ledger._rewrite()
    if os.stat(cache.ledger.path).st_ino == int(sys.argv[2]):
        break
"""


@pytest.mark.parametrize("pool", ["held", "dropped"])
def test_a_ledger_rewritten_by_another_process_is_read_anew_whatever_inode_it_gets(tmp_path, monkeypatch, pool):
    """Processes sharing a bounded cache (DataLoader workers, ranks of a host) each read the
    ledger from where they last stopped, and read it from the start once it is rewritten,
    told by its inode. ext4 gives a rewrite the inode the one before it freed, so after two
    rewrites a process took the new file for the old one and read on from its old place: it
    missed the other's files, and two workers held up to 1.6x the limit. Each process now
    sees every file the other added, across rewrites; also where the ledger it held open was
    dropped from the pool of handles (by the ledgers of other caches: a pool of one here)."""
    import subprocess
    import sys

    from forge_grain.stores.handles import POOL
    from forge_grain.stores.object_cache import ObjectCache

    cache = ObjectCache("s3://bucket/x", {"endpoint_url": "http://127.0.0.1:9"}, tmp_path / "objects", 10**9)
    (cache.dir / "copy").mkdir()
    for i in range(40):  # (a ledger longer than the other's rewrite: read on from its old place, nothing)
        (cache.dir / f"copy/old{i}.bin").write_bytes(b"x" * 100)
    with cache._accounting():
        cache.ledger.rebuild()
        for i in range(40):
            cache.ledger.drop(f"copy/old{i}.bin")
            cache.ledger.add(f"copy/old{i}.bin", 100)
    with cache._accounting():
        assert len(cache.ledger.sync()) == 40
    if pool == "dropped":
        monkeypatch.setattr(POOL, "capacity", 1)
        elsewhere = ObjectCache("s3://bucket/y", {"endpoint_url": "http://127.0.0.1:9"}, tmp_path / "objects", 10**9)
        with elsewhere._accounting():
            elsewhere.ledger.rebuild()  # its ledger held open in the pool in place of the first cache's
    other = subprocess.run([sys.executable, "-c", LEDGER_OF_ANOTHER_PROCESS, str(tmp_path / "objects"),
                            str(os.stat(cache.ledger.path).st_ino)],
                           capture_output=True, text=True, timeout=120)
    assert other.returncode == 0, other.stderr[-3000:]
    with cache._accounting():
        files = dict(cache.ledger.sync())
    assert files == {str(p.relative_to(cache.dir)): p.stat().st_size for p in (cache.dir / "copy").iterdir()}


def test_a_record_written_while_another_threads_download_lands_counts_the_ledger_safely(tmp_path):
    """Whether a record (or a download) fits beside the ledger is read under the lock the
    ledger's files change under: read outside it while a fetch thread's download landed, a
    run of a mixture of 1,000 files stopped with "dictionary changed size during iteration"."""
    import sys
    import threading

    from forge_grain.stores.object_cache import ObjectCache

    cache = ObjectCache("s3://bucket/x", {"endpoint_url": "http://127.0.0.1:9"}, tmp_path / "objects", 10**9)
    for i in range(3000):  # (a ledger of many files: counting it takes a while)
        (cache.dir / f"f{i}.bin").write_bytes(b"")
    cache.ledger.rebuild()
    stop = threading.Event()

    def land():
        k = 0
        while not stop.is_set():
            part = cache.dir / f"g{k % 50}.bin"
            part.write_bytes(b"x")
            cache._commit(part, cache.dir / f"h{k % 50}.bin", 1)
            k += 1

    lander, interval = threading.Thread(target=land), sys.getswitchinterval()
    lander.start()
    sys.setswitchinterval(1e-5)  # (threads switch often: the race is met at once)
    try:
        for i in range(300):
            cache.write_record(cache.dir / f"r{i % 5}.json", b"{}")
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        lander.join()
    assert cache.ledger.sync() == {str(p.relative_to(cache.dir)): p.stat().st_size for p in cache.dir.rglob("*")
                                   if p.is_file() and not p.name.startswith(".")}


def settled(cache, timeout: float = 30.0) -> int:
    """The cache's bytes once the ledger and a walk agree: downloads hinted ahead may still be
    landing when the iterator closes (the store's fetch threads finish them), so compare once
    they have, and fail if the two never agree."""
    deadline = time.monotonic() + timeout
    files = lambda: sum(cache.ledger.sync().values())  # (the ledger's own bytes: its reserve, not its size now)
    while (counted := files()) != (walked := cache.used() - cache.ledger.size()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counted == walked, (counted, walked)
    assert cache.ledger.size() <= cache.ledger.reserve()
    return cache.used()


def test_shards_are_downloaded_by_obstore_where_the_options_allow_and_by_s3fs_otherwise(tmp_path, s3, local_stores,
                                                                                       monkeypatch):
    """With explicit credentials (as here) shards come through obstore, the Rust client; options
    obstore cannot honour (a requester-pays bucket), or boto's credential chain finding none
    (no such profile, nothing in the environment), keep s3fs, so no credential that works with
    s3fs stops working."""
    from forge_grain.stores.remote_dir import fast_client

    store = TokenStore.open("s3://bucket/bin", storage_options=s3.options(), object_cache=str(tmp_path))
    assert store.cache._fast is not None
    assert np.array_equal(store[100], TokenStore.open(local_stores["bin"])[100])
    no_aws_credentials(monkeypatch, tmp_path / "no-such-file")
    assert fast_client("s3://bucket/bin", {"profile": "research"}) is None
    assert fast_client("s3://bucket/bin", {"key": "k", "secret": "s", "requester_pays": True}) is None
    assert fast_client("s3://bucket/bin", None) is None
    assert fast_client("gs://bucket/bin", {"key": "k", "secret": "s"}) is None
    assert fast_client("s3://bucket/a/b", {"anon": True})[1] == "a/b/"


@pytest.mark.parametrize("where", ["environment", "profile"])
def test_credentials_from_boto_s_chain_read_through_obstore(tmp_path, s3, local_stores, monkeypatch, where):
    """No key in the options (a role, the environment, a profile: how most training hosts
    reach S3) reads through obstore too, with the credentials boto's chain finds, as s3fs
    would: the batches equal the local store's."""
    no_aws_credentials(monkeypatch, tmp_path / "no-such-file")
    opts = {k: v for k, v in s3.options().items() if k not in ("key", "secret")}
    if where == "environment":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.options()["key"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.options()["secret"])
    else:
        (tmp_path / "credentials").write_text(f"[research]\naws_access_key_id = {s3.options()['key']}\n"
                                              f"aws_secret_access_key = {s3.options()['secret']}\n")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
        opts["profile"] = "research"
    src = dict(name="web", path="s3://bucket/bin", storage_options=opts, object_cache=str(tmp_path / "o"))
    assert_disk_stream(list(Pipeline(config(src), 0, 1).iterator()), local_stores["bin"])
    store = TokenStore.open("s3://bucket/bin", storage_options=opts, object_cache=str(tmp_path / "o"))
    assert store.cache._fast is not None and store.cache._fast[0].credential_provider is not None


FIRST_BATCH = """
import json, sys
from forge_grain import DataConfig, Pipeline
src = dict(name="web", path="s3://bucket/bin", storage_options=json.loads(sys.argv[1]), object_cache=sys.argv[2])
cfg = DataConfig.from_dict(dict(sources=[src], seq_len=64, global_batch_size=8, seed=1))
batch = next(Pipeline(cfg, 0, 1).iterator())
print(json.dumps({"tokens": int(batch["inputs"].sum()), "s3fs": "s3fs" in sys.modules}))
"""


def test_a_store_read_through_obstore_reaches_its_first_batch_without_importing_s3fs(tmp_path, s3, local_stores):
    """Importing s3fs (aiobotocore, aiohttp) took 0.23-0.29 s of a store's first open, a third of
    its time to the first batch behind a 30 ms link: where obstore reads, s3fs is imported only
    for what obstore does not do (listings, writes). The batch is the local store's."""
    out = subprocess.run([sys.executable, "-c", FIRST_BATCH, json.dumps(s3.options()), str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    disk = DataConfig.from_dict(dict(sources=[dict(name="web", path=str(local_stores["bin"]))], seq_len=64,
                                     global_batch_size=8, seed=1))
    assert got == {"tokens": int(next(Pipeline(disk, 0, 1).iterator())["inputs"].sum()), "s3fs": False}


def test_a_bucket_in_another_region_than_the_clients_is_found_and_read(tmp_path, s3, local_stores, caplog):
    """S3 answers a request signed for another region than its bucket's with a 301 and no
    Location (the proxy answers as S3 does): botocore (s3fs) follows it, obstore did not, and
    every read failed after its retries where s3fs read. The bucket's region is asked once (a
    HEAD of the bucket names it) and the client made again for it: a Pipeline's batches are
    the local store's, and a store opened after signs for that region from its first request."""
    s3.fs().put(str(local_stores["bin"]), "elsewhere/bin", recursive=True)
    s3.proxy.regions["elsewhere"] = "eu-west-1"
    s3.proxy.clear()
    try:
        with caplog.at_level(logging.INFO, logger="forge_grain"):
            src = dict(name="web", path="s3://elsewhere/bin", storage_options=s3.options(via_proxy=True),
                       object_cache=str(tmp_path / "o"))
            got = list(Pipeline(config(src), 0, 1).iterator())
        assert_disk_stream(got, local_stores["bin"])
        assert "bucket 'elsewhere' is in eu-west-1, not us-east-1: asking there" in caplog.text
        assert s3.proxy.seen.count(("HEAD", "/elsewhere")) == 1
        s3.proxy.seen.clear()
        again = TokenStore.open("s3://elsewhere/bin", storage_options=s3.options(via_proxy=True),
                                object_cache=str(tmp_path / "o2"))
        assert again.cache._fast[0].config["region"] == "eu-west-1" and ("HEAD", "/elsewhere") not in s3.proxy.seen
    finally:
        del s3.proxy.regions["elsewhere"]


def test_reads_in_flight_on_many_threads_when_the_region_is_found_are_retried_not_refused(tmp_path, s3,
                                                                                            local_stores):
    """Every part of every download signed for the wrong region at once: one thread asks the
    bucket's region, the others find it known (a failed read of the old client is not taken
    for a server that names no region) and read on."""
    s3.fs().put(str(local_stores["bin"]), "moved/bin", recursive=True)
    store = TokenStore.open("s3://moved/bin", storage_options=s3.options(via_proxy=True),
                            object_cache=str(tmp_path / "o"))
    disk = TokenStore.open(local_stores["bin"])
    s3.proxy.regions["moved"] = "ap-south-1"  # (from here on: the client made at the open signs for us-east-1)
    try:
        firsts = [int(store._file_doc_starts[i]) for i in range(len(store._files))]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda d: store[d], firsts))
        assert all(np.array_equal(g, disk[d]) for g, d in zip(got, firsts))
        assert s3.proxy.seen.count(("HEAD", "/moved")) == 1
    finally:
        del s3.proxy.regions["moved"]


def test_a_bucket_whose_region_the_server_does_not_say_is_an_error_naming_the_option(tmp_path, s3, local_stores):
    s3.fs().put(str(local_stores["bin"]), "nowhere/bin", recursive=True)
    s3.proxy.regions["nowhere"] = ""  # (every signed request a 301, the bucket's HEAD without a region)
    try:
        with pytest.raises(StoreError, match=r"s3://nowhere/bin: the server refuses requests signed for region "
                                             r"'us-east-1' \(the bucket is in another\) .* pass .*region_name"):
            TokenStore.open("s3://nowhere/bin", storage_options=s3.options(via_proxy=True), object_cache=str(tmp_path))
    finally:
        del s3.proxy.regions["nowhere"]


def test_elastic_resume_from_object_storage_equals_the_disk_stream(tmp_path, s3, local_stores):
    remote = config(source("s3://bucket/bin", storage_options=s3.options(), object_cache=str(tmp_path / "objects")))
    disk = Pipeline(config(source(local_stores["bin"])), 0, 1, num_threads=0, cache_dir=tmp_path / "plans")
    two = [Pipeline(remote, r, 2) for r in range(2)]
    its = [p.iterator() for p in two]
    for _ in range(4):
        for it in its:
            next(it)
    state = two[0].state_at(4)
    for count in (1, 4):
        parts = [Pipeline(remote, r, count).iterator(state) for r in range(count)]
        for step in range(4, 9):
            got = [next(it) for it in parts]
            joined = {k: np.concatenate([g[k] for g in got]) for k in got[0] if k != "step"}
            assert same(joined, disk.global_batch(step))


def test_a_long_lookahead_with_a_small_cache_fetches_each_shard_about_once(tmp_path, s3, local_stores):
    """Shards are hinted in the order the steps read them, and no further ahead than the cache
    holds: a lookahead longer than the cache (64 steps, a 20% cache, the locality order one
    chunk at a time) does not make downloads evict each other before they are read."""
    s3.proxy.clear()
    limit = 120_000
    remote = source("s3://bucket/bin", storage_options=s3.options(via_proxy=True), object_cache=str(tmp_path / "o"),
                    cache_limit=limit)
    cfg = lambda src: DataConfig.from_dict(dict(sources=[{**src, "shuffle_window": 1}], seq_len=64,  # noqa: E731
                                                global_batch_size=8, seed=1, plan_chunk_docs=75, num_epochs=1))
    disk = Pipeline(cfg(source(local_stores["bin"])), 0, 1, cache_dir=tmp_path / "plans")
    pipe = Pipeline(cfg(remote), 0, 1, fetch_ahead=64)
    a, b = disk.iterator(), pipe.iterator()
    for step in range(disk.num_steps):
        assert same(next(a), next(b)), step
        assert pipe.stores[0].cache.used() <= limit
    shard_gets = sum(n for path, n in s3.proxy.gets.items() if "/bin/shard-" in path and path.endswith(".bin"))
    starts = pipe.stores[0]._file_doc_starts  # a window reads one chunk's shards; a shard two chunks share may be
    first_last = [np.searchsorted(starts, [c, min(c + 75, starts[-1]) - 1], side="right") for c in
                  range(0, int(starts[-1]), 75)]  # read twice
    per_window = sum(int(b - a) + 1 for a, b in first_last)
    assert 30 <= shard_gets <= per_window, (shard_gets, per_window)


def test_a_cache_of_two_shards_downloads_the_next_shard_while_one_is_read(tmp_path, s3, local_stores):
    """With room for the shard read now and the next (not for a third), the next is in the
    cache before the first step that reads it: no shard boundary waits for a
    download (the locality order, a window a shard, each shard read for more than the 16 steps
    the pipeline's hints move by)."""
    disk_store = TokenStore.open(local_stores["bin"])
    docs = {s.num_documents for s in disk_store.manifest.shards}
    assert len(docs) == 1  # a chunk of the plan is one shard
    docs = docs.pop()
    indices = sum((local_stores["bin"] / s.index).stat().st_size for s in disk_store.manifest.shards)  # kept too
    limit = indices + int(2.5 * max(s.num_tokens for s in disk_store.manifest.shards) * disk_store.dtype.itemsize)
    remote = source("s3://bucket/bin", storage_options=s3.options(), object_cache=str(tmp_path / "o"),
                    cache_limit=limit)
    cfg = lambda src: DataConfig.from_dict(dict(sources=[{**src, "shuffle_window": 1}], seq_len=64,  # noqa: E731
                                                global_batch_size=8, seed=1, plan_chunk_docs=docs,
                                                num_epochs=1))
    disk = Pipeline(cfg(source(local_stores["bin"])), 0, 1, num_threads=0, cache_dir=tmp_path / "plans")
    pipe = Pipeline(cfg(remote), 0, 1, num_threads=0)
    store = pipe.stores[0]

    def shards(step):
        return set(pipe.datasets[0].arrays_read(pipe.mixture.locate(pipe.shard_rows(step))[1]).tolist())

    read, boundaries = set(), 0
    for step in range(disk.num_steps):
        assert same(disk.batch(step), pipe.batch(step)), step
        read |= shards(step)
        for future in list(store._pending.values()):
            future.result()  # the downloads this step's hint started
        new = shards(step + 1) - read if step + 1 < disk.num_steps else set()
        if new and len(shards(step)) == 1:  # the next step starts a shard
            assert all((store.cache.dir / store._name(k)).exists() for k in new), (step, new)
            boundaries += 1
        assert store.cache.used() <= limit
    assert boundaries >= 20


def test_an_iterator_downloads_the_first_steps_shards_before_its_first_batch(tmp_path, s3, local_stores):
    """Made to be read, an iterator starts the downloads of the steps it starts at (from a state,
    too) while the trainer sets up; a pipeline built only to describe the run downloads none."""
    s3.proxy.clear()
    remote = source("s3://bucket/bin", storage_options=s3.options(via_proxy=True), object_cache=str(tmp_path / "o"))

    def shard_gets():
        return sum(n for path, n in s3.proxy.gets.items() if "/bin/shard-" in path and path.endswith(".bin"))

    planner = Pipeline(config(remote), 0, 1)
    planner.describe()
    time.sleep(0.5)
    assert shard_gets() == 0
    pipe = Pipeline(config(remote), 0, 1)
    it = pipe.iterator(pipe.state_at(3))
    needed = set(pipe.datasets[0].arrays_read(pipe.mixture.locate(pipe.shard_rows(3))[1]).tolist())
    cached = lambda: {int(p.name[6:11]) for p in (tmp_path / "o").rglob("shard-*.bin")}  # noqa: E731
    for _ in range(100):
        if needed <= cached():
            break
        time.sleep(0.05)
    assert needed <= cached() and shard_gets() >= len(needed)  # downloaded, no batch made yet
    disk = Pipeline(config(source(local_stores["bin"])), 0, 1, cache_dir=tmp_path / "plans")
    assert same(next(it), disk.global_batch(3))


def test_a_large_object_is_read_in_parallel_ranged_parts_and_checked_whole(tmp_path, s3, local_stores, monkeypatch):
    from forge_grain.stores import download  # (its parts: BLOCK bytes at most)

    monkeypatch.setattr(download, "BLOCK", 4096)
    s3.fs().put(str(local_stores["bin"]), "bucket/bin-parts", recursive=True)  # (no other test's reads counted)
    s3.proxy.clear()
    store = TokenStore.open("s3://bucket/bin-parts", storage_options=s3.options(via_proxy=True),
                            object_cache=str(tmp_path))
    disk = TokenStore.open(local_stores["bin"])
    doc = int(store._file_doc_starts[3])
    assert np.array_equal(store[doc], disk[doc])
    size = (local_stores["bin"] / store.manifest.shards[3].tokens).stat().st_size
    gets = [n for path, n in s3.proxy.gets.items() if path.endswith(f"bin-parts/{store.manifest.shards[3].tokens}")]
    assert size > 3 * 4096 and gets == [-(-size // 4096)]  # one GET a part
    s3.proxy.clear()
    s3.proxy.fail(store.manifest.shards[5].tokens, "truncate", times=1)  # one part cut short: retried, exact
    doc = int(store._file_doc_starts[5])
    assert np.array_equal(store[doc], disk[doc])


def test_objects_a_read_waits_for_together_share_the_request_threads_between_them(tmp_path, s3):
    """One object a read waits for is cut into a part for every request thread; several at once
    (a LitData dataset's chunks copied at its open, eight at a time) share the threads: each
    was cut as if alone, and the open of 16 chunks of 24.7 MB asked 1,025 GETs of 387 KiB (199
    now; its epoch from a shaped link 3.15 s, now 1.70 s: `bench_cache_limit.py --link`)."""
    from forge_grain.stores.download import Download
    from forge_grain.stores.object_cache import ObjectCache

    cache = ObjectCache("s3://bucket/bin", s3.options(), tmp_path)
    size = 24_746_264
    one = Download(cache, "x", tmp_path / "x", None, size, frozenset, False, None, 0, None)
    workers = max(8, cache.requests.workers)
    alone = -(-size // one._part_size(size, True))
    cache._in_flight[2] = 8
    together = -(-size // one._part_size(size, True))
    assert alone == workers and workers <= 8 * together <= workers + 8


def test_a_prefetch_waiting_for_a_download_slot_goes_on_when_needed_and_is_dropped_when_unhinted(tmp_path, s3,
                                                                                                monkeypatch):
    """The objects a process downloads ahead are bounded process-wide (each holds two
    descriptors). A prefetch waiting for a slot must not keep a read waiting: the slots may
    all be held by prefetches that wait for room the reader frees only once it has that
    object, so once its object is needed now (`hurry`) it goes on without a slot; and one
    whose object is no longer hinted gives up, taking no slot."""
    from forge_grain.stores import request_pool
    from forge_grain.stores.object_cache import ObjectCache

    s3.fs().pipe("bucket/slots/a", b"a" * 1000)
    s3.fs().pipe("bucket/slots/b", b"b" * 1000)
    cache = ObjectCache("s3://bucket/slots", s3.options(), tmp_path)
    slots, hinted = request_pool.Slots(1), {"copy/a", "copy/b"}
    monkeypatch.setattr(request_pool, "_AHEAD", [slots])
    assert slots.take(lambda: True, lambda: False)  # the one slot held (by a prefetch waiting for room)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            a = pool.submit(cache.get, "a", "copy/a", size=1000, upcoming=lambda: hinted, ahead=True)
            b = pool.submit(cache.get, "b", "copy/b", size=1000, upcoming=lambda: hinted, ahead=True)
            time.sleep(0.5)
            assert not a.done() and not b.done()  # waiting for a slot
            cache.hurry("copy/a")
            assert a.result(timeout=30).read_bytes() == b"a" * 1000
            hinted.discard("copy/b")
            slots.poke()
            assert b.result(timeout=30) is None and not (cache.dir / "copy/b").exists()
        assert slots.free == 0  # neither took a slot
    finally:
        slots.give()


def test_a_mixtures_sources_in_object_storage_open_at_once_and_give_the_local_batches(tmp_path, s3, local_stores):
    """A mixture of sources in object storage opens them at once (each open waits on its
    manifest and index: one after another, 8 sources behind a 30 ms link took 1.2 s to
    build), and its first step reads them at once: the batches are the local copies'."""
    for i in range(4):
        s3.fs().put(str(local_stores["bin"]), f"bucket/openmix/d{i}", recursive=True)  # reads counted by prefix
    s3.proxy.clear()
    s3.proxy.latency = 0.1  # (each read: its opens overlap only if made at once)

    def mixture(where):
        return DataConfig.from_dict(dict(sources=[dict(name=f"d{i}", weight=1 + i, strategy="bestfit", **where(i))
                                                  for i in range(4)],
                                         seq_len=64, global_batch_size=16, seed=3, num_epochs=1))

    remote = Pipeline(mixture(lambda i: dict(path=f"s3://bucket/openmix/d{i}", object_cache=str(tmp_path / "objects"),
                                             storage_options=s3.options(via_proxy=True))), 0, 1)
    assert s3.proxy.peaks["openmix"] >= 2  # (one after another: 1)
    got = list(itertools.islice(remote.iterator(), 6))
    want = list(itertools.islice(Pipeline(mixture(lambda i: dict(path=str(local_stores["bin"]))), 0, 1).iterator(), 6))
    assert len(got) == 6 and all(same(a, b) for a, b in zip(got, want))
    assert len(set(np.unique(got[0]["source_id"]).tolist())) > 1  # (a first step of several sources)


def test_an_object_fetched_ahead_alone_is_read_in_whole_rounds_of_the_request_threads():
    """A part's time is mostly the wait for its first byte: an object whose parts would end in
    a round that leaves request threads idle (48 parts on 32 threads) is cut into larger parts
    that fill whole rounds (32), never finer than asked and never above BLOCK."""
    from forge_grain.stores.download import BLOCK, PART_AHEAD, PART_LONE, whole_rounds

    for size in (3_000_000, 24_746_264, 100_000_000, 400_000_000):
        for workers in (8, 16, 32, 64):
            for part in (PART_LONE, PART_AHEAD):
                got = whole_rounds(size, part, workers)
                parts = -(-size // got)
                assert part <= got <= max(part, BLOCK)
                if -(-size // part) >= workers and got < BLOCK:
                    assert -parts % workers <= 1, (size, workers, part, parts)  # (a round full, to a read)
    assert -(-24_746_264 // whole_rounds(24_746_264, PART_LONE, 32)) == 32  # (48 parts of 512 KiB before)


def test_an_object_fetched_ahead_is_cut_into_even_parts_with_no_sliver_at_the_end():
    """An object is cut into parts of one size, as many as its size over the part asked for,
    rounded to the nearest: a Megatron block of 3.09 MB cut at 0.94 MB was four GETs, the
    last of 0.27 MB (a whole request's first-byte wait and CPU for a sliver); now three."""
    from forge_grain.stores.download import BLOCK, even_parts

    assert -(-3_090_000 // even_parts(3_090_000, 940_000)) == 3
    assert even_parts(int(2.05 * BLOCK), BLOCK) == -(-int(2.05 * BLOCK) // 3)  # (not two of BLOCK and a sliver)
    for size in (1, 1000, 3_090_000, 24_746_264, int(2.05 * BLOCK), 400_000_000):
        for part in (1, 262_144, 940_000, 1 << 20, 5 << 20, BLOCK):
            got = even_parts(size, part)
            parts = -(-size // got)
            assert parts == max(int(size / part + 0.5), 1, -(-size // BLOCK)), (size, part)  # (halves up)
            assert got * (parts - 1) < size <= got * parts  # (every part one size but the last, short by < parts)
            assert size - got * (parts - 1) > got - parts
            assert got <= BLOCK


@pytest.mark.parametrize("refused", [False, True])
def test_a_download_starts_writing_each_part_to_disk_as_it_arrives(tmp_path, s3, monkeypatch, refused):
    """Each part of a download is handed to the kernel's writeback as it is written
    (`files.start_writeback`), so the fsync before the rename has little left: a 24.7 MB
    shard's fsync took 9-14 ms after its last part, on the path of the read waiting for it
    (at a cache_limit of two shards, every shard's), 1-2 ms with this. Every byte is handed
    over once; where the file system refuses the call (an error from it), the download is the
    same, made durable by its fsync alone."""
    import hashlib

    from forge_grain import files
    from forge_grain.stores.object_cache import ObjectCache

    size = 3_000_000 + 17
    data = np.random.default_rng(7).integers(0, 256, size, np.uint8).tobytes()
    s3.fs().pipe("bucket/writeback/x", data)
    handed, real = [], files._SYNC_FILE_RANGE

    def recorded(fd, offset, length, flags):
        handed.append((offset, length))
        return -1 if refused or real is None else real(fd, offset, length, flags)

    monkeypatch.setattr(files, "_SYNC_FILE_RANGE", recorded)
    cache = ObjectCache("s3://bucket/writeback", s3.options(), tmp_path, requests=8)
    path = cache.get("x", "copy/x", hashlib.sha256(data).hexdigest(), size)
    assert path.read_bytes() == data
    assert len(handed) > 1 and sorted(handed)[0][0] == 0
    spans = sorted(handed)
    assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:])) and spans[-1][0] + spans[-1][1] == size


def test_an_object_fetched_ahead_is_cut_into_parts_that_a_connection_carries_in_part_seconds(tmp_path, s3,
                                                                                            monkeypatch):
    """Each ranged read is a request, and each request costs CPU in the client and the server:
    an object fetched ahead is cut into parts no smaller than what one connection was lately
    seen to carry in PART_SECONDS. Behind 30 ms and 10 MB/s a connection that is about 1-1.2 MB
    (a 24.7 MB chunk in 20-27 GETs, not 48-52: a LitData dataset under a cache_limit of 4
    chunks' worth read its epoch in 2.18-2.21 s, not 2.8-3.0 s, on two cores shared with the
    server); a link whose connections carry 2 MB/s keeps the parts the request threads call
    for, a fast one is read in parts of BLOCK; reads slowed by a busy CPU do not make them
    smaller, and a link that slows is followed once its reads are the recent ones. Each
    endpoint and bucket is measured apart (a near one's parts are not a far one's)."""
    from forge_grain.stores import request_pool
    from forge_grain.stores.download import BLOCK, Download
    from forge_grain.stores.object_cache import ObjectCache

    monkeypatch.setattr(request_pool, "_REQUESTS", {})  # this test's own pool and links: nothing read yet
    monkeypatch.setattr(request_pool, "_CARRIED", {})
    cache = ObjectCache("s3://bucket/bin", s3.options(), tmp_path)
    size = 24_746_264
    ahead = Download(cache, "x", tmp_path / "x", None, size, frozenset, True, None, 0, None)
    cache._in_flight[1] = 1  # (one download running: this one, alone)
    carried = cache.carried

    def parts() -> int:
        return -(-size // ahead._part_size(size, False))

    def link(mbps: float, ttfb: float = 0.03, rounds: int = 6, slower: float = 1.0) -> int:
        """Parts a download is cut into once `rounds` downloads' worth of reads came through a
        link of `ttfb` and `mbps` a connection (each read `slower` times its time)."""
        for _ in range(rounds):
            part = ahead._part_size(size, False)
            for _ in range(-(-size // part)):
                carried.read(part, slower * (ttfb + part / (mbps * 1e6)))
        return parts()

    asked = parts()  # (what the request threads call for: nothing was read yet)
    assert asked >= 24
    assert link(2) == asked
    fast = link(10)
    assert 16 <= fast <= 25 and fast < asked, fast
    assert link(10, slower=3, rounds=4) == fast  # (a busy CPU a while)
    carried.read(size, 0.01)  # (one read from a cache near the host)
    assert parts() == fast
    assert link(2, rounds=12) == asked  # (the link slowed for good)
    assert parts() == asked and link(200, rounds=12) == -(-size // BLOCK)
    elsewhere = ObjectCache("s3://bucket/bin", s3.options(via_proxy=True), tmp_path)  # (another endpoint)
    assert elsewhere.carried is not carried and elsewhere.carried.bytes_in(1.0) == 0
    assert ObjectCache("s3://bucket/other", s3.options(), tmp_path).carried is carried  # (the same link)


def test_under_a_cache_limit_reads_slowed_by_a_busy_cpu_for_good_do_not_cut_the_prefetch_finer(tmp_path, s3,
                                                                                                monkeypatch):
    """Under a cache_limit the next file is fetched beside the reader the whole epoch, so every
    recent read was timed on a busy CPU, and a read's time counts its first byte: the smaller
    the parts, the less a connection is seen to carry, so the smaller the next parts. On two
    cores shared with the server a LitData dataset at 2 chunks' worth fell to parts of
    0.57-0.8 MB, 500-780 GETs an epoch (410 unbounded), and rounds at 0.73-0.80x the
    unbounded rate. There a part fetched ahead is at least twice what a connection carried in
    PART_SECONDS, up to PART_AHEAD; a link that binds (2 MB/s a connection) keeps the parts
    its request threads call for."""
    from forge_grain.stores import request_pool
    from forge_grain.stores.download import PART_AHEAD, Download
    from forge_grain.stores.object_cache import ObjectCache

    monkeypatch.setattr(request_pool, "_REQUESTS", {})  # this test's own pool: nothing read yet
    size = 24_746_264

    def parts(limit: int | None, mbps: float, slower: float = 1.0) -> int:
        """Parts of an object of `size` fetched ahead alone, once 8 such objects came through a
        link of 30 ms and `mbps` a connection, each read `slower` times its time."""
        monkeypatch.setattr(request_pool, "_CARRIED", {})  # (its own link: nothing read yet)
        cache = ObjectCache("s3://bucket/bin", s3.options(), tmp_path / f"{limit}-{mbps}-{slower}", limit=limit)
        cache.requests.growth.workers = request_pool.BOUND  # (grown: the limit's share is below the parts)
        ahead = Download(cache, "x", tmp_path / "x", None, size, frozenset, True, None, 0, None)
        cache._in_flight[1] = 1  # (one download running: this one, alone)
        for _ in range(8):
            part = ahead._part_size(size, False)
            for _ in range(-(-size // part)):
                cache.carried.read(part, slower * (0.03 + part / (mbps * 1e6)))
        return -(-size // ahead._part_size(size, False))

    two = 2 * size  # (two files' worth)
    assert parts(two, 10.0, slower=2.0) == -(-size // PART_AHEAD)  # (47 before: parts of PART_LONE)
    assert parts(two, 10.0) <= -(-size // PART_AHEAD)  # (reads at the link's own pace: as before)
    assert parts(two, 2.0) >= 32 > -(-size // PART_AHEAD)  # (the link binds: every request thread on it)
    assert parts(None, 10.0, slower=2.0) > parts(two, 10.0, slower=2.0)  # (unbounded: as before)


def test_a_prefetch_under_a_large_cache_limit_is_cut_into_fewer_parts(tmp_path, s3, monkeypatch):
    """Under a cache_limit, a part fetched ahead is at least cache_limit / (IN_FLIGHT * request
    threads): with a part on every thread, that share of the cache is in flight, the rest holds
    the window being read. Where the cache is large that is fewer requests for the same bytes
    (a 16-shard store at 8 shards' worth behind 30 ms and 10 MB/s a connection: 266 GETs an
    epoch instead of 410, read in 1.99 s instead of 2.33); a cache whose share is no larger
    than the parts are anyway (2 shards' worth, once the threads have grown) changes nothing,
    and no part takes a connection longer than ROOM_PARTS parts of PART_SECONDS (behind 2 MB/s a connection the
    share of a few threads took 1.5 s a part, and the first epoch 6.1 s against 5.1 s)."""
    from forge_grain.stores import request_pool
    from forge_grain.stores.download import BLOCK, IN_FLIGHT, PART_SECONDS, ROOM_PARTS, Download
    from forge_grain.stores.object_cache import ObjectCache

    monkeypatch.setattr(request_pool, "_REQUESTS", {})  # this test's own pool: nothing read yet
    size = 24_746_264

    def part(limit: int | None, mbps: float = 10.0) -> tuple[int, int]:
        """The part an object of `size` fetched ahead alone is cut into behind a link of 30 ms
        and `mbps` a connection, and the request threads."""
        monkeypatch.setattr(request_pool, "_CARRIED", {})  # (its own link: nothing read yet)
        cache = ObjectCache("s3://bucket/bin", s3.options(), tmp_path / f"{limit}-{mbps}", limit=limit)
        for _ in range(request_pool.Carried.RECENT):  # (reads of 1 MB through that link)
            cache.carried.read(1 << 20, 0.03 + (1 << 20) / (mbps * 1e6))
        ahead = Download(cache, "x", tmp_path / "x", None, size, frozenset, True, None, 0, None)
        cache._in_flight[1] = 1  # (one download running: this one, alone)
        return ahead._part_size(size, False), cache.requests.workers

    unbounded, workers = part(None)
    assert part(IN_FLIGHT * workers * unbounded)[0] == unbounded
    large = 4 * size
    share = large // (IN_FLIGHT * workers)
    assert share <= part(large)[0] <= share + 1 and share > unbounded  # (the share, cut evenly: `even_parts`)
    slow, _ = part(large, mbps=2.0)
    assert part(None, mbps=2.0)[0] < slow <= 2e6 * ROOM_PARTS * PART_SECONDS < large // (IN_FLIGHT * workers)
    assert part(1 << 40, mbps=200.0)[0] == -(-size // 3) <= BLOCK  # (never more than one read holds; three even parts)


def test_fetch_threads_set_in_a_toml_config_bound_the_reads_in_flight(tmp_path, s3, local_stores, monkeypatch):
    """`fetch_threads` of a source in object storage reaches its store from a job file: at
    most that many ranged reads are in flight (index reads at open included), and a larger
    value puts more in flight behind a slow link (50 ms to each answer here)."""
    from forge_grain.stores import download  # (its parts: BLOCK bytes at most)

    monkeypatch.setattr(download, "BLOCK", 4096)  # several parts a shard
    peaks = []
    for n in (2, 6):
        s3.fs().put(str(local_stores["bin"]), f"bucket/fetch{n}", recursive=True)  # reads counted by prefix
        s3.proxy.clear()
        s3.proxy.latency = 0.05
        opts = s3.options(via_proxy=True)
        (tmp_path / f"job{n}.toml").write_text(f"""seq_len = 64
global_batch_size = 8
num_epochs = 1
[[sources]]
name = "web"
path = "s3://bucket/fetch{n}"
fetch_threads = {n}
object_cache = "{tmp_path / f'objects{n}'}"
storage_options = {{ key = "{opts['key']}", secret = "{opts['secret']}", endpoint_url = "{opts['endpoint_url']}" }}
""")
        pipe = Pipeline(DataConfig.from_toml(tmp_path / f"job{n}.toml"), 0, 1, cache_dir=tmp_path / f"plans{n}")
        it = pipe.iterator()
        for _ in range(3):
            next(it)
        it.close()
        peaks.append(s3.proxy.peaks[f"fetch{n}"])
        assert pipe.stores[0].cache.requests.workers == n
    assert peaks[0] <= 2 < peaks[1] <= 6, peaks
    with pytest.raises(ConfigError, match=r"sources\[0\]\.fetch_threads: must be a positive integer"):
        DataConfig.from_dict(dict(sources=[source("s3://bucket/bin", fetch_threads=0)], seq_len=64,
                                  global_batch_size=8))


def test_reads_in_flight_grow_behind_a_slow_link_by_default(tmp_path, s3, local_stores, monkeypatch):
    """Without `fetch_threads`, a store behind a link slow to answer (50 ms to each read here)
    puts more reads in flight than the pool starts with: it doubles them while the rate rises."""
    from forge_grain.stores import download, request_pool

    monkeypatch.setattr(download, "BLOCK", 4096)  # many parts a shard: more reads than workers
    monkeypatch.setattr(request_pool, "_REQUESTS", {})  # this test's own pool, grown from the start
    s3.fs().put(str(local_stores["bin"]), "bucket/grow", recursive=True)
    s3.proxy.clear()
    s3.proxy.latency = 0.05
    store = TokenStore.open("s3://bucket/grow", storage_options=s3.options(via_proxy=True),
                            object_cache=str(tmp_path / "objects"))
    shards = range(len(store.manifest.shards))
    assert sum(s.num_tokens * 2 for s in store.manifest.shards) // 4096 > 4 * request_pool.START
    store.prefetch(shards)
    disk = TokenStore.open(local_stores["bin"])
    assert all(np.array_equal(store[i], disk[i]) for i in range(0, len(disk), 5))
    assert store.cache.requests.workers > request_pool.START
    assert s3.proxy.peaks["grow"] > request_pool.START, s3.proxy.peaks
    store.close()  # its downloads ahead stop here, not in the next test's count of reads


def test_shards_hinted_together_are_read_in_the_order_of_need(tmp_path, s3, local_stores):
    """Shards told of in one hint download in the order the steps need them, however the
    download threads happen to start: with one read in flight, the GETs follow the hint."""
    s3.proxy.clear()
    store = TokenStore.open("s3://bucket/bin", storage_options=s3.options(via_proxy=True),
                            object_cache=str(tmp_path / "objects"), fetch_threads=1)
    gate = threading.Event()  # the one reader is held while the hint queues every shard behind it
    store.cache.requests.submit(True, store.cache.requests.job(), gate.wait)
    need = [17, 3, 26, 9, 12, 0, 21, 5]
    store.prefetch(need)
    time.sleep(0.5)  # the download threads all start meanwhile, in whatever order
    gate.set()
    for k in need:
        store._array(k)
    got = [int(path.rsplit("shard-", 1)[1][:5]) for method, path in s3.proxy.seen
           if method == "GET" and "/bucket/bin/" in path and path.endswith(".bin")]  # (this store's only)
    assert got == need


def test_a_mixtures_downloads_ahead_follow_the_steps_across_its_sources(tmp_path, s3, local_stores):
    """A mixture's hint numbers its sources' downloads by the steps that first read them: with
    one read in flight, the shards arrive in the order of need across the sources. Numbered
    one source after another, one source's whole window queued before the other's first
    shard, which a step then waited for."""
    from forge_grain.pipeline.fetching import HINT_STEPS

    for name in ("a", "b"):
        s3.fs().put(str(local_stores["bin"]), f"bucket/needmix/{name}", recursive=True)
    s3.proxy.clear()
    pipe = Pipeline(DataConfig.from_dict(dict(
        sources=[dict(name=n, path=f"s3://bucket/needmix/{n}", strategy="bestfit", shuffle_window=1, fetch_threads=1,
                      object_cache=str(tmp_path / "objects"), storage_options=s3.options(via_proxy=True))
                 for n in "ab"],
        seq_len=64, global_batch_size=8, seed=1, plan_chunk_docs=100, num_epochs=1)), 0, 1)
    stores = [d.store for d in pipe.datasets]
    requests = stores[0].cache.requests  # (one pool: both have fetch_threads = 1)
    gate = threading.Event()  # the one reader is held while the hint queues every shard behind it
    requests.submit(True, requests.job(), gate.wait)
    pipe.fetching.advance(0)  # the hint of the first steps, as the first batch tells it
    time.sleep(0.5)  # the download threads all start meanwhile, in whatever order
    gate.set()
    hinted = [sorted(store._pending) for store in stores]
    for store, shards in zip(stores, hinted):
        for k in shards:
            store._array(k)
    got = [(path.split("/needmix/")[1][0], int(path.rsplit("shard-", 1)[1][:5])) for method, path in s3.proxy.seen
           if method == "GET" and "/needmix/" in path and path.endswith(".bin")]
    first_block = {}  # (source, shard) -> the block of steps that first reads it (what a hint orders by)
    for step in range(pipe.order.num_steps):
        src, rank = pipe.order.locate(pipe.order.shard_rows(step))
        for i, name in enumerate("ab"):
            for k in pipe.datasets[i].arrays_read(rank[src == i]).tolist():
                first_block.setdefault((name, k), step // HINT_STEPS)
    blocks = [first_block[g] for g in got]
    assert {name for name, _ in got} == {"a", "b"} and len(got) == sum(map(len, hinted))
    assert blocks == sorted(blocks), got


def test_a_closed_iterator_stops_the_downloads_ahead_it_asked_for(tmp_path, s3, local_stores, monkeypatch):
    """Closing an iterator withdraws its hints: the downloads ahead not yet begun give up, and
    only those already running (two here, the process's download slots) finish. Left to run,
    a closed iterator's window downloaded every shard it named beside the next reader's."""
    from forge_grain.stores import request_pool

    monkeypatch.setattr(request_pool, "_AHEAD", [request_pool.Slots(2)])  # (two downloads ahead at once)
    s3.fs().put(str(local_stores["bin"]), "bucket/closing", recursive=True)
    s3.proxy.clear()
    s3.proxy.latency = 0.05
    pipe = Pipeline(config(source("s3://bucket/closing", storage_options=s3.options(via_proxy=True),
                                  object_cache=str(tmp_path / "objects"))), 0, 1)
    it = pipe.iterator()
    next(it)

    def fetched():
        return {path for method, path in s3.proxy.seen if method == "GET" and "/closing/" in path and
                path.endswith(".bin")}

    hinted, before = len(pipe.datasets[0].store._keep), fetched()
    it.close()
    seen, deadline = None, time.monotonic() + 30
    while fetched() != seen and time.monotonic() < deadline:  # until no new shard for a second
        seen = fetched()
        time.sleep(1.0)
    # (at the close, at most the two slots' downloads had begun and not yet been seen; the
    # shards begun before it depend on how far the downloads ahead got while the first batch
    # was read: 6-9 under load)
    assert hinted >= 20 and len(seen - before) <= 2, (hinted, len(before), len(seen))
    assert not pipe.datasets[0].store._keep
    again = pipe.iterator()  # a new iterator tells its own hints again, and reads as before
    got = [next(again) for _ in range(3)]
    want = list(itertools.islice(Pipeline(config(source(local_stores["bin"])), 0, 1).iterator(), 3))
    assert all(same(a, b) for a, b in zip(got, want))
    again.close()


def test_a_pipeline_over_object_storage_leaves_no_thread_of_its_build_running(tmp_path, s3, local_stores):
    """numba is set up in a thread while remote stores open; the build joins it, so a
    DataLoader worker forked after the build finds no lock held by it."""
    Pipeline(config(source("s3://bucket/bin", storage_options=s3.options(), object_cache=str(tmp_path / "o"))), 0, 1)
    assert not [t.name for t in threading.enumerate() if t.name == "forge-grain-numba"]


def test_reads_in_flight_stop_growing_when_the_link_is_full():
    """The doubling ends at the first one that does not raise the rate: on a link that carries
    12 reads' worth, 16 reads and 32 read at one rate, so the pool stays at 32, and more reads
    would hold memory for nothing. A round in which the reads outpaced the demand teaches nothing."""
    from forge_grain.stores.request_pool import Growth

    now = [0.0]
    growth = Growth(clock=lambda: now[0])
    growth.done(0, True)  # (the first round's clock starts)
    for _ in range(6):  # a round each: as many reads as workers, all while others waited
        n = growth.workers
        for _ in range(n):
            now[0] += 1.0 / min(n, 12)  # the link carries 12 reads a second at most
            growth.done(1 << 20, True)
    assert (growth.workers, growth.settled) == (32, True)

    idle = Growth(clock=lambda: now[0])
    for _ in range(100):
        now[0] += 0.01
        idle.done(1 << 20, False)  # no read waiting: the consumer, not the link, was the limit
    assert (idle.workers, idle.settled) == (16, False)


def test_reads_in_flight_settled_in_a_busy_moment_grow_again_while_they_stay_the_limit():
    """A round measured while the CPU was busy (here 32 reads came at 16's rate) settles the
    pool at 32. While its workers stay the limit (requests waiting through every round), a
    doubling is tried again after PROBE_S seconds of such rounds, measured against the rate
    then: on a link that now carries 64 reads' worth the pool reaches 64. Where a probe does
    not help, the next waits twice as long."""
    from forge_grain.stores.request_pool import Growth

    now = [0.0]

    def rounds(growth, count, carried):
        """`count` rounds of as many reads as workers, the link carrying `carried(workers)`
        reads a second, requests waiting throughout."""
        for _ in range(count):
            n = growth.workers
            for _ in range(n):
                now[0] += 1.0 / carried(n)
                growth.done(1 << 20, True)

    growth = Growth(clock=lambda: now[0])
    growth.done(0, True)  # (the first round's clock starts)
    rounds(growth, 2, lambda n: 16)  # 16 reads a second, then 32 at the same rate: the CPU was busy
    assert (growth.workers, growth.settled) == (32, True)
    rounds(growth, 4, lambda n: n)  # one second a round: 4 s of the workers being the limit
    assert (growth.workers, growth.settled) == (32, True)
    rounds(growth, 1, lambda n: n)
    assert growth.workers == 64  # (its bound)
    rounds(growth, 3, lambda n: n)
    assert (growth.workers, growth.settled) == (64, True)

    full = Growth(start=4, clock=lambda: now[0])  # a link full at 6 reads a second: 8 help, 16 do not
    full.done(0, True)
    rounds(full, 3, lambda n: min(n, 6))
    assert (full.workers, full.settled) == (16, True)
    for wait in (Growth.PROBE_S, 2 * Growth.PROBE_S):
        start = now[0]
        while full.workers == 16:
            rounds(full, 1, lambda n: min(n, 6))
        assert wait <= now[0] - start < wait + 16 / 6  # (a round of 16 reads)
        assert (full.workers, full.settled) == (32, False)  # the probe's round ...
        rounds(full, 1, lambda n: min(n, 6))
        assert (full.workers, full.settled) == (16, True)  # ... no faster: back


def test_workers_above_the_growths_count_rest_until_it_wants_them():
    """After a probe goes back, the pool runs no more reads at once than its growth wants;
    the workers resting take jobs again when it wants more."""
    from forge_grain.stores.request_pool import Growth, Requests

    pool = Requests()
    pool.growth = Growth(8, 8, clock=lambda: 0.0)  # (its clock still: no round ends to change it)
    running, peak, lock = [0], [0], threading.Lock()

    def read(gate):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        gate.wait(10)
        with lock:
            running[0] -= 1

    def batch(count):
        peak[0], gate = 0, threading.Event()
        futures = [pool.submit(False, pool.job(), read, gate) for _ in range(count)]
        deadline = time.monotonic() + 10
        while running[0] < min(count, pool.workers) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # (a worker that should rest would have taken a job by now)
        gate.set()
        for f in futures:
            f.result(timeout=10)
        return peak[0]

    assert batch(16) == 8
    pool.growth.workers = 4  # a probe that did not help
    assert batch(4) == 4  # (each worker, done with a job, rests while more than 4 take jobs)
    assert batch(16) == 4
    pool.growth.workers = 8
    assert batch(16) == 8


def test_ranged_reads_run_in_order_of_need():
    """A read for a batch waiting now runs before queued prefetches, and the parts of a shard
    asked for earlier before those of one asked for later (so the next shard arrives with all
    the connections' bandwidth), however the jobs were queued."""
    from forge_grain.stores.request_pool import Requests

    pool, ran, gate = Requests(1), [], threading.Event()
    blocker = pool.submit(True, pool.job(), gate.wait)  # the one worker is busy while the queue fills
    first, second = pool.job(), pool.job()
    futures = [pool.submit(False, second, ran.append, ("second", k)) for k in range(3)]
    futures += [pool.submit(False, first, ran.append, ("first", k)) for k in range(3)]
    futures.append(pool.submit(True, pool.job(), ran.append, ("now", 0)))
    gate.set()
    for f in [blocker, *futures]:
        f.result(timeout=10)
    assert ran == [("now", 0), *(("first", k) for k in range(3)), *(("second", k) for k in range(3))]


@pytest.mark.parametrize("kind", ["drop", "500", "delay", "truncate"])
def test_transient_faults_are_retried_and_the_data_is_exact(tmp_path, s3, local_stores, kind):
    s3.proxy.clear()
    s3.proxy.fail("shard-0000", kind, times=2)  # the first two reads of shards 0-9 fail
    s3.proxy.fail("manifest.json", kind, times=2)  # ... and of what opening reads
    s3.proxy.fail("shards.idx.npy", kind, times=2)
    store = TokenStore.open("s3://bucket/bin", storage_options=s3.options(via_proxy=True),
                            object_cache=str(tmp_path / "objects"))
    disk = TokenStore.open(local_stores["bin"])
    assert all(np.array_equal(store[i], disk[i]) for i in range(0, len(disk), 7))
    assert all(f[2] == 0 for f in s3.proxy.faults)  # the faults happened


def test_a_persistent_failure_is_an_error_naming_the_object(tmp_path, s3, local_stores):
    s3.proxy.clear()
    s3.proxy.fail("shard-00003.bin", "500", times=1000)
    store = TokenStore.open("s3://bucket/bin", storage_options=s3.options(via_proxy=True),
                            object_cache=str(tmp_path / "objects"))
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"s3://bucket/bin/shard-00003\.bin: failed after 5 attempts"):
        store[int(store._file_doc_starts[3])]
    assert time.monotonic() - t0 < 60
    assert not list((tmp_path / "objects").rglob("shard-00003.bin"))  # nothing half-written looks complete
    s3.proxy.clear()


def test_a_shard_never_answered_is_an_error_within_the_deadline_and_its_reads_start_no_threads(tmp_path, s3,
                                                                                                 local_stores,
                                                                                                 monkeypatch):
    """The server takes every ranged read of one shard and never answers: each read is given
    up after its share of FORGE_GRAIN_REMOTE_DEADLINE by obstore's own client timeout, and
    the error names the shard. No thread is started for a read (one each, as for s3fs, was
    two more hand-overs of the GIL a request, up to 5 ms each while the consumer ran Python)."""
    monkeypatch.setenv("FORGE_GRAIN_REMOTE_DEADLINE", "2")
    s3.proxy.clear()
    store = TokenStore.open("s3://bucket/bin", storage_options=s3.options(via_proxy=True),
                            object_cache=str(tmp_path / "objects"))
    assert store.cache._fast is not None  # (read through obstore)
    started, start = [], threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda t: (started.append(t.name), start(t))[1])
    disk = TokenStore.open(local_stores["bin"])
    assert np.array_equal(store[int(store._file_doc_starts[2])], disk[int(disk._file_doc_starts[2])])
    s3.proxy.fail("shard-00004.bin", "hang", times=1000)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"s3://bucket/bin/shard-00004\.bin: failed after \d attempts in 2 s: "
                                         r"TimeoutError: no answer within 0.5 s"):
        store[int(store._file_doc_starts[4])]
    assert time.monotonic() - t0 < 2.5
    assert "forge-grain-remote" not in started
    s3.proxy.clear()


def test_a_corrupt_object_fails_its_checksum_naming_it(tmp_path, s3, local_stores):
    fs = s3.fs()
    fs.put(str(local_stores["bin"]), "bucket/corrupt", recursive=True)
    data = bytearray(fs.cat("bucket/corrupt/shard-00005.bin"))
    data[100] ^= 0xFF
    fs.pipe("bucket/corrupt/shard-00005.bin", bytes(data))
    store = TokenStore.open("s3://bucket/corrupt", storage_options=s3.options(), object_cache=str(tmp_path / "o"))
    with pytest.raises(StoreError, match=r"s3://bucket/corrupt/shard-00005\.bin: .*sha256 does not match"):
        store[int(store._file_doc_starts[5])]
    assert store[0] is not None  # other shards still read


def test_a_missing_object_or_store_is_named(tmp_path, s3, local_stores):
    with pytest.raises(StoreError, match=r"s3://bucket/nothing: nothing at this URL"):
        TokenStore.open("s3://bucket/nothing", storage_options=s3.options(), object_cache=str(tmp_path / "o"))
    fs = s3.fs()
    fs.put(str(local_stores["bin"]), "bucket/partial", recursive=True)
    fs.put(str(local_stores["bin"]), "bucket/unfinished", recursive=True)
    fs.rm("bucket/unfinished/manifest.json")  # an upload that stopped before its manifest
    with pytest.raises(StoreError, match=r"s3://bucket/unfinished: holds a forge-grain store's shards but no "
                                         r"manifest\.json .*did not finish"):
        TokenStore.open("s3://bucket/unfinished", storage_options=s3.options(), object_cache=str(tmp_path / "o"))
    fs.rm("bucket/partial/shard-00007.bin")
    store = TokenStore.open("s3://bucket/partial", storage_options=s3.options(), object_cache=str(tmp_path / "o"))
    with pytest.raises(StoreError, match=r"s3://bucket/partial/shard-00007\.bin: FileNotFoundError"):
        store[int(store._file_doc_starts[7])]


def test_a_broken_manifest_a_foreign_dtype_or_a_truncated_shard_in_object_storage_is_named(tmp_path, s3,
                                                                                             local_stores):
    fs = s3.fs()
    fs.put(str(local_stores["bin"]), "bucket/hostile", recursive=True)
    good = fs.cat("bucket/hostile/manifest.json")
    opts = dict(storage_options=s3.options(), object_cache=str(tmp_path / "o"))
    fs.pipe("bucket/hostile/manifest.json", b"{not json")
    with pytest.raises(StoreError, match=r"s3://bucket/hostile/manifest\.json"):
        TokenStore.open("s3://bucket/hostile", **opts)
    fs.pipe("bucket/hostile/manifest.json", good.replace(b'"<u2"', b'"<f4"'))
    with pytest.raises(StoreError, match=r"s3://bucket/hostile.*dtype"):
        TokenStore.open("s3://bucket/hostile", **opts)
    fs.pipe("bucket/hostile/manifest.json", good)
    shard = fs.cat("bucket/hostile/shard-00004.bin")
    fs.pipe("bucket/hostile/shard-00004.bin", shard[: len(shard) // 2])
    store = TokenStore.open("s3://bucket/hostile", **opts)
    with pytest.raises(StoreError, match=r"s3://bucket/hostile/shard-00004\.bin: failed .*bytes arrived of the"):
        store[int(store._file_doc_starts[4])]
    assert not list((tmp_path / "o").rglob("shard-00004.bin"))  # nothing kept of it


READ_ALL = """
import sys, json
from forge_grain import TokenStore
store = TokenStore.open("s3://bucket/bin", storage_options=json.loads(sys.argv[1]), object_cache=sys.argv[2])
total = sum(int(store[i].sum()) for i in range(len(store)))
print(total, store.cache.downloads)
"""


def test_two_processes_share_one_cache_downloading_each_shard_once(tmp_path, s3, local_stores):
    s3.proxy.clear()
    opts = json.dumps(s3.options(via_proxy=True))
    procs = [subprocess.Popen([sys.executable, "-c", READ_ALL, opts, str(tmp_path / "shared")], stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    disk = TokenStore.open(local_stores["bin"])
    assert {int(o[0]) for o in outs} == {sum(int(disk[i].sum()) for i in range(len(disk)))}
    shard_gets = {path: n for path, n in s3.proxy.gets.items() if path.endswith(".bin")}
    assert len(shard_gets) == 30 and set(shard_gets.values()) == {1}  # one download per shard for the host
    assert sum(int(o[1]) for o in outs) == 31  # 30 shards and the joined index, split between the two


def test_prepare_to_object_storage_writes_the_local_store_and_an_interrupted_upload_resumes(tmp_path, s3,
                                                                                          local_stores, monkeypatch):
    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    docs = local_stores["bin"].parent / "docs.jsonl"
    args = dict(token_field="ids", vocab_size=1000, bos_id=0, num_shards=30, progress=False)
    s3.proxy.clear()
    s3.proxy.fail("up/shard-00012.bin", "500", times=1000, method="PUT")  # the upload fails part-way
    with pytest.raises(StoreError, match=r"s3://bucket/up/shard-00012\.bin: failed after 5 attempts"):
        prepare(docs, "s3://bucket/up", storage_options=s3.options(via_proxy=True), **args)
    fs = s3.fs()
    assert not fs.exists("bucket/up/manifest.json")  # an unfinished upload never looks like a store
    first = {p for p, n in s3.proxy.puts.items() if p.endswith((".bin", ".npy"))}
    s3.proxy.clear()
    url = prepare(docs, "s3://bucket/up", storage_options=s3.options(via_proxy=True), **args)
    again = {p for p in s3.proxy.puts if p.endswith((".bin", ".npy"))}
    assert "/bucket/up/shard-00012.bin" in again and not again & (first - {"/bucket/up/shard-00012.bin"})
    remote = TokenStore.open(url, storage_options=s3.options(), object_cache=str(tmp_path / "o"), verify=True)
    local = TokenStore.open(local_stores["bin"])
    assert remote.fingerprint == local.fingerprint and len(remote) == len(local)
    assert all(np.array_equal(remote[i], local[i]) for i in range(0, len(local), 11))
    from forge_grain.packing.summary import format_summary  # what `forge-grain prepare DIR s3://...` prints

    assert format_summary(remote).startswith("s3://bucket/up  (bin, 30 shard(s))"), format_summary(remote)[:200]
    assert not fs.exists("bucket/up/.forge-grain-upload.json")
    s3.proxy.clear()
    prepare(docs, "s3://bucket/up", storage_options=s3.options(via_proxy=True), **args)
    assert not [p for p in s3.proxy.puts if not p.endswith(".forge-grain-writer.lock")]  # complete: nothing uploaded
    with pytest.raises(StoreError, match="already holds another token store"):
        prepare(docs, "s3://bucket/up", storage_options=s3.options(), **{**args, "num_shards": 20})


def test_prepare_to_a_bucket_that_does_not_exist_fails_before_tokenizing(tmp_path, s3, local_stores, monkeypatch):
    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    docs = local_stores["bin"].parent / "docs.jsonl"
    from forge_grain.preparation import local as preparation

    def no_tokenizing(*a, **k):
        raise AssertionError("the corpus was read before the output was checked")

    monkeypatch.setattr(preparation, "_write_store", no_tokenizing)
    with pytest.raises(PrepareError, match=r"s3://no-such-bucket/web: cannot write there .*check that the bucket "
                                           r"exists.*nothing was tokenized"):
        prepare(docs, "s3://no-such-bucket/web", storage_options=s3.options(), token_field="ids", vocab_size=1000,
                progress=False)


def test_a_damaged_cached_copy_is_downloaded_again(tmp_path, s3, local_stores):
    """A cached copy cut short (what a power loss leaves) or with a flipped byte: the object is
    the truth. A short copy is fetched again on read; verify=True re-checks every copy."""
    local = TokenStore.open(local_stores["bin"])
    opts = dict(storage_options=s3.options(), object_cache=str(tmp_path / "o"))
    store = TokenStore.open("s3://bucket/bin", **opts)
    first = int(store._file_doc_starts[3])
    store[first]
    (copy,) = (tmp_path / "o").rglob("shard-00003.bin")
    data = copy.read_bytes()
    store.close()
    copy.write_bytes(data[: len(data) // 2])
    again = TokenStore.open("s3://bucket/bin", **opts)
    assert np.array_equal(again[first], local[first]) and copy.stat().st_size == len(data)
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0xFF
    again.close()
    copy.write_bytes(bytes(flipped))
    checked = TokenStore.open("s3://bucket/bin", verify=True, **opts)
    assert copy.read_bytes() == data
    assert all(np.array_equal(checked[i], local[i]) for i in range(0, len(local), 97))


def test_a_reservation_of_a_process_that_died_is_reclaimed(tmp_path, s3, local_stores):
    """A process killed mid-download leaves its temporary, allocated at full size, in a cache
    with cache_limit: the others reclaim it instead of waiting for it forever."""
    from forge_grain.files import temporary

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    opts = dict(storage_options=s3.options(), object_cache=str(tmp_path / "o"))
    probe = TokenStore.open("s3://bucket/bin", **opts)
    shard = max(s.num_tokens for s in probe.manifest.shards) * 2
    (copy_dir,) = {p.parent for p in (tmp_path / "o").rglob("*.idx.npy")}
    probe.close()
    stale = temporary(copy_dir / "shard-00001.bin").with_name(
        temporary(copy_dir / "shard-00001.bin").name.rsplit("-", 1)[0] + f"-{dead.pid}")
    store = TokenStore.open("s3://bucket/bin", cache_limit=shard * 3, **opts)
    with store.cache._accounting():  # after the open (which removes what dead processes left): a death meanwhile
        with open(stale, "wb") as f:
            f.truncate(shard * 2)  # the dead download's reservation: most of the cache, in its ledger
        store.cache.ledger.sync()
        store.cache.ledger.add(str(stale.relative_to(store.cache.dir)), shard * 2)
    got = []
    reader = threading.Thread(target=lambda: got.append(store[int(store._file_doc_starts[2])]), daemon=True)
    reader.start()
    reader.join(60)  # a wait for the dead reservation would never end: fail instead of hanging
    assert not reader.is_alive() and len(got) == 1 and not stale.exists()


def test_a_store_of_128_shards_opens_with_a_few_requests_before_its_first_shard(tmp_path, s3, local_stores):
    """Every shard's document index comes in one object (`shards.idx.npy`, checked by the
    manifest's sha256): opening costs the manifest and that object whatever the shard count,
    with no listing and no HEAD (the shards' sizes are the manifest's)."""
    store_dir = prepare(next(local_stores["bin"].parent.glob("docs.jsonl")), tmp_path / "s128", token_field="ids",
                        vocab_size=1000, bos_id=0, num_shards=128, progress=False)
    s3.fs().put(str(store_dir), "bucket/s128", recursive=True)
    disk = TokenStore.open(store_dir)
    s3.proxy.clear()
    store = TokenStore.open("s3://bucket/s128", storage_options=s3.options(via_proxy=True),
                            object_cache=str(tmp_path / "objects"))
    # what the guide says: two GETs through obstore (these options give it); the format's probe
    # read the manifest, and the open took it from there (a HEAD, then the GET, before)
    assert s3.proxy.seen == [("GET", "/bucket/s128/manifest.json"), ("GET", "/bucket/s128/shards.idx.npy")], \
        s3.proxy.seen
    assert np.array_equal(store.offsets, disk.offsets)
    assert all(np.array_equal(store[i], disk[i]) for i in range(0, len(disk), 97))


@pytest.mark.parametrize("bad", ["float", "two-dimensional", "truncated", "short"])
def test_a_joined_index_of_the_wrong_kind_is_refused_naming_it(tmp_path, s3, local_stores, bad):
    """Even with a manifest whose sha256 matches it (a writer that is not prepare), a joined
    index that is not one integer offset per document boundary is an error naming the object."""
    joined = np.load(local_stores["bin"] / "shards.idx.npy")
    if bad == "float":
        joined = joined.astype(np.float64)
    elif bad == "two-dimensional":
        joined = joined[: len(joined) // 2 * 2].reshape(2, -1)
    elif bad == "short":
        joined = joined[:-5]
    buf = io.BytesIO()
    np.save(buf, joined)
    data = buf.getvalue()[:-64] if bad == "truncated" else buf.getvalue()
    manifest = json.loads((local_stores["bin"] / "manifest.json").read_text())
    manifest["indices"]["sha256"] = hashlib.sha256(data).hexdigest()
    fs = s3.fs()
    fs.put(str(local_stores["bin"]), f"bucket/joined-{bad}", recursive=True)
    fs.pipe(f"bucket/joined-{bad}/shards.idx.npy", data)
    fs.pipe(f"bucket/joined-{bad}/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(StoreError, match=rf"s3://bucket/joined-{bad}/shards[.]idx[.]npy: "):
        TokenStore.open(f"s3://bucket/joined-{bad}", storage_options=s3.options(), object_cache=str(tmp_path / "o"))


def many_documents(tmp_path: Path) -> Path:
    """A store of 70,000 short documents in 4 shards: a joined index of 560 KB, more than one
    GET's 512 KiB."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"ids": [0, 2 + i % 900, 3]}) + "\n" for i in range(70_000)))
    return prepare(docs, tmp_path / "many", token_field="ids", vocab_size=1000, bos_id=0, num_shards=4,
                   progress=False)


def test_a_large_joined_index_is_read_in_parallel_parts_and_still_checked(tmp_path, s3):
    """An index of more than 512 KiB (here 70,000 documents) is read in ranged parts on several
    connections, their ranges from the size np.save gives the manifest's offsets (no HEAD
    first), checked by its sha256 as the one-GET read of a small one is; the documents are the
    local store's, and a tampered index of the same size is refused naming it."""
    local = many_documents(tmp_path)
    fs = s3.fs()
    fs.put(str(local), "bucket/many-docs", recursive=True)
    s3.proxy.clear()
    remote = TokenStore.open("s3://bucket/many-docs", storage_options=s3.options(via_proxy=True),
                             object_cache=str(tmp_path / "o"))
    assert s3.proxy.gets["/bucket/many-docs/shards.idx.npy"] >= 2  # parts, not one GET
    assert ("HEAD", "/bucket/many-docs/shards.idx.npy") not in s3.proxy.seen
    disk = TokenStore.open(local)
    assert len(remote) == len(disk) == 70_000 and remote.fingerprint == disk.fingerprint
    assert all(np.array_equal(remote[i], disk[i]) for i in (0, 1, 34_567, 69_999))
    index = bytearray((local / "shards.idx.npy").read_bytes())
    index[-8:] = (10**9).to_bytes(8, "little")  # the last offset, changed; the size is the same
    fs.pipe("bucket/many-docs/shards.idx.npy", bytes(index))
    with pytest.raises(StoreError, match=r"s3://bucket/many-docs/shards[.]idx[.]npy: .*sha256"):
        TokenStore.open("s3://bucket/many-docs", storage_options=s3.options(), object_cache=str(tmp_path / "o2"))


@pytest.mark.parametrize("header", [80, 192])
def test_a_large_joined_index_with_another_header_than_numpys_is_read(tmp_path, s3, header, caplog):
    """A joined index written by another tool, its .npy header shorter or longer than np.save's
    (so not the size the manifest's offsets give), is asked its size and read once more: the
    documents are the local store's, and the guess was read once, never retried."""
    local = many_documents(tmp_path)
    data = (local / "shards.idx.npy").read_bytes()
    end = 10 + int.from_bytes(data[8:10], "little")  # numpy's header: magic, version, length, its dict
    text = data[10:end].decode().strip()
    text = text + " " * (header - 11 - len(text)) + "\n"
    rewritten = data[:8] + len(text).to_bytes(2, "little") + text.encode() + data[end:]
    assert np.array_equal(np.load(io.BytesIO(rewritten)), np.load(local / "shards.idx.npy"))
    (local / "shards.idx.npy").write_bytes(rewritten)
    manifest = json.loads((local / "manifest.json").read_text())
    manifest["indices"]["sha256"] = hashlib.sha256(rewritten).hexdigest()
    (local / "manifest.json").write_text(json.dumps(manifest))
    s3.fs().put(str(local), f"bucket/header-{header}", recursive=True)
    s3.proxy.clear()
    caplog.set_level(logging.INFO, logger="forge_grain.stores")
    remote = TokenStore.open(f"s3://bucket/header-{header}", storage_options=s3.options(via_proxy=True),
                             object_cache=str(tmp_path / "o"))
    disk = TokenStore.open(local)
    assert len(remote) == len(disk) == 70_000 and np.array_equal(remote.offsets, disk.offsets)
    assert all(np.array_equal(remote[i], disk[i]) for i in (0, 34_567, 69_999))
    assert s3.proxy.seen.count(("HEAD", f"/bucket/header-{header}/shards.idx.npy")) == 1
    assert re.search(r"shards[.]idx[.]npy: not the \d+ bytes expected", caplog.text) and not retried(caplog), caplog.text


@pytest.mark.parametrize("extra", [10**6, 10**15])
def test_a_manifest_whose_counts_make_the_joined_index_huge_is_refused_naming_it(tmp_path, s3, local_stores, extra):
    """A manifest claiming far more documents than its joined index holds: the index is never
    read at the size those counts give (10**15 documents: 8 PB), but asked its size, read,
    and refused naming it and both counts."""
    manifest = json.loads((local_stores["bin"] / "manifest.json").read_text())
    manifest["shards"][0]["num_documents"] += extra
    manifest["num_documents"] += extra
    fs = s3.fs()
    fs.put(str(local_stores["bin"]), f"bucket/counts-{extra}", recursive=True)
    fs.pipe(f"bucket/counts-{extra}/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(StoreError, match=rf"s3://bucket/counts-{extra}/shards[.]idx[.]npy: holds \d+ offsets .* "
                                         rf"the shards' indices {manifest['num_documents'] + 30} in one"):
        TokenStore.open(f"s3://bucket/counts-{extra}", storage_options=s3.options(), object_cache=str(tmp_path / "o"))


def retried(caplog) -> collections.Counter:
    """The attempts that failed and were made again, by the object's path at the server (a
    request timing out under a loaded machine is read twice, by design: not a second read)."""
    return collections.Counter("/" + m for m in re.findall(r"s3://(\S+): attempt \d+ failed", caplog.text))


def test_a_store_without_the_joined_index_reads_each_shards_index_once(tmp_path, s3, local_stores, caplog):
    """Stores prepared before the joined index open as they did: each shard's index read whole
    and checked by its sha256, no listing; one whose manifest predates those checksums too is
    listed once for the indices' sizes. Both read the same documents. (A read that failed and
    was retried counts once: CI once saw an index GET twice under load.)"""
    caplog.set_level(logging.INFO, logger="forge_grain.stores.remote_dir")
    disk = TokenStore.open(local_stores["bin"])
    fs = s3.fs()
    manifest = json.loads((local_stores["bin"] / "manifest.json").read_text())
    del manifest["indices"]
    for name, lists in (("joinless", 0), ("older", 1)):
        if name == "older":
            for shard in manifest["shards"]:
                del shard["index_sha256"]
        fs.put(str(local_stores["bin"]), f"bucket/{name}", recursive=True)
        fs.pipe(f"bucket/{name}/manifest.json", json.dumps(manifest).encode())
        s3.proxy.clear()
        caplog.clear()
        s3.proxy.fail(f"{name}/shard-00001.idx.npy", "500")  # (a failed read is made again, and counted apart)
        store = TokenStore.open(f"s3://bucket/{name}", storage_options=s3.options(via_proxy=True),
                                object_cache=str(tmp_path / "objects"))
        assert retried(caplog)[f"/bucket/{name}/shard-00001.idx.npy"] >= 1
        assert s3.proxy.lists == lists
        assert sorted(p.rsplit("/", 1)[1] for p in s3.proxy.gets if p.endswith(".idx.npy")) == sorted(
            s.index for s in disk.manifest.shards)
        again = retried(caplog)
        assert all(n == 1 + again[p] for p, n in s3.proxy.gets.items() if p.endswith(".idx.npy")), (
            s3.proxy.gets, again)
        assert np.array_equal(store.offsets, disk.offsets)
        assert all(np.array_equal(store[i], disk[i]) for i in range(0, len(disk), 97))
    s3.proxy.clear()


@pytest.mark.parametrize("which", ["shards.idx.npy", "shard-00002.idx.npy"])
def test_an_index_changed_in_object_storage_fails_its_checksum(tmp_path, s3, local_stores, which):
    """The joined index, and a shard's own index in a store without it, are checked by the
    manifest's sha256 before any offset is used."""
    import io

    fs = s3.fs()
    fs.put(str(local_stores["bin"]), "bucket/moved", recursive=True)
    if which != "shards.idx.npy":
        manifest = json.loads((local_stores["bin"] / "manifest.json").read_text())
        del manifest["indices"]
        fs.pipe("bucket/moved/manifest.json", json.dumps(manifest).encode())
    offsets = np.load(local_stores["bin"] / which)
    offsets[3] += 1
    buf = io.BytesIO()
    np.save(buf, offsets)
    fs.pipe(f"bucket/moved/{which}", buf.getvalue())
    with pytest.raises(StoreError, match=rf"s3://bucket/moved/{which.replace('.', '[.]')}: .*sha256 does not match"):
        TokenStore.open("s3://bucket/moved", storage_options=s3.options(), object_cache=str(tmp_path / "o"))


def test_a_second_writer_to_one_url_is_refused_naming_the_first(tmp_path, s3, local_stores, monkeypatch):
    """Two prepare jobs (on any hosts, either runner) into one s3:// output: the second is refused
    by a lock object created only if absent; the lock goes when the first ends."""
    from forge_grain.locks import LockedError
    from forge_grain.stores.writer_lock import writer_lock

    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    docs = local_stores["bin"].parent / "docs.jsonl"
    args = dict(token_field="ids", vocab_size=1000, bos_id=0, num_shards=3, progress=False,
                storage_options=s3.options())
    with writer_lock("s3://bucket/twice", s3.options()):
        for runner in ("local", "beam"):
            with pytest.raises(LockedError, match=r"s3://bucket/twice is being written by process \d+ on .*remove "
                                                  r"s3://bucket/twice/\.forge-grain-writer\.lock"):
                prepare(docs, "s3://bucket/twice", runner=runner, **args)
        assert not s3.fs().exists("bucket/twice/manifest.json")
    url = prepare(docs, "s3://bucket/twice", **args)  # the first ended: its lock is gone
    assert len(TokenStore.open(url, storage_options=s3.options(), object_cache=str(tmp_path / "o"))) == 3000
    assert not s3.fs().exists("bucket/twice/.forge-grain-writer.lock")


def test_a_prepare_killed_mid_upload_leaves_a_lock_the_rerun_takes_over(tmp_path, s3, local_stores, caplog):
    """The README's promise: re-running an interrupted prepare uploads what is missing. The
    killed job's lock names a process that no longer runs on this host: the re-run takes it
    over, says so, and completes the store."""
    docs = local_stores["bin"].parent / "docs.jsonl"
    env = {**os.environ, "FORGE_GRAIN_CACHE": str(tmp_path / "cache")}
    s3.proxy.fail("killed/shard-00001", "hang", times=5, method="PUT")  # the upload stalls there
    cmd = [sys.executable, "-m", "forge_grain", "prepare", str(docs), "s3://bucket/killed", "--token-field", "ids",
           "--vocab-size", "1000", "--bos-id", "0", "--num-shards", "3", "-q",
           "--storage-options", json.dumps(s3.options(via_proxy=True))]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    fs = s3.fs()
    try:
        deadline = time.monotonic() + 120
        while not (fs.exists("bucket/killed/.forge-grain-writer.lock") and s3.proxy.puts):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
            fs.invalidate_cache()
        time.sleep(1)
    finally:
        proc.kill()
        proc.wait()
        s3.proxy.clear()
    assert fs.exists("bucket/killed/.forge-grain-writer.lock") and not fs.exists("bucket/killed/manifest.json")
    os.environ["FORGE_GRAIN_CACHE"], saved = env["FORGE_GRAIN_CACHE"], os.environ.get("FORGE_GRAIN_CACHE")
    try:
        with caplog.at_level(logging.WARNING, logger="forge_grain.stores.writer_lock"):
            url = prepare(docs, "s3://bucket/killed", token_field="ids", vocab_size=1000, bos_id=0, num_shards=3,
                          progress=False, storage_options=s3.options())
    finally:
        os.environ.pop("FORGE_GRAIN_CACHE") if saved is None else os.environ.__setitem__("FORGE_GRAIN_CACHE", saved)
    assert re.search(rf"took over the writer lock of process {proc.pid} on .*no longer runs on this host", caplog.text)
    assert len(TokenStore.open(url, storage_options=s3.options(), object_cache=str(tmp_path / "o"))) == 3000
    assert not fs.exists("bucket/killed/.forge-grain-writer.lock")


def plant_lock(fs, url_path: str, **fields) -> None:
    """A lock object as another job wrote it."""
    record = {"owner": "x" * 32, "pid": 4242, "host": "another-host", "since": time.time() - 60,
              "renewed": time.time(), "lease_s": 300, **fields}
    fs.pipe(f"{url_path}/.forge-grain-writer.lock", json.dumps(record).encode())


def test_a_lock_whose_lease_ran_out_is_taken_over_and_a_live_one_is_not(s3, caplog):
    from forge_grain.locks import LockedError
    from forge_grain.stores.writer_lock import writer_lock

    fs = s3.fs()
    plant_lock(fs, "bucket/leased")  # renewed just now, on another host: a live job
    with pytest.raises(LockedError, match=r"being written by process 4242 on another-host .*taken over once its "
                                          r"lease runs out \(300 s unrenewed\)"):
        with writer_lock("s3://bucket/leased", s3.options()):
            pass
    plant_lock(fs, "bucket/leased", renewed=time.time() - 301)  # its job died 5 minutes ago
    with caplog.at_level(logging.WARNING, logger="forge_grain.stores.writer_lock"):
        with writer_lock("s3://bucket/leased", s3.options()):
            assert json.loads(fs.cat_file("bucket/leased/.forge-grain-writer.lock"))["pid"] == os.getpid()
    assert "took over the writer lock of process 4242 on another-host" in caplog.text
    assert "its lease ran out" in caplog.text
    assert not fs.exists("bucket/leased/.forge-grain-writer.lock")


FORGED_LEASES = {"lease_s a string": dict(lease_s="inf"), "lease_s NaN": dict(lease_s=float("nan")),
                 "lease_s 1e308": dict(lease_s=1e308), "since past a float": dict(since=10**400, renewed=None),
                 "renewed in the future": dict(renewed=time.time() + 86400), "pid a string": dict(pid="4242")}


def test_a_lock_that_is_not_a_valid_lease_expires_after_the_default_lease(s3, monkeypatch, caplog):
    """A lock whose lease is `inf`, NaN or 1e308, whose time is past the largest float or in the
    future: `prepare` ended in "internal error" or never took the lock over. Such a record counts
    as expired the default lease after the lock object was written, and the messages say so."""
    from forge_grain.locks import LockedError
    from forge_grain.stores.writer_lock import writer_lock

    monkeypatch.setenv("FORGE_GRAIN_LOCK_LEASE", "60")  # (long enough for a loaded machine: the locks stand)
    fs = s3.fs()
    for k, fields in enumerate(FORGED_LEASES.values()):
        record = {"owner": "x" * 32, "pid": 4242, "host": "another-host", "since": time.time(), "renewed": time.time(),
                  "lease_s": 300, **fields}
        fs.pipe(f"bucket/forged-{k}/.forge-grain-writer.lock",
                json.dumps({key: v for key, v in record.items() if v is not None}).encode())
        with pytest.raises(LockedError, match=r"taken over once its lease runs out \(60 s after the lock was written: "
                                              r"its record is not a valid lease unrenewed\)"):
            with writer_lock(f"s3://bucket/forged-{k}", s3.options()):
                pass
    monkeypatch.setenv("FORGE_GRAIN_LOCK_LEASE", "1")
    time.sleep(2.5)  # past that default lease (the store's times are whole seconds)
    for k, name in enumerate(FORGED_LEASES):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="forge_grain.stores.writer_lock"):
            with writer_lock(f"s3://bucket/forged-{k}", s3.options()):
                pass
        assert "its record is not a valid lease" in caplog.text and "counted as expired 1 s" in caplog.text, name


def test_a_live_holder_renews_its_lease_and_one_of_two_takers_wins(s3, monkeypatch):
    """A job holding the lock longer than its lease renews it (a second job stays refused); of
    two jobs taking over one dead lock at once, exactly one gets it."""
    from forge_grain.locks import LockedError
    from forge_grain.stores.writer_lock import writer_lock

    # a lease of 3 s renewed every 0.75 s: a loaded machine (a CI run beside another) may stall
    # the renewal for a second, never for the whole lease (a 1 s lease was taken over so once)
    monkeypatch.setenv("FORGE_GRAIN_LOCK_LEASE", "3")
    with writer_lock("s3://bucket/renewed", s3.options()):
        time.sleep(7)  # past two leases
        with pytest.raises(LockedError, match="being written by process"):
            with writer_lock("s3://bucket/renewed", s3.options()):
                pass
    fs = s3.fs()
    plant_lock(fs, "bucket/raced", renewed=time.time() - 60, lease_s=1)
    outcomes, start = [], threading.Barrier(2)

    def take():
        start.wait()
        try:
            with writer_lock("s3://bucket/raced", s3.options()):
                outcomes.append("held")
                time.sleep(1)
        except LockedError as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=take) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("held") == 1, outcomes


@pytest.mark.parametrize("layout", ["bin", "arrayrecord"])
def test_a_copy_evicted_between_its_fetch_and_its_opening_is_fetched_again(tmp_path, s3, local_stores, layout):
    """With a small cache_limit a prefetch can evict a copy after it was fetched for a read and
    before the read maps (or opens) it: the read fetches it again, never a FileNotFoundError."""
    store = TokenStore.open(f"s3://bucket/{layout}", storage_options=s3.options(), object_cache=str(tmp_path / "o"))
    local = TokenStore.open(local_stores[layout])
    fetch = store._fetch
    evicted = []

    def fetch_then_evict(k, ahead=False):
        path = fetch(k, ahead)
        if not evicted:
            path.unlink()
            evicted.append(k)
        return path

    if layout == "bin":
        store._fetch = fetch_then_evict
    else:
        store._records._fetch = fetch_then_evict
    doc = int(store._file_doc_starts[6]) + 3
    assert np.array_equal(store[doc], local[doc]) and evicted


def test_a_copy_evicted_before_every_read_is_an_error_naming_cache_limit(tmp_path, s3, local_stores):
    """Other downloads evicting a shard each time it lands (a cache_limit smaller than what the
    steps read at once) end in an error saying to raise cache_limit, not a missing file or a loop."""
    store = TokenStore.open("s3://bucket/bin", storage_options=s3.options(), object_cache=str(tmp_path / "o"),
                            cache_limit=10**7)
    fetch = store._fetch

    def fetch_then_evict(k, ahead=False):
        path = fetch(k, ahead)
        path.unlink()
        return path

    store._fetch = fetch_then_evict
    with pytest.raises(StoreError, match=r"s3://bucket/bin/shard-00006.bin: evicted before it could be read, 4 times: "
                                         r"cache_limit 10000000 bytes cannot hold the shards one step reads"):
        store[int(store._file_doc_starts[6]) + 3]


@pytest.fixture(scope="module")
def peers(tmp_path_factory, s3):
    """An MDS, LitData, Megatron, Arrow and raw dataset on disk, each uploaded to s3://peers/<name>."""
    from mds_writer import write_mds
    from test_formats import LITDATA, make_docs, write_arrow, write_megatron

    base = tmp_path_factory.mktemp("peers")
    docs = make_docs(120)
    (base / "megatron").mkdir()
    (base / "raw").mkdir()
    np.concatenate(docs).astype(np.uint16).tofile(base / "raw" / "part-0.bin")
    local = {
        "mds": write_mds(base / "mds", {"tokens": "ndarray:int32"}, [{"tokens": d} for d in docs], samples_per_shard=40),
        "litdata": LITDATA / "dataset",
        "megatron": write_megatron(base / "megatron" / "c4_text_document", docs).parent,
        "arrow": write_arrow(base / "arrow", docs, text=["x"] * len(docs)),
        "arrow_shards": write_arrow(base / "arrow_shards", docs, num_shards=4, text=["x"] * len(docs)),
        "raw": base / "raw",
    }
    fs = s3.fs()
    s3.fresh_bucket("peers")  # (a test putting a dataset of its own there may have made it, or a set-up before)
    for name, path in local.items():
        fs.put(str(path), f"peers/{name}", recursive=True)
    return local


PEER_OPTIONS = {"raw": dict(dtype="uint16", eos_id=1)}


@pytest.mark.parametrize("name", ["mds", "litdata", "megatron", "arrow", "raw"])
def test_a_peer_dataset_in_object_storage_reads_equal_to_its_local_copy(tmp_path, s3, peers, name):
    """A MosaicML, LitData, Megatron, Hugging Face or raw dataset in a bucket opens in place
    (its format found from the listing) and gives the documents of the same files on disk,
    with the same checks; a second open (another process) reuses the copy in the cache."""
    import pickle

    opts = dict(storage_options=s3.options(via_proxy=True), object_cache=str(tmp_path / "c"), **PEER_OPTIONS.get(name, {}))
    local = TokenStore.open(peers[name], **PEER_OPTIONS.get(name, {}))
    before, sent_before = s3.proxy.gets.copy(), s3.proxy.sent.copy()
    remote = TokenStore.open(f"s3://peers/{name}", **opts)
    downloaded = sum(s3.proxy.gets.values()) - sum(before.values())
    assert remote.format == local.format and len(remote) == len(local) and remote.dtype == local.dtype
    assert remote.fingerprint == local.fingerprint  # the same bytes: a state written on one resumes on the other
    for i in range(len(local)):
        assert np.array_equal(remote[i], local[i])
    assert "s3://peers" in repr(remote)
    assert downloaded > 0
    if name == "litdata":  # (its open reads the chunks' heads; each chunk is fetched once, as it is read)
        sent = {path: n - sent_before.get(path, 0) for path, n in s3.proxy.sent.items()}
        for chunk in peers[name].glob("*.bin"):
            head = 4 * (2 + int(np.frombuffer(chunk.read_bytes()[:4], "<u4")[0]))
            assert sent.get(f"/peers/{name}/{chunk.name}", 0) <= chunk.stat().st_size + head
        downloaded = sum(s3.proxy.gets.values()) - sum(before.values())
    # each byte fetched once: what the open read is what the reads read (a Megatron .bin this
    # small is read whole by its open's checks, and its blocks are written from those bytes)
    assert sum(s3.proxy.gets.values()) - sum(before.values()) == downloaded
    again = pickle.loads(pickle.dumps(remote))  # as a DataLoader worker reopens it
    assert np.array_equal(again[len(local) - 1], local[len(local) - 1])
    assert sum(s3.proxy.gets.values()) - sum(before.values()) == downloaded  # nothing fetched twice


INDEX_FILES = {"index.json", "state.json", "dataset_info.json"}  # what peers' datasets list their data files in


@pytest.mark.parametrize("name", ["mds", "litdata", "arrow_shards"])
def test_a_peer_dataset_larger_than_cache_limit_reads_a_file_at_a_time(tmp_path, s3, peers, name):
    """A LitData, MDS or Arrow (`save_to_disk`) dataset in a bucket with a cache_limit below its
    size opens (each data file read once to find its documents, and evicted as the limit needs)
    and reads equal to its local copy, with the local copy's fingerprint, the cache never above
    the limit; a second open reads only its index and the listing, and a read fetches just its
    file."""
    import pickle

    local = TokenStore.open(peers[name])
    files = sorted(f for f in Path(peers[name]).iterdir() if f.name not in INDEX_FILES)
    total, largest = sum(f.stat().st_size for f in files), max(f.stat().st_size for f in files)
    limit = 2 * largest + 1 + LEDGER_ROOM
    assert len(files) >= 3 and limit < total
    opts = dict(storage_options=s3.options(via_proxy=True), object_cache=str(tmp_path / "c"), cache_limit=limit)
    remote = TokenStore.open(f"s3://peers/{name}", **opts)
    assert remote.fetches and remote.format == local.format and len(remote) == len(local)
    assert remote.fingerprint == local.fingerprint  # a state saved over the local copy resumes here
    for i in range(len(local)):
        assert np.array_equal(remote[i], local[i]), i
        assert remote.cache.used() <= limit
    s3.proxy.clear()
    again = pickle.loads(pickle.dumps(remote))  # as a DataLoader worker reopens it: the records are kept
    last = len(local) - 1
    assert np.array_equal(again[last], local[last])
    data_gets = [p for p, n in s3.proxy.gets.items() for _ in range(n) if p.rsplit("/", 1)[-1] not in INDEX_FILES]
    assert len(data_gets) <= 1, data_gets  # the last document's file, unless it was still cached


def litdata_chunks(path: Path) -> tuple[list[int], int]:
    """A LitData dataset's chunk sizes, and the bytes of their heads (count and item table)."""
    index = json.loads((Path(path) / "index.json").read_text())
    return ([(Path(path) / c["filename"]).stat().st_size for c in index["chunks"]],
            sum(4 * (c["chunk_size"] + 2) for c in index["chunks"]))


def test_a_litdata_dataset_under_a_cache_limit_opens_from_its_chunk_heads(tmp_path, s3, peers):
    """Under a cache_limit, a LitData dataset's first open reads each chunk's head only (its item
    table, one ranged GET a chunk), not every chunk whole (its first epoch fetched the dataset
    twice). The chunks' content fingerprints are taken from the copies the epoch reads: after a
    pass, the fingerprint is the local copy's with no further request, and a later open has it
    kept; asked for before any read (a state saved at the first step), the chunks are read for
    it then, within the limit, and it is the same. The heads are read at once (one after
    another, a 16-chunk dataset's open took 0.6 s behind a 30 ms link)."""
    local = TokenStore.open(peers["litdata"])
    sizes, heads = litdata_chunks(peers["litdata"])
    limit = 2 * max(sizes) + 1 + LEDGER_ROOM

    def opened(cache, latency=0.0):
        s3.proxy.clear()
        s3.proxy.latency = latency  # (each read: the heads overlap only if read at once)
        store = TokenStore.open("s3://peers/litdata", storage_options=s3.options(via_proxy=True),
                                object_cache=str(tmp_path / cache), cache_limit=limit)
        s3.proxy.latency = 0.0
        return store

    def chunks(counts) -> int:
        return sum(n for p, n in counts.items() if "/chunk-" in p)

    remote = opened("read", latency=0.05)
    assert chunks(s3.proxy.sent) == heads and chunks(s3.proxy.gets) == len(sizes)
    assert s3.proxy.peaks["litdata"] >= min(3, len(sizes)), s3.proxy.peaks
    for i in range(len(local)):
        assert np.array_equal(remote[i], local[i]), i
        assert remote.cache.used() <= limit
    assert chunks(s3.proxy.sent) == heads + sum(sizes)  # each chunk once
    gets = chunks(s3.proxy.gets)
    assert remote.fingerprint == local.fingerprint and chunks(s3.proxy.gets) == gets
    assert opened("read").fingerprint == local.fingerprint and chunks(s3.proxy.gets) == 0  # (kept: prints.json)
    asked = opened("asked")
    assert asked.fingerprint == local.fingerprint and asked.cache.used() <= limit
    assert chunks(s3.proxy.sent) == heads + sum(sizes)


@pytest.mark.parametrize("limit", [200_000, None])
def test_a_litdata_chunk_opened_from_its_head_keeps_the_local_checks(tmp_path, s3, peers, limit):
    """What the local reader refuses in a LitData dataset is refused at a URL too, with a
    cache_limit or without one (read a chunk at a time either way), naming the object: a
    damaged item table, a chunk cut short or really Parquet, a declared dtype the index
    contradicts, or an index whose item count the chunk cannot hold at the open (no more than
    its head read; a count of 10**15, or of -3, reads nothing), a token id past the declared
    vocabulary when the epoch reaches that chunk."""
    fs, opts = s3.fs(), dict(storage_options=s3.options(via_proxy=True), cache_limit=limit)
    for made in ("lit-table", "lit-count", "lit-cut", "lit-parquet"):  # (by the other case: put afresh)
        if fs.exists(f"peers/{made}"):
            fs.rm(f"peers/{made}", recursive=True)
    sizes, _ = litdata_chunks(peers["litdata"])
    local = TokenStore.open(peers["litdata"])

    def refused(url, match, **extra):
        with pytest.raises(StoreError, match=match):
            store = TokenStore.open(url, object_cache=str(tmp_path / url.replace("/", "_")), **opts, **extra)
            [store[i] for i in range(len(store))]

    fs.put(str(peers["litdata"]), "peers/lit-table", recursive=True)
    head = bytearray(fs.cat_file("peers/lit-table/chunk-0-2.bin", start=0, end=64))
    head[8:12], head[12:16] = head[12:16], head[8:12]  # items 1 and 2 swap their starts
    fs.pipe_file("peers/lit-table/chunk-0-2.bin", bytes(head) + fs.cat_file("peers/lit-table/chunk-0-2.bin")[64:])
    refused("s3://peers/lit-table", r"s3://peers/lit-table/chunk-0-2\.bin: item 1 ends at byte \d+, before it starts")
    fs.put(str(peers["litdata"]), "peers/lit-count", recursive=True)
    index = json.loads(fs.cat_file("peers/lit-count/index.json"))
    index["chunks"][1]["chunk_size"] = 10**15
    fs.pipe_file("peers/lit-count/index.json", json.dumps(index).encode())
    s3.proxy.clear()
    refused("s3://peers/lit-count", rf"s3://peers/lit-count/chunk-0-1\.bin: {sizes[1]} bytes cannot hold the header "
                                    rf"of {10**15} items")
    assert sum(n for p, n in s3.proxy.sent.items() if "chunk-0-1" in p) == 0
    index["chunks"][1]["chunk_size"] = -3
    fs.pipe_file("peers/lit-count/index.json", json.dumps(index).encode())
    refused("s3://peers/lit-count", r"s3://peers/lit-count/chunk-0-1\.bin: index.json lists -3 items in it")
    refused("s3://peers/litdata", r"s3://peers/litdata/index.json: dtype=int32 was declared, but .*int64",
            dtype="int32")  # (the index says int64)
    fs.put(str(peers["litdata"]), "peers/lit-cut", recursive=True)
    fs.pipe_file("peers/lit-cut/chunk-0-3.bin", fs.cat_file("peers/lit-cut/chunk-0-3.bin")[:-8])
    refused("s3://peers/lit-cut", r"s3://peers/lit-cut/chunk-0-3\.bin: \d+ bytes, but its offset table ends at byte "
                                  r"\d+; the chunk is truncated")
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs.put(str(peers["litdata"]), "peers/lit-parquet", recursive=True)
    pq.write_table(pa.table({"text": ["a document"] * 2000}), tmp_path / "chunk.parquet")
    fs.put_file(str(tmp_path / "chunk.parquet"), "peers/lit-parquet/chunk-0-4.bin")
    refused("s3://peers/lit-parquet", r"s3://peers/lit-parquet/chunk-0-4\.bin: its header \(n=\d+\) disagrees with "
                                      r"index\.json")
    largest = int(max(local[i].max() for i in range(len(local))))
    starts = local.file_doc_starts
    first = next(k for k in range(len(sizes)) if any(local[i].max() == largest for i in range(starts[k], starts[k + 1])))
    refused("s3://peers/litdata", rf"s3://peers/litdata/chunk-0-{first}\.bin: token id {largest} is at or past "
                                  rf"vocab_size {largest}", vocab_size=largest)


@pytest.mark.parametrize("name", ["megatron", "raw"])
def test_a_megatron_or_raw_dataset_larger_than_cache_limit_reads_in_blocks(tmp_path, s3, peers, name):
    """A Megatron dataset or raw token files in a bucket, with a cache_limit below their size,
    open without a copy of the file (Megatron: its .idx, then ranges; raw: read through once to
    find its documents) and read equal to the local copy, with its fingerprint, the cache never
    above the limit; a second open reads neither the index nor the data, and a read fetches one
    block of documents, not the file."""
    import pickle

    options = PEER_OPTIONS.get(name, {})
    local = TokenStore.open(peers[name], **options)
    data = [f for f in Path(peers[name]).iterdir() if f.suffix == ".bin"]
    limit = sum(f.stat().st_size for f in data) // 3
    opts = dict(storage_options=s3.options(via_proxy=True), object_cache=str(tmp_path / "c"), cache_limit=limit)
    remote = TokenStore.open(f"s3://peers/{name}", **opts, **options)
    assert remote.fetches and remote.format == local.format and len(remote) == len(local)
    assert remote.fingerprint == local.fingerprint  # a state saved over the local copy resumes here
    assert len(remote._parts) >= 8
    for i in range(len(local)):
        assert np.array_equal(remote[i], local[i]), i
        assert i % 10 or remote.cache.used() <= limit
    assert remote.cache.used() <= limit
    assert sum(remote._parts[p].size for p in remote._opened) <= limit  # (evicted blocks are not held mapped)
    s3.proxy.clear()
    again = pickle.loads(pickle.dumps(remote))  # as a DataLoader worker reopens it: the record is kept
    middle = len(local) // 2
    assert np.array_equal(again[middle], local[middle])
    assert not any(p.endswith(".idx") for p in s3.proxy.gets)
    assert sum(n for p, n in s3.proxy.gets.items() if p.endswith(".bin")) > 0  # (evicted since it was read)
    fetched = sum(n for p, n in s3.proxy.sent.items() if p.endswith(".bin"))
    # one block (a run under load once fetched 44,568 bytes here: the requests say which)
    assert 0 < fetched <= max(b.size for b in remote._parts) < limit, (s3.proxy.seen, dict(s3.proxy.sent))


def test_a_megatron_dataset_without_cache_limit_is_not_copied_whole_at_open(tmp_path, s3, monkeypatch):
    """A Megatron `.bin` in a bucket, no cache_limit: the open reads its `.idx` and a few sampled
    ranges, not the file (a copy at open kept the first batch of a 100 GB file waiting for all
    of it); a read fetches the block its document lies in; an epoch of batches equals the local
    file's and fetches each byte about once; a worker reopening it fetches nothing more.
    (The sizes are scaled down: a file past 9 MB is not held whole at open, blocks of 1 MB.)"""
    import pickle

    from forge_grain.stores import blocks, mirror_ranges
    from test_formats import make_docs, write_megatron

    monkeypatch.setattr(mirror_ranges, "KEEP", 9 << 20)
    monkeypatch.setattr(blocks, "BLOCK", 1 << 20)
    docs = [np.concatenate([d] * 12) for d in make_docs(2_400, seed=3)]  # about 10 MB of int32 tokens
    (tmp_path / "meg").mkdir()
    prefix = write_megatron(tmp_path / "meg" / "big_text_document", docs)
    size = prefix.with_suffix(".bin").stat().st_size
    assert size > (9 << 20)
    s3.fs().put(str(prefix.parent), "peers/meg-big", recursive=True)
    s3.proxy.clear()
    opts = dict(storage_options=s3.options(via_proxy=True), object_cache=str(tmp_path / "c"))

    def fetched():
        return sum(n for p, n in s3.proxy.sent.items() if p.endswith(".bin"))

    remote = TokenStore.open("s3://peers/meg-big", **opts)
    local = TokenStore.open(prefix.parent)
    assert remote.fetches and len(remote) == len(local)
    opened = fetched()
    assert opened < size // 10, (opened, size)
    assert np.array_equal(remote[0], local[0])
    assert fetched() - opened <= 2 * (1 << 20)  # the first block, not the file
    src = dict(name="web", path="s3://peers/meg-big", strategy="bestfit", **opts)
    cfg = DataConfig.from_dict(dict(sources=[src], seq_len=2048, global_batch_size=16, seed=1, num_epochs=1))
    disk = Pipeline(DataConfig.from_dict({**cfg.to_dict(), "sources": [dict(name="web", path=str(prefix.parent),
                                                                            strategy="bestfit")]}), 0, 1)
    pipe = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "p")
    assert pipe.num_steps == disk.num_steps
    for step, batch in enumerate(pipe.iterator()):
        assert same(batch, disk.batch(step)), step
    before = fetched()
    assert before <= opened + 1.05 * size, (before, size)
    assert pipe.stores[0].fingerprint == local.fingerprint  # a state saved over a local copy resumes here ...
    assert fetched() == before  # ... its sampled places taken from the blocks the epoch read
    again = pickle.loads(pickle.dumps(remote))  # as a DataLoader worker reopens it
    assert np.array_equal(again[len(local) - 1], local[len(local) - 1])
    assert fetched() == before


@pytest.mark.parametrize("limit,suffix", [(None, "bin"), (10_000, "bin"), (10_000, "npy")])
def test_one_raw_token_file_at_a_url_opens_like_the_local_file(tmp_path, s3, peers, limit, suffix):
    """nanoGPT's `train.bin` (or a `.npy` with its header) in a bucket, named by its own URL:
    copied, or read in blocks under a cache_limit, and equal to the local file."""
    path = peers["raw"] / "part-0.bin"
    if suffix == "npy":
        path = tmp_path / "tokens.npy"
        np.save(path, np.fromfile(peers["raw"] / "part-0.bin", np.uint16))
        s3.fs().put_file(str(path), "peers/raw-npy/tokens.npy")
    local = TokenStore.open(path, **PEER_OPTIONS["raw"])
    url = "s3://peers/raw/part-0.bin" if suffix == "bin" else "s3://peers/raw-npy/tokens.npy"
    remote = TokenStore.open(url, storage_options=s3.options(), cache_limit=limit,
                             object_cache=str(tmp_path / "c"), **PEER_OPTIONS["raw"])
    assert remote.fetches == (limit is not None) and remote.fingerprint == local.fingerprint
    assert all(np.array_equal(remote[i], local[i]) for i in range(len(local)))


@pytest.mark.parametrize("name,client", [("megatron", "obstore"), ("mds", "obstore"), ("megatron", "s3fs")])
def test_a_dataset_rewritten_while_read_in_parts_is_refused_not_read(tmp_path, s3, peers, name, client):
    """A dataset read a file or a block at a time, rewritten in place after it opened (the same
    names and sizes, other bytes): a part fetched since is refused, naming the object, never
    read as documents its record does not describe (through obstore each GET carries the
    ETag; through s3fs, as in a forked DataLoader worker, a HEAD after the GETs checks it)."""
    options = s3.options() if client == "obstore" else {**s3.options(), "requester_pays": False}  # (not obstore's)
    fs, url = s3.fs(), f"peers/{name}-{client}-rewritten-later"
    fs.put(str(peers[name]), url, recursive=True)
    data = sorted(f for f in fs.ls(url) if f.endswith((".bin", ".mds")))
    sizes = [fs.size(f) for f in data]  # (a limit below the dataset: in parts)
    limit = 2 * max(sizes) + 1 if len(sizes) > 2 else sum(sizes) // 3
    store = TokenStore.open(f"s3://{url}", storage_options=options, object_cache=str(tmp_path / "c"),
                            cache_limit=limit)
    assert (store.cache._fast is not None) == (client == "obstore")
    assert np.array_equal(store[0], TokenStore.open(peers[name])[0])
    last = data[-1]
    fs.pipe_file(last, bytes(reversed(fs.cat_file(last))))  # the same size
    with pytest.raises(StoreError, match=f"s3://{url}/{last.rsplit('/', 1)[-1]}: the data at this URL changed after"):
        store[len(store) - 1]


@pytest.mark.parametrize("kind", ["drop", "truncate"])
def test_faults_while_a_raw_file_is_scanned_and_read_in_blocks_are_retried(tmp_path, s3, peers, kind):
    """Dropped connections and bodies cut short, while a raw file is read through at its first
    open and while its blocks are fetched, are retried: the documents are exact."""
    s3.fs().put(str(peers["raw"]), f"peers/raw-faults-{kind}", recursive=True)
    s3.proxy.clear()
    s3.proxy.fail(f"raw-faults-{kind}/part-0.bin", kind, times=3)
    store = TokenStore.open(f"s3://peers/raw-faults-{kind}", storage_options=s3.options(via_proxy=True),
                            object_cache=str(tmp_path / "c"), cache_limit=100_000, **PEER_OPTIONS["raw"])
    assert len(store._parts) >= 4 and all(f[2] == 0 for f in s3.proxy.faults)  # they happened at the open
    s3.proxy.fail(f"raw-faults-{kind}/part-0.bin", kind, times=3)
    local = TokenStore.open(peers["raw"], **PEER_OPTIONS["raw"])
    assert all(np.array_equal(store[i], local[i]) for i in range(len(local)))
    assert all(f[2] == 0 for f in s3.proxy.faults)  # ... and at the blocks' reads
    s3.proxy.clear()


def test_megatron_and_raw_files_read_in_blocks_keep_the_local_checks(tmp_path, s3, peers):
    """With cache_limit (blocks of documents) what is refused on disk is refused too, naming the
    object in the bucket: a raw file without a dtype, with a dtype its bytes contradict, cut
    short, or really Parquet; a document larger than the cache; a Megatron .bin cut short, a
    dtype its index contradicts, an EOS its documents do not end with (these also without a
    cache_limit: a Megatron dataset is read in blocks then too)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from test_formats import EOS, make_docs

    fs, opts = s3.fs(), dict(storage_options=s3.options(), cache_limit=20_000)

    def refused(url, match, **extra):
        with pytest.raises(StoreError, match=match):
            TokenStore.open(url, object_cache=str(tmp_path / url.replace("/", "_")), **opts, **extra)

    refused("s3://peers/raw", r"s3://peers/raw/part-0\.bin: a raw token file does not record its dtype")
    docs = np.concatenate(make_docs(200, seed=4))
    fs.pipe_file("peers/raw-wide/part-0.bin", docs.astype(np.int32).tobytes())
    refused("s3://peers/raw-wide", r"s3://peers/raw-wide/part-0\.bin: read as uint16.*32-bit ids", dtype="uint16")
    fs.pipe_file("peers/raw-cut/part-0.bin", docs.astype(np.uint16).tobytes()[:-1])
    refused("s3://peers/raw-cut", r"s3://peers/raw-cut/part-0\.bin: .* not a multiple", dtype="uint16")
    pq.write_table(pa.table({"text": ["a document"] * 50}), tmp_path / "part.parquet")
    fs.put_file(str(tmp_path / "part.parquet"), "peers/raw-pq/part-0.bin")
    refused("s3://peers/raw-pq", r"s3://peers/raw-pq/part-0\.bin: this is a Parquet file", dtype="uint16")
    fs.pipe_file("peers/raw-stream/part-0.bin", docs.astype(np.uint16).tobytes())
    refused("s3://peers/raw-stream", r"s3://peers/raw-stream/part-0\.bin: document 0 of this file is [0-9]+ bytes, "
            r"more than cache_limit 20000 holds.*eos_id", dtype="uint16")  # no eos_id: one document
    fs.put(str(peers["megatron"]), "peers/meg-cut", recursive=True)
    fs.pipe_file("peers/meg-cut/c4_text_document.bin", fs.cat_file("peers/meg-cut/c4_text_document.bin")[:-8])
    for limit in (20_000, None):  # (a Megatron dataset is read in blocks without a limit too)
        opts["cache_limit"] = limit
        refused("s3://peers/meg-cut", r"s3://peers/meg-cut/c4_text_document\.bin: .* bytes, but its index describes "
                r".* truncated")
        refused("s3://peers/megatron", r"s3://peers/megatron/c4_text_document\.idx: dtype=uint16 was declared, but "
                r"the Megatron index records int32", dtype="uint16")
        refused("s3://peers/megatron", r"s3://peers/megatron/c4_text_document\.bin: eos_id=3 was declared, but "
                r"document 0 does not end with it", eos_id=3)  # (EOS is 1)
    opts["cache_limit"] = 20_000
    store = TokenStore.open("s3://peers/megatron", eos_id=EOS, object_cache=str(tmp_path / "ok"), **opts)
    assert len(store) == len(TokenStore.open(peers["megatron"]))


def zstd_litdata(tmp_path, s3) -> tuple[Path, dict]:
    """The LitData fixture with its chunks compressed (zstd), on disk and at s3://peers/litdata-zstd."""
    import shutil

    import zstd

    from test_formats import LITDATA

    packed = shutil.copytree(LITDATA / "dataset", tmp_path / "zstd")
    index = json.loads((packed / "index.json").read_text())
    index["config"]["compression"] = "zstd"
    for chunk in index["chunks"]:
        (packed / chunk["filename"]).write_bytes(zstd.compress((packed / chunk["filename"]).read_bytes(), 1))
    (packed / "index.json").write_text(json.dumps(index))
    s3.fs().put(str(packed), "peers/litdata-zstd", recursive=True)
    return packed, index


def test_a_compressed_chunk_that_cannot_fit_with_its_decompressed_copy_says_the_size_it_needs(tmp_path, s3):
    """A LitData zstd chunk is held with its decompressed copy while it is decompressed: a
    cache_limit that holds the decompressed chunk but not both says so at open, with the bytes it
    needs (it said the chunk was "truncated or damaged (FileNotFoundError: ...)"); a limit above
    that reads it."""
    packed, index = zstd_litdata(tmp_path, s3)
    sizes = [(packed / c["filename"]).stat().st_size + c["chunk_bytes"] for c in index["chunks"]]
    plain = max(c["chunk_bytes"] for c in index["chunks"])
    opts = dict(storage_options=s3.options(), object_cache=str(tmp_path / "c"))
    with pytest.raises(StoreError, match=r"s3://peers/litdata-zstd: its data file chunk-0-\d\.bin needs "
                                         rf"{max(sizes)} bytes of the cache at once \([0-9]+ compressed and {plain} "
                                         r"decompressed.*raise cache_limit above [0-9]+"):
        TokenStore.open("s3://peers/litdata-zstd", cache_limit=plain + 2000, **opts)
    store = TokenStore.open("s3://peers/litdata-zstd", cache_limit=max(sizes) + 45_000, **opts)  # (records, ledger)
    local = TokenStore.open(packed)
    assert all(np.array_equal(store[i], local[i]) for i in range(len(local)))


def test_compressed_litdata_chunks_read_a_file_at_a_time_stay_within_cache_limit(tmp_path, s3, monkeypatch):
    """LitData chunks written with compression, in a bucket, under a cache_limit: each is
    decompressed inside the bounded cache (its compressed copy then dropped), nothing is written
    outside it, and the documents and the fingerprint are the local dataset's."""
    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    packed, index = zstd_litdata(tmp_path, s3)
    limit = 3 * max(c["chunk_bytes"] for c in index["chunks"])  # below the dataset's 157 KB
    remote = TokenStore.open("s3://peers/litdata-zstd", storage_options=s3.options(), cache_limit=limit)
    assert remote.fetches and not (tmp_path / "cache" / "litdata").exists()
    local = TokenStore.open(packed)  # (decompresses into $FORGE_GRAIN_CACHE/litdata)
    assert remote.fingerprint == local.fingerprint and len(remote) == len(local)
    for i in range(len(local)):
        assert np.array_equal(remote[i], local[i]), i
        assert i % 10 or remote.cache.used() <= limit
    assert not list(remote.cache.dir.rglob("chunk-0-*.bin")) or all(
        p.name.startswith("plain-") for p in remote.cache.dir.rglob("chunk-0-*.bin"))  # compressed copies gone


def test_compressed_litdata_chunks_without_cache_limit_are_each_fetched_once(tmp_path, s3, monkeypatch):
    """Without a cache_limit a LitData dataset is read a chunk at a time too; its compressed
    chunks say nothing of their documents in their heads, so the first open fetches and
    decompresses each one in the cache (once: the reads and a reopen in another process fetch
    nothing more, and no compressed copy stays), and the documents and the fingerprint are the
    local dataset's. Its first batch waits for its chunks: no ranges of compressed bytes."""
    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    import pickle

    packed, index = zstd_litdata(tmp_path, s3)
    s3.proxy.clear()
    remote = TokenStore.open("s3://peers/litdata-zstd", storage_options=s3.options(via_proxy=True),
                             object_cache=str(tmp_path / "objects"))
    chunks = {f"/peers/litdata-zstd/{c['filename']}": (packed / c["filename"]).stat().st_size for c in index["chunks"]}
    assert {p: s3.proxy.sent.get(p) for p in chunks} == chunks  # each whole, once, at the open
    local = TokenStore.open(packed)
    assert remote.fingerprint == local.fingerprint and len(remote) == len(local)
    for i in range(len(local)):
        assert np.array_equal(remote[i], local[i]), i
    again = pickle.loads(pickle.dumps(remote))  # as a DataLoader worker reopens it
    assert np.array_equal(again[len(local) - 1], local[len(local) - 1])
    assert {p: s3.proxy.sent.get(p) for p in chunks} == chunks  # nothing fetched again
    assert not remote._ranged()  # (its first step waits for its chunks: no ranges of compressed bytes)
    assert all(p.name.startswith("plain-") for p in remote.cache.dir.rglob("chunk-0-*.bin"))  # compressed copies gone


def test_a_prefetch_with_no_room_to_decompress_a_chunk_leaves_it_to_the_read(tmp_path, s3):
    """A prefetch of a compressed chunk decompresses it where the cache has room beside the
    copies the next steps read; where it has not, the compressed copy waits for the read, which
    makes room as it comes. The prefetch decompressed as a read does: it evicted the chunk the
    next steps read first (fetched again when they came), or, where every copy was hinted,
    stopped with "nothing can be evicted", and the read that came for the chunk raised that
    (a crossing: zstd MDS shards under a limit, killed and resumed, on two cores)."""
    packed, index = zstd_litdata(tmp_path, s3)
    plain = {c["filename"]: c["chunk_bytes"] for c in index["chunks"]}
    small = {name: (packed / name).stat().st_size for name in plain}
    a, c = sorted(plain, key=plain.get)[-2:]
    opts = dict(storage_options=s3.options(via_proxy=True))
    big = TokenStore.open("s3://peers/litdata-zstd", cache_limit=10 * sum(plain.values()),
                          object_cache=str(tmp_path / "records"), **opts).cache
    limit = big.limit - big.room() + plain[a] + small[c] + plain[c] // 2  # (the records and the ledger, and ...)
    store = TokenStore.open("s3://peers/litdata-zstd", cache_limit=limit, object_cache=str(tmp_path / "c"), **opts)
    room = store.cache.room()
    assert plain[a] + small[c] <= room < plain[a] + small[c] + plain[c]  # (c arrives; its decompressed copy cannot)
    first = {part.name: int(store._first_array[part.k]) for part in store._parts}  # (each file's first array)
    local = TokenStore.open(packed)

    def read(name) -> int:  # (the GETs of its object the read of its first array took)
        s3.proxy.clear()
        want = np.array([first[name]])
        assert all(np.array_equal(x, y) for x, y in zip(store.arrays_for(want), local.arrays_for(want)))
        return sum(n for path, n in s3.proxy.gets.items() if path.endswith("/" + name))

    try:
        for hint in ([a], [a, c]):  # the chunk read now arrives first; then the next is hinted
            store.prefetch(np.array([first[k] for k in hint]))
            concurrent.futures.wait(list(store._pending.values()))
            assert all(f.exception() is None for f in store._pending.values())
        assert read(a) == 0, "the prefetch of the next chunk evicted the one read now"
        store.prefetch(np.array([first[c]]))  # the reads move on: the first leaves the hints
        assert read(c) == 0 and store.cache.used() <= limit  # (its compressed copy was there: decompressed now)
    finally:
        store.close()


@pytest.mark.parametrize("compression", ["zstd", "br", "snappy", "gz"])
def test_compressed_mds_shards_read_a_file_at_a_time_stay_within_cache_limit(tmp_path, s3, monkeypatch, compression):
    """MDS shards written compressed (only `zip_data` in the bucket), under a cache_limit below
    the dataset: each is fetched and decompressed inside the bounded cache (to the size
    `raw_data.bytes` promises), read, and its compressed copy dropped; the documents and the
    fingerprint are the local dataset's, and nothing lands outside the limit. (They were refused
    as "only a compressed one".)"""
    from mds_writer import write_mds
    from test_formats import make_docs

    monkeypatch.setenv("FORGE_GRAIN_CACHE", str(tmp_path / "cache"))
    docs = make_docs(120, seed=4)
    packed = write_mds(tmp_path / "mds", {"tokens": "ndarray:int32"}, [{"tokens": d} for d in docs],
                       samples_per_shard=30, compression=compression)
    index = json.loads((packed / "index.json").read_text())
    assert all(s["zip_data"] and not (packed / s["raw_data"]["basename"]).exists() for s in index["shards"])
    s3.fs().put(str(packed), f"peers/mds-{compression}", recursive=True)
    raw = [s["raw_data"]["bytes"] for s in index["shards"]]
    # below the dataset decompressed: the records and the ledger, a shard compressed and decompressed
    limit = 9 * sum(raw) // 10 + LEDGER_ROOM
    assert limit < sum(raw) + sum(f.stat().st_size for f in packed.iterdir())

    remote = TokenStore.open(f"s3://peers/mds-{compression}", storage_options=s3.options(), cache_limit=limit)
    assert remote.fetches and not (tmp_path / "cache" / "mds").exists()
    local = TokenStore.open(packed)  # (decompresses into $FORGE_GRAIN_CACHE/mds)
    assert remote.fingerprint == local.fingerprint and len(remote) == len(local) == len(docs)
    for i in range(len(local)):
        assert np.array_equal(remote[i], local[i]) and np.array_equal(remote[i], docs[i]), i
        assert remote.cache.used() <= limit
    names = {s["zip_data"]["basename"] for s in index["shards"]}
    assert not [p for p in remote.cache.dir.rglob("*") if p.name in names]  # compressed copies gone


def zstd_mds(tmp_path, s3, name: str, docs: list, per_shard: int) -> tuple[dict, int]:
    """`docs` written as an MDS dataset of zstd shards (`zip_data` only), uploaded to
    s3://peers/<name>: its index, and the most bytes a shard takes of the cache at once (its
    compressed copy beside its decompressed one)."""
    from mds_writer import write_mds

    packed = write_mds(tmp_path / name, {"tokens": "ndarray:int32"}, [{"tokens": d} for d in docs],
                       samples_per_shard=per_shard, compression="zstd")
    s3.fs().put(str(packed), f"peers/{name}", recursive=True)
    index = json.loads((packed / "index.json").read_text())
    return index, max((packed / s["zip_data"]["basename"]).stat().st_size + s["raw_data"]["bytes"]
                      for s in index["shards"])


KILLED_HOLDING_COMPRESSED = """
import json, os, signal, sys
from forge_grain import StoreError, TokenStore
store = TokenStore.open(sys.argv[1], storage_options=json.loads(sys.argv[2]), object_cache=sys.argv[3],
                        cache_limit=int(sys.argv[4]))
for p in store._parts:  # each compressed shard fetched, as a read does before decompressing it
    try:
        store.cache.get(p.name, p.fetched, size=p.packed_size)
    except StoreError:  # (the cache holds no more of them)
        break
os.kill(os.getpid(), signal.SIGKILL)  # killed before any is decompressed and dropped
"""


def test_compressed_copies_left_by_a_killed_process_do_not_stop_a_rerun_at_the_same_limit(tmp_path, s3):
    """A compressed MDS shard is fetched, decompressed beside its copy, and the copy dropped: a
    process killed in between left copies that were never evicted (not data copies), and the
    re-run at the same cache_limit stopped ("nothing can be evicted; raise it", found by the
    crossing harness with a SIGKILL). They are evicted now where nothing else frees the room a
    read needs, and the re-run reads every document, the cache within the limit."""
    from test_formats import make_docs

    docs = make_docs(160, seed=23)
    index, peak = zstd_mds(tmp_path, s3, "mds-killed", docs, 20)
    limit = 2 * peak + 4 * LEDGER_ROOM  # (eight shards' records, about 3.7 KB each, and the ledger)
    assert limit < sum(s["raw_data"]["bytes"] for s in index["shards"])
    cache = str(tmp_path / "objects")
    killed = subprocess.run([sys.executable, "-c", KILLED_HOLDING_COMPRESSED, "s3://peers/mds-killed",
                             json.dumps(s3.options()), cache, str(limit)], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    left = [p for p in Path(cache).rglob("*.mds.zstd")]
    assert len(left) >= 2, left
    store = TokenStore.open("s3://peers/mds-killed", storage_options=s3.options(), object_cache=cache,
                            cache_limit=limit)
    for i, d in enumerate(docs):
        assert np.array_equal(store[i], d), i
        assert store.cache.used() <= limit


def test_a_compressed_copy_evicted_before_its_decompression_is_fetched_again(tmp_path, s3, monkeypatch):
    """Another process sharing the cache may evict a compressed MDS shard's copy between its
    download and its decompression: the shard is fetched again and read, not reported as
    damaged or missing. (The eviction is made to happen there: the cache removes that copy,
    as an eviction does, the first time it hands one over.)"""
    from test_formats import make_docs

    from forge_grain.stores.object_cache import ObjectCache

    docs = make_docs(120, seed=29)
    _, peak = zstd_mds(tmp_path, s3, "mds-evicted", docs, 30)
    get, evicted = ObjectCache.get, []

    def get_then_evicted(self, name, copy, *args, **kwargs):
        path = get(self, name, copy, *args, **kwargs)
        if path is not None and copy.endswith(".mds.zstd") and not evicted:
            self.discard(copy)
            evicted.append(name)
        return path

    monkeypatch.setattr(ObjectCache, "get", get_then_evicted)
    s3.proxy.clear()
    store = TokenStore.open("s3://peers/mds-evicted", storage_options=s3.options(via_proxy=True),
                            object_cache=str(tmp_path / "objects"), cache_limit=2 * peak + 4 * LEDGER_ROOM)
    assert [np.array_equal(store[i], d) for i, d in enumerate(docs)] == [True] * len(docs)
    assert len(evicted) == 1 and s3.proxy.gets[f"/peers/mds-evicted/{evicted[0]}"] >= 2, (evicted, s3.proxy.gets)


def test_a_peer_dataset_read_a_file_at_a_time_keeps_the_local_checks(tmp_path, s3, peers):
    """With cache_limit (a file at a time) what is refused on disk is refused too, naming the
    object in the bucket: a declared dtype the data disagrees with, a shard cut short, and a
    file that is not what the index says (a Parquet file in place of a LitData chunk); for MDS,
    LitData and Arrow."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, limit = s3.fs(), 10**6
    opts = dict(storage_options=s3.options(), cache_limit=limit)
    with pytest.raises(StoreError, match="s3://peers/mds/.*int32.*uint16|s3://peers/mds/.*uint16.*int32"):
        TokenStore.open("s3://peers/mds", dtype="uint16", object_cache=str(tmp_path / "a"), **opts)
    with pytest.raises(StoreError, match="s3://peers/arrow_shards/data-00000-of-00004.arrow: dtype=uint16 was "
                                         "declared, but its Arrow schema"):
        TokenStore.open("s3://peers/arrow_shards", dtype="uint16", object_cache=str(tmp_path / "b"), **opts)
    fs.put(str(peers["mds"]), "peers/mds-cut-parted", recursive=True)
    shard = sorted(f for f in fs.ls("peers/mds-cut-parted") if f.endswith(".mds"))[0]
    fs.pipe_file(shard, fs.cat_file(shard)[:-3])
    with pytest.raises(StoreError, match="s3://peers/mds-cut-parted/shard.*truncated"):
        TokenStore.open("s3://peers/mds-cut-parted", object_cache=str(tmp_path / "b"), **opts)
    fs.put(str(peers["litdata"]), "peers/litdata-parquet", recursive=True)
    pq.write_table(pa.table({"text": ["a document"] * 50}), tmp_path / "part.parquet")
    fs.put_file(str(tmp_path / "part.parquet"), "peers/litdata-parquet/chunk-0-1.bin")
    with pytest.raises(StoreError, match="s3://peers/litdata-parquet/chunk-0-1.bin"):
        TokenStore.open("s3://peers/litdata-parquet", object_cache=str(tmp_path / "c"), **opts)
    # the same for Arrow files: one cut short, and a Parquet file in place of one
    fs.put(str(peers["arrow_shards"]), "peers/arrow-cut-parted", recursive=True)
    arrow = sorted(f for f in fs.ls("peers/arrow-cut-parted") if f.endswith(".arrow"))[1]
    fs.pipe_file(arrow, fs.cat_file(arrow)[:-100])
    with pytest.raises(StoreError, match=r"s3://peers/arrow-cut-parted/data-00001-of-00004\.arrow: the Arrow stream "
                                         r"is truncated or damaged"):
        TokenStore.open("s3://peers/arrow-cut-parted", object_cache=str(tmp_path / "d"), **opts)
    fs.put(str(peers["arrow_shards"]), "peers/arrow-parquet", recursive=True)
    fs.put_file(str(tmp_path / "part.parquet"), "peers/arrow-parquet/data-00002-of-00004.arrow")
    with pytest.raises(StoreError, match=r"s3://peers/arrow-parquet/data-00002-of-00004\.arrow: not a readable Arrow"):
        TokenStore.open("s3://peers/arrow-parquet", object_cache=str(tmp_path / "e"), **opts)


def test_a_peer_dataset_rewritten_in_object_storage_is_copied_again(tmp_path, s3, peers):
    """The copy is named by the listing: replacing a shard in place is never read from a stale copy."""
    from mds_writer import write_mds
    from test_formats import make_docs

    fs, opts = s3.fs(), dict(storage_options=s3.options(), object_cache=str(tmp_path / "c"))
    fs.put(str(peers["mds"]), "peers/mds-rewritten", recursive=True)
    first = TokenStore.open("s3://peers/mds-rewritten", **opts)[0]
    docs = make_docs(120, seed=7)
    new = write_mds(tmp_path / "new", {"tokens": "ndarray:int32"}, [{"tokens": d} for d in docs], samples_per_shard=40)
    for f in new.iterdir():  # in place, same names
        fs.put_file(str(f), f"peers/mds-rewritten/{f.name}")
    store = TokenStore.open("s3://peers/mds-rewritten", **opts)
    assert np.array_equal(store[0], docs[0]) and not np.array_equal(first, docs[0])


def test_a_megatron_prefix_in_object_storage_opens_like_its_local_prefix(tmp_path, s3, peers):
    prefix = peers["megatron"] / "c4_text_document"
    remote = TokenStore.open("s3://peers/megatron/c4_text_document", storage_options=s3.options(),
                             object_cache=str(tmp_path / "c"))
    local = TokenStore.open(prefix)
    assert len(remote) == len(local) and np.array_equal(remote[5], local[5])


# (MDS: 3 shards of about 17 KB; a limit of 30,000 held one beside the records, and two batch
# threads evicted each other's shard until a read failed, now and then on a loaded machine)
@pytest.mark.parametrize("name,limit", [("mds", None), ("mds", 45_000), ("litdata", 70_000), ("megatron", 20_000),
                                        ("raw", 10_000)])
def test_a_peer_dataset_source_gives_the_stream_of_its_local_copy(tmp_path, s3, peers, name, limit):
    """The same batches as the local copy's: copied whole, or (with a cache_limit below the
    dataset's size) a file at a time or, Megatron and raw files, a block of documents at a time,
    the coming steps' fetched ahead."""
    options = PEER_OPTIONS.get(name, {})
    remote = config(source(f"s3://peers/{name}", storage_options=s3.options(), object_cache=str(tmp_path / "c"),
                           cache_limit=limit, **options))
    local = config(source(peers[name], **options))
    a, b = Pipeline(local, 0, 1, cache_dir=tmp_path / "p1"), Pipeline(remote, 0, 1, cache_dir=tmp_path / "p2")
    assert a.num_steps == b.num_steps
    it = b.iterator()
    for step in range(a.num_steps):
        assert same(a.batch(step), next(it))
        assert limit is None or b.stores[0].cache.used() <= limit
    assert (limit is not None) == b.stores[0].fetches


def test_peer_datasets_in_object_storage_keep_the_local_checks(tmp_path, s3, peers):
    """What is refused on disk is refused from a bucket, naming the URL: a raw file without a
    dtype, a declared dtype the data disagrees with, a Parquet file among raw token files, an
    MDS shard cut short, a dataset with a file larger than cache_limit (read a file at a time),
    and a peer's dataset opened as a forge-grain store."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, opts = s3.fs(), dict(storage_options=s3.options(), object_cache=str(tmp_path / "c"))
    with pytest.raises(StoreError, match="s3://peers/raw.*dtype"):
        TokenStore.open("s3://peers/raw", **opts)
    with pytest.raises(StoreError, match="s3://peers/mds/.*int32.*uint16|s3://peers/mds/.*uint16.*int32"):
        TokenStore.open("s3://peers/mds", dtype="uint16", **opts)
    pq.write_table(pa.table({"text": ["a document"] * 50}), tmp_path / "part.parquet")
    fs.put_file(str(tmp_path / "part.parquet"), "peers/raw-parquet/part-0.bin")
    with pytest.raises(StoreError, match="s3://peers/raw-parquet/part-0.bin: this is a Parquet file"):
        TokenStore.open("s3://peers/raw-parquet", dtype="uint16", **opts)
    fs.put(str(peers["mds"]), "peers/mds-cut", recursive=True)
    shard = sorted(f for f in fs.ls("peers/mds-cut") if f.endswith(".mds"))[0]
    fs.pipe_file(shard, fs.cat_file(shard)[:-3])
    with pytest.raises(StoreError, match="s3://peers/mds-cut/shard.*truncated"):
        TokenStore.open("s3://peers/mds-cut", **opts)
    fs.put(str(peers["arrow"]), "peers/arrow-cut", recursive=True)
    arrow = next(f for f in fs.ls("peers/arrow-cut") if f.endswith(".arrow"))
    whole = fs.cat_file(arrow)
    for cut in (3, 100):  # in the stream's end marker (a raw ArrowInvalid once), in a record batch
        fs.pipe_file(arrow, whole[:-cut])
        with pytest.raises(StoreError, match=r"s3://peers/arrow-cut/data-00000-of-00001\.arrow: the Arrow stream is "
                                             r"truncated or damaged"):
            TokenStore.open("s3://peers/arrow-cut", **{**opts, "object_cache": str(tmp_path / f"cut{cut}")})
    with pytest.raises(StoreError, match="s3://peers/litdata: its data file of [0-9]+ bytes cannot fit cache_limit "
                                         "20000"):  # read a file at a time: one file must fit
        TokenStore.open("s3://peers/litdata", cache_limit=20_000, **opts)
    with pytest.raises(StoreError, match="s3://peers/litdata: cache_limit 100 bytes cannot hold its index.json "
                                         r"\(897 bytes\)"):  # nor its index: that is said first
        TokenStore.open("s3://peers/litdata", cache_limit=100, **{**opts, "object_cache": str(tmp_path / "tiny")})
    with pytest.raises(StoreError, match="s3://peers/arrow: this is a Hugging Face save_to_disk dataset.*not a "
                                         "forge-grain store"):
        TokenStore.open("s3://peers/arrow", format="native", **opts)
    with pytest.raises(StoreError, match="s3://bucket/nothing-here: nothing at this URL"):
        TokenStore.open("s3://bucket/nothing-here", **opts)


def test_a_dataset_dict_split_in_a_bucket_reads_a_file_at_a_time(tmp_path, s3):
    """A `DatasetDict` saved with `save_to_disk` and uploaded: with cache_limit, `split=` reads that
    split's Arrow files one at a time, equal to the local split; without `split`, it says how."""
    import datasets

    from test_formats import make_docs

    docs = make_docs(60)
    local_dir = tmp_path / "dd"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in docs[:40]]}),
        "test": datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in docs[40:]]}),
    }).save_to_disk(str(local_dir), num_shards={"train": 3, "test": 1})
    s3.fs().put(str(local_dir), "peers/dd", recursive=True)
    local = TokenStore.open(local_dir, split="train")
    opts = dict(storage_options=s3.options(), object_cache=str(tmp_path / "c"), cache_limit=10**6)
    remote = TokenStore.open("s3://peers/dd", split="train", **opts)
    assert remote.fetches and len(remote) == len(local) == 40 and remote.fingerprint == local.fingerprint
    assert all(np.array_equal(remote[i], local[i]) for i in range(len(local)))
    with pytest.raises(StoreError, match="a DatasetDict: with cache_limit, pass split="):
        TokenStore.open("s3://peers/dd", **opts)


def test_the_manifest_read_to_tell_the_format_serves_the_open_after_it_only(tmp_path, s3, local_stores):
    """The format's probe reads a store's manifest whole, and the open that follows it takes
    those bytes: one GET of it an open. A later open asks again (a store rewritten between two
    opens is seen), and a probe of one URL never serves another's open."""
    from forge_grain.stores.remote_dir import RemoteDir

    for name in ("one", "two"):
        s3.fs().put(str(local_stores["bin"]), f"bucket/{name}", recursive=True)
    options = dict(storage_options=s3.options(via_proxy=True), object_cache=str(tmp_path / "objects"))
    manifest_gets = lambda: [p for m, p in s3.proxy.seen if m == "GET" and p.endswith("manifest.json")]  # noqa: E731
    for _ in range(2):
        s3.proxy.clear()
        TokenStore.open("s3://bucket/one", **options)
        assert manifest_gets() == ["/bucket/one/manifest.json"]
    s3.proxy.clear()
    assert RemoteDir("s3://bucket/one", options["storage_options"]).probe_manifest("manifest.json")
    two = TokenStore.open("s3://bucket/two", format="native", **options)  # (no probe of its own)
    assert manifest_gets() == ["/bucket/one/manifest.json", "/bucket/two/manifest.json"]
    assert two.url == "s3://bucket/two" and len(two) == len(TokenStore.open(local_stores["bin"]))
