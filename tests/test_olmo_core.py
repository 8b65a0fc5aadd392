"""forge-grain inside OLMo-core: its data-loader contract, and its own Trainer and Checkpointer
run for real (torchrun, 2 ranks, gloo), killed after a checkpoint and restarted on 2 ranks and on 1.

The reference for every trained batch is the forge-grain pipeline itself (shard r of W, step
s - 1 for OLMo-core's step s), turned into OLMo-core's keys by `olmo_batch`; the labels OLMo-core
makes from those keys are checked against the pipeline's own targets.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SLOW, make_texts, write_jsonl
from framework_runs import step_records, two_store_toml

olmo_core = pytest.importorskip("olmo_core")
import torch  # noqa: E402
from multiproc import free_port  # noqa: E402
from olmo_core.data.data_loader import TextDataLoaderBase  # noqa: E402
from olmo_core.data.utils import get_cumulative_document_lengths, get_labels  # noqa: E402

from forge_grain.bridges.olmo import ForgeGrainDataLoader, ForgeGrainDataLoaderConfig, olmo_batch  # noqa: E402
from forge_grain import DataConfig, Pipeline, StateError, prepare  # noqa: E402
from forge_grain.packing.varlen import varlen  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Two small stores and a 2-epoch config: 17 steps an epoch of 8 rows x 64 tokens."""
    return two_store_toml(tmp_path_factory.mktemp("olmo"), (120, 80), (1, 2), seed=3, weights=(0.6, 0.4))


def loader(toml, tmp_path, rank=0, world=1, **kw) -> ForgeGrainDataLoader:
    return ForgeGrainDataLoader(toml, work_dir=tmp_path / "work", dp_world_size=world, dp_rank=rank,
                                fs_local_rank=0, **kw)


def digest(batch: dict) -> str:
    h = hashlib.sha256()
    for key in ("input_ids", "label_mask"):
        h.update(batch[key].contiguous().numpy().tobytes())
    return h.hexdigest()


def expected(toml, world: int, steps: int) -> dict:
    """{(OLMo-core step, rank): hash} from the pipeline itself."""
    cfg = DataConfig.from_toml(toml)
    out = {}
    for r in range(world):
        p = Pipeline(cfg, r, world, num_threads=0)
        for s in range(steps):
            out[(s + 1, r)] = digest(olmo_batch(p.batch(s), intra_document=False))
    return out


# -- the contract, without the Trainer ----------------------------------------------------------


def test_batches_are_olmo_core_keys_and_its_labels_are_the_pipelines_targets(small, tmp_path):
    dl = loader(small, tmp_path)
    assert isinstance(dl, TextDataLoaderBase)
    dl.reshuffle(epoch=1)
    batch = next(iter(dl))  # TextDataLoaderBase checks input_ids holds rank_batch_size tokens
    raw = dl.pipeline.batch(0)
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (8, 64)
    assert dl.global_batch_size == 8 * 64 == dl.rank_batch_size and dl.global_num_tokens_in_batch(batch) == 512
    labels = get_labels(dict(batch)).numpy()  # OLMo-core's own: input_ids shifted, label_mask applied
    want = np.where(raw["loss_mask"], raw["targets"], -100)
    assert np.array_equal(labels[:, :-1], want[:, :-1])  # every target but a row's last, masked as trained
    assert (labels[:, -1] == -100).all()
    # intra-document masking: OLMo-core's cumulative lengths are forge-grain's varlen ones
    lens = batch["doc_lens"]
    assert (lens.sum(dim=1) == 64).all() and batch["max_doc_lens"] == lens.max(dim=1).values.tolist()
    cu = varlen(raw)["cu_seqlens"]
    assert np.array_equal(get_cumulative_document_lengths(lens).numpy(), cu[: len(np.unique(cu))])
    assert set(batch) == {"input_ids", "label_mask", "doc_lens", "max_doc_lens"}
    mock = dl.get_mock_batch()
    assert mock["input_ids"].shape == batch["input_ids"].shape and mock["doc_lens"].sum() == 8 * 64


@pytest.mark.parametrize("workers", [0, 2])
def test_epochs_are_the_pipelines_passes(small, tmp_path, workers):
    dl = loader(small, tmp_path, rank=1, world=2, num_workers=workers)
    p = Pipeline(DataConfig.from_toml(small), 1, 2, num_threads=0)
    n = p.steps_per_epoch
    assert dl.total_batches == dl.batches_in_epoch(2) == n and dl.batches_in_epoch(3) == 0
    for epoch in (1, 2):
        dl.reshuffle(epoch)
        got = [digest(b) for b in dl]
        assert got == [digest(olmo_batch(p.batch(s), False)) for s in range((epoch - 1) * n, epoch * n)]
        assert dl.batches_processed == n and dl.tokens_processed == n * dl.global_batch_size
        dl.reset()


def test_a_state_resumes_mid_epoch_on_another_rank_count(small, tmp_path):
    two = [loader(small, tmp_path, rank=r, world=2) for r in range(2)]
    for dl in two:
        dl.reshuffle(2)
        it = iter(dl)
        for _ in range(5):
            next(it)
    states = [dl.state_dict() for dl in two]
    assert states[0] == states[1]  # global: the same on every rank (OLMo-core falls back to rank 0's)
    one = loader(small, tmp_path)
    one.load_state_dict(json.loads(json.dumps(states[0])))  # a checkpoint's round trip
    one.reshuffle(2)  # the Trainer reshuffles after loading
    n = one.total_batches
    assert one.batches_processed == 5 and one.tokens_processed == 5 * 512
    p = Pipeline(DataConfig.from_toml(small), 0, 1, num_threads=0)
    assert [digest(b) for b in one] == [digest(olmo_batch(p.batch(s), False)) for s in range(n + 5, 2 * n)]


def test_a_mixture_with_a_streaming_source_resumes_mid_epoch(tmp_path):
    """The state carries the streams' positions: a new loader continues them exactly."""
    web = prepare(write_jsonl(tmp_path / "web.jsonl", make_texts(120, seed=1)), tmp_path / "web", progress=False)
    files = [str(write_jsonl(tmp_path / f"s{i}.jsonl", make_texts(60, seed=5 + i))) for i in range(2)]
    cfg = DataConfig(sources=[dict(name="web", path=str(web), weight=0.5),
                              dict(name="stream", hf_dataset="json", hf_data_files=files, hf_streaming=True, window=20,
                                   weight=0.5)],
                     seq_len=32, global_batch_size=8, seed=4, num_epochs=2, canonical_streams=4, canonical_workers=2)
    first = ForgeGrainDataLoader(cfg, work_dir=tmp_path, dp_world_size=1, dp_rank=0, cache_dir=tmp_path / "cache")
    first.reshuffle(1)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["forge_grain"]["streams"]  # the streams' positions, not only a step
    again = ForgeGrainDataLoader(cfg, work_dir=tmp_path, dp_world_size=1, dp_rank=0, cache_dir=tmp_path / "cache")
    again.load_state_dict(state)
    p = Pipeline(cfg, 0, 1, num_threads=0, cache_dir=tmp_path / "cache")
    want = [digest(olmo_batch(p.batch(s), False)) for s in range(p.num_steps)]
    got = []
    for epoch in (1, 2):
        again.reshuffle(epoch)
        got += [digest(b) for b in again]
        again.reset()
    assert got == want[3:]


def test_what_it_cannot_do_is_said(small, tmp_path):
    dl = loader(small, tmp_path)
    with pytest.raises(RuntimeError, match="set global_batch_size .* in the forge-grain config"):
        dl.global_batch_size = 2 * dl.global_batch_size  # OLMo-core's BatchSizeSchedulerCallback
    with pytest.raises(ValueError, match="not saved by forge-grain"):
        dl.load_state_dict({"dataset_fingerprint": "x", "batches_processed": 3, "epoch": 1})
    other = DataConfig.from_toml(small)
    other.seed = 99
    with pytest.raises(StateError):
        ForgeGrainDataLoader(other, work_dir=tmp_path).load_state_dict(dl.state_dict())
    ramp = DataConfig.from_toml(small)
    ramp.batch_sizes = [[0, 4], [6, 8]]
    with pytest.raises(ValueError, match="BatchSizeSchedulerCallback"):
        ForgeGrainDataLoader(ramp, work_dir=tmp_path)


def test_the_config_builds_from_a_toml(small, tmp_path):
    dl = ForgeGrainDataLoaderConfig(config=str(small), work_dir=str(tmp_path), num_workers=1).build()
    assert (dl.dp_rank, dl.dp_world_size, dl.num_workers) == (0, 1, 1)
    assert dl.pipeline.config == DataConfig.from_toml(small)


# -- OLMo-core's Trainer and Checkpointer, killed and restarted ---------------------------------


def train(toml, folder, record, *, ranks=2, crash_after=0, workers=0, epochs=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={free_port()}",
           str(SCRIPTS / "olmo_train.py"), str(toml), str(folder), str(record), str(epochs), "4",
           str(crash_after), str(workers)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return r


RESTARTS = [(2, 0), (1, 0)] + ([(2, 2), (1, 2)] if SLOW else [])  # (ranks after the restart, its workers)


def test_olmo_core_trainer_killed_after_a_checkpoint_resumes_exactly(small, tmp_path):
    """Killed in epoch 2, a step after a checkpoint (one every 4 steps): restarted from OLMo-core's
    latest checkpoint it trains every step after the checkpoint, each once, as the pipeline's
    batches, on 2 ranks and on 1."""
    n = Pipeline(DataConfig.from_toml(small), 0, 1, num_threads=0).steps_per_epoch
    total, crash = 2 * n, n + 5  # the last checkpoint before the crash: step n + 4 - (n + 4) % 4
    saved = crash - crash % 4
    if SLOW:  # the uninterrupted run trains the pipeline's batches too
        whole = train(small, tmp_path / "whole", tmp_path / "whole")
        assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-5000:]
        assert step_records(tmp_path / "whole", 2) == expected(small, 2, total)
    first = train(small, tmp_path / "ckpt", tmp_path / "first", crash_after=crash)
    assert first.returncode != 0, "the run was to die after its checkpoint"
    got = step_records(tmp_path / "first", 2)
    want2 = expected(small, 2, total)
    assert sorted(got) == sorted((s, r) for s in range(1, crash + 1) for r in range(2))
    assert got == {k: want2[k] for k in got}
    for ranks, workers in RESTARTS:
        folder = tmp_path / f"ckpt-{ranks}-{workers}"
        shutil.copytree(tmp_path / "ckpt", folder)
        rec = tmp_path / f"after-{ranks}-{workers}"
        r = train(small, folder, rec, ranks=ranks, workers=workers)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
        after = step_records(rec, ranks)
        assert sorted(after) == sorted((s, q) for s in range(saved + 1, total + 1) for q in range(ranks))
        want = want2 if ranks == 2 else expected(small, ranks, total)
        assert after == {k: want[k] for k in after}, f"restart on {ranks} ranks, {workers} workers"
