"""A read order that fits a bounded cache (`forge_grain.packing.fitted`), against a real S3
server (moto) counting the bytes it serves: an epoch under a `cache_limit` of two files
fetches each file about once, for every store kind and strategy, in the order a local copy
gives with the same `shuffle_bytes`; the cache, its ledger included, never holds more than
the limit; `forge-grain plan` says what an epoch will fetch and warns when an order thrashes."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from forge_grain import DataConfig, Pipeline, StateError, StoreError, TokenStore, prepare  # noqa: E402
from s3server import Peak, S3Server  # noqa: E402

FILES = 16
DATA_SUFFIXES = (".bin", ".mds", ".arrow")
KINDS = {"bin": {}, "mds": {}, "arrow": {}, "megatron": {}, "raw": {"dtype": "uint16", "eos_id": 1}}


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        yield server


@pytest.fixture(scope="module")
def stores(tmp_path_factory, s3):
    """The same 2,400 documents as a forge-grain store, MDS and Arrow datasets (16 files each), a
    Megatron file and a raw uint16 file; on disk and uploaded to s3://fit/<kind>."""
    from mds_writer import write_mds
    from test_formats import write_arrow, write_megatron

    base = tmp_path_factory.mktemp("fit")
    rng = np.random.default_rng(3)
    docs = [np.append(rng.integers(2, 1000, int(rng.integers(20, 600))), 1).astype(np.int32) for _ in range(2400)]
    with open(base / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"ids": d.tolist()}) + "\n")
    local = {"bin": prepare(base / "docs.jsonl", base / "bin", token_field="ids", vocab_size=1000, eos_id=1,
                            bos_id=None, num_shards=FILES, progress=False),
             "mds": write_mds(base / "mds", {"tokens": "ndarray:int32"}, [{"tokens": d} for d in docs],
                              samples_per_shard=len(docs) // FILES),
             "arrow": write_arrow(base / "arrow", docs, num_shards=FILES)}
    (base / "megatron").mkdir()
    local["megatron"] = write_megatron(base / "megatron" / "text_document", docs).parent
    (base / "raw").mkdir()
    np.concatenate(docs).astype(np.uint16).tofile(base / "raw" / "tokens.bin")
    local["raw"] = base / "raw"
    fs = s3.fs()
    s3.fresh_bucket("fit")
    for kind, path in local.items():
        fs.put(str(path), f"fit/{kind}", recursive=True)
    return local


def data_files(path: Path) -> list[int]:
    return [f.stat().st_size for f in Path(path).iterdir() if f.suffix in DATA_SUFFIXES]


def two_files(path: Path) -> int:
    """A cache_limit of two of the dataset's files (of a sixteenth of a single file, twice), and
    room for the records and the ledger beside them."""
    sizes = data_files(path)
    unit = max(sizes) if len(sizes) > 1 else sizes[0] // FILES
    return 2 * unit + 60_000


def config(path, strategy: str = "bestfit", top: dict | None = None, **source) -> DataConfig:
    return DataConfig.from_dict(dict(sources=[dict(name="web", path=str(path), strategy=strategy, **source)],
                                     seq_len=256, global_batch_size=8, seed=4, **{"num_epochs": 1, **(top or {})}))


def remote(s3, tmp_path, kind: str, limit: int, **extra) -> dict:
    return dict(storage_options=s3.options(via_proxy=True), object_cache=str(tmp_path / "objects"),
                cache_limit=limit, **KINDS[kind], **extra)


def served(s3) -> int:
    return sum(n for p, n in s3.proxy.sent.items() if p.endswith(DATA_SUFFIXES))


def epoch_as_local(pipe, local, steps: int | None = None) -> int:
    """One epoch of `pipe` (or its first `steps`), each batch the `local` pipeline's: the most
    bytes its cache held."""
    peak = Peak(pipe.stores[0].cache)
    try:
        for step, batch in zip(range(steps) if steps is not None else itertools.count(), pipe.iterator()):
            want = local.batch(step)
            assert all(np.array_equal(batch[k], want[k]) for k in want), step
    finally:
        most = peak.stop()
    return most


CASES = [(kind, "bestfit") for kind in KINDS] + [("bin", "concat"), ("mds", "concat")]


@pytest.mark.parametrize("kind,strategy", CASES)
def test_an_epoch_under_a_cache_limit_of_two_files_fetches_each_file_about_once(tmp_path, s3, stores, kind, strategy):
    """With cache_limit = two files and nothing else set, the epoch reads its data files in
    windows that fit (a whole-epoch shuffle re-downloaded such a dataset 100-230 times): at most
    1.05x the data fetched, the cache never above the limit, ledger included, and the batches
    those of the local copy read with shuffle_bytes = a quarter of the limit."""
    limit = two_files(stores[kind])
    src = remote(s3, tmp_path, kind, limit)
    local = Pipeline(config(stores[kind], strategy, shuffle_bytes=limit // 4, **KINDS[kind]), 0, 1,
                     cache_dir=tmp_path / "p1")
    pipe = Pipeline(config(f"s3://fit/{kind}", strategy, **src), 0, 1, cache_dir=tmp_path / "p2")
    fit = pipe._sources[0].dataset.fitted
    assert fit is not None and fit.files_together >= 1
    assert local.num_steps == pipe.num_steps
    s3.proxy.clear()
    most = epoch_as_local(pipe, local)
    data = sum(data_files(stores[kind]))
    assert served(s3) <= 1.05 * data, (served(s3) / data, fit)
    assert most <= limit, (most, limit)


@pytest.mark.parametrize("kind", ["bin", "megatron"])
def test_a_length_change_inside_an_epoch_reads_the_rest_of_it_a_window_at_a_time(tmp_path, s3, stores, kind):
    """A sequence-length change inside an epoch plans the rest of the epoch afresh
    (`packing.rest`). Under a cache_limit its runs are planned by the chunks of the order
    fitted to the cache and read a window of chunks at a time, as the epoch's rows were:
    planned whole and shuffled, the rest read every file at every step, and the Megatron file
    fetched 27x its bytes in that epoch. Now about once: the windows being read and fetched
    ahead at the change are fetched again (two windows, half the limit, at most). The
    batches are the local copy's with the same shuffle_bytes; the cache stays under the limit."""
    limit = two_files(stores[kind])
    top = {"seq_lens": [[0, 128], [20, 256]], "num_epochs": None, "max_steps": 2000}
    pipe = Pipeline(config(f"s3://fit/{kind}", top=top, **remote(s3, tmp_path, kind, limit)), 0, 1,
                    num_threads=0, cache_dir=tmp_path / "p2")
    local = Pipeline(config(stores[kind], top=top, shuffle_bytes=limit // 4, **KINDS[kind]), 0, 1, num_threads=0,
                     cache_dir=tmp_path / "p1")
    rest = [p for p in pipe.mixture.datasets[0]._pieces_to(4000) if p.rest]
    assert len(rest) == 1 and rest[0].dataset.shuffle_window == pipe.datasets[0].fitted.window
    s3.proxy.clear()
    most = epoch_as_local(pipe, local, rest[0].end // 8)  # (to the epoch's end: 8 rows a step)
    data = sum(data_files(stores[kind]))
    assert served(s3) <= 1.05 * data + 2 * (limit // 4), served(s3) / data
    assert most <= limit, (most, limit)


def test_an_epoch_of_a_litdata_dataset_under_a_tight_limit_fetches_each_chunk_once(tmp_path, s3):
    """A LitData dataset (written by `litdata.optimize`) under a cache_limit that holds its records
    and two chunks, no more: the first open reads the chunks' heads only, and the epoch, in the
    order fitted to the limit, fetches each chunk once, the cache never above the limit, the
    batches the local copy's. (The records a chunk's first read needs are made at the open:
    made during the epoch, into a full cache, one evicted the chunk fetched ahead, and an epoch
    at two chunks' worth fetched the data 1.88 times behind a shaped link.)"""
    from test_formats import LITDATA

    path = LITDATA / "dataset"
    s3.fs().put(str(path), "fit/litdata", recursive=True)
    sizes = [f.stat().st_size for f in path.glob("chunk-*.bin")]
    options = dict(storage_options=s3.options(via_proxy=True), object_cache=str(tmp_path / "records"))
    records = TokenStore.open("s3://fit/litdata", cache_limit=10 * sum(sizes), **options).cache.used()
    limit = records + 2 * max(sizes) + 2_000  # (the ledger grows by a line or two)
    local = Pipeline(config(path, shuffle_bytes=limit // 4), 0, 1, cache_dir=tmp_path / "p1")
    s3.proxy.clear()
    src = {**options, "object_cache": str(tmp_path / "objects"), "cache_limit": limit}
    pipe = Pipeline(config("s3://fit/litdata", **src), 0, 1, cache_dir=tmp_path / "p2")
    heads = served(s3)
    assert heads < sum(sizes) // 50, heads
    s3.proxy.clear()
    most = epoch_as_local(pipe, local)
    assert served(s3) <= 1.05 * sum(sizes), served(s3) / sum(sizes)
    assert most <= limit, (most, limit)
    assert pipe.fingerprint == local.fingerprint and served(s3) <= 1.05 * sum(sizes)


def test_the_chunk_after_a_small_last_chunk_is_fetched_while_the_one_before_is_read(tmp_path, s3):
    """`litdata.optimize` ends a dataset with a small chunk (here 1.5 KB beside 31 KB ones).
    At a cache_limit of two chunks' worth, a hint of the chunk read now, the small one and a
    large one kept the first two and cut the rest, so the large one was fetched only once the
    reads had left the first, and a step waited for it (behind 30 ms and 10 MB/s a connection,
    0.29 s of a 3.4 s epoch of 24.7 MB chunks). It is fetched ahead now, as far as the cache
    holds it."""
    from test_formats import LITDATA

    path = LITDATA / "dataset"
    s3.fs().put(str(path), "fit/litdata-small-last", recursive=True)
    sizes = {f.name: f.stat().st_size for f in path.glob("chunk-*.bin")}
    options = dict(storage_options=s3.options(via_proxy=True), object_cache=str(tmp_path / "records"))
    records = TokenStore.open("s3://fit/litdata-small-last", cache_limit=10 * sum(sizes.values()), **options).cache.used()
    store = TokenStore.open("s3://fit/litdata-small-last", **{**options, "object_cache": str(tmp_path / "objects"),
                                                               "cache_limit": records + 2 * max(sizes.values()) + 2_000})
    first = {part.name: int(store._first_array[part.k]) for part in store._parts}  # (each file's first array)
    small = min(sizes, key=sizes.get)
    now, after = sorted(set(sizes) - {small})[:2]
    assert store.cache.room() < sizes[now] + sizes[small] + sizes[after]  # (the three do not fit: the case here)

    def sent(name):
        return sum(n for p, n in s3.proxy.sent.items() if p.endswith("/" + name))

    s3.proxy.clear()
    try:
        store.prefetch(np.array([first[now], first[small], first[after]]))
        for _ in range(300):  # (downloads run in the background)
            if sent(now) == sizes[now] and sent(after) >= sizes[after] // 2:
                break
            time.sleep(0.01)
        assert sent(now) == sizes[now] and sent(after) >= sizes[after] // 2, (sent(now), sent(after), sizes[after])
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["bin", "megatron"])
def test_a_second_epoch_reads_each_file_from_its_new_copy(tmp_path, s3, stores, kind):
    """A batch's gather finds the files it reads by their addresses in memory, remembered while
    each file's map lives (`mapping.Addresses`). Under a limit of two files, the second epoch
    fetches and maps every file (or block) again: its batches are still the local copy's. An
    address kept past its map would read freed memory, or another file's tokens."""
    limit = two_files(stores[kind])
    two = {"num_epochs": 2}
    local = Pipeline(config(stores[kind], top=two, shuffle_bytes=limit // 4, **KINDS[kind]), 0, 1,
                     cache_dir=tmp_path / "p1")
    pipe = Pipeline(config(f"s3://fit/{kind}", top=two, **remote(s3, tmp_path, kind, limit)), 0, 1,
                    cache_dir=tmp_path / "p2")
    s3.proxy.clear()
    for step, batch in enumerate(pipe.iterator()):
        want = local.batch(step)
        assert all(np.array_equal(batch[k], want[k]) for k in want), step
    assert step + 1 == local.num_steps
    assert served(s3) >= 1.5 * sum(data_files(stores[kind]))  # (most files fetched in both epochs: one read
    # last in the first may still be in the cache when the second reads it first)


@pytest.mark.parametrize("kind", list(KINDS))
def test_dataloader_workers_sharing_the_cache_fetch_each_file_about_once(tmp_path, s3, stores, kind):
    """Two forked DataLoader workers read one epoch through one bounded cache of two files'
    worth: each reads every other step, both in the same windows, so a file one fetched is
    there for the other. Together they fetch at most 1.05x the data (not a copy each), the
    cache never above the limit, and the batches are those the local copy makes."""
    import torch
    from torch.utils.data import DataLoader

    from forge_grain.bridges.torch import GrainIterableDataset
    from forge_grain.stores.object_cache import ObjectCache

    limit = two_files(stores[kind])
    local = Pipeline(config(stores[kind], shuffle_bytes=limit // 4, **KINDS[kind]), 0, 1, cache_dir=tmp_path / "p1")
    ds = GrainIterableDataset(config(f"s3://fit/{kind}", **remote(s3, tmp_path, kind, limit)), rank=0,
                              world_size=1, cache_dir=tmp_path / "p2")
    s3.proxy.clear()
    peak = Peak(ObjectCache(f"s3://fit/{kind}", s3.options(via_proxy=True), tmp_path / "objects", limit=limit))
    try:
        steps = 0
        for steps, batch in enumerate(DataLoader(ds, batch_size=None, num_workers=2), 1):
            want = local.batch(steps - 1)
            assert all(torch.equal(batch[k], torch.as_tensor(want[k])) for k in want), steps - 1
    finally:
        most = peak.stop()
    assert steps == local.num_steps
    data = sum(data_files(stores[kind]))
    assert served(s3) <= 1.05 * data, served(s3) / data
    assert limit // 4 <= most <= limit, (most, limit)  # (the poll saw the workers' cache)


def test_a_threads_table_of_addresses_holds_only_the_arrays_its_last_gather_read():
    """A gather from object storage finds its arrays in its thread's table of addresses over all
    the store's arrays (`mapping.Addresses`): only the arrays of the last gather are held and
    have an address there, so the map of a block evicted since is freed (its disk space with
    it), and a block mapped again is found at its new address."""
    import weakref

    from forge_grain.stores.mapping import Addresses

    arrays = [np.arange(i, i + 10, dtype=np.uint16) for i in range(4)]
    table = Addresses(4, np.uint16)
    got = table.token_arrays([1, 2], arrays[1:3])
    assert got.addresses.tolist() == [0, arrays[1].ctypes.data, arrays[2].ctypes.data, 0]
    assert got.lengths.tolist() == [0, 10, 10, 0]
    evicted = weakref.ref(arrays[1])
    del got
    arrays[1] = None  # (the store no longer maps block 1)
    got = table.token_arrays([2, 3], arrays[2:4])
    assert evicted() is None
    assert got.addresses[1] == got.lengths[1] == 0 and got.addresses[3] == arrays[3].ctypes.data
    again = np.arange(5, dtype=np.uint16)  # block 2 mapped again: a new array
    got = table.token_arrays([2], [again])
    assert got.addresses.tolist() == [0, 0, again.ctypes.data, 0] and got.lengths.tolist() == [0, 0, 5, 0]


def test_a_threads_table_is_reused_while_the_stores_maps_are_unchanged_and_no_longer():
    """A step whose arrays an earlier step read finds the table as it is (`Addresses.unchanged`),
    without asking the store, only while the store's maps (`mapping.Maps`) are unchanged: the
    arrays held then are still mapped. Its gather stops at the first row reading an array the
    table holds no address of, and says where, so the store is asked for the rest. Once a map
    comes or goes, the store is asked again, and the arrays held before (an evicted block's
    among them) are let go."""
    import weakref

    from forge_grain.packing import kernels
    from forge_grain.packing.packed import ROW_KEYS, empty_rows
    from forge_grain.stores.mapping import Addresses, Maps

    arrays = [np.arange(100 * i, 100 * i + 10, dtype=np.uint16) for i in range(4)]
    maps = Maps(enumerate(arrays))
    table = Addresses(4, np.uint16)
    assert table.unchanged(maps) is None  # (nothing found in these maps yet)
    table.token_arrays([1, 2], arrays[1:3], maps, maps.changes)
    got = table.token_arrays([3], arrays[3:], maps, maps.changes)  # (unchanged maps: 1 and 2 stay)
    assert got.addresses.tolist() == [0, *(a.ctypes.data for a in arrays[1:])]
    assert table.unchanged(maps) is got
    assert table.unchanged(Maps(enumerate(arrays))) is None  # (another process's maps)

    # rows of one segment each: the 10 tokens of array r (one piece per array)
    rows, seq_len = np.array([2, 3, 0, 1], np.int64), 8
    row_ptr, start = np.arange(5, dtype=np.int64), np.arange(4, dtype=np.int64) * 10
    pieces = np.arange(0, 50, 10, dtype=np.int64), np.arange(4, dtype=np.int64), np.zeros(4, np.int64)
    out = empty_rows(4, seq_len)

    def gather(table_now):
        return kernels.fill_rows(rows, np.arange(4, dtype=np.int64), row_ptr, start, np.full(4, 10, np.int64),
                                 np.zeros(4, np.int64), np.zeros(4, np.uint8), table_now, *pieces, seq_len, 0,
                                 *(out[k] for k in ROW_KEYS), kernels.NO_MASKS, False)

    assert gather(got) == 2  # rows 2 and 3 written; row 0 reads array 0, never mapped here
    assert out["inputs"][:2].tolist() == [arrays[2][:8].tolist(), arrays[3][:8].tolist()]
    got = table.token_arrays([0], arrays[:1], maps, maps.changes)
    assert gather(got) == 4 and out["inputs"][2:].tolist() == [arrays[0][:8].tolist(), arrays[1][:8].tolist()]

    evicted = weakref.ref(arrays[1])
    del maps[1]  # (the store evicts block 1)
    arrays[1] = None
    assert table.unchanged(maps) is None
    got = table.token_arrays([2], arrays[2:3], maps, maps.changes)
    assert evicted() is None
    assert got.addresses.tolist() == [0, 0, arrays[2].ctypes.data, 0]
    assert table.unchanged(maps) is got and gather(got) == 1  # (the first row reads array 2, held; the next 3, no longer)


def test_bos_bestfit_keeps_its_rows_under_a_fitted_order(tmp_path, s3, stores):
    """bos_bestfit (rows start at a document's BOS) planned in the fitted chunks: every row still
    starts at a document, and the epoch fetches each shard about once."""
    base = tmp_path / "bos"
    docs = [[0, *np.random.default_rng(i).integers(2, 1000, 50 + i % 300).tolist()] for i in range(1600)]
    with open(tmp_path / "bos.jsonl", "w") as f:
        f.writelines(json.dumps({"ids": d}) + "\n" for d in docs)
    prepare(tmp_path / "bos.jsonl", base, token_field="ids", vocab_size=1000, bos_id=0, num_shards=FILES,
            progress=False)
    s3.fs().put(str(base), "fit/bos", recursive=True)
    limit = 2 * max(data_files(base)) + 60_000
    pipe = Pipeline(config("s3://fit/bos", "bos_bestfit", **remote(s3, tmp_path, "bin", limit)), 0, 1,
                    cache_dir=tmp_path / "p")
    s3.proxy.clear()
    for batch in pipe.iterator():
        assert (batch["inputs"][:, 0] == 0).all()
    assert served(s3) <= 1.05 * sum(data_files(base))


def test_an_arrayrecord_store_of_small_shards_is_fitted_to_the_cache_by_its_files_sizes(tmp_path, s3):
    """ArrayRecord pads its files (four shards of 50 short documents: a few KB of tokens in
    files of 128 KiB): an order planned in token bytes saw the store as smaller than the window
    and shuffled it whole, and an epoch under a limit of two files fetched 25x the data. Planned in
    the files' sizes (from the listing; from disk for a local copy, which gets the same chunks):
    one file a window, each fetched about once, the batches the local copy's; and `plan`
    counts what the epoch fetches (it gave no figure for ArrayRecord)."""
    base = small_arrayrecord(tmp_path)
    s3.fs().put(str(base), "fit-ar/small", recursive=True)  # (its own bucket: "fit" is `stores`')
    files = [f.stat().st_size for f in Path(base).glob("*.array_record")]
    store = TokenStore.open(base)
    assert sum(files) > 4 * store.num_tokens * store.dtype.itemsize  # (the padding this is about)
    limit = 2 * max(files) + 60_000
    local = Pipeline(config(base, shuffle_bytes=limit // 4), 0, 1, cache_dir=tmp_path / "p1")
    pipe = Pipeline(config("s3://fit-ar/small", **remote(s3, tmp_path, "bin", limit)), 0, 1, cache_dir=tmp_path / "p2")
    fit = pipe._sources[0].dataset.fitted
    assert fit is not None and fit.files_together == 1, fit
    assert np.array_equal(fit.bounds, local._sources[0].dataset.fitted.bounds)
    cache = pipe.describe()["sources"][0]["cache"]
    assert cache["data_bytes"] == sum(files) and cache["fitted_order"]["files_together"] == 1
    s3.proxy.clear()
    most = epoch_as_local(pipe, local)
    served_ar = sum(n for p, n in s3.proxy.sent.items() if p.endswith(".array_record"))
    assert served_ar <= 1.05 * sum(files), served_ar / sum(files)
    assert 0.95 * cache["fetch_bytes"] <= served_ar <= 1.05 * cache["fetch_bytes"], (served_ar, cache)
    assert most <= limit, (most, limit)


def small_arrayrecord(tmp_path) -> Path:
    """A store of four ArrayRecord shards of 50 short documents each, written by `prepare`."""
    texts = [" ".join(f"w{(i * 7 + j) % 97}" for j in range(5 + i % 40)) for i in range(200)]
    with open(tmp_path / "ar.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return prepare(tmp_path / "ar.jsonl", tmp_path / "ar", layout="arrayrecord", num_shards=4, progress=False)


def test_an_arrayrecord_shard_missing_from_the_store_is_named_when_the_order_is_planned(tmp_path, s3):
    """The fitted order of an ArrayRecord store is planned in its files' sizes, read from the
    store's listing: a shard its manifest lists but the bucket lacks (deleted, or an upload cut
    short) stops the open with an error naming that object, not an order planned as if it
    were empty."""
    base = small_arrayrecord(tmp_path)
    fs = s3.fs()
    fs.put(str(base), "fit-ar/gone", recursive=True)
    shard = sorted(p.name for p in Path(base).glob("*.array_record"))[2]
    fs.rm(f"fit-ar/gone/{shard}")
    limit = 2 * max(f.stat().st_size for f in Path(base).glob("*.array_record")) + 60_000
    with pytest.raises(StoreError, match=rf"fit-ar/gone/{shard}: listed in .* but not found in the store"):
        Pipeline(config("s3://fit-ar/gone", **remote(s3, tmp_path, "bin", limit)), 0, 1, cache_dir=tmp_path / "p")


def test_a_limit_of_only_the_two_largest_files_fetches_at_most_one_and_a_half_times(tmp_path, s3, stores):
    """The tightest limit a file-at-a-time read can run in (the two largest files, the records
    and the ledger): no prefetch fits beside the file being read, and an epoch still fetches at
    most 1.5x the data."""
    sizes = sorted(data_files(stores["mds"]))
    limit = sizes[-1] + sizes[-2] + 45_000
    pipe = Pipeline(config("s3://fit/mds", **remote(s3, tmp_path, "mds", limit)), 0, 1, cache_dir=tmp_path / "p")
    s3.proxy.clear()
    peak = Peak(pipe.stores[0].cache)
    steps = sum(1 for _ in pipe.iterator())
    assert steps == pipe.num_steps and peak.stop() <= limit
    assert served(s3) <= 1.5 * sum(sizes)


def test_a_resume_keeps_the_order_the_run_was_fitted_to(tmp_path, s3, stores):
    """The order is data: a state saved under one cache_limit resumes exactly where shuffle_bytes
    keeps the run's value (here with another cache_limit), and is refused, naming shuffle_bytes,
    where a new cache_limit would change it."""
    limit = two_files(stores["mds"])
    first = Pipeline(config("s3://fit/mds", **remote(s3, tmp_path, "mds", limit)), 0, 1, cache_dir=tmp_path / "p")
    it = first.iterator()
    for _ in range(7):
        next(it)
    state = it.get_state()
    want = [first.batch(s) for s in range(7, 12)]
    kept = config("s3://fit/mds", **remote(s3, tmp_path, "mds", 3 * limit, shuffle_bytes=limit // 4))
    it = Pipeline(kept, 0, 1, cache_dir=tmp_path / "p", resume_from=state).iterator(state)
    for w in want:
        got = next(it)
        assert all(np.array_equal(got[k], w[k]) for k in w)
    changed = config("s3://fit/mds", **remote(s3, tmp_path, "mds", 3 * limit))
    with pytest.raises(StateError, match="shuffle_bytes"):
        Pipeline(changed, 0, 1, cache_dir=tmp_path / "p", resume_from=state).iterator(state)


def test_plan_says_what_an_epoch_fetches_and_warns_when_the_order_thrashes(tmp_path, s3, stores):
    """`forge-grain plan` prints, for a source under cache_limit, its read order and the bytes an
    epoch fetches (within 5% of what the server then serves), and warns, with the fix, when an
    order not fitted to the cache (here shuffle_window over planning chunks of many files) would
    fetch more than 1.5x the data."""
    limit = two_files(stores["mds"])
    src = remote(s3, tmp_path, "mds", limit)
    src["storage_options"] = {k: v for k, v in src["storage_options"].items() if k != "config_kwargs"}

    def plan(**extra) -> dict:
        toml = tmp_path / "run.toml"
        entries = {"name": "web", "path": "s3://fit/mds", "strategy": "bestfit", **src, **extra}
        lines = ["seq_len = 256", "global_batch_size = 8", "seed = 4", "num_epochs = 1", "plan_chunk_docs = 1200",
                 "[[sources]]"] + [f"{k} = {json.dumps(v)}" for k, v in entries.items() if k != "storage_options"]
        lines += ["[sources.storage_options]"] + [f"{k} = {json.dumps(v)}" for k, v in src["storage_options"].items()]
        toml.write_text("\n".join(lines) + "\n")
        out = subprocess.run([sys.executable, "-m", "forge_grain", "plan", str(toml), "--json"], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)

    fitted = plan()
    cache = fitted["sources"][0]["cache"]
    assert cache["limit"] == limit and cache["fitted_order"]["shuffle_bytes"] == limit // 4
    assert cache["data_bytes"] == sum(data_files(stores["mds"]))
    assert cache["fetch_bytes"] <= 1.05 * cache["data_bytes"] and not fitted["warnings"]
    pipe = Pipeline(config("s3://fit/mds", **remote(s3, tmp_path, "mds", limit)), 0, 1, cache_dir=tmp_path / "p")
    s3.proxy.clear()
    sum(1 for _ in pipe.iterator())
    assert 0.95 * cache["fetch_bytes"] <= served(s3) <= 1.05 * cache["fetch_bytes"]
    thrashing = plan(shuffle_window=1)  # (the replay leaves out the prefetch's churn: such a run fetches more)
    cache = thrashing["sources"][0]["cache"]
    assert cache["fitted_order"] is None and cache["fetch_bytes"] > 1.5 * cache["data_bytes"]
    assert any("fetches" in w and "remove shuffle_window" in w for w in thrashing["warnings"])


@pytest.mark.parametrize("kind", ["megatron", "raw"])
@pytest.mark.parametrize("small", [True, False])
def test_a_first_open_under_a_limit_reads_each_byte_about_once(tmp_path, s3, stores, monkeypatch, kind, small):
    """The first open of a Megatron or raw file under cache_limit (its scan, its checks, its
    content fingerprint) fetches at most 1.1x the file (a raw file was fetched 4x, a Megatron one
    2x): a small file is held in memory through the open, and a large one (here: past a lowered
    threshold) reads its scattered checks without merging them across much of the file (at most
    a fiftieth of it a pass, beside the samples themselves). The fingerprint stays the local
    copy's."""
    from forge_grain import TokenStore
    from forge_grain.stores import checks, mirror_ranges

    if not small:
        monkeypatch.setattr(mirror_ranges, "KEEP", 100_000)
        monkeypatch.setattr(checks, "WHOLE_BELOW", 50_000)  # (the local fingerprint samples alike)
    size = sum(data_files(stores[kind]))
    s3.proxy.clear()
    store = TokenStore.open(f"s3://fit/{kind}", **remote(s3, tmp_path, kind, size // 3))
    if small:
        assert served(s3) <= 1.1 * size, served(s3) / size
    else:  # the checks' samples are of a fixed size (0.4% of a file of 64 MB, the least that is not held)
        sampled = (2 * checks.SAMPLE_BLOCKS * checks.SAMPLE_BLOCK_BYTES + checks.PROBES * checks.PROBE_BYTES
                   + 2 * mirror_ranges.SAMPLED_ENDS * 8)
        assert served(s3) <= 1.06 * size + sampled, (served(s3) - sampled) / size
    assert store.fingerprint == TokenStore.open(stores[kind], **KINDS[kind]).fingerprint


def data_gets(s3) -> int:
    return sum(n for p, n in s3.proxy.gets.items() if p.endswith(DATA_SUFFIXES))


@pytest.mark.parametrize("kind", ["megatron", "raw"])
def test_a_large_files_fingerprint_is_gathered_from_the_blocks_an_epoch_reads(tmp_path, s3, stores, monkeypatch,
                                                                              kind):
    """Under a cache_limit, a Megatron or raw file too large to hold through its first open
    (here: past a lowered threshold) no longer takes its content fingerprint's 2,048 probes in
    ranged GETs at the open (5 s of an 8 s epoch behind a local S3 server): they are taken from
    the blocks the epoch reads. After one epoch the pipeline's fingerprint is the local copy's
    with no further request, and kept for the next open; asked for before (a state saved at
    step 3), the places not seen yet are read then, and the state is the local copy's."""
    from forge_grain.stores import checks, mirror_ranges

    monkeypatch.setattr(mirror_ranges, "KEEP", 100_000)
    monkeypatch.setattr(checks, "WHOLE_BELOW", 50_000)  # (the local fingerprint samples alike)
    limit = two_files(stores[kind])
    local = Pipeline(config(stores[kind], shuffle_bytes=limit // 4, **KINDS[kind]), 0, 1, cache_dir=tmp_path / "p1")

    def build(cache):
        s3.proxy.clear()
        src = remote(s3, tmp_path, kind, limit) | {"object_cache": str(tmp_path / cache)}
        return Pipeline(config(f"s3://fit/{kind}", **src), 0, 1, cache_dir=tmp_path / "p2")

    pipe = build("gathered")
    assert data_gets(s3) < checks.PROBES // 8, data_gets(s3)  # (the checks' samples, not the probes)
    opened = served(s3)  # (a raw file is read through at its open, to find its documents)
    steps = [b for b in pipe.iterator()]
    gets = data_gets(s3)
    assert pipe.fingerprint == local.fingerprint and data_gets(s3) == gets
    assert all(np.array_equal(b[k], want[k]) for b, want in zip(steps, local.iterator()) for k in want)
    assert served(s3) - opened <= 1.05 * sum(data_files(stores[kind]))
    assert build("gathered").fingerprint == local.fingerprint and data_gets(s3) == 0  # (kept: prints.json)

    pipe = build("asked")
    it = pipe.iterator()
    for _ in range(3):
        next(it)
    _FORKED.append(pipe._sources[0].opened)  # (a forked DataLoader worker asks for it too: its own requests)
    try:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            assert pool.apply(_forked_fingerprint) == TokenStore.open(stores[kind], **KINDS[kind]).fingerprint
    finally:
        _FORKED.clear()
    assert pipe.state_at(3) == local.state_at(3) and data_gets(s3) >= checks.PROBES // 8
    local.check_state(pipe.state_at(3))


_FORKED: list = []


def _forked_fingerprint() -> str:
    return _FORKED.pop().fingerprint


def test_a_cache_of_two_shards_fetches_the_next_as_far_as_it_fits_before_it_is_read(tmp_path, s3, stores):
    """At a cache_limit of exactly two shards' worth, the next shard cannot fit beside the one
    being read and the indices: it is fetched while the shard before is read, as far as it fits
    into the cache and the rest into memory, and written whole once that one leaves (before,
    every shard boundary waited for a whole download: 0.47x the unbounded rate behind a link of
    30 ms and 10 MB/s a connection). The batches stay the local copy's, the cache never holds
    more than the limit, each shard is fetched once."""
    sizes = data_files(stores["bin"])
    limit = 2 * max(sizes)
    src = remote(s3, tmp_path, "bin", limit)
    local = Pipeline(config(stores["bin"], shuffle_bytes=limit // 4), 0, 1, num_threads=0, cache_dir=tmp_path / "p1")
    pipe = Pipeline(config("s3://fit/bin", **src), 0, 1, num_threads=0, cache_dir=tmp_path / "p2")
    store = pipe.stores[0]
    names = {k: store.manifest.shards[k].tokens for k in range(len(store.manifest.shards))}

    def shards(step):
        return set(pipe.datasets[0].arrays_read(pipe.mixture.locate(pipe.shard_rows(step))[1]).tolist())

    def sent(k):
        return sum(n for p, n in s3.proxy.sent.items() if p.endswith(names[k]))

    s3.proxy.clear()
    peak = Peak(store.cache)
    read, ahead, on_disk = set(), [], []
    try:
        for step in range(pipe.num_steps):
            want, got = local.batch(step), pipe.batch(step)  # (each step made once, as an iterator makes it)
            assert all(np.array_equal(got[k], want[k]) for k in want), step
            read |= shards(step)
            new = shards(step + 1) - read if step + 1 < pipe.num_steps else set()
            for k in new:  # (downloads run in the background: give the one ahead a moment)
                size = store.manifest.shards[k].num_tokens * store.dtype.itemsize
                for _ in range(200):
                    if sent(k) >= size // 2:
                        break
                    time.sleep(0.01)
                ahead.append(sent(k) / size)
                on_disk.append((store.cache.dir / store._name(k)).exists())
    finally:
        most = peak.stop()
    assert len(ahead) >= 10 and min(ahead) >= 0.5, ahead
    assert not all(on_disk), on_disk  # (the limit allowed no whole shard ahead: this is what the test is about)
    assert served(s3) <= 1.05 * sum(sizes), served(s3) / sum(sizes)
    assert most <= limit, (most, limit)
    assert not list(store.cache.dir.glob(".*.hurry.lock"))  # (the word "needed now" is spent once heard)


def test_the_word_needed_now_is_spent_also_when_the_prefetch_ended_as_it_was_said(tmp_path, s3):
    """A batch that needs a shard being prefetched says so (a marker file: a prefetch waiting
    for room stops waiting) and waits for it. The prefetch spends the word as it ends; said
    after that and before its future is done, the word was left in the cache for good (the
    two-shard epoch above found such a marker at its end)."""
    import concurrent.futures

    from forge_grain.stores.object_cache import ObjectCache

    cache = ObjectCache("s3://fit/bin", s3.options(), tmp_path / "objects", 1 << 20)
    copy, prefetch, spent = "m/shard.bin", concurrent.futures.Future(), threading.Event()
    marker = cache._hurry_marker(copy)

    def ending():  # the prefetch: it spends the word, then (later) its future is done
        cache.heard(copy)
        spent.set()
        for _ in range(500):  # until the batch has said it needs the shard
            if marker.exists():
                break
            time.sleep(0.01)
        prefetch.set_result("done")

    threading.Thread(target=ending, daemon=True).start()
    assert spent.wait(10)
    assert cache.result_now(prefetch, copy) == "done"
    assert not marker.exists()
    failed = concurrent.futures.Future()
    failed.set_exception(OSError("the object is gone"))
    with pytest.raises(OSError, match="gone"):  # (a failed prefetch raises as it did)
        cache.result_now(failed, copy)


@pytest.mark.parametrize("kind", ["bin", "megatron"])
def test_a_shard_leaves_the_hints_once_the_last_step_reading_it_is_made(tmp_path, s3, stores, kind):
    """The hints tell a bounded cache which shards the coming steps read; a shard leaves them
    as soon as the last step reading it is made, in this process or (steps it never makes, as
    another DataLoader worker's) once a later step is made here; not with the block of 16
    steps it was looked up in. So a cache of two shards may drop it and fetch the shard after
    the next while the next still arrives (read flat out, one download at a time before).
    A Megatron file's blocks too, where a window of the fitted order reads several blocks
    at once and the next window several others (they stayed until the block of steps where
    the windows meet was made, which waits for the next window's blocks: at 2 files' worth
    behind 2 MB/s a connection, 5-6 of the 14 blocks held ahead were there already, and 8 in
    flight)."""
    from forge_grain.pipeline.fetching import HINT_STEPS

    limit = 2 * max(data_files(stores["bin"])) if kind == "bin" else two_files(stores[kind])
    for stride in (1, 2):  # (2: the steps of one of two workers)
        pipe = Pipeline(config(f"s3://fit/{kind}", **remote(s3, tmp_path / str(stride), kind, limit)), 0, 1,
                        num_threads=0, cache_dir=tmp_path / f"p{stride}")
        store = pipe.stores[0]
        shards = (lambda a: a) if kind == "bin" else store._parts_of  # (a Megatron file: its blocks)
        name = store._name if kind == "bin" else (lambda p: store._parts[p].copy)
        read = [set(shards(pipe.datasets[0].arrays_read(pipe.mixture.locate(pipe.shard_rows(t))[1])).tolist())
                for t in range(pipe.num_steps)]
        last = {k: max(t for t in range(pipe.num_steps) if k in read[t]) for k in set().union(*read)}
        if kind == "megatron":  # (what the test is about: windows of more blocks than a shard boundary reads)
            assert pipe.datasets[0].fitted.window >= 3 and max(map(len, read)) >= 4
        early = set()
        for step in range(0, pipe.num_steps, stride):
            pipe.batch(step)
            for k, t in last.items():  # every shard whose last reader is made (or is another worker's, behind)
                if t <= step:
                    assert name(k) not in store._keep, (stride, step, k, t)
                    early |= {k} if (t + 1) % HINT_STEPS else set()
        assert len(early) >= 5, early  # (shards that left before the end of their block of steps)


def test_a_block_of_steps_is_looked_at_step_by_step_where_one_window_hands_over_to_the_next(tmp_path, s3, stores):
    """The hints give a block of steps' shards to its last step, except where one window of
    the fitted order ends and the next begins (`windows_meet`): at any row of the block, and
    at an epoch's end; never inside a window, where steps of a row or two each read only
    some of its files (told from the arrays read, most blocks of such steps were looked at
    step by step). The windows are found here from the rows alone: the span of each chunk's
    rows in the epoch, overlapping spans merged (a window's rows are shuffled together)."""
    from forge_grain.pipeline.fetching import windows_meet

    pipe = Pipeline(config("s3://fit/megatron", top={"num_epochs": 2},
                           **remote(s3, tmp_path, "megatron", two_files(stores["megatron"]))), 0, 1,
                    num_threads=0, cache_dir=tmp_path / "plans")
    d = pipe.datasets[0]
    n = d.num_rows
    window = []  # (each index's window, found for each epoch apart: each visits the chunks in its own order)
    for e in range(2):
        chunk = np.searchsorted(np.cumsum(d._chunk_rows), d.rows_of(np.arange(e * n, (e + 1) * n)), side="right")
        first = {c: p for p, c in reversed(list(enumerate(chunk.tolist())))}
        last = {c: p for p, c in enumerate(chunk.tolist())}
        spans = []
        for c in sorted(first, key=first.get):
            if spans and first[c] <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], last[c])
            else:
                spans.append([first[c], last[c]])
        assert d.fitted.window >= 3 and len(spans) >= 3  # (several windows of several chunks)
        window.append(e * n + np.searchsorted([a for a, _ in spans], np.arange(n), side="right"))
    window = np.concatenate(window)
    for size in (1, 5, 16, 37):
        indices = np.arange(2 * n)
        cuts = np.arange(0, 2 * n + size, size).clip(max=2 * n)
        want = [window[a] != window[b - 1] for a, b in zip(cuts[:-1], cuts[1:])]
        assert windows_meet(d, indices, cuts).tolist() == want, size
        assert sum(want) >= len(spans) if size > 1 else not any(want)  # (a block of one row is in one window)
    shuffled = np.random.default_rng(0).permutation(indices)[:40]  # (a block's rows in any order: its least and greatest)
    assert windows_meet(d, shuffled, np.array([0, 0, 40])).tolist() == [False, True]  # (a block of no rows: none)

    top = {"seq_lens": [[0, 128], [20, 256]], "num_epochs": None, "max_steps": 200}  # (rows of two lengths: pieces)
    pipe = Pipeline(config("s3://fit/megatron", top=top, **remote(s3, tmp_path / "lens", "megatron",
                                                                   two_files(stores["megatron"]))), 0, 1,
                    num_threads=0, cache_dir=tmp_path / "plans-lens")
    d = pipe.mixture.datasets[0]
    rows = np.arange(pipe.num_steps * 8)
    where = [d.locate(j)[:2] for j in rows.tolist()]  # (each row's piece's dataset, and its index there)
    want = [a[0] is not b[0] or bool(a[0].windows_apart([a[1]], [b[1]])[0]) for a, b in zip(where, where[1:])]
    assert d.windows_apart(rows[:-1], rows[1:]).tolist() == want
    assert len({id(w[0]) for w in where}) >= 2 and sum(want) >= 4  # (a change, and windows on both sides)


@pytest.mark.parametrize("kind", ["bin", "megatron"])
def test_the_shards_of_a_block_of_steps_found_in_one_call_are_those_each_step_reads(tmp_path, s3, stores, kind):
    """The hints look up a block of steps at once and, at a boundary of the fitted order, each
    step's shards (`arrays_read` with `ends`, one call): the same shards, in the same order, as each
    step's rows read when asked for alone; steps of no rows (a mixture's other source) read none;
    also under a schedule of sequence lengths (a dataset of two plans)."""
    for top in ({}, {"seq_lens": [[0, 128], [20, 256]], "num_epochs": None, "max_steps": 80}):
        pipe = Pipeline(config(f"s3://fit/{kind}", top=top, **remote(s3, tmp_path / str(len(top)), kind,
                                                                     two_files(stores[kind]))),
                        0, 1, num_threads=0, cache_dir=tmp_path / f"p{len(top)}")
        d = pipe.datasets[0]
        rng = np.random.default_rng(len(top))
        for a in range(0, 60, 7):
            steps = [pipe.mixture.locate(pipe.shard_rows(t))[1] for t in range(a, a + 16)]
            steps = [r[: int(rng.integers(0, len(r) + 1))] for r in steps]  # (some of no rows)
            ends = np.cumsum([len(r) for r in steps])
            got = d.arrays_read(np.concatenate(steps), ends)
            want = [d.arrays_read(r) for r in steps]
            assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want)), (top, a)
            assert any(len(w) for w in want)


def test_a_script_that_ends_without_closing_its_pipeline_exits_while_a_prefetch_waits_for_room(tmp_path, s3,
                                                                                                stores):
    """A training script that stops after some steps and never closes its pipeline exits at
    once, though a prefetch in a bounded cache is waiting for room (before, the interpreter
    joined the prefetch's thread at exit, and the prefetch waited for hints that never moved:
    the script hung)."""
    src = remote(s3, tmp_path, "bin", 2 * max(data_files(stores["bin"])))
    child = (f"from forge_grain import DataConfig, Pipeline\n"
             f"src = dict(name='web', path='s3://fit/bin', **{src!r})\n"
             f"pipe = Pipeline(DataConfig.from_dict(dict(sources=[src], seq_len=128, global_batch_size=8, seed=0)), 0, 1)\n"
             f"it = pipe.iterator()\n"
             f"for _ in range(3):\n"
             f"    next(it)\n"
             f"import time; time.sleep(1)  # (the next shard's prefetch is waiting for room now)\n"
             f"print(len(list(pipe.stores[0].cache.dir.glob('**/*.tmp*'))), 'partial')\n")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] != "0", done.stdout  # (there was one waiting: what the test is about)


def test_a_prefetch_waiting_for_room_is_finished_when_another_process_needs_it(tmp_path, s3, stores):
    """A prefetch fetched as far as the cache holds it waits for room while the copy it must not
    evict is still hinted; another process that needs the object now (a DataLoader worker, a rank
    on the host) does not wait for those hints to move: the waiting prefetch makes room as a
    fetch needed now does, finishes, and both read the one copy (fetched once). A prefetch no
    longer hinted drops what it fetched."""
    from forge_grain.stores.object_cache import ObjectCache

    opts, local = s3.options(via_proxy=True), stores["bin"]
    files = sorted(f.name for f in Path(local).iterdir() if f.suffix == ".bin")
    a, b, c = files[:3]
    size = (Path(local) / b).stat().st_size
    limit = (Path(local) / a).stat().st_size + size // 2
    cache = ObjectCache("s3://fit/bin", opts, tmp_path / "objects", limit)
    copy = lambda name: f"m/{name}"  # noqa: E731
    cache.get(a, copy(a))
    s3.proxy.clear()
    hinted = {copy(a), copy(b)}
    got = {}
    waiting = threading.Thread(target=lambda: got.update(b=cache.get(b, copy(b), upcoming=lambda: hinted,
                                                                      ahead=True)), daemon=True)
    waiting.start()
    try:
        for _ in range(500):  # its first part arrives: half of it fits
            if served(s3) >= size // 4:
                break
            time.sleep(0.01)
        time.sleep(0.3)
        assert waiting.is_alive() and not (cache.dir / copy(b)).exists()  # (it waits: `a` is hinted)
        script = (f"import json\nfrom forge_grain.stores.object_cache import ObjectCache\n"
                  f"c = ObjectCache('s3://fit/bin', json.loads({json.dumps(json.dumps(opts))}), "
                  f"{str(tmp_path / 'objects')!r}, {limit})\nprint(c.get({b!r}, {copy(b)!r}))\n")
        other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert other.returncode == 0, other.stderr[-2000:]
        waiting.join(30)
    finally:  # (a failure leaves no prefetch waiting)
        hinted.discard(copy(b))
    assert not waiting.is_alive() and got["b"] == cache.dir / copy(b)
    assert Path(other.stdout.strip()) == got["b"]
    assert (Path(local) / b).read_bytes() == got["b"].read_bytes()
    assert served(s3) == size  # fetched once, by the prefetch; the other process read its copy
    assert cache.used() <= limit

    hinted.update({copy(b), copy(c)})  # a prefetch whose hint moves on while it waits: given up, its bytes dropped
    dropped = {}
    waiting = threading.Thread(target=lambda: dropped.update(c=cache.get(c, copy(c), upcoming=lambda: hinted,
                                                                          ahead=True)), daemon=True)
    waiting.start()
    time.sleep(0.5)
    hinted.discard(copy(c))
    waiting.join(30)
    assert not waiting.is_alive() and dropped["c"] is None
    assert not (cache.dir / copy(c)).exists() and cache.used() <= limit
    assert not [p for p in (cache.dir / "m").iterdir() if ".tmp-" in p.name]


def test_the_rest_of_a_prefetch_the_cache_cannot_hold_yet_arrives_meanwhile_and_is_written_once_there_is_room(
        tmp_path, s3, stores):
    """A prefetch of which only half fits beside a copy still hinted reads its other half too,
    into memory (`download.STAGED` bytes at most), while it waits: once the hint moves on, the
    copy is complete at once, with no request more (at a cache_limit of two shards, the rest was
    asked for only when the shard was needed: a round trip a shard). Meanwhile the cache holds
    no more than the limit, and no copy that is not whole."""
    from forge_grain.stores.object_cache import ObjectCache

    local = stores["bin"]
    a, b = sorted(f.name for f in Path(local).iterdir() if f.suffix == ".bin")[3:5]
    size = (Path(local) / b).stat().st_size
    limit = (Path(local) / a).stat().st_size + size // 2
    cache = ObjectCache("s3://fit/bin", s3.options(via_proxy=True), tmp_path / "objects", limit)
    copy = lambda name: f"m/{name}"  # noqa: E731
    cache.get(a, copy(a))
    s3.proxy.clear()
    hinted, got = {copy(a), copy(b)}, {}
    waiting = threading.Thread(target=lambda: got.update(b=cache.get(b, copy(b), upcoming=lambda: hinted,
                                                                      ahead=True)), daemon=True)
    waiting.start()
    try:
        for _ in range(500):
            if served(s3) >= size:
                break
            time.sleep(0.01)
        assert served(s3) == size  # all of it arrived, though the cache has room for half
        time.sleep(0.2)
        assert waiting.is_alive() and not (cache.dir / copy(b)).exists() and cache.used() <= limit
    finally:
        hinted.discard(copy(a))  # (the copy before leaves the hints: the room is there)
    waiting.join(30)
    assert not waiting.is_alive() and got["b"] == cache.dir / copy(b)
    assert got["b"].read_bytes() == (Path(local) / b).read_bytes()
    assert served(s3) == size and cache.used() <= limit


def test_a_prefetch_waiting_for_room_takes_what_another_process_frees_without_asking_again_meanwhile(
        tmp_path, s3, stores):
    """A prefetch fetched as far as the cache holds it, waiting beside a copy still hinted and a
    download of another process that holds room, does not take the cache's lock every few
    milliseconds while nothing changes (asked every 10 ms, it cost a LitData epoch at two
    chunks' worth 72-114 ms of a download thread's CPU beside the reader); once that other
    process gives its room back, the prefetch takes it and finishes, soon."""
    from forge_grain.stores.object_cache import ObjectCache

    local = stores["bin"]
    a, b = sorted(f.name for f in Path(local).iterdir() if f.suffix == ".bin")[5:7]
    size = (Path(local) / b).stat().st_size
    limit = (Path(local) / a).stat().st_size + size + size // 8
    cache = ObjectCache("s3://fit/bin", s3.options(via_proxy=True), tmp_path / "objects", limit)
    copy = lambda name: f"m/{name}"  # noqa: E731
    cache.get(a, copy(a))
    script = (f"import sys\nfrom forge_grain.files import temporary\n"
              f"from forge_grain.stores.object_cache import ObjectCache\n"
              f"c = ObjectCache('s3://fit/bin', {{}}, {str(tmp_path / 'objects')!r}, {limit})\n"
              f"tmp = temporary(c.dir / 'm' / 'other.bin')\n"
              f"assert c._make_room({size // 2}, set(), tmp, ahead=False)  # (as a download of it does)\n"
              f"print('held', flush=True)\nsys.stdin.readline()\nc._forget(tmp)\nprint('freed', flush=True)\n")
    other = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    hinted, got, asks = {copy(a), copy(b)}, {}, []
    try:
        assert other.stdout.readline().strip() == "held", other.stderr.read()[-2000:]
        make_room = cache._make_room
        cache._make_room = lambda *args, **kw: asks.append(time.monotonic()) or make_room(*args, **kw)
        waiting = threading.Thread(target=lambda: got.update(b=cache.get(b, copy(b), upcoming=lambda: hinted,
                                                                          ahead=True)), daemon=True)
        waiting.start()
        for _ in range(500):  # all of it arrives (the rest held in memory), though the cache has room for part
            if served(s3) >= size:
                break
            time.sleep(0.01)
        time.sleep(0.1)
        before = len(asks)
        time.sleep(1.0)
        assert waiting.is_alive() and not (cache.dir / copy(b)).exists()  # (it waits: there is no room)
        assert len(asks) - before <= 6, len(asks) - before  # (every 10 ms: about 100)
        freed = time.monotonic()
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "freed", other.stderr.read()[-2000:]
        waiting.join(30)
        assert not waiting.is_alive() and got["b"] == cache.dir / copy(b)
        assert time.monotonic() - freed < 5
        assert asks[-1] - freed < 0.2  # (the room was taken at the first look after it was given back)
    finally:
        hinted.clear()
        other.kill()
    assert got["b"].read_bytes() == (Path(local) / b).read_bytes() and cache.used() <= limit


def test_a_step_across_a_shard_boundary_lets_the_shard_it_leaves_go_before_it_waits_for_the_next(
        tmp_path, s3, stores):
    """A step of the read order that fits the cache may read the last rows of one shard and the
    first of the next. Its batch fills the rows of the shard it holds first, and that shard
    leaves the hints (no later step reads it) before the batch waits for the next one: so the
    bounded cache may drop it and fetch the shard after (before, it left once the next had
    arrived whole: one download at a time, read flat out). The batches stay the local copy's."""
    limit = 2 * max(data_files(stores["bin"]))
    src = remote(s3, tmp_path, "bin", limit)
    local = Pipeline(config(stores["bin"], shuffle_bytes=limit // 4), 0, 1, num_threads=0, cache_dir=tmp_path / "p1")
    pipe = Pipeline(config("s3://fit/bin", **src), 0, 1, num_threads=0, cache_dir=tmp_path / "p2")
    store = pipe.stores[0]
    read = [set(pipe.datasets[0].arrays_read(pipe.mixture.locate(pipe.shard_rows(t))[1]).tolist())
            for t in range(pipe.num_steps)]
    last = {k: max(t for t in range(pipe.num_steps) if k in read[t]) for k in set().union(*read)}
    now, waits = {}, []
    array = store._array

    def watched(k):  # (a read that waits for its shard: what the hints keep then)
        if not store.held(np.array([k]))[0]:
            waits.append((now["step"], k, store._keep))
        return array(k)

    store._array = watched
    for step in range(pipe.num_steps):
        now["step"] = step
        want, got = local.batch(step), pipe.batch(step)
        assert all(np.array_equal(got[k], want[k]) for k in want), step
    boundaries = 0
    for step, k, keep in waits:
        left = [j for j in read[step] if j != k and last[j] == step]
        assert not [j for j in left if store._name(j) in keep], (step, k, left)
        boundaries += bool(left)
    assert boundaries >= 5, waits


@pytest.mark.parametrize("files", [1, 3])
def test_a_bounded_cache_fetches_a_chunk_of_the_fitted_order_as_one_block(tmp_path, s3, stores, files):
    """Under a cache_limit a raw or Megatron file is planned in units of a thirty-second of the
    limit, grouped into chunks of about twice that, and a window reads its chunks whole: the
    cache fetches each chunk's units as one block (each download is a turn of the cache's
    bookkeeping taken from the reader), never across two chunks or two files. Raw files, one
    and three (a chunk may span files: one block in each), with the local copy's batches."""
    from forge_grain.packing.fitted import unit_bounds

    tokens = np.fromfile(stores["raw"] / "tokens.bin", np.uint16)
    ends = np.flatnonzero(tokens == 1) + 1
    base = tmp_path / "raw"
    base.mkdir()
    for k, part in enumerate(np.split(tokens, ends[[len(ends) * j // files - 1 for j in range(1, files)]])):
        part.tofile(base / f"part-{k}.bin")
    s3.fs().put(str(base), f"fit/raw{files}", recursive=True)
    limit = two_files(stores["raw"])
    pipe = Pipeline(config(f"s3://fit/raw{files}", **remote(s3, tmp_path, "raw", limit)), 0, 1, cache_dir=tmp_path / "p")
    store, fit = pipe.stores[0], pipe.datasets[0].fitted
    offsets = np.asarray(store.offsets, np.int64)
    block_starts = set(store._pieces[0].tolist())  # (where each block's tokens start)
    file_starts = set(offsets[np.asarray(store.file_doc_starts)].tolist())
    assert set(offsets[fit.bounds].tolist()) <= block_starts  # a chunk's first unit starts a block
    for a, b in zip(fit.bounds[:-1], fit.bounds[1:]):  # ... and a block inside it starts only at a file
        inside = {t for t in block_starts if offsets[a] < t < offsets[b]}
        assert inside <= file_starts, (a, b)
    units = len(unit_bounds(store, limit // 4)[0]) - 1
    assert len(block_starts) - 1 <= units * 0.6, (len(block_starts) - 1, units)  # about half as many downloads
    local = Pipeline(config(base, shuffle_bytes=limit // 4, **KINDS["raw"]), 0, 1, cache_dir=tmp_path / "l")
    s3.proxy.clear()
    assert epoch_as_local(pipe, local) <= limit
    assert served(s3) <= 1.05 * tokens.nbytes


def test_a_block_of_a_chunks_units_stays_within_the_most_one_download_takes(monkeypatch):
    """On a large cache a chunk holds many units of the most a block takes (`BLOCK`): they are
    fetched in blocks of at most that, not as one download of a sixteenth of the cache (the
    first step would wait for it), and still never across a chunk."""
    from forge_grain.stores import blocks

    monkeypatch.setattr(blocks, "BLOCK", 10_000)
    rng = np.random.default_rng(5)
    files = [np.concatenate([[0], np.cumsum(rng.integers(1, 3_000, n))]) for n in (400, 0, 250)]
    limit = 10**7  # (units of BLOCK, chunks of limit / 16: about 60 units)
    units = [blocks.block_cuts(o, blocks.BLOCK // 2) for o in files]
    sizes = [int(n) * 2 for c in units for n in np.diff(c)]
    firsts = np.cumsum([0] + sizes)  # (bytes before each unit, over the files)
    starts = {int(firsts[k]) for k in blocks.chunk_starts(sizes, limit // 4)}
    assert 1 < len(starts) < len(sizes) // 8
    at = 0
    for cuts, got, offsets in zip(units, blocks.fetch_cuts(files, 2, limit), files):
        assert got[0] == 0 and got[-1] == offsets[-1] and set(got.tolist()) <= set(cuts.tolist())
        for a, b in zip(got[:-1], got[1:]):
            one_unit = np.searchsorted(cuts, a) + 1 == np.searchsorted(cuts, b)
            assert (b - a) * 2 <= blocks.BLOCK or one_unit
        chunk_firsts = {s - at for s in starts if at <= s < at + 2 * int(offsets[-1])}
        assert {2 * int(t) for t in got[:-1]} >= chunk_firsts  # every chunk starts a block
        at += 2 * int(offsets[-1])


@pytest.mark.parametrize("kind", ["megatron", "raw"])
def test_the_parts_hinted_download_together_as_far_as_the_cache_holds_them(tmp_path, s3, stores, monkeypatch,
                                                                            kind):
    """The blocks of a Megatron or raw token file, hinted ahead under a cache_limit that holds
    them all, all download at once (each waits on its own reads): they downloaded 8 at a time
    while the hints held 28, and a Megatron epoch at 2 blocks' worth behind 30 ms and 2 MB/s a
    connection took 11.9 s (now 7.4 s). Every download is held until as many run as were
    hinted (or 20 s pass); then they all land, and the store's tokens are the local copy's."""
    from forge_grain import TokenStore
    from forge_grain.stores.download import Download

    gate, lock, running = threading.Event(), threading.Lock(), []
    attempt = Download._attempt

    def held(self):
        with lock:
            running.append(self.name)
        assert gate.wait(60), "no release"
        return attempt(self)

    store = TokenStore.open(f"s3://fit/{kind}", **remote(s3, tmp_path, kind, 3 * sum(data_files(stores[kind])) // 2))
    parts = store.units_of(np.arange(store.num_arrays))[0]
    hinted = len(set(parts.tolist()))
    assert hinted > 8
    monkeypatch.setattr(Download, "_attempt", held)
    store.prefetch(np.arange(store.num_arrays))
    deadline = time.monotonic() + 20
    while len(running) < hinted and time.monotonic() < deadline:
        time.sleep(0.01)
    together = len(running)
    gate.set()
    deadline = time.monotonic() + 60
    while not store.held(np.arange(store.num_arrays)).all() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert together == hinted, f"{together} of {hinted} hinted downloads ran at once"
    local = TokenStore.open(stores[kind], **KINDS[kind])
    assert all(np.array_equal(store[i], local[i]) for i in range(len(local)))
    store.close()
