"""The first batch an iterator makes from a store in object storage reads its documents in
ranged GETs while the shards holding them download (`forge_grain.stores.document_ranges`): the
first batch of a global shuffle does not wait for dozens of whole shards. These tests hold every shard download
(a prefetch's `_fetch` waits at a gate, in this process and in forked workers) and ask:
- the first batch comes anyway, and is the batch the local copy gives; the epoch after is too;
- the same for the first batch of an iterator restored at an odd step;
- under DataLoader workers (forked) the same;
- a range read from an object replaced after the open, then put back before its download
  (checked against the manifest's sha256) lands, is an error naming it at the next batch
  (the download's future holds it: a batch reading the shard, or the next hint, raises it);
- under a `cache_limit`, or once the budget is spent, a step waits for its shards instead;
  and only the first step of a fresh window of hints reads ranges, where they cost less;
- the same for a Megatron `.bin` without a `cache_limit`, read in blocks of documents (their
  downloads held instead): its first batch, in this process and in forked workers, and a
  `.bin` rewritten after the open refused by the ranges themselves.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import make_texts, write_jsonl

from forge_grain import DataConfig, Pipeline, StoreError, prepare
from forge_grain.stores import document_ranges
from forge_grain.stores.remote import RemoteStore

pytest.importorskip("s3fs")
pytest.importorskip("moto")
from s3server import S3Server  # noqa: E402

SHARDS = 12


@pytest.fixture(scope="module")
def s3():
    with S3Server("ranges") as server:
        yield server


@pytest.fixture(scope="module")
def store(tmp_path_factory, s3):
    """A store of 12 shards, on disk and at s3://ranges/store."""
    base = tmp_path_factory.mktemp("ranges")
    path = prepare(write_jsonl(base / "docs.jsonl", make_texts(12000, seed=3)), base / "store", num_shards=SHARDS,
                   progress=False)
    s3.fs().put(str(path), "ranges/store", recursive=True)
    return path


class Gate:
    """Shard downloads asked for ahead (prefetches) wait until it is opened (60 s at most, then
    fail: a batch waited for them), in
    this process and in its forked children (it is a file); `fetched` lists the shards fetched
    any other way (needed now) in this process."""

    def __init__(self, door):
        self.door, self.fetched = door, []

    def open(self) -> None:
        self.door.touch()

    def close(self) -> None:
        self.door.unlink(missing_ok=True)

    def hold(self, ahead: bool, what) -> None:
        """A prefetch (`ahead`) waits until the gate opens; a fetch of `what` needed now is noted."""
        if ahead:
            end = time.monotonic() + 60
            while not self.door.exists():
                if time.monotonic() > end:
                    raise TimeoutError("a download held at the gate for 60 s: a batch waited for it")
                time.sleep(0.01)
        else:
            self.fetched.append(what)

    def wrap(self, fetch):
        def held(store, k, ahead=False, job=None):
            self.hold(ahead, k)
            return fetch(store, k, ahead, job)
        return held


@pytest.fixture
def gate(tmp_path, monkeypatch) -> Gate:
    # this store's shards are small (120 KB): a GET a KiB of them waited for is "fewer requests
    # than the downloads"; what that rule decides is `test_a_step_reads_ranges_only_where_...`
    monkeypatch.setattr(document_ranges, "REQUEST_BYTES", 1024)
    held = Gate(tmp_path / "gate")
    monkeypatch.setattr(RemoteStore, "_fetch", held.wrap(RemoteStore._fetch))
    yield held
    held.open()  # (downloads still held in another thread go on, and end)


def config(store, s3, tmp_path, **options) -> DataConfig:
    src = dict(name="web", path="s3://ranges/store", storage_options=s3.options(via_proxy=True),
               object_cache=str(tmp_path / "objects"), **options)
    return DataConfig(sources=[src], seq_len=64, global_batch_size=8, seed=5, num_epochs=1)


def local_batches(store, tmp_path) -> list[np.ndarray]:
    cfg = DataConfig(sources=[dict(name="web", path=str(store))], seq_len=64, global_batch_size=8, seed=5,
                     num_epochs=1)
    return batches_of(cfg, tmp_path / "local")


def batches_of(cfg: DataConfig, cache_dir) -> list[np.ndarray]:
    """Every batch's inputs of the epoch of `cfg`, made one at a time."""
    p = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=cache_dir)
    return [p.batch(s)["inputs"].copy() for s in range(p.num_steps)]


def assert_first_batch_held(pipe: Pipeline, want: list, gate: Gate) -> None:
    """`pipe`'s first batch is `want`'s while every download ahead is held at `gate` (none was
    fetched whole for it); once it opens, so are the rest."""
    it = pipe.iterator()
    assert np.array_equal(next(it)["inputs"], want[0])
    assert gate.fetched == []
    gate.open()
    rest = [b["inputs"].copy() for b in it]
    assert len(rest) == len(want) - 1 and all(np.array_equal(a, b) for a, b in zip(rest, want[1:]))


def assert_workers_read_held(cfg: DataConfig, cache_dir, want: list, gate: Gate) -> None:
    """Two forked DataLoader workers' first batches of `cfg` come while every download is held
    at `gate` (a file: the workers' too) and are `want`'s; once it opens, so are the rest."""
    from torch.utils.data import DataLoader

    from forge_grain.bridges.torch import GrainIterableDataset

    ds = GrainIterableDataset(cfg, rank=0, world_size=1, cache_dir=cache_dir)
    batches = iter(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork", timeout=120))
    firsts = [next(batches) for _ in range(2)]  # each worker's first, its downloads held at the gate
    assert [int(b["step"]) for b in firsts] == [0, 1]
    assert all(np.array_equal(b["inputs"].numpy(), want[int(b["step"])]) for b in firsts)
    gate.open()
    rest = [(int(b["step"]), b["inputs"].numpy()) for b in batches]
    assert [s for s, _ in rest] == list(range(2, len(want)))
    assert all(np.array_equal(x, want[s]) for s, x in rest)


def test_the_first_batch_comes_while_its_shards_download_and_is_the_local_ones(store, s3, tmp_path, gate):
    want = local_batches(store, tmp_path)
    s3.proxy.clear()
    pipe = Pipeline(config(store, s3, tmp_path), 0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    it = pipe.iterator()
    first = next(it)["inputs"]
    assert np.array_equal(first, want[0])
    assert gate.fetched == []  # no shard was fetched whole for it: every download is held at the gate
    read = [p for p, n in s3.proxy.sent.items() if p.endswith(".bin") and n]
    assert read, "the batch's tokens came from the objects, in ranges"
    gate.open()
    rest = [b["inputs"].copy() for b in it]
    assert len(rest) == len(want) - 1
    assert all(np.array_equal(a, b) for a, b in zip(rest, want[1:]))
    sizes = {f"/ranges/store/{s.tokens}": s.num_tokens * pipe.datasets[0].store.dtype.itemsize
             for s in pipe.datasets[0].store.manifest.shards}
    fetched = sum(n for p, n in s3.proxy.sent.items() if p in sizes)
    assert fetched <= sum(sizes.values()) * (1 + document_ranges.SHARE) + 1  # the ranges are within the budget


def test_an_iterator_restored_at_an_odd_step_reads_that_step_in_ranges(store, s3, tmp_path, gate):
    want = local_batches(store, tmp_path)
    pipe = Pipeline(config(store, s3, tmp_path), 0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    at = len(want) // 2 + 1
    it = pipe.iterator(pipe.state_at(at))
    assert np.array_equal(next(it)["inputs"], want[at])
    assert gate.fetched == []
    gate.open()
    rest = [b["inputs"].copy() for b in it]
    assert len(rest) == len(want) - at - 1
    assert all(np.array_equal(a, b) for a, b in zip(rest, want[at + 1:]))


def test_forked_workers_read_their_first_batches_in_ranges_too(store, s3, tmp_path, gate):
    assert_workers_read_held(config(store, s3, tmp_path), tmp_path / "cache", local_batches(store, tmp_path), gate)


def test_a_range_read_from_a_replaced_object_is_an_error_once_the_download_lands(store, s3, tmp_path, gate):
    pipe = Pipeline(config(store, s3, tmp_path), 0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    fs = s3.fs()
    names = [f"ranges/store/{s.tokens}" for s in pipe.datasets[0].store.manifest.shards]
    kept = {n: fs.cat_file(n) for n in names}
    try:
        for n, data in kept.items():  # every shard replaced by other bytes of the same size
            fs.pipe(n, bytes(255 - b for b in data))
        it = pipe.iterator()
        next(it)  # read in ranges from the replaced objects
    finally:
        for n, data in kept.items():
            fs.pipe(n, data)
    gate.open()  # the downloads get the original objects, which match the manifest
    store, end = pipe.datasets[0].store, time.monotonic() + 60
    while not all(f.done() for f in store._pending.values()) and time.monotonic() < end:  # (compared as each lands)
        time.sleep(0.05)
    for _ in range(4):  # the next batch says so, and so does every try again
        with pytest.raises(StoreError, match=r"s3://ranges/store/.*changed after the pipeline opened it.*ranged GET"):
            next(it)
    it.close()  # (the downloads ahead that failed concern no step now: closing says nothing more)


def test_under_a_cache_limit_or_with_no_budget_left_the_first_step_waits_for_its_shards(store, s3, tmp_path, gate,
                                                                                     monkeypatch):
    size = sum(f.stat().st_size for f in store.glob("*.bin"))
    for options in (dict(cache_limit=4 * size), {}):
        if not options:
            monkeypatch.setattr(document_ranges, "SHARE", 0.0)
        gate.close()
        pipe = Pipeline(config(store, s3, tmp_path / str(len(options)), **options), 0, 1, num_threads=0,
                        cache_dir=tmp_path / "cache")
        s3.proxy.clear()
        box: dict = {}
        waiting = threading.Thread(target=lambda: box.setdefault("batch", next(pipe.iterator())), daemon=True)
        waiting.start()
        waiting.join(1.0)
        assert "batch" not in box and not any(p.endswith(".bin") for p in s3.proxy.gets), options
        gate.open()  # the downloads go on, and the batch comes once they land
        waiting.join(60)
        assert "batch" in box


def test_only_the_first_step_of_a_fresh_start_reads_ranges_and_only_where_they_cost_less_than_the_wait():
    """A global shuffle's first step (a document from each of 35 shards of 3 MiB) reads ranges;
    a window order's (30 documents of one shard) waits, as does any step but the first of a
    fresh window of hints, and any past the budget."""
    mib = 1 << 20
    spread = {k: [(k * 1000, k * 1000 + 4096)] for k in range(35)}
    one = {0: [(a * 90_000, a * 90_000 + 2048) for a in range(30)]}
    ranges = document_ranges.DocumentRanges(400 * mib, "s3://b/store")
    assert ranges.take(spread, 35 * 3 * mib, 0) is None  # no window has started
    ranges.first = 7
    assert ranges.take(one, 3 * mib, 7) is None  # 30 GETs where the download takes 3
    assert ranges.take(spread, 35 * 3 * mib, 8) is None  # not the window's first step
    assert ranges.take(spread, 35 * 3 * mib, None) is None  # no step being made (no hints)
    assert ranges.take(spread, 35 * 3 * mib, 7) == {k: [(a, b)] for k, [(a, b)] in spread.items()}
    assert ranges.left == 4 * mib - 35 * 4096
    assert ranges.take({0: [(0, 100), (2000, 2100)]}, 8 * mib, 7) == {0: [(0, 2100)]}  # joined within GAP
    assert ranges.take({0: [(0, 5 * mib)]}, 200 * mib, 7) is None  # past the budget


@pytest.fixture
def megatron(s3, tmp_path, monkeypatch):
    """A Megatron prefix on disk and at s3://ranges/meg, read in blocks of 256 KiB (64 MiB in
    use), of a file past what a first open holds whole (9 MB here, 64 MiB in use); every
    block's prefetch held at a gate (`Gate`)."""
    from test_formats import make_docs, write_megatron

    from forge_grain.stores import blocks, mirror_ranges

    monkeypatch.setattr(mirror_ranges, "KEEP", 9 << 20)
    monkeypatch.setattr(blocks, "BLOCK", 256 << 10)
    monkeypatch.setattr(document_ranges, "REQUEST_BYTES", 1024)  # (blocks of 256 KiB: see `gate`)
    held = Gate(tmp_path / "gate")
    monkeypatch.setattr(mirror_ranges._Block, "fetch", _held_block(held, mirror_ranges._Block.fetch))
    (tmp_path / "meg").mkdir()
    docs = [np.concatenate([d] * 12) for d in make_docs(2_400, seed=5)]
    prefix = write_megatron(tmp_path / "meg" / "web_text_document", docs)
    s3.fs().put(str(prefix.parent), "ranges/meg", recursive=True)
    yield prefix, held
    held.open()  # (downloads still held in another thread go on, and end)


def _held_block(gate: Gate, fetch):
    """`_Block.fetch`, its prefetches held at `gate` (as `Gate.wrap` holds a shard's)."""
    def held(block, keep=frozenset(), ahead=False, job=None):
        gate.hold(ahead, block.start)
        return fetch(block, keep, ahead, job)
    return held


def megatron_config(path, **options) -> DataConfig:
    return DataConfig(sources=[dict(name="web", path=str(path), **options)], seq_len=256, global_batch_size=8,
                      seed=5, num_epochs=1)


def test_the_first_batch_of_a_megatron_file_comes_while_its_blocks_download(s3, tmp_path, megatron):
    """A Megatron `.bin` in a bucket without a cache_limit is read in blocks of documents as
    the steps need them: the first batch of a global shuffle, a document or two of dozens of
    blocks, reads them in ranges while every block download is held, and equals the local
    file's; so do the rest, and the whole fetches each byte about once."""
    prefix, held = megatron
    size = prefix.with_suffix(".bin").stat().st_size
    want = batches_of(megatron_config(prefix.parent), tmp_path / "local")
    s3.proxy.clear()
    remote = megatron_config("s3://ranges/meg", storage_options=s3.options(via_proxy=True),
                             object_cache=str(tmp_path / "o"))
    pipe = Pipeline(remote, 0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    assert pipe.datasets[0].store.fetches and len(pipe.datasets[0].store._parts) >= 30
    assert_first_batch_held(pipe, want, held)
    fetched = sum(n for p, n in s3.proxy.sent.items() if p.endswith(".bin"))
    assert fetched <= size * (1.05 + document_ranges.SHARE), (fetched, size)


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_a_megatron_file_rewritten_after_the_open_is_refused_by_its_first_ranges(s3, tmp_path, megatron, client):
    """The ranges are read of the version the `.idx` was read beside (through obstore each GET
    carries its ETag; through s3fs a HEAD after them checks it): a `.bin` rewritten in place
    since the open is an error naming it, not other tokens. (Every block download is held:
    only the ranges read it.)"""
    options = s3.options() if client == "obstore" else {**s3.options(), "requester_pays": False}  # (not obstore's)
    pipe = Pipeline(megatron_config("s3://ranges/meg", storage_options=options, object_cache=str(tmp_path / "o")),
                    0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    assert (pipe.datasets[0].store.cache._fast is not None) == (client == "obstore")
    fs, name = s3.fs(), "ranges/meg/web_text_document.bin"
    kept = fs.cat_file(name)
    try:
        fs.pipe(name, bytes(255 - b for b in kept))  # rewritten in place, the same size
        with pytest.raises(StoreError, match=r"s3://ranges/meg/web_text_document\.bin: the data at this URL changed "
                                             "after the pipeline opened it"):
            next(pipe.iterator())
    finally:
        fs.pipe(name, kept)


def test_forked_workers_read_their_first_megatron_batches_in_ranges_too(s3, tmp_path, megatron):
    """Under DataLoader workers (forked), each worker's first batch of a Megatron `.bin` without
    a cache_limit comes while every block download is held (the gate is a file: the workers'
    too), equal to the local one; so do the rest."""
    prefix, held = megatron
    want = batches_of(megatron_config(prefix.parent), tmp_path / "local")
    remote = megatron_config("s3://ranges/meg", storage_options=s3.options(), object_cache=str(tmp_path / "o"))
    assert_workers_read_held(remote, tmp_path / "cache", want, held)


@pytest.fixture
def litdata(s3, tmp_path, monkeypatch):
    """The LitData dataset of the tests' data (written by `litdata.optimize`, 6 chunks) at
    s3://ranges/litdata, every chunk's prefetch held at a gate (`Gate`). Its chunks are small
    (31 KB): a step's ranges are within the budget only at a tenth of the dataset (a hundredth
    in use) and a GET a KiB (see `gate`)."""
    from test_formats import LITDATA

    from forge_grain.stores import mirror_parts

    monkeypatch.setattr(document_ranges, "SHARE", 0.1)
    monkeypatch.setattr(document_ranges, "REQUEST_BYTES", 1024)
    held = Gate(tmp_path / "gate")
    fetch = mirror_parts._Part.fetch

    def held_fetch(part, keep=frozenset(), ahead=False, job=None):
        held.hold(ahead, part.name)
        return fetch(part, keep, ahead, job)

    monkeypatch.setattr(mirror_parts._Part, "fetch", held_fetch)
    s3.fs().put(str(LITDATA / "dataset"), "ranges/litdata", recursive=True)
    yield LITDATA / "dataset", held
    held.open()


def litdata_config(path, **options) -> DataConfig:
    return DataConfig(sources=[dict(name="web", path=str(path), **options)], seq_len=64, global_batch_size=8,
                      seed=5, num_epochs=1)


def test_a_litdata_dataset_without_cache_limit_gives_its_first_batch_while_its_chunks_download(s3, tmp_path,
                                                                                            litdata):
    """A LitData dataset in a bucket without a cache_limit is not copied whole at the open: the
    open reads its index and each chunk's head, and the first batch of a global shuffle reads
    its documents in ranges while every chunk download is held, equal to the local dataset's;
    so do the rest, and each chunk is fetched once (beside the ranges' budget)."""
    path, held = litdata
    chunks = {f"/ranges/litdata/{c.name}": c.stat().st_size for c in path.glob("*.bin")}
    want = batches_of(litdata_config(path), tmp_path / "local")
    s3.proxy.clear()
    remote = litdata_config("s3://ranges/litdata", storage_options=s3.options(via_proxy=True),
                            object_cache=str(tmp_path / "o"))
    pipe = Pipeline(remote, 0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    opened = sum(s3.proxy.sent.get(p, 0) for p in chunks)
    assert 0 < opened < sum(chunks.values()) / 10  # the heads (item tables) only
    assert_first_batch_held(pipe, want, held)
    assert sum(s3.proxy.sent.get(p, 0) for p in chunks) <= opened + sum(chunks.values()) * (1.05 + document_ranges.SHARE)


@pytest.mark.parametrize("client", ["obstore", "s3fs"])
def test_a_litdata_chunk_rewritten_after_the_open_is_refused_by_its_first_ranges(s3, tmp_path, litdata, client):
    """The first batch's ranges are read of the chunks' versions the open read the heads of
    (obstore: each GET carries the ETag; s3fs: a HEAD after them): every chunk rewritten in
    place since is an error naming one, not other tokens. (Every chunk download is held.)"""
    path, _ = litdata
    options = s3.options() if client == "obstore" else {**s3.options(), "requester_pays": False}  # (not obstore's)
    pipe = Pipeline(litdata_config("s3://ranges/litdata", storage_options=options, object_cache=str(tmp_path / "o")),
                    0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    assert (pipe.datasets[0].store.cache._fast is not None) == (client == "obstore")
    fs, kept = s3.fs(), {c.name: c.read_bytes() for c in path.glob("*.bin")}
    try:
        for name, data in kept.items():  # (the same heads, other tokens: the same size)
            fs.pipe(f"ranges/litdata/{name}", data[:64] + bytes(255 - b for b in data[64:]))
        with pytest.raises(StoreError, match=r"s3://ranges/litdata/chunk-0-\d\.bin: the data at this URL changed "
                                             "after the pipeline opened it"):
            next(pipe.iterator())
    finally:
        for name, data in kept.items():
            fs.pipe(f"ranges/litdata/{name}", data)


def test_forked_workers_read_their_first_litdata_batches_in_ranges_too(s3, tmp_path, litdata):
    """Under DataLoader workers (forked), each worker's first batch of a LitData dataset without
    a cache_limit comes while every chunk download is held, equal to the local one; so do the rest."""
    path, held = litdata
    want = batches_of(litdata_config(path), tmp_path / "local")
    remote = litdata_config("s3://ranges/litdata", storage_options=s3.options(), object_cache=str(tmp_path / "o"))
    assert_workers_read_held(remote, tmp_path / "cache", want, held)
