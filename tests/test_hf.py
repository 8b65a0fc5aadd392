"""Hugging Face sources: eager and streaming agree, exact step counts, streaming resume, caches, errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import make_texts, write_jsonl
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from forge_grain import (
    ConfigError,
    DataConfig,
    Pipeline,
    PrepareError,
    StateError,
    TokenStore,
)
from forge_grain.pipeline.config import SourceConfig
from forge_grain.preparation.hf_cache import eager_store
from forge_grain.sources.stream_cursors import StreamCursor
from forge_grain.sources.streaming import StreamingSource
from forge_grain.packing.packed import empty_rows


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("hf") / "docs.jsonl", make_texts(1200, seed=4, empty_every=37))


def source(jsonl, **kw):
    d = dict(name="hf", hf_dataset="json", hf_data_files=str(jsonl), window=150)
    d.update(kw)
    return SourceConfig(**d)


def hf_config(jsonl, strategy="bestfit", batch=4, **kw):
    return DataConfig(sources=[source(jsonl, strategy=strategy, hf_streaming=True, **kw)], seq_len=48,
                      global_batch_size=batch, seed=3)


def test_eager_and_streaming_give_the_same_documents(tmp_path, jsonl):
    store = TokenStore.open(eager_store(source(jsonl), tmp_path, progress=False))
    stream = StreamingSource(source(jsonl, hf_streaming=True), 48, 0, tmp_path)
    texts = [t for batch in stream._batches(100) for t in batch]
    streamed = [d.tolist() for d in stream.tokenize(texts) if len(d)]
    assert streamed == [store[i].tolist() for i in range(len(store))]
    assert (stream.lengths(progress=False)[stream.lengths(progress=False) > 0] == store.lengths).all()


def test_eager_cache_is_reused_and_rebuilt_for_another_tokenizer(tmp_path, jsonl):
    first = eager_store(source(jsonl), tmp_path, progress=False)
    stamp = (first / "manifest.json").stat().st_mtime_ns
    assert eager_store(source(jsonl), tmp_path, progress=False) == first
    assert (first / "manifest.json").stat().st_mtime_ns == stamp  # opened, not rebuilt
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(make_texts(200), trainers.BpeTrainer(vocab_size=400, special_tokens=["<|bos|>", "<|endoftext|>"]))
    tok.save(str(tmp_path / "other.json"))
    other = eager_store(source(jsonl, tokenizer=str(tmp_path / "other.json")), tmp_path, progress=False)
    assert other != first and TokenStore.open(other).vocab_size == tok.get_vocab_size()


def test_concurrent_first_uses_build_the_eager_cache_once(tmp_path, jsonl):
    code = ("import sys; from forge_grain.pipeline.config import SourceConfig; from forge_grain.preparation.hf_cache import eager_store; "
            f"print(eager_store(SourceConfig(name='hf', hf_dataset='json', hf_data_files={str(jsonl)!r}), "
            f"{str(tmp_path)!r}, progress=False))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    paths = {o.strip() for o, _ in outs}
    assert len(paths) == 1 and TokenStore.open(paths.pop(), verify=True)


@pytest.mark.parametrize("strategy", ["concat", "bos_bestfit", "bestfit"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_counted_steps_equal_the_batches_produced(tmp_path, jsonl, strategy, ranks):
    cfg = hf_config(jsonl, strategy, batch=2 * ranks)
    produced = []
    for k in range(ranks):
        p = Pipeline(cfg, k, ranks, cache_dir=tmp_path)
        produced.append(sum(1 for _ in iter(p)))
        assert produced[-1] == p.num_steps
    # the count is of rows a real pass produces: read each shard's stream to its end
    src = StreamingSource(cfg.sources[0], cfg.seq_len, 0, tmp_path)
    for k, counted in enumerate(src.rows_per_stream(ranks, progress=False)):
        cursor = StreamCursor(src, k, ranks)
        out, rows = empty_rows(1, cfg.seq_len), 0
        while cursor.epoch == 0:
            cursor.emit(out, 0)
            rows += 1
        assert rows == counted


def test_streaming_resume_mid_epoch_is_exact(tmp_path, jsonl):
    cfg = hf_config(jsonl, "bos_bestfit", batch=4)
    for k in range(2):
        it = iter(Pipeline(cfg, k, 2, cache_dir=tmp_path))
        for _ in range(7):
            next(it)
        state = it.get_state()
        expected = [next(it) for _ in range(12)]  # crosses packing windows
        again = Pipeline(cfg, k, 2, cache_dir=tmp_path).iterator(state)
        for e in expected:
            g = next(again)
            assert int(g["step"]) == int(e["step"]) and np.array_equal(g["inputs"], e["inputs"])
        with pytest.raises(StateError, match=r"canonical_streams, canonical_workers\] = \[2, 1\]"):
            Pipeline(cfg, 0, 1, cache_dir=tmp_path).iterator(state)  # dealt for 2 shards by default
        with pytest.raises(StateError, match=rf"no position for canonical stream\(s\) \[{1 - k}\]"):
            Pipeline(cfg, 0, 1, cache_dir=tmp_path, resume_from=state).iterator(state)  # the other shard's is needed


def test_streaming_and_stored_sources_mix(tmp_path, jsonl, bin_store):
    cfg = DataConfig(sources=[dict(name="stream", hf_dataset="json", hf_data_files=str(jsonl), hf_streaming=True,
                                   window=150, weight=0.5),
                              dict(name="store", path=str(bin_store), weight=0.5)],
                     seq_len=48, global_batch_size=8, seed=1)
    batches = list(iter(Pipeline(cfg, 0, 1, cache_dir=tmp_path)))
    ids = np.concatenate([b["source_id"] for b in batches])
    assert len(batches) > 10 and abs((ids == 0).mean() - 0.5) < 0.05


def test_bad_hugging_face_sources(tmp_path, jsonl):
    no_field = write_jsonl(tmp_path / "c.jsonl", ["a", "b"], field="body")
    for streaming in (False, True):
        with pytest.raises(PrepareError, match="no text field 'text'"):
            Pipeline(DataConfig(sources=[source(no_field, hf_streaming=streaming)], seq_len=8, global_batch_size=1),
                     0, 1, cache_dir=tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(PrepareError, match="empty|cannot load"):
        StreamingSource(source(tmp_path / "empty.jsonl", hf_streaming=True), 8, 0, tmp_path)
    with pytest.raises(PrepareError, match="no-such/dataset"):
        StreamingSource(SourceConfig(name="x", hf_dataset="no-such/dataset", hf_streaming=True), 8, 0, tmp_path)
    with pytest.raises(ConfigError, match="exactly one of 'path'"):
        DataConfig(sources=[dict(name="x", path="p", hf_dataset="json")], seq_len=8, global_batch_size=1)


def test_streaming_through_the_torch_bridge_resumes_exactly(tmp_path, jsonl):
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    from forge_grain.bridges.torch import GrainIterableDataset

    cfg = hf_config(jsonl, "bestfit", batch=4)

    def loader(workers=0):
        return StatefulDataLoader(GrainIterableDataset(cfg, rank=0, world_size=1, cache_dir=tmp_path),
                                  batch_size=None, num_workers=workers)

    full = [b["inputs"].numpy().copy() for b in loader()]
    first = loader()
    it = iter(first)
    head = [next(it)["inputs"].numpy().copy() for _ in range(9)]
    state = first.state_dict()
    second = loader()
    second.load_state_dict(state)
    rest = [b["inputs"].numpy().copy() for b in second]
    assert len(head) + len(rest) == len(full)
    assert all(np.array_equal(a, b) for a, b in zip(head + rest, full))
    with pytest.raises(StateError, match="canonical_workers=1: the worker count must divide it"):
        list(DataLoader(GrainIterableDataset(cfg, rank=0, world_size=1, cache_dir=tmp_path), batch_size=None,
                        num_workers=2))


def test_streaming_rows_are_a_checkpointable_grain_iter_dataset(tmp_path, jsonl):
    import grain

    from forge_grain.sources.stream_cursors import StreamingRows

    rows = StreamingRows(StreamingSource(source(jsonl, hf_streaming=True, window=40), 48, 0, tmp_path))
    grain.experimental.assert_equal_output_after_checkpoint(grain.experimental.LimitIterDataset(rows, count=60))


def test_single_host_streaming_state_through_orbax(tmp_path, jsonl):
    import orbax.checkpoint as ocp

    from forge_grain import checkpoint

    cfg = hf_config(jsonl, "concat", batch=4)
    it = iter(Pipeline(cfg, 0, 1, cache_dir=tmp_path))
    for _ in range(5):
        next(it)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")
    checkpoint.save(mngr, 5, it)
    mngr.wait_until_finished()
    expected = [next(it)["inputs"] for _ in range(6)]
    again = iter(Pipeline(cfg, 0, 1, cache_dir=tmp_path))
    checkpoint.restore(mngr, again)
    assert all(np.array_equal(next(again)["inputs"], e) for e in expected)



def test_streaming_states_of_several_hosts_go_through_the_same_orbax_handler(tmp_path, jsonl):
    """Each host writes its own shard's stream file beside the global state; a restore joins them."""
    from forge_grain import checkpoint

    cfg = hf_config(jsonl, "concat", batch=4)
    handler = checkpoint.PipelineCheckpointHandler()
    item = tmp_path / "item"
    item.mkdir()
    two = [iter(Pipeline(cfg, k, 2, cache_dir=tmp_path)) for k in (0, 1)]
    for it in two:
        for _ in range(3):
            next(it)
        handler.save(item, args=checkpoint.Save(it))  # what each host's Orbax does in the shared directory
    assert sorted(f.name for f in item.iterdir()) == ["state.json", "stream-0-of-2.json", "stream-1-of-2.json"]
    expected = [[next(it)["inputs"] for _ in range(4)] for it in two]
    for k, want in enumerate(expected):
        again = iter(Pipeline(cfg, k, 2, cache_dir=tmp_path))
        handler.restore(item, args=checkpoint.Restore(again))
        assert all(np.array_equal(next(again)["inputs"], e) for e in want)
    with pytest.raises(StateError, match=r"canonical_streams, canonical_workers\] = \[2, 1\]"):
        handler.restore(item, args=checkpoint.Restore(iter(Pipeline(cfg, 0, 1, cache_dir=tmp_path))))
    # one host of a cluster of one reads both hosts' files: it continues with the whole global batch
    state = handler.restore(item)
    one = iter(Pipeline(cfg, 0, 1, cache_dir=tmp_path, resume_from=state))
    handler.restore(item, args=checkpoint.Restore(one))
    for k in range(4):
        assert np.array_equal(next(one)["inputs"], np.concatenate([expected[0][k], expected[1][k]]))
