"""Streaming at scale: a parallel tokenizer that keeps the stream exact, canonical streams
that make batches and states independent of the shard and worker counts, streaming files
from object storage, and DataLoader workers over a streaming pipeline."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_texts, write_jsonl

from forge_grain import ConfigError, DataConfig, Pipeline, PrepareError, StateError, merge_states

KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "source_id")


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """Two JSON Lines files of 1,500 documents (some empty), and the same rows as Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("streaming")
    texts = make_texts(1500, seed=7, empty_every=41)
    jsonl = [write_jsonl(d / "part-0.jsonl", texts[:800]), write_jsonl(d / "part-1.jsonl", texts[800:])]
    parquet = []
    for k, chunk in enumerate((texts[:800], texts[800:])):
        parquet.append(d / f"part-{k}.parquet")
        pq.write_table(pa.table({"text": chunk, "n": list(range(len(chunk)))}), parquet[-1], row_group_size=300)
    return {"json": [str(p) for p in jsonl], "parquet": [str(p) for p in parquet]}


def config(files, kind="json", canonical=4, workers=1, batch=8, strategy="bestfit", num_epochs=1, **kw) -> DataConfig:
    src = dict(name="web", hf_dataset=kind, hf_data_files=files, hf_streaming=True, window=60, strategy=strategy, **kw)
    return DataConfig(sources=[src], seq_len=48, global_batch_size=batch, seed=5, num_epochs=num_epochs,
                      canonical_streams=canonical, canonical_workers=workers)


def run(pipeline, steps=None, state=None) -> list[dict]:
    it = pipeline.iterator(state)
    out = []
    for b in it:
        out.append(copy(b))
        if steps is not None and len(out) == steps:
            break
    return out


def copy(batch: dict) -> dict:
    return {k: batch[k].copy() for k in KEYS}


def joined(per_shard: list[list[dict]]) -> list[dict]:
    """Global batches from the shards' parts."""
    return [{k: np.concatenate([p[s][k] for p in per_shard]) for k in KEYS} for s in range(len(per_shard[0]))]


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in KEYS)


def test_batches_do_not_depend_on_the_tokenizer_pool_size(tmp_path, parts):
    runs = {n: run(Pipeline(config(parts["json"]), 0, 1, cache_dir=tmp_path / f"c{n}", tokenize_threads=n))
            for n in (0, 1, 2, 4)}
    assert len(runs[1]) > 20
    assert all(same(runs[n], runs[0]) for n in (1, 2, 4))


def test_global_batches_do_not_depend_on_the_shard_count(tmp_path, parts):
    cfg = config(parts["json"], canonical=4)
    one = run(Pipeline(cfg, 0, 1, cache_dir=tmp_path))
    for n in (2, 4):
        shards = [Pipeline(cfg, k, n, cache_dir=tmp_path) for k in range(n)]
        assert {p.num_steps for p in shards} == {len(one)}
        assert same(joined([run(p) for p in shards]), one)


@pytest.mark.parametrize("strategy", ["bestfit", "bos_bestfit", "concat"])
def test_a_state_saved_on_two_shards_resumes_on_one_and_on_four(tmp_path, parts, strategy):
    cfg = config(parts["json"], canonical=4, strategy=strategy)
    whole = run(Pipeline(cfg, 0, 1, cache_dir=tmp_path))
    two = [Pipeline(cfg, k, 2, cache_dir=tmp_path) for k in range(2)]
    iters = [p.iterator() for p in two]
    head = [[copy(next(it)) for _ in range(11)] for it in iters]  # crosses windows
    state = merge_states([it.get_state() for it in iters])
    assert same(joined(head), whole[:11])
    for n in (1, 4):
        rest = joined([run(Pipeline(cfg, k, n, cache_dir=tmp_path), state=state) for k in range(n)])
        assert same(rest, whole[11:])
    # a shard's own state holds only its streams: alone it cannot resume another layout of shards
    with pytest.raises(StateError, match=r"no position for canonical stream\(s\) \[2, 3\]"):
        Pipeline(cfg, 0, 1, cache_dir=tmp_path).iterator(iters[0].get_state())
    # but it does resume its own shard
    own = iters[1].get_state()
    assert same(run(Pipeline(cfg, 1, 2, cache_dir=tmp_path), state=own), [copy(b) for b in iters[1]])


def test_a_state_taken_while_streams_straddle_an_epoch_end_resumes_exactly(tmp_path, parts):
    """In a mixture, streams wrap at different steps; a state where some have and some have not
    resumes on other shard counts (each process reads each epoch once for all its streams)."""
    one = config(parts["json"], canonical=4, num_epochs=None)
    src = dict(one.sources[0].__dict__)
    cfg = DataConfig(sources=[src, {**src, "name": "twin", "hf_data_files": parts["parquet"], "hf_dataset": "parquet",
                                     "weight": 0.5}],
                     seq_len=48, global_batch_size=8, seed=5, num_epochs=None, canonical_streams=4)
    it = Pipeline(cfg, 0, 1, cache_dir=tmp_path, num_threads=0).iterator()
    made = 0
    while {st["epoch"] for st in it.get_state()["streams"][0].values()} != {0, 1}:  # the point of the test
        next(it)
        made += 1
    state = it.get_state()
    whole = run(Pipeline(cfg, 0, 1, cache_dir=tmp_path), steps=made + 36)
    for n in (1, 2, 4):
        rest = [run(Pipeline(cfg, k, n, cache_dir=tmp_path), steps=36, state=state) for k in range(n)]
        assert same(joined(rest), whole[made:])


def test_one_streaming_source_makes_epochs_of_exactly_the_counted_steps(tmp_path, parts):
    """Epoch e starts every canonical stream at its epoch e, at step e * steps_per_epoch, so a
    pass starts without reading the ones before it, and num_epochs passes are every step."""
    cfg = config(parts["json"], canonical=4, num_epochs=3)
    p = Pipeline(cfg, 0, 1, cache_dir=tmp_path, num_threads=0)
    n = p.steps_per_epoch
    assert p.epoch_aligned and p.num_steps == 3 * n
    whole = run(p)
    assert len(whole) == 3 * n
    it = Pipeline(cfg, 0, 1, cache_dir=tmp_path, num_threads=0).iterator()
    for _ in range(n):
        next(it)
    at = it.get_state()
    assert {st["epoch"] for st in at["streams"][0].values()} <= {0, 1}  # before the step: some may be behind
    nxt = next(it)  # ... which step n moves to the start of epoch 1
    assert same([copy(nxt)], whole[n : n + 1])
    fresh = Pipeline(cfg, 0, 1, cache_dir=tmp_path, num_threads=0)
    fresh.start_streams(2 * n)  # no state, no reading: epoch 2 starts there
    assert same([copy(fresh.batch(s)) for s in range(2 * n, 2 * n + 5)], whole[2 * n : 2 * n + 5])


def test_reading_several_streams_costs_the_requests_of_one(tmp_path, parts, s3):
    """A process reads the source once for all the canonical streams it reads."""
    gets = {}
    for canonical in (1, 4):
        cfg = config(["s3://texts/json/*.jsonl"], canonical=canonical, batch=8,
                     storage_options=s3.options(via_proxy=True))
        p = Pipeline(cfg, 0, 1, cache_dir=tmp_path / str(canonical))  # the counting pass reads it too
        s3.proxy.clear()
        run(p)
        gets[canonical] = sum(n for path, n in s3.proxy.gets.items() if "json/part-" in path)
    assert gets[4] == gets[1] > 0, gets


def test_shard_counts_that_do_not_divide_the_canonical_streams_are_refused(tmp_path, parts):
    with pytest.raises(ConfigError, match=r"canonical_streams 4: .*shard count \(3\) to divide it"):
        Pipeline(config(parts["json"], canonical=4, batch=24), 0, 3, cache_dir=tmp_path)
    cfg = config(parts["json"], canonical=4)
    it = Pipeline(cfg, 0, 2, cache_dir=tmp_path).iterator()
    next(it)
    with pytest.raises(StateError, match=r"\[canonical_streams, canonical_workers\] = \[4, 1\]"):
        Pipeline(config(parts["json"], canonical=2), 0, 2, cache_dir=tmp_path).iterator(it.get_state())
    # by default the first run's shard count is the canonical count, and a resumed run adopts the saved one
    first = Pipeline(config(parts["json"], canonical=None), 0, 2, cache_dir=tmp_path)
    assert first.layout.groups == 2
    state = merge_states([Pipeline(config(parts["json"], canonical=None), k, 2, cache_dir=tmp_path).state_at(0)
                          for k in range(2)])
    assert Pipeline(config(parts["json"], canonical=None), 0, 1, cache_dir=tmp_path, resume_from=state).layout.groups == 2


@pytest.mark.parametrize("canonical,workers,shards", [(4, 1, 2), (2, 2, 1), (2, 2, 2)])
def test_counted_steps_are_every_step_before_a_stream_wraps(tmp_path, parts, canonical, workers, shards):
    cfg = config(parts["json"], canonical=canonical, workers=workers)
    for k in range(shards):
        p = Pipeline(cfg, k, shards, cache_dir=tmp_path, num_threads=0)
        produced = sum(1 for _ in p.iterator())
        assert produced == p.num_steps > 0
        for rows in p.streams:  # no stream has emitted a row of its second epoch
            assert all(s["epoch"] == 0 or (s["window"], s["emitted"]) == (0, 0) for s in rows.states().values())
    # the count is tight: with unlimited epochs, the next step reads some stream's next epoch
    more = Pipeline(config(parts["json"], canonical=canonical, workers=workers, num_epochs=None), 0, 1,
                    cache_dir=tmp_path, num_threads=0)
    it = more.iterator()
    for _ in range(p.num_steps + 1):
        next(it)
    assert any(s["epoch"] == 1 and (s["window"], s["emitted"]) != (0, 0) for s in more.streams[0].states().values())


def test_parquet_streams_as_its_json_lines_twin(tmp_path, parts):
    assert same(run(Pipeline(config(parts["parquet"], "parquet"), 0, 1, cache_dir=tmp_path)),
                run(Pipeline(config(parts["json"]), 0, 1, cache_dir=tmp_path)))


# -- object storage ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(parts):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from s3server import S3Server

    server = S3Server()
    fs = server.fs()
    server.fresh_bucket("texts")  # its own bucket: moto keeps one state per process
    for kind, files in parts.items():
        for f in files:
            fs.put(f, f"texts/{kind}/{f.rsplit('/', 1)[1]}")
    yield server
    server.stop()


@pytest.mark.parametrize("kind", ["json", "parquet"])
def test_streaming_from_object_storage_equals_streaming_local_files(tmp_path, parts, s3, kind):
    suffix = "jsonl" if kind == "json" else "parquet"
    remote = config([f"s3://texts/{kind}/*.{suffix}"], kind, storage_options=s3.options())
    local = run(Pipeline(config(parts[kind], kind), 0, 1, cache_dir=tmp_path / "local"))
    p = Pipeline(remote, 0, 1, cache_dir=tmp_path / "remote")
    assert p.stores[0].path == f"s3://texts/{kind}/*.{suffix} (2 files)"
    assert same(run(p), local)
    # and resumes mid-file: the state holds a file, a row and a byte offset
    it = Pipeline(remote, 0, 1, cache_dir=tmp_path / "remote").iterator()
    for _ in range(9):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert same(run(Pipeline(remote, 0, 1, cache_dir=tmp_path / "remote"), state=state), local[9:])


def test_streaming_rows_from_object_storage_are_explained_by_file_and_row(tmp_path, s3):
    """`explain` names each document of a streamed row by the file at its URL and its row
    there: the text at that place, tokenized, is the row's tokens at the named slots."""
    texts = make_texts(1500, seed=7, empty_every=41)  # the `parts` fixture's rows: 800 in part-0, 700 in part-1
    p = Pipeline(config(["s3://texts/json/*.jsonl"], storage_options=s3.options()), 0, 2, num_threads=0,
                 cache_dir=tmp_path)
    files = set()
    for step in range(p.num_steps):
        batch = p.batch(step)
        for row, e in enumerate(p.explain(step, shard=0)):
            for seg in e["segments"]:
                part = 0 if seg["document"] < 800 else 1
                assert seg["file"] == f"s3://texts/json/part-{part}.jsonl"
                assert seg["index_in_file"] == seg["document"] - 800 * part
                (lo, hi), (a, b) = seg["tokens"], seg["slots"]
                tokens = p.stores[0].tokenize([texts[seg["document"]]])[0]
                assert np.array_equal(batch["inputs"][row, a:b], tokens[lo:hi])
                files.add(part)
    assert files == {0, 1}


def test_streaming_from_object_storage_survives_faults(tmp_path, parts, s3):
    local = run(Pipeline(config(parts["json"]), 0, 1, cache_dir=tmp_path / "local"))
    remote = config(["s3://texts/json/*.jsonl"], storage_options=s3.options(via_proxy=True))
    s3.proxy.clear()
    for kind in ("drop", "500", "truncate"):
        s3.proxy.fail("json/part-1.jsonl", kind, times=2)
    assert same(run(Pipeline(remote, 0, 1, cache_dir=tmp_path / "remote")), local)
    assert all(f[2] == 0 for f in s3.proxy.faults)  # the faults happened
    s3.proxy.clear()


@pytest.fixture(scope="module")
def sixteen(s3):
    """16 JSON Lines files of 120 documents each at s3://texts/many/ (each about the same size)."""
    texts = make_texts(16 * 120, seed=11, empty_every=53)
    fs = s3.fs()
    for f in range(16):
        fs.pipe_file(f"texts/many/part-{f:02d}.jsonl", b"".join(json.dumps({"text": t}).encode() + b"\n"
                                                              for t in texts[f * 120:(f + 1) * 120]))
    return sum(fs.size(f"texts/many/part-{f:02d}.jsonl") for f in range(16))


def test_files_dealt_to_canonical_streams_read_each_byte_once_across_the_shards(tmp_path, s3, sixteen):
    """With 4 canonical streams over 16 files, each stream reads 4 whole files of its own: the
    bytes all shards GET are one pass of the corpus, the same on 1, 2 and 4 shards (not one
    pass a shard, as rows dealt read), and the guarantees of canonical streams hold: the global batches do not depend on
    the shard count, and a state saved on 2 shards resumes on 1 and on 4."""
    cfg = config(["s3://texts/many/*.jsonl"], canonical=4, storage_options=s3.options(via_proxy=True))
    rows_cfg = config(["s3://texts/many/*.jsonl"], canonical=4, storage_options=s3.options(via_proxy=True),
                      dealing="rows")
    Pipeline(cfg, 0, 1, cache_dir=tmp_path)  # the counting pass (once a host, cached): not what is measured

    def egress(c, n):
        shards = [Pipeline(c, k, n, cache_dir=tmp_path) for k in range(n)]
        s3.proxy.clear()
        batches = [run(p) for p in shards]
        sent = sum(b for path, b in s3.proxy.sent.items() if "/texts/many/" in path)
        return joined(batches), sent

    one, once = egress(cfg, 1)
    # each file once; a stream that ends its epoch reads its next one's first window ahead
    assert len(one) > 10 and sixteen <= once < 1.25 * sixteen
    for n in (2, 4):
        batches, sent = egress(cfg, n)
        assert same(batches, one) and sent == once, (n, sent, once)
    by_rows, sent = egress(rows_cfg, 4)
    assert sent >= 4 * sixteen and not same(by_rows, one)  # rows dealt: every shard reads every byte
    two = [Pipeline(cfg, k, 2, cache_dir=tmp_path) for k in range(2)]
    iters = [p.iterator() for p in two]
    head = [[copy(next(it)) for _ in range(7)] for it in iters]
    state = merge_states([it.get_state() for it in iters])
    assert same(joined(head), one[:7])
    for n in (1, 4):
        rest = joined([run(Pipeline(cfg, k, n, cache_dir=tmp_path), state=state) for k in range(n)])
        assert same(rest, one[7:])
    # the dealing is data: a state of files dealt is refused by rows dealt, naming what differs
    with pytest.raises(StateError, match="sources"):
        Pipeline(rows_cfg, 0, 1, cache_dir=tmp_path).iterator(state)


def test_streamed_rows_of_files_dealt_are_explained_by_file_and_row(tmp_path, s3, sixteen):
    texts = make_texts(16 * 120, seed=11, empty_every=53)
    p = Pipeline(config(["s3://texts/many/*.jsonl"], canonical=4, storage_options=s3.options()), 0, 2,
                 num_threads=0, cache_dir=tmp_path)
    files = set()
    for step in range(6):
        batch = p.batch(step)
        for row, e in enumerate(p.explain(step, shard=0)):
            for seg in e["segments"]:
                f = int(seg["file"].rsplit("-", 1)[1].split(".")[0])
                (lo, hi), (a, b) = seg["tokens"], seg["slots"]
                tokens = p.stores[0].tokenize([texts[f * 120 + seg["index_in_file"]]])[0]
                assert np.array_equal(batch["inputs"][row, a:b], tokens[lo:hi])
                files.add(f)
    assert len(files) >= 2


def test_dealing_files_is_refused_where_it_cannot_work(tmp_path, parts, s3):
    with pytest.raises(ConfigError, match="dealing = 'files' needs files at URLs.*at least as many as the 4"):
        Pipeline(config(parts["json"], canonical=4, dealing="files"), 0, 1, cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="dealing = 'files' needs files at URLs.*this source has 2"):
        Pipeline(config(["s3://texts/json/*.jsonl"], canonical=4, dealing="files", storage_options=s3.options()), 0, 1,
                 cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="dealing: 'auto', 'files' or 'rows'"):
        config(parts["json"], dealing="shards").validate()


def test_bad_files_in_object_storage_are_named(tmp_path, s3):
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs = s3.fs()
    good = b"".join(json.dumps({"text": f"document {i}"}).encode() + b"\n" for i in range(50))
    fs.pipe({"texts/bad/not-utf8.jsonl": good + b'{"text": "caf\xe9"}\n',
             "texts/bad/truncated.jsonl": good + b'{"text": "cut he',
             "texts/bad/number.jsonl": good + b'{"text": 17}\n',
             "texts/bad/no-field.jsonl": good + b'{"body": "x"}\n',
             "texts/bad/notes.txt": b"plain text\n",
             "texts/bad/truncated.parquet": b"PAR1" + b"\0" * 100})
    ids = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"text": [[1, 2, 3]] * 10}), ids)
    fs.put(str(ids), "texts/bad/ids.parquet")
    cases = {"not-utf8.jsonl": "row 50: bytes that are not UTF-8", "truncated.jsonl": "row 50: not JSON",
             "number.jsonl": "row 50, field 'text': holds the int value '17', not text", "no-field.jsonl": "row 50: no text field 'text'",
             "notes.txt": "not a JSON Lines", "truncated.parquet": "not a readable Parquet file",
             "ids.parquet": "column 'text' holds list<element: int64>, not text"}
    for name, message in cases.items():
        kind = "parquet" if name.endswith(".parquet") else "json"
        with pytest.raises(PrepareError, match=message) as e:
            Pipeline(config([f"s3://texts/bad/{name}"], kind, storage_options=s3.options()), 0, 1,
                     cache_dir=tmp_path)
        assert f"texts/bad/{name}" in str(e.value)
    with pytest.raises(PrepareError, match="no file matches"):
        Pipeline(config(["s3://texts/bad/*.missing"], storage_options=s3.options()), 0, 1, cache_dir=tmp_path)


# -- DataLoader workers ------------------------------------------------------------------------


def torch_batches(loader, n=None) -> list[dict]:
    out = []
    for b in loader:
        out.append({k: b[k].numpy().copy() for k in ("inputs", "targets", "segment_ids", "loss_mask")})
        if n is not None and len(out) == n:
            break
    return out


def same_torch(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_dataloader_workers_over_a_streaming_pipeline_equal_no_workers(tmp_path, parts):
    import torch
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    from forge_grain.bridges.torch import GrainIterableDataset

    cfg = config(parts["json"], canonical=2, workers=2)

    def dataset():
        return GrainIterableDataset(cfg, rank=0, world_size=1, cache_dir=tmp_path)

    alone = torch_batches(DataLoader(dataset(), batch_size=None, num_workers=0))
    assert len(alone) > 20
    first = next(iter(DataLoader(dataset(), batch_size=None, num_workers=2)))
    assert all(isinstance(v, torch.Tensor) for v in first.values())  # a loop's `.to(device)` works on all of it
    assert same_torch(torch_batches(DataLoader(dataset(), batch_size=None, num_workers=2)), alone)

    # the tracker's state, taken under 2 workers, resumes under 0 and under 1
    ds = dataset()
    tracker = ds.tracker()
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    for b in loader:
        tracker.update(b)
        if int(b["step"]) == 12:
            break
    state = json.loads(json.dumps(tracker.state_dict()))
    for workers in (0, 1):
        again = dataset()
        again.tracker().load_state_dict(state)
        assert same_torch(torch_batches(DataLoader(again, batch_size=None, num_workers=workers)), alone[13:])

    # the per-worker state of StatefulDataLoader resumes the same worker count
    first = StatefulDataLoader(dataset(), batch_size=None, num_workers=2)
    head = torch_batches(first, 7)
    second = StatefulDataLoader(dataset(), batch_size=None, num_workers=2)
    second.load_state_dict(first.state_dict())
    assert same_torch(head + torch_batches(second), alone)


def test_dataloader_workers_forked_after_the_counting_pass_still_tokenize(tmp_path, parts):
    """The counting pass runs on this process's tokenizer threads; forked workers must make
    their own (a fork has the executor but not its threads: they would wait forever)."""
    from torch.utils.data import DataLoader

    from forge_grain.bridges.torch import GrainIterableDataset

    ds = GrainIterableDataset(config(parts["json"], canonical=2, workers=2), rank=0, world_size=1, cache_dir=tmp_path)
    got = torch_batches(DataLoader(ds, batch_size=None, num_workers=2, timeout=120))
    assert same_torch(got, torch_batches(DataLoader(ds, batch_size=None, num_workers=0)))


def test_two_gloo_ranks_with_two_workers_each_save_one_state_that_resumes_on_one(tmp_path, parts):
    """torchrun, 2 ranks x 2 DataLoader workers over 2 x 2 canonical streams: the ranks' parts
    are the global batches, both ranks' tracker states are the same (gathered), and it
    resumes on one process with no workers."""
    import subprocess
    import sys
    from pathlib import Path

    from torch.utils.data import DataLoader

    from forge_grain.bridges.torch import GrainIterableDataset
    from multiproc import free_port

    cfg = config(parts["json"], canonical=2, workers=2)
    cfg_path = tmp_path / "data.json"
    cfg_path.write_text(json.dumps(cfg.to_dict()))
    script = Path(__file__).parent / "scripts" / "torch_streaming.py"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", str(script), str(cfg_path), str(tmp_path / "cache"), "9",
                        str(tmp_path / "rank")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    whole = [b["inputs"].numpy() for b in DataLoader(GrainIterableDataset(cfg, rank=0, world_size=1,
                                                                         cache_dir=tmp_path / "cache"),
                                                     batch_size=None)]
    parts_ = [np.load(tmp_path / f"rank{k}.npz") for k in range(2)]
    for s in range(9):
        assert np.array_equal(np.concatenate([p[f"arr_{s}"] for p in parts_]), whole[s])
    states = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    assert states[0] == states[1] and sorted(states[0]["streams"][0]) == ["0", "1", "2", "3"]
    ds = GrainIterableDataset(cfg, rank=0, world_size=1, cache_dir=tmp_path / "cache")
    ds.tracker().load_state_dict(states[0])
    rest = [b["inputs"].numpy() for b in DataLoader(ds, batch_size=None)]
    assert len(rest) == len(whole) - 9 and all(np.array_equal(a, b) for a, b in zip(rest, whole[9:]))


def test_storage_options_without_urls_are_refused(parts):
    with pytest.raises(ConfigError, match="storage_options: only for streaming hf_data_files at URLs"):
        config(parts["json"], storage_options={"anon": True})


def test_a_tampered_or_foreign_counting_pass_is_counted_again(tmp_path, parts, caplog):
    """The epoch of a streaming source comes from its cached counting pass: a cache whose
    lengths were edited (or that belongs to another stream) is recounted, not trusted."""
    cfg = config(parts["json"], canonical=2)
    steps = Pipeline(cfg, 0, 1, cache_dir=tmp_path, num_threads=0).num_steps
    (lengths,) = (tmp_path / "hf").glob("*.lengths.npy")
    np.save(lengths, np.load(lengths)[::2])  # half the documents: the epoch would halve
    with caplog.at_level("WARNING"):
        assert Pipeline(cfg, 0, 1, cache_dir=tmp_path, num_threads=0).num_steps == steps
    assert "counting again" in caplog.text
