"""Scale: many shard files and many sources under a cluster's descriptor limit.

Each case runs in a fresh process whose `ulimit -n` is 256 (clusters commonly give 1024),
reads batches, restores a saved state in a new pipeline, and must get the same batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import config
from forge_grain import plan_offsets, prepare
from forge_grain.packing import chunked
from forge_grain.packing.chunked import plan_chunked
from forge_grain.packing.plans import PLAN_ARRAYS, PackingPlan
from forge_grain.stores.writer import write_store

LIMIT = 256

# Reads 6 batches, then resumes from the state after 3 in a new pipeline; prints open descriptors.
RESUME = textwrap.dedent("""\
    import json, os, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
    import numpy as np
    from forge_grain import DataConfig, Pipeline
    config = DataConfig.from_dict(json.loads(open(sys.argv[1]).read()))
    pipe = Pipeline(config, 0, 1, cache_dir=sys.argv[2])
    it = pipe.iterator()
    batches = [next(it) for _ in range(6)]
    state = pipe.state_at(3)
    again = Pipeline(config, 0, 1, cache_dir=sys.argv[2]).iterator(state)
    for want in batches[3:]:
        got = next(again)
        assert all(np.array_equal(got[k], want[k]) for k in want), "resumed batches differ"
    print("fds", len(os.listdir("/proc/self/fd")), "tokens", int(sum(b["loss_mask"].sum() for b in batches)))
""").format(limit=LIMIT)


def run_limited(config: dict, work, max_open: int | None = None) -> tuple[int, int]:
    (work / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "FORGE_GRAIN_MAX_OPEN_FILES": str(max_open)} if max_open else None
    r = subprocess.run([sys.executable, "-c", RESUME, str(work / "config.json"), str(work / "cache")],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    _, fds, _, tokens = r.stdout.split()
    return int(fds), int(tokens)


def docs_jsonl_of(path, docs) -> Path:
    with open(path, "w") as f:
        f.writelines(json.dumps({"ids": d.tolist()}) + "\n" for d in docs)
    return path


def docs_jsonl(path, n_docs: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n_docs):
            f.write(json.dumps({"ids": [0, *rng.integers(2, 1000, int(rng.integers(5, 60))).tolist()]}) + "\n")
    return path


@pytest.mark.parametrize("layout", ["bin", "arrayrecord"])
def test_a_store_of_2000_shard_files_iterates_and_resumes_under_ulimit_256(tmp_path, layout):
    out = prepare(docs_jsonl(tmp_path / "docs.jsonl", 6000), tmp_path / "store", token_field="ids", vocab_size=1000,
                  bos_id=0, layout=layout, num_shards=2000, progress=False)
    assert len(list(out.glob("shard-*.idx.npy"))) == 2000
    config = dict(sources=[dict(name="s", path=str(out), strategy="bestfit")], seq_len=32, global_batch_size=64, seed=3)
    fds, tokens = run_limited(config, tmp_path, max_open=40)
    assert fds < 40 + 24 and tokens > 0  # ArrayRecord readers within the pool's cap, plus the process's own


def test_a_directory_of_1200_token_files_opens_under_ulimit_256(tmp_path):
    """KempnerForge's layout: one `tokenized_*.npy` per input file, read in place."""
    rng = np.random.default_rng(1)
    for i in range(1200):
        np.save(tmp_path / f"tokenized_{i:05d}.npy", np.concatenate([rng.integers(2, 1000, 40), [1]]).astype(np.uint16))
    config = dict(sources=[dict(name="kf", path=str(tmp_path), eos_id=1, strategy="concat")], seq_len=32,
                  global_batch_size=16, seed=0)
    fds, _ = run_limited(config, tmp_path)
    assert fds < 64


def test_a_pipeline_of_1000_sources_iterates_and_resumes_under_ulimit_256(tmp_path):
    rng = np.random.default_rng(2)
    sources = []
    for i in range(1000):
        docs = [np.concatenate([[0], rng.integers(2, 1000, int(rng.integers(5, 50)))]) for _ in range(8)]
        path = write_store(tmp_path / f"s{i:04d}", docs, vocab_size=1000, bos_id=0, eos_id=1)
        sources.append(dict(name=f"s{i:04d}", path=str(path), weight=1 + i % 3, strategy="bestfit"))
    config = dict(sources=sources, seq_len=32, global_batch_size=64, seed=5)
    fds, tokens = run_limited(config, tmp_path)
    assert fds < 64 and tokens > 0


@pytest.fixture(scope="module")
def s3():
    """moto's S3 on 127.0.0.1, bucket "scale" (each test writes under a prefix of its own)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from s3server import S3Server

    with S3Server("scale") as server:
        yield server


@pytest.mark.parametrize("kind, limit", [("store", None), pytest.param("store", "tight", marks=pytest.mark.slow),
                                         pytest.param("mds", None, marks=pytest.mark.slow),
                                         pytest.param("mds", "tight", marks=pytest.mark.slow)])
def test_a_mixture_of_datasets_of_1000_files_in_object_storage_resumes_under_ulimit_256(tmp_path, s3, kind, limit):
    """Object storage holds descriptors for every object downloading (its temporary file and
    its lock) and every request (a connection): four sources of 250 files each, read whole or
    under a cache_limit that holds some dozens of them (evicting as it goes), need no more than
    a cluster gives, however many sources download at once (each has threads for 64)."""
    from mds_writer import write_mds

    rng = np.random.default_rng(4)
    docs = [np.concatenate([[0], rng.integers(2, 1000, int(rng.integers(400, 1600)))]) for _ in range(750)]
    if kind == "store":
        local = prepare(docs_jsonl_of(tmp_path / "docs.jsonl", docs), tmp_path / "local", token_field="ids",
                        vocab_size=1000, bos_id=0, num_shards=250, progress=False)
        extra, room = {}, 400_000  # its manifest (about 80 KB) and some 50 shards of 6 KB
    else:
        local = write_mds(tmp_path / "local", {"tokens": "ndarray:int32"},
                          [{"tokens": d.astype(np.int32)} for d in docs], samples_per_shard=3)
        extra, room = {"token_field": "tokens"}, 1_500_000  # its index, a record a file (2.3 KB), 70 files of 12 KB
    data = sum(f.stat().st_size for f in Path(local).rglob("*") if f.is_file())
    assert limit is None or data > room  # (a limit that evicts)
    sources = []
    for i in range(4):
        s3.fs().put(str(local), f"scale/{tmp_path.name}/d{i}", recursive=True)
        sources.append(dict(name=f"d{i}", path=f"s3://scale/{tmp_path.name}/d{i}", storage_options=s3.options(),
                            strategy="bestfit", object_cache=str(tmp_path / "objects"), **extra,
                            **({"cache_limit": room} if limit else {})))
    fds, tokens = run_limited(dict(sources=sources, seq_len=64, global_batch_size=64, seed=1), tmp_path)
    assert fds < 64 and tokens > 0


def test_the_ranges_a_first_batch_reads_at_once_stay_within_ulimit_256(tmp_path, s3):
    """A large batch's first step, read in ranges while its shards download, reads 1000s of
    spans: made at once on a thread and a connection each, 600 of them ran out of descriptors."""
    payload = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    child = textwrap.dedent(f"""\
        import json, resource, sys
        resource.setrlimit(resource.RLIMIT_NOFILE, ({LIMIT}, {LIMIT}))
        from forge_grain.stores.object_cache import ObjectCache, read_at_once
        cache = ObjectCache("s3://scale/spans", json.loads(sys.argv[1]), sys.argv[2])
        spans = [("blob", a, a + 100) for a in range(0, 600 * 1500, 1500)]
        got = read_at_once(cache, spans)
        sys.stdout.buffer.write(b"".join(bytes(g) for g in got))
    """)
    s3.fs().pipe("scale/spans/blob", payload)
    r = subprocess.run([sys.executable, "-c", child, json.dumps(s3.options()), str(tmp_path / "objects")],
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert r.stdout == b"".join(payload[a:a + 100] for a in range(0, 600 * 1500, 1500))


# -- chunked planning -------------------------------------------------------------------------

def lognormal_offsets(n: int, seed: int = 0) -> np.ndarray:
    lengths = np.clip(np.random.default_rng(seed).lognormal(np.log(600), 1.0, n), 1, 100_000).astype(np.int64)
    return np.concatenate([[0], np.cumsum(lengths)])


def plan_arrays(p) -> list[np.ndarray]:
    return [np.asarray(getattr(p, name)) for name in PLAN_ARRAYS]



def test_a_small_store_is_planned_in_process_and_a_large_one_in_workers(tmp_path, monkeypatch):
    """The default worker count (the README: one per core past 2 M documents, in the process
    itself below that, where a worker's start costs more than the plan), with the same plan."""
    offsets = lognormal_offsets(8_000)
    started = []
    real = chunked._run_workers
    monkeypatch.setattr(chunked, "_run_workers", lambda *a: (started.append(a[2]), real(*a))[1])
    small = plan_chunked(offsets, 1024, "bestfit", tmp_path / "a", chunk_docs=2000, progress=False)
    assert started == [] and small.stats["chunks"] == 4
    monkeypatch.setattr(chunked, "IN_PROCESS_DOCS", 5_000)  # the same store counted as large
    large = plan_chunked(offsets, 1024, "bestfit", tmp_path / "b", chunk_docs=2000, progress=False)
    cores = min(os.cpu_count() or 1, 4)  # one worker per core, at most one per chunk (one core: in process)
    assert started == ([cores] if cores > 1 else [])
    assert all(np.array_equal(a, b) for a, b in zip(plan_arrays(small), plan_arrays(large)))

@pytest.mark.parametrize("strategy", ["bestfit", "bos_bestfit", "concat"])
def test_a_store_planned_in_process_is_joined_in_memory_as_the_chunks_on_disk_are(tmp_path, monkeypatch, strategy):
    """The default in-process planning (a store under a cache_limit: chunks fitted to the cache,
    an empty one among them) saves the store's plan once, no chunk's, and gives the plan, the
    checksum and the stats of the chunks planned and joined on disk."""
    offsets = lognormal_offsets(8_000, seed=5)
    bounds = np.array([0, 700, 2_500, 2_500, 6_100, 8_000])
    saved = []
    real_save = PackingPlan.save
    monkeypatch.setattr(PackingPlan, "save", lambda self, d: (saved.append(Path(d).name), real_save(self, d))[1])
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "plan.json").write_text("{}")  # a damaged plan left there: replaced
    memory = plan_chunked(offsets, 512, strategy, tmp_path / "mem", seed=3, bounds=bounds, max_segments=6,
                          progress=False)
    assert saved == ["mem"]
    disk = plan_chunked(offsets, 512, strategy, tmp_path / "disk", seed=3, bounds=bounds, max_segments=6, workers=1,
                        progress=False)
    assert len(saved) == 1 + 5  # (the chunks, on disk)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(plan_arrays(memory), plan_arrays(disk)))
    assert PackingPlan.load(tmp_path / "mem").checksum() == PackingPlan.load(tmp_path / "disk").checksum()
    same = lambda stats: {k: v for k, v in stats.items() if k != "planning_seconds"}  # noqa: E731
    assert same(memory.stats) == same(disk.stats) and memory.stats["chunk_rows"][2] == 0
    assert not (tmp_path / "mem.chunks").exists()


@pytest.mark.parametrize("strategy", ["bestfit", "bos_bestfit", "concat"])
def test_chunked_plans_match_the_whole_corpus_quality_whatever_the_workers(tmp_path, strategy):
    offsets = lognormal_offsets(20_000)
    whole = plan_offsets(offsets, 2048, strategy, seed=4)
    one = plan_chunked(offsets, 2048, strategy, tmp_path / "w1", seed=4, chunk_docs=5000, workers=1, progress=False)
    two = plan_chunked(offsets, 2048, strategy, tmp_path / "w2", seed=4, chunk_docs=5000, workers=2, progress=False)
    assert one.stats["chunks"] == 4 and all(np.array_equal(a, b) for a, b in zip(plan_arrays(one), plan_arrays(two)))
    assert PackingPlan.load(tmp_path / "w1").checksum() == one.checksum()  # the checksum hashed while writing holds
    assert abs(one.stats["fill"] - whole.stats["fill"]) < 0.001
    assert abs(one.stats["cropped_share"] - whole.stats["cropped_share"]) < 0.001
    # rows of a chunk hold only that chunk's tokens, and the stats add up over the rows
    bounds = offsets[chunked.chunk_bounds(20_000, 5000)]
    seg_chunk = np.searchsorted(bounds, one.seg_start, side="right") - 1
    row_of_seg = np.repeat(np.arange(one.num_rows), np.diff(one.row_ptr))
    first = seg_chunk[one.row_ptr[:-1][np.diff(one.row_ptr) > 0]]
    assert np.array_equal(seg_chunk, first[row_of_seg])
    assert one.stats["rows"] == one.num_rows and one.stats["segments"] == len(one.seg_start)


def test_a_killed_chunked_planning_run_completes_on_a_rerun_reusing_finished_chunks(tmp_path):
    offsets = lognormal_offsets(2_000_000, seed=1)
    np.save(tmp_path / "offsets.npy", offsets)
    code = ("import sys, numpy as np; from pathlib import Path; from forge_grain.packing.chunked import plan_chunked; "
            "plan_chunked(np.load(sys.argv[1]), 512, 'bestfit', Path(sys.argv[2]), chunk_docs=100_000, workers=1, "
            "progress=False)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "offsets.npy"), str(tmp_path / "plan")])
    parts = tmp_path / "plan.chunks"
    deadline = time.monotonic() + 120
    while len(list(parts.glob("chunk-*/plan.json"))) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    finished = {d.name: d.stat().st_mtime_ns for d in parts.glob("chunk-*") if (d / "plan.json").exists()}
    assert 3 <= len(finished) < 20 and not (tmp_path / "plan").exists()  # killed part-way: no plan yet
    reused = []
    real_plan_chunk = chunked._plan_chunk
    chunked._plan_chunk = lambda offs, k, d, **kw: (reused.append(d.name), real_plan_chunk(offs, k, d, **kw))
    try:
        resumed = plan_chunked(offsets, 512, "bestfit", tmp_path / "plan", chunk_docs=100_000, workers=1,
                               progress=False)
    finally:
        chunked._plan_chunk = real_plan_chunk
    assert not set(reused) & set(finished) and len(reused) == 20 - len(finished)
    fresh = plan_chunked(offsets, 512, "bestfit", tmp_path / "fresh", chunk_docs=100_000, workers=1, progress=False)
    assert all(np.array_equal(a, b) for a, b in zip(plan_arrays(resumed), plan_arrays(fresh)))
    assert not parts.exists()  # the chunks are removed once the store's plan is saved


def test_chunks_left_by_a_run_with_other_parameters_are_not_reused(tmp_path, monkeypatch):
    offsets = lognormal_offsets(20_000, seed=2)
    monkeypatch.setattr(chunked, "_join", lambda *a: (_ for _ in ()).throw(RuntimeError("killed")))
    with pytest.raises(RuntimeError):  # a run dies with its chunks saved, its plan not joined
        plan_chunked(offsets, 2048, "bestfit", tmp_path / "p", chunk_docs=5000, workers=1, progress=False)
    monkeypatch.undo()
    other = plan_chunked(offsets, 1024, "bestfit", tmp_path / "p", chunk_docs=5000, workers=1, progress=False)
    fresh = plan_chunked(offsets, 1024, "bestfit", tmp_path / "q", chunk_docs=5000, workers=1, progress=False)
    assert all(np.array_equal(a, b) for a, b in zip(plan_arrays(other), plan_arrays(fresh)))


def test_a_pipeline_planned_in_chunks_resumes_exactly_and_refuses_another_chunking(tmp_path, stores):
    from forge_grain import Pipeline, StateError

    cfg = config(stores, plan_chunk_docs=100)
    pipe = Pipeline(cfg, 0, 1, cache_dir=tmp_path, plan_workers=2)
    it = pipe.iterator()
    batches = [next(it) for _ in range(5)]
    again = Pipeline(cfg, 0, 1, cache_dir=tmp_path).iterator(pipe.state_at(2))
    for want in batches[2:]:
        got = next(again)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    assert [d.plan.stats["chunks"] for d in pipe.datasets] == [4, 3, 2]
    with pytest.raises(StateError):
        Pipeline(config(stores, plan_chunk_docs=200), 0, 1, cache_dir=tmp_path).iterator(pipe.state_at(2))


def test_the_locality_order_is_a_permutation_per_epoch_reading_few_chunks_at_a_time(tmp_path, stores):
    from forge_grain import pack

    ds = pack(stores["web"], 64, "bestfit", cache_dir=tmp_path, chunk_docs=50, shuffle_window=2, num_epochs=3)
    n, chunk_rows = ds.num_rows, np.asarray(ds.plan.stats["chunk_rows"])
    assert len(chunk_rows) == 8 and chunk_rows.sum() == n
    chunk_of_row = np.repeat(np.arange(len(chunk_rows)), chunk_rows)
    epochs = [ds.rows_of(np.arange(e * n, (e + 1) * n)) for e in range(3)]
    for rows in epochs:
        assert np.array_equal(np.sort(rows), np.arange(n))  # every row once per epoch
        chunks = chunk_of_row[rows]
        seen, windows = set(), []
        for c in chunks:  # the epoch reads its chunks two at a time: a chunk once done is not met again
            if c not in seen:
                seen.add(c)
                windows.append(c)
        first_pos = {c: int(np.flatnonzero(chunks == c)[0]) for c in windows}
        last_pos = {c: int(np.flatnonzero(chunks == c)[-1]) for c in windows}
        for k in range(0, len(windows), 2):  # window k // 2 ends before window k // 2 + 1 starts
            pair, later = windows[k : k + 2], windows[k + 2 :]
            assert all(last_pos[c] < first_pos[d] for c in pair for d in later)
        assert len(windows) == len(chunk_rows)
    assert not np.array_equal(epochs[0], epochs[1])
    same = pack(stores["web"], 64, "bestfit", cache_dir=tmp_path, chunk_docs=50, shuffle_window=2, num_epochs=3)
    assert np.array_equal(same.rows_of(np.arange(3 * n)), np.concatenate(epochs))  # a pure function of the index
    parts = np.concatenate([ds.rows_of(np.arange(k, 3 * n, 7)) for k in range(7)])  # any order of asking
    assert np.array_equal(np.sort(parts), np.sort(np.concatenate(epochs)))
    # asked a batch at a time, as a trainer asks (most batches lie in one window: found without grouping)
    batches = np.concatenate([ds.rows_of(np.arange(a, min(a + 5, 3 * n))) for a in range(0, 3 * n, 5)])
    assert np.array_equal(batches, np.concatenate(epochs))


def disk_bytes(root: Path) -> int:
    total = 0
    for directory, _, files in os.walk(root):  # (a directory removed while walking is skipped: rglob raised)
        for name in files:
            try:
                total += os.stat(os.path.join(directory, name)).st_size
            except FileNotFoundError:
                pass  # removed while walking
    return total


def test_chunked_planning_peaks_near_the_final_plan_on_disk(tmp_path):
    """No copy of the offsets, and the chunks removed as they are joined: planning a corpus does
    not need twice its plan's size free on disk."""
    import threading

    offsets = lognormal_offsets(400_000, seed=3)
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], disk_bytes(tmp_path / "out"))
            time.sleep(0.002)

    (tmp_path / "out").mkdir()
    sampler = threading.Thread(target=sample)
    sampler.start()
    real_parts = chunked._parts

    def parts(files, name, dtype):  # measured at every step of the join, not only when sampled
        for part in real_parts(files, name, dtype):
            yield part
            peak[0] = max(peak[0], disk_bytes(tmp_path / "out"))

    chunked._parts = parts
    try:
        p = plan_chunked(offsets, 512, "bestfit", tmp_path / "out" / "plan", chunk_docs=50_000, workers=2,
                         progress=False)
    finally:
        chunked._parts = real_parts
        done.set()
        sampler.join()
    final = disk_bytes(tmp_path / "out")
    assert p.stats["chunks"] == 8 and final > 1_000_000
    assert peak[0] <= 1.2 * final, (peak[0], final)


def test_a_chunked_plan_whose_join_was_cut_short_completes_on_a_rerun(tmp_path, monkeypatch):
    offsets = lognormal_offsets(40_000, seed=4)
    real_parts = chunked._parts

    def dies(files, name, dtype):
        for i, part in enumerate(real_parts(files, name, dtype)):
            if name == "seg_start" and i == 2:
                raise OSError("disk full")
            yield part

    monkeypatch.setattr(chunked, "_parts", dies)
    with pytest.raises(OSError, match="disk full"):
        plan_chunked(offsets, 1024, "bestfit", tmp_path / "p", chunk_docs=5000, workers=1, progress=False)
    assert not (tmp_path / "p").exists()
    monkeypatch.undo()
    again = plan_chunked(offsets, 1024, "bestfit", tmp_path / "p", chunk_docs=5000, workers=2, progress=False)
    fresh = plan_chunked(offsets, 1024, "bestfit", tmp_path / "q", chunk_docs=5000, workers=1, progress=False)
    assert all(np.array_equal(a, b) for a, b in zip(plan_arrays(again), plan_arrays(fresh)))
    assert PackingPlan.load(tmp_path / "p").checksum() == fresh.checksum()
