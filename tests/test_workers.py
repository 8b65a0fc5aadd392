"""Every store, every worker: the torch bridge under DataLoader workers gives exactly the batches
of no workers, for every kind of data forge-grain reads (its bin and ArrayRecord layouts, a
peer's format, a store in object storage, streaming files on disk and at URLs), with every
start method (fork, spawn, forkserver), persistent workers or not, and with or without a pause
before the first batch (a trainer building its model while the parent's background threads
open sources and download shards); and a state taken under workers resumes. Also: a process
exits cleanly without closing anything, workers die with their parent, and data rewritten
under a URL is refused rather than read.

The grid runs a seeded subset by default and all of it with FORGE_GRAIN_SLOW=1.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SLOW, make_texts, trials, write_jsonl
from torch.utils.data import DataLoader

from forge_grain.bridges.torch import GrainIterableDataset
from forge_grain import DataConfig, Pipeline, StateError, StoreError, prepare

pytest.importorskip("s3fs")
pytest.importorskip("moto")
from s3server import S3Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["bin", "arrayrecord", "megatron", "s3", "s3_mds_parted", "s3_arrow_parted", "s3_litdata_parted",
         "s3_megatron_ranged", "streaming", "streaming_s3"]
LOADERS = [(0, None, False)] + [(2, ctx, persistent) for ctx in ("fork", "spawn", "forkserver")
                                for persistent in (False, True)]
PAUSES = [0.0, 1.0]
TIMEOUT_S = 120  # a DataLoader that waits longer for a batch fails: a hang is an error, not a stuck suite


@pytest.fixture(scope="module")
def s3():
    with S3Server("workers") as server:
        yield server


@pytest.fixture(scope="module")
def data(tmp_path_factory, s3):
    """One corpus in every kind of data; in object storage under s3://workers/."""
    from mds_writer import write_mds
    from test_formats import LITDATA, make_docs, write_arrow, write_megatron

    base = tmp_path_factory.mktemp("workers")
    texts = make_texts(240, seed=11, empty_every=37)
    corpus = write_jsonl(base / "corpus.jsonl", texts)
    files = [write_jsonl(base / "s0.jsonl", texts[:120]), write_jsonl(base / "s1.jsonl", texts[120:])]
    out = {"cache": base / "cache", "objects": base / "objects", "files": [str(f) for f in files]}
    out["bin"] = prepare(corpus, base / "bin", num_shards=3, progress=False)
    out["arrayrecord"] = prepare(corpus, base / "ar", layout="arrayrecord", num_shards=2, progress=False)
    (base / "meg").mkdir()
    out["megatron"] = write_megatron(base / "meg" / "text_document", make_docs(200, seed=3))
    mds = write_mds(base / "mds", {"tokens": "ndarray:int32"}, [{"tokens": d} for d in make_docs(200, seed=5)],
                    samples_per_shard=40)
    out["mds_limit"] = 3 * max(f.stat().st_size for f in mds.glob("*.mds"))  # below the dataset: read in parts
    arrow = write_arrow(base / "arrow", make_docs(200, seed=7), num_shards=5)
    out["arrow_limit"] = 3 * max(f.stat().st_size for f in arrow.glob("*.arrow"))
    out["megatron_limit"] = (base / "meg" / "text_document.bin").stat().st_size // 2  # read in blocks of documents
    # (LitData: its chunks' heads read at the open, each chunk's fingerprint and checks taken where it is read)
    out["litdata_limit"] = 3 * max(f.stat().st_size for f in (LITDATA / "dataset").glob("chunk-*.bin"))
    fs = s3.fs()
    fs.put(str(out["bin"]), "workers/nat", recursive=True)
    fs.put(str(mds), "workers/mds", recursive=True)
    fs.put(str(arrow), "workers/arrow", recursive=True)
    fs.put(str(base / "meg"), "workers/meg", recursive=True)
    fs.put(str(LITDATA / "dataset"), "workers/litdata", recursive=True)
    for f in files:
        fs.put(str(f), f"workers/texts/{f.name}")
    out["options"] = s3.options()
    return out


def source(data, kind: str) -> dict:
    streaming = dict(name="t", hf_dataset="json", hf_streaming=True, window=20)
    return {
        "bin": dict(name="t", path=str(data["bin"]), strategy="bos_bestfit"),
        "arrayrecord": dict(name="t", path=str(data["arrayrecord"]), strategy="bestfit"),
        "megatron": dict(name="t", path=str(data["megatron"]), strategy="bestfit"),
        "s3": dict(name="t", path="s3://workers/nat", strategy="bestfit", storage_options=data["options"],
                   object_cache=str(data["objects"])),
        "s3_mds_parted": dict(name="t", path="s3://workers/mds", strategy="bestfit", storage_options=data["options"],
                              object_cache=str(data["objects"]), cache_limit=data["mds_limit"]),
        "s3_arrow_parted": dict(name="t", path="s3://workers/arrow", strategy="bestfit",
                                storage_options=data["options"], object_cache=str(data["objects"]),
                                cache_limit=data["arrow_limit"]),
        "s3_litdata_parted": dict(name="t", path="s3://workers/litdata", strategy="bestfit",
                                  storage_options=data["options"], object_cache=str(data["objects"]),
                                  cache_limit=data["litdata_limit"]),
        "s3_megatron_ranged": dict(name="t", path="s3://workers/meg", strategy="bestfit",
                                   storage_options=data["options"], object_cache=str(data["objects"]),
                                   cache_limit=data["megatron_limit"]),
        "streaming": dict(streaming, hf_data_files=data["files"]),
        "streaming_s3": dict(streaming, hf_data_files=["s3://workers/texts/s0.jsonl", "s3://workers/texts/s1.jsonl"],
                             storage_options=data["options"]),
    }[kind]


def config(data, kind: str) -> DataConfig:
    return DataConfig(sources=[source(data, kind)], seq_len=32, global_batch_size=4, seed=2, num_epochs=1,
                      canonical_streams=4, canonical_workers=2)


def dataset(data, kind: str) -> GrainIterableDataset:
    return GrainIterableDataset(config(data, kind), rank=0, world_size=1, cache_dir=data["cache"])


def loader(ds, workers: int, context: str | None, persistent: bool) -> DataLoader:
    if not workers:
        return DataLoader(ds, batch_size=None)
    return DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context=context,
                      persistent_workers=persistent, timeout=TIMEOUT_S)


_REFERENCE: dict = {}


def reference(data, kind: str) -> list[np.ndarray]:
    """Every batch's inputs, made in order by one pipeline in this process."""
    if kind not in _REFERENCE:
        p = Pipeline(config(data, kind), 0, 1, num_threads=0, cache_dir=data["cache"])
        _REFERENCE[kind] = [p.batch(s)["inputs"].copy() for s in range(p.num_steps)]
    return _REFERENCE[kind]


GRID = list(itertools.product(KINDS, LOADERS, PAUSES))
# by default: every kind under forked workers after a pause (the default start method, where the
# parent's threads and clients meet the fork), and two seeded cases of the rest
FORKED = [(kind, (2, "fork", False), 1.0) for kind in KINDS]
DEFAULT = FORKED + random.Random(44).sample([c for c in GRID if c not in FORKED], 2)


@pytest.mark.parametrize("kind, how, pause", GRID if SLOW else DEFAULT,
                         ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_workers_give_the_batches_of_no_workers_and_their_state_resumes(data, kind, how, pause):
    workers, context, persistent = how
    want = reference(data, kind)
    k = len(want) // 2 + 1  # an odd step: the state falls between the workers' turns
    ds = dataset(data, kind)
    time.sleep(pause)  # the parent's opener and downloads run meanwhile
    tracker, seen, state = ds.tracker(), [], None
    for batch in loader(ds, workers, context, persistent):
        tracker.update(batch)
        seen.append((int(batch["step"]), batch["inputs"].numpy().copy()))
        if len(seen) == k:
            state = tracker.state_dict()
    assert [s for s, _ in seen] == list(range(len(want)))
    assert all(np.array_equal(x, want[s]) for s, x in seen)
    again = dataset(data, kind)
    again.tracker().load_state_dict(state)
    got = [(int(b["step"]), b["inputs"].numpy()) for b in loader(again, workers, context, persistent)]
    assert [s for s, _ in got] == list(range(k, len(want)))
    assert all(np.array_equal(x, want[s]) for s, x in got)


# -- a user's script, in its own interpreter --------------------------------------------------------


def run_script(tmp_path: Path, body: str, timeout: float = 300) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text("import sys\nsys.path[:0] = [%r, %r]\n%s" % (str(ROOT), str(ROOT / "tests"), textwrap.dedent(body)))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path)


def test_a_script_that_closes_nothing_exits_cleanly_every_time(tmp_path, data):
    """Over an ArrayRecord store and a store at an s3:// URL: batches taken, DataLoader workers
    left running mid-pass and the process left to exit as scripts do: exit code 0 and no C++
    `terminate` (a background thread inside native code at exit aborts the process)."""
    configs = [json.dumps(config(data, kind).to_dict()) for kind in ("arrayrecord", "s3")]
    body = f"""
        import json
        from torch.utils.data import DataLoader
        from forge_grain.bridges.torch import GrainIterableDataset
        from forge_grain import DataConfig
        kept = []
        for text in {configs!r}:
            ds = GrainIterableDataset(DataConfig.from_dict(json.loads(text)), rank=0, world_size=1,
                                      cache_dir={str(data["cache"])!r})
            it = iter(ds)
            for _ in range(3):
                next(it)
            workers = iter(DataLoader(ds, batch_size=None, num_workers=2))
            next(workers)
            kept += [it, workers]
        print("done")
    """
    for trial in trials(2, 20):
        r = run_script(tmp_path, body)
        assert (r.returncode, "terminate called" in r.stderr) == (0, False), (trial, r.stderr[-3000:])
        assert "done" in r.stdout


def test_workers_of_a_killed_training_process_exit(tmp_path, data, s3):
    """The training process is killed (SIGKILL: no clean-up runs) while its two workers wait in a
    download that never arrives (forge-grain code, not torch's loop, which checks its parent):
    they are gone within 10 s."""
    proxy_options = s3.options(via_proxy=True)
    s3.proxy.fail("nat/shard-00000.bin", "hang", times=100)  # the indices arrive, the pipeline builds
    cfg = config(data, "s3").to_dict()
    cfg["sources"][0].update(storage_options=proxy_options, object_cache=str(tmp_path / "objects"))
    pids = tmp_path / "pids"
    pids.mkdir()
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""\
        import json, os, sys
        sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / "tests")!r}]
        from torch.utils.data import DataLoader
        from forge_grain.bridges.torch import GrainIterableDataset
        from forge_grain import DataConfig
        ds = GrainIterableDataset(DataConfig.from_dict(json.loads({json.dumps(cfg)!r})), rank=0, world_size=1)
        def note(_):
            open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
        for batch in DataLoader(ds, batch_size=None, num_workers=2, worker_init_fn=note):
            pass
        """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = [int(p.name) for p in pids.iterdir()]
        assert len(workers) == 2
        time.sleep(1)  # inside the download now
        assert all(alive(w) for w in workers)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        left = outliving(workers)
        if left:
            pytest.fail(f"workers outlived the training process: {left}")
    finally:
        proc.kill()
        s3.proxy.clear()
        for w in [int(p.name) for p in pids.iterdir()]:
            if alive(w):
                os.kill(w, signal.SIGKILL)


def outliving(pids: list[int], seconds: float = 10) -> list:
    """The processes of `pids` still running after `seconds` (each with its threads' states:
    `threads_of`), for a test that kills their parent."""
    gone_by = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < gone_by:
        time.sleep(0.1)
    return [threads_of(p) for p in pids if alive(p)]


def threads_of(pid: int) -> list:
    """Process `pid`'s parent and what each of its threads is doing (name, state, kernel wait),
    for a failure's message."""
    with open(f"/proc/{pid}/stat") as f:
        out = [pid, "parent", int(f.read().rsplit(")", 1)[1].split()[1])]
    for task in sorted(os.listdir(f"/proc/{pid}/task")):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                name, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
            with open(f"/proc/{pid}/task/{task}/wchan") as f:
                out.append((name, rest.split()[0], f.read()))
        except OSError:  # (a thread gone meanwhile)
            continue
    return out


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("forker", ["main thread", "another thread"])
def test_a_worker_stuck_in_its_own_exit_ends_with_its_parent(tmp_path, forker):
    """A worker that began to exit (its loop noticed first that the training process is gone),
    waiting there for a thread stuck in a download that never comes, still ends within 10 s of
    its parent's SIGKILL: the parent watch goes on polling through the exit (it stopped when
    exit began, and such a worker lived on: `test_workers_of_a_killed_training_process_exit`
    failed so under load). Forked by the parent's main thread, the kernel kills it too
    (PR_SET_PDEATHSIG); forked by another thread, the watch alone ends it."""
    note = tmp_path / "child"
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""\
        import multiprocessing, os, sys, threading, time
        sys.path[:0] = [{str(ROOT)!r}]
        from forge_grain.processes import exit_with_parent

        def child():
            exit_with_parent()
            threading.Thread(target=time.sleep, args=(600,)).start()  # joined at exit: a hung download's thread
            open({str(note)!r}, "w").write(str(os.getpid()))  # ... and now this process exits, waiting for it

        def start():
            multiprocessing.get_context("fork").Process(target=child).start()

        if {forker == "main thread"}:
            start()
        else:
            forker = threading.Thread(target=start)
            forker.start()
            forker.join()
        time.sleep(600)
        """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (note.exists() and note.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(note.read_text())
        time.sleep(1)  # in its exit, joining the stuck thread
        assert alive(child)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        left = outliving([child])
        if left:
            os.kill(child, signal.SIGKILL)
            pytest.fail(f"the worker outlived its parent: {left}")
    finally:
        proc.kill()


# -- data rewritten under a URL ----------------------------------------------------------------------


def test_a_peer_dataset_rewritten_under_its_url_is_refused_by_a_spawned_worker(tmp_path, s3):
    """An MDS dataset at a URL rewritten after the pipeline opened it: a worker that opens it again
    (spawn pickles the dataset) finds the other data and refuses it, naming the URL."""
    from mds_writer import write_mds

    def mds(seed):
        rng = np.random.default_rng(seed)
        samples = [{"tokens": rng.integers(2, 1000, int(rng.integers(5, 60))).astype(np.int32)} for _ in range(120)]
        out = write_mds(tmp_path / f"mds{seed}", {"tokens": "ndarray:int32"}, samples, samples_per_shard=40)
        s3.fs().put(str(out), "workers/mds", recursive=True)

    mds(1)
    src = dict(name="m", path="s3://workers/mds", strategy="bestfit", storage_options=s3.options(),
               object_cache=str(tmp_path / "objects"), vocab_size=1000)
    cfg = DataConfig(sources=[src], seq_len=32, global_batch_size=4, seed=2, num_epochs=1)
    ds = GrainIterableDataset(cfg, rank=0, world_size=1, cache_dir=tmp_path / "plans")
    store = pickle.dumps(ds.pipeline.stores[0])  # a store sent alone pins its listing
    s3.fs().rm("workers/mds", recursive=True)
    mds(2)
    with pytest.raises(StoreError, match=r"s3://workers/mds: the data at this URL changed after the pipeline opened"):
        pickle.loads(store)
    with pytest.raises(Exception, match=r"s3://workers/mds: the data changed after the pipeline was built"):
        list(DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn", timeout=TIMEOUT_S))
    again = GrainIterableDataset(cfg, rank=0, world_size=1, cache_dir=tmp_path / "plans")
    with pytest.raises(StateError, match=r"source 'm' \(s3://workers/mds\): the data is not what the state was "
                                         "saved with"):  # a resumed process: other data
        again.tracker().load_state_dict(ds.tracker().state_dict())


# -- ArrayRecord records: uncompressed now, zstd in older stores ---------------------------------------


def as_older_store(store: Path) -> Path:
    """The store as forge-grain wrote it before recording the compression: zstd records, and a
    manifest without "compression"."""
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    from forge_grain.files import sha256_file

    manifest = json.loads((store / "manifest.json").read_text())
    for shard in manifest["shards"]:
        path = store / shard["tokens"]
        reader = ArrayRecordReader(str(path))
        records = reader.read_all()
        reader.close()
        writer = ArrayRecordWriter(str(path), "group_size:1")
        for r in records:
            writer.write(r)
        writer.close()
        shard["sha256"] = sha256_file(path)
    del manifest["compression"]
    (store / "manifest.json").write_text(json.dumps(manifest))
    return store


def test_prepare_writes_uncompressed_records_and_the_manifest_says_so(data):
    from array_record.python.array_record_module import ArrayRecordReader

    manifest = json.loads((data["arrayrecord"] / "manifest.json").read_text())
    assert manifest["compression"] == "none"
    reader = ArrayRecordReader(str(data["arrayrecord"] / manifest["shards"][0]["tokens"]))
    assert "uncompressed" in reader.writer_options_string().split(",")
    reader.close()


def test_an_older_zstd_store_is_refused_by_name_in_a_forked_worker_and_read_by_a_spawned_one(tmp_path, data):
    """Its parent read a zstd record: riegeli's decoder pool would crash the forked worker's own
    first decode (a segfault), so the worker says what to do instead; spawned workers read it."""
    import shutil

    store = as_older_store(Path(shutil.copytree(data["arrayrecord"], tmp_path / "old")))
    src = dict(name="t", path=str(store), strategy="bestfit")
    cfg = DataConfig(sources=[src], seq_len=32, global_batch_size=4, seed=2, num_epochs=1)
    make = lambda: GrainIterableDataset(cfg, rank=0, world_size=1, cache_dir=tmp_path / "plans")  # noqa: E731
    want = [b["inputs"].numpy() for b in make()]  # this process decodes zstd records
    with pytest.raises(Exception, match=r"shard-0000\d\.array_record: this store's records are zstd-compressed"):
        list(DataLoader(make(), batch_size=None, num_workers=2, timeout=TIMEOUT_S))
    got = [b["inputs"].numpy() for b in DataLoader(make(), batch_size=None, num_workers=2, timeout=TIMEOUT_S,
                                                   multiprocessing_context="spawn")]
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))


def test_a_shard_whose_compression_disagrees_with_the_manifest_is_named_at_open(tmp_path, data):
    import shutil

    from forge_grain import TokenStore

    store = as_older_store(Path(shutil.copytree(data["arrayrecord"], tmp_path / "mixed")))
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["compression"] = "none"
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"shard-00000\.array_record: its records are compressed, but manifest\.json "
                                         r"says not"):
        TokenStore.open(store)


def test_a_value_made_per_process_is_made_anew_in_a_forked_child_and_in_its_own_child():
    """A network client, thread pool or lock is made once per process (`per_process`): a
    forked child (a DataLoader worker) makes its own, so does a child it forks in turn, and
    the parent keeps its own. The process's id is kept and renewed at a fork rather than
    asked for at each use (a system call, several a step): the fork must still be seen."""
    import multiprocessing
    from forge_grain.processes import per_process

    class Holder:
        @per_process
        def client(self):
            return (os.getpid(), object())

    holder, ctx = Holder(), multiprocessing.get_context("fork")
    mine = holder.client

    def child(out, depth):
        made = holder.client
        ok = made[0] == os.getpid() and made is holder.client and made is not mine
        if depth:
            inner = ctx.Queue()
            p = ctx.Process(target=child, args=(inner, depth - 1))
            p.start()
            ok = ok and inner.get(timeout=60)
            p.join(60)
        out.put(ok)

    out = ctx.Queue()
    p = ctx.Process(target=child, args=(out, 1))
    p.start()
    assert out.get(timeout=60)
    p.join(60)
    assert holder.client is mine and mine[0] == os.getpid()
