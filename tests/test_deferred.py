"""Deferred opening: a rebuilt pipeline takes its sources' facts from the record of the last
build and opens each source when a batch first reads it; a store changed behind the record's
back is an error at that read, never other data."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from multiproc import wait_forked

from forge_grain import DataConfig, Pipeline, StoreError
from forge_grain.pipeline.pipeline import StateError
from forge_grain.stores.writer import write_store


def small_stores(root, n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    sources = []
    for i in range(n):
        docs = [np.concatenate([[0], rng.integers(2, 1000, int(rng.integers(5, 50)))]) for _ in range(12)]
        path = write_store(root / f"s{i:02d}", docs, vocab_size=1000, bos_id=0, eos_id=1)
        sources.append(dict(name=f"s{i:02d}", path=str(path), weight=1 + i % 3))
    return sources


def config(sources, **kw) -> DataConfig:
    return DataConfig.from_dict(dict(sources=sources, **kw))


def batches(pipe: Pipeline, start: int, stop: int) -> list[dict]:
    return [pipe.batch(s) for s in range(start, stop)]


def same(a: list[dict], b: list[dict]) -> bool:
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_a_rebuilt_pipeline_defers_its_sources_and_gives_the_same_batches_and_state(tmp_path):
    cfg = config(small_stores(tmp_path, 20), seq_len=32, global_batch_size=16, seed=3)
    first = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    assert not any(o.record for o in first._sources)  # nothing recorded yet: opened in full
    want = batches(first, 0, 6)
    again = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    assert all(o.record for o in again._sources)  # built from the record (the opener may have opened some since)
    assert again.fingerprint == first.fingerprint and again.rows_per_epoch == first.rows_per_epoch
    assert again.consumed(5) == first.consumed(5)
    got = [next(again.iterator(first.state_at(3))) for _ in range(1)] + batches(again, 4, 6)
    assert same(got, want[3:])
    # on two shards, each rebuilt from the record, the halves make the same global batches
    halves = [Pipeline(cfg, k, 2, cache_dir=tmp_path / "cache", num_threads=0) for k in range(2)]
    for step in range(6):
        joined = {k: np.concatenate([h.batch(step)[k] for h in halves]) for k in want[step] if k != "step"}
        assert all(np.array_equal(joined[k], want[step][k]) for k in joined)


def test_a_store_rewritten_in_place_with_its_times_restored_is_opened_in_full(tmp_path):
    cfg = config(small_stores(tmp_path, 3), seq_len=32, global_batch_size=16, seed=3)
    first = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    # other document boundaries written into the index in place, its size and times kept:
    # the kernel's change time still moves, so the build opens the source
    index = tmp_path / "s01" / "shard-00000.idx.npy"
    st = os.stat(index)
    offsets = np.load(index)
    moved = offsets.copy()
    moved[1:-1] = np.maximum(moved[:-2] + 1, moved[1:-1] - 1)  # each inner boundary a token earlier
    assert not np.array_equal(moved, offsets)
    with open(index, "r+b") as f:
        f.seek(os.path.getsize(index) - moved.nbytes)
        f.write(moved.tobytes())
    os.utime(index, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    assert [o.record is None for o in again._sources] == [False, True, False]
    assert again.fingerprint != first.fingerprint
    with pytest.raises(StateError, match="other data"):
        again.iterator(first.state_at(1))


def test_a_record_that_disagrees_with_the_store_fails_at_the_first_read_and_is_dropped(tmp_path):
    cfg = config(small_stores(tmp_path, 3), seq_len=32, global_batch_size=16, seed=3)
    first = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    (record_file,) = (tmp_path / "cache").glob("sources-*.json")
    data = json.loads(record_file.read_text())
    key = next(k for k in data["records"] if "s01" in k)
    data["records"][key]["facts"]["plan_sha256"] = "0" * 64  # a record of other data
    record_file.write_text(json.dumps(data))
    stale = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    assert stale.fingerprint != first.fingerprint  # built from the record's facts
    with pytest.raises(StoreError, match=r"source 's01' .*changed after this pipeline was built.*plan_sha256"):
        for step in range(stale.num_steps):
            stale.batch(step)
    assert not record_file.exists()
    rebuilt = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)  # opens every source again
    assert not any(o.record for o in rebuilt._sources) and rebuilt.fingerprint == first.fingerprint
    want = first.batch(1)
    assert all(np.array_equal(rebuilt.batch(1)[k], want[k]) for k in want)


def test_a_store_rewritten_by_its_writer_is_opened_in_full_at_build(tmp_path):
    sources = small_stores(tmp_path, 2)
    cfg = config(sources, seq_len=32, global_batch_size=8, seed=1)
    first = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    small_stores(tmp_path, 2, seed=9)  # the same paths, other documents
    again = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    assert not any(o.record for o in again._sources)
    assert again.fingerprint != first.fingerprint
    third = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)  # recorded again
    assert all(o.record for o in third._sources) and third.fingerprint == again.fingerprint


def test_a_truncated_record_file_is_ignored_and_every_source_opened(tmp_path, caplog):
    cfg = config(small_stores(tmp_path, 3), seq_len=32, global_batch_size=16, seed=3)
    first = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    (record_file,) = (tmp_path / "cache").glob("sources-*.json")
    text = record_file.read_text()
    record_file.write_text(text[: len(text) // 2])  # cut short: not JSON
    with caplog.at_level("WARNING"):
        again = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    assert "ignoring the unreadable source record" in caplog.text and str(record_file) in caplog.text
    assert not any(o.record for o in again._sources) and again.fingerprint == first.fingerprint
    assert json.loads(record_file.read_text())["version"] == 1  # written again, whole


@pytest.mark.parametrize("damage", [
    lambda d: next(iter(d["records"].values()))["facts"].__setitem__("num_rows", "x"),
    lambda d: d.__setitem__("records", []),
    lambda d: next(iter(d["records"].values()))["facts"].__setitem__("vocab_size", "big"),
    lambda d: next(iter(d["records"].values())).__setitem__("files", 3),
], ids=["num_rows a string", "records a list", "vocab_size a string", "files an int"])
def test_a_record_of_the_wrong_types_is_ignored_and_rewritten(tmp_path, caplog, damage):
    """A record that does not validate is ignored with a warning and rewritten: it must not
    fail this build (with a raw TypeError) nor every later one."""
    cfg = config(small_stores(tmp_path, 3), seq_len=32, global_batch_size=16, seed=3)
    first = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    (record_file,) = (tmp_path / "cache").glob("sources-*.json")
    data = json.loads(record_file.read_text())
    damage(data)
    record_file.write_text(json.dumps(data))
    with caplog.at_level("WARNING"):
        again = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    assert "ignoring the unreadable source record" in caplog.text
    assert same(batches(again, 0, again.num_steps), batches(first, 0, first.num_steps))
    third = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)  # the rewritten record defers again
    assert all(o.record for o in third._sources) and same(batches(third, 0, 2), batches(first, 0, 2))


def test_sources_are_opened_ahead_of_the_steps_that_read_them_without_a_batch_made(tmp_path):
    """Deferral costs the batches nothing when the caller leaves time (a model's setup, training steps)."""
    import time

    cfg = config(small_stores(tmp_path, 30), seq_len=32, global_batch_size=16, seed=3)
    first = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    want = batches(first, 0, 8)
    again = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    read = np.unique(np.concatenate([again.mixture.locate(again.shard_rows(s))[0] for s in range(8)]))
    deadline = time.monotonic() + 60
    while not all(again.datasets[i].is_open for i in read) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(again.datasets[i].is_open for i in read)  # no batch asked for them
    assert same(batches(again, 0, 8), want)


def test_a_process_forked_while_sources_open_in_the_background_makes_its_batches(tmp_path):
    """DataLoader workers are forked from a pipeline whose opener may be mid-open: a fork must
    not leave the child waiting on a lock held by a thread it does not have."""
    import time

    cfg = config(small_stores(tmp_path, 60), seq_len=32, global_batch_size=16, seed=3)
    first = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)
    want = [first.batch(s)["inputs"] for s in range(6)]
    for trial in range(5):
        again = Pipeline(cfg, 0, 1, cache_dir=tmp_path / "cache", num_threads=0)  # its opener starts now
        time.sleep(0.002 * trial)
        pid = os.fork()
        if pid == 0:
            ok = all(np.array_equal(again.batch(s)["inputs"], want[s]) for s in range(6))
            os._exit(0 if ok else 3)
        code = wait_forked(pid)
        if code is None:
            pytest.fail(f"the forked process hung (trial {trial})")
        assert code == 0


def test_a_source_slow_to_open_in_one_thread_holds_up_no_other_sources_first_batch(tmp_path):
    """Batch threads (or a trainer's own) make batches of different sources at once: one whose
    store is still opening (from object storage: seconds) must not hold up the first batch
    of another. Python 3.11's `functools.cached_property` held one lock per class while the
    first computed its value, so the other waited for the whole open."""
    import threading

    sources = small_stores(tmp_path, 2)
    slow, ready = (Pipeline(config([s], seq_len=32, global_batch_size=2), 0, 1).mixture.datasets[0] for s in sources)
    entered, release = threading.Event(), threading.Event()

    class SlowToOpen:  # the store as it answers while its open waits on the network
        def __init__(self, store):
            self._store = store

        def __getattr__(self, name):
            return getattr(self._store, name)

        @property
        def pieces(self):
            entered.set()
            release.wait(60)
            return self._store.pieces

    slow._store = SlowToOpen(slow._store)
    opening = threading.Thread(target=slow.get_batch, args=([0, 1],), daemon=True)
    opening.start()
    assert entered.wait(30)
    other = threading.Thread(target=ready.get_batch, args=([0, 1],), daemon=True)
    other.start()
    other.join(10)
    held_up = other.is_alive()
    release.set()
    opening.join(30)
    other.join(30)
    assert not held_up, "the other source's first batch waited for this one's open"
    assert not opening.is_alive() and not other.is_alive()
