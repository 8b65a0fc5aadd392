"""Every trainer loop gives the uninterrupted run's batches: stored, streaming and mixed
sources; 0, 1 or 2 DataLoader workers, persistent or not; `set_epoch` at every pass; a state
taken from the tracker, from `StatefulDataLoader` or through DCP, mid-pass, at a pass's last
batch or at training's last; resumed on the same or another world size.

One parametrized test over that grid: a seeded subset by default, all of it with
FORGE_GRAIN_SLOW=1.
"""

from __future__ import annotations

import itertools
import random
import warnings

import numpy as np
import pytest
import torch
from conftest import SLOW, make_texts, write_jsonl
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from forge_grain.bridges.torch import GrainIterableDataset
from forge_grain import DataConfig, Pipeline, prepare

EPOCHS = 4  # passes, so set_epoch runs at 0, 1, 2 and 3
SOURCES = ["stored", "streaming", "mixture"]
WORKERS = [(0, False), (1, False), (2, False), (1, True), (2, True)]
STATES = ["tracker", "stateful", "dcp"]
WHEN = ["mid", "pass_end", "training_end"]
WORLD = [1, 2]  # the world size resumed on (the run that saves has one rank)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("loops")
    texts = make_texts(160, seed=3, empty_every=31)
    files = [str(write_jsonl(base / "s0.jsonl", texts[:80])), str(write_jsonl(base / "s1.jsonl", texts[80:]))]
    stores = {name: prepare(write_jsonl(base / f"{name}.jsonl", make_texts(n, seed=seed)), base / name, progress=False)
              for name, n, seed in (("web", 120, 1), ("code", 80, 2))}  # the streaming source's tokenizer
    return {**stores, "files": files, "cache": base / "cache"}


def make_config(data, kind: str) -> DataConfig:
    stored = [dict(name="web", path=str(data["web"]), weight=0.6, strategy="bos_bestfit"),
              dict(name="code", path=str(data["code"]), weight=0.4)]
    streaming = [dict(name="stream", hf_dataset="json", hf_data_files=data["files"], hf_streaming=True, window=20,
                      weight=0.5)]
    sources = {"stored": stored, "streaming": streaming, "mixture": stored[:1] + streaming}[kind]
    return DataConfig(sources=sources, seq_len=32, global_batch_size=8, seed=4, num_epochs=EPOCHS,
                      canonical_streams=4, canonical_workers=2)


def dataset(data, kind, rank=0, world=1) -> GrainIterableDataset:
    return GrainIterableDataset(make_config(data, kind), rank=rank, world_size=world, cache_dir=data["cache"])


def loader(ds, workers, persistent, stateful=False):
    cls = StatefulDataLoader if stateful else DataLoader
    return cls(ds, batch_size=None, num_workers=workers, persistent_workers=persistent and workers > 0)


_REFERENCE: dict = {}


def reference(data, kind) -> list[np.ndarray]:
    """Every global batch of the uninterrupted run, made in order by one pipeline."""
    if kind not in _REFERENCE:
        p = Pipeline(make_config(data, kind), 0, 1, num_threads=0, cache_dir=data["cache"])
        _REFERENCE[kind] = [p.batch(s)["inputs"].copy() for s in range(p.num_steps)]
    return _REFERENCE[kind]


def run_until(data, kind, workers, persistent, how, k):
    """Train with set_epoch at each pass until k steps are consumed; the state then, and the
    (step, inputs) seen."""
    ds = dataset(data, kind)
    n, seen = len(ds), []
    tracker = ds.tracker()
    dl = loader(ds, workers, persistent, stateful=how == "stateful")
    state = None
    for epoch in range(EPOCHS):
        if len(seen) == k:
            break
        ds.set_epoch(epoch)
        for batch in dl:
            tracker.update(batch)
            seen.append((int(batch["step"]), batch["inputs"].numpy().copy()))
            if len(seen) == k:
                state = dl.state_dict() if how == "stateful" else tracker.state_dict()
                break
    if state is None:  # k == 0
        state = dl.state_dict() if how == "stateful" else tracker.state_dict()
    assert [s for s, _ in seen] == list(range(k)) and n * EPOCHS == ds.num_steps
    return state, seen


def resume(data, kind, workers, persistent, how, state, world, tmp_path, k):
    """A new job of `world` ranks loads the state taken after k steps and trains on to the end,
    as a loop does: from the pass of the state (a tracker's: the pass its next step is in; a
    StatefulDataLoader's: the pass it was taken in, whose rest it yields first). The global
    batches."""
    rank_sets = [dataset(data, kind, r, world) for r in range(world)]
    if how == "dcp":
        import torch.distributed.checkpoint as dcp

        saver = dataset(data, kind).tracker()
        saver.load_state_dict(state)
        dcp.save({"data": saver}, checkpoint_id=tmp_path / "dcp")
        # DCP loads into the structure of the target's state_dict(): on a real job of several ranks that
        # is the tracker's gathered state (all_gather_object), holding every stream, as one rank's does here
        target = dataset(data, kind).tracker()
        dcp.load({"data": target}, checkpoint_id=tmp_path / "dcp")
        for ds in rank_sets:
            ds.tracker().load_state_dict(target.state_dict())
    loaders = [loader(ds, workers, persistent, stateful=how == "stateful") for ds in rank_sets]
    for ds, dl in zip(rank_sets, loaders):
        if how == "stateful":
            dl.load_state_dict(state)
        elif how == "tracker":
            ds.tracker().load_state_dict(state)
    n = len(rank_sets[0])
    if how == "stateful":
        first_epoch = 0 if k == 0 else (k - 1) // n + bool(state.get("_iterator_finished"))
    else:
        first_epoch = k // n
    got = []
    for epoch in range(first_epoch, EPOCHS):
        for ds in rank_sets:
            ds.set_epoch(epoch)
        for parts in zip(*loaders):
            steps = {int(p["step"]) for p in parts}
            assert len(steps) == 1, steps
            got.append((steps.pop(), torch.cat([p["inputs"] for p in parts]).numpy()))
    return got


GRID = [c for c in itertools.product(SOURCES, WORKERS, STATES, WHEN, WORLD)
        if not (c[2] == "stateful" and c[4] != 1)]  # StatefulDataLoader resumes its own worker count and world
DEFAULT = random.Random(25).sample(GRID, 14)


@pytest.mark.parametrize("kind, workers, how, when, world", GRID if SLOW else DEFAULT)
def test_every_loop_resumes_to_the_uninterrupted_batches(data, tmp_path, kind, workers, how, when, world):
    W, persistent = workers
    want = reference(data, kind)
    n = len(want) // EPOCHS
    k = {"mid": n + 3 + (W == 2), "pass_end": 2 * n, "training_end": len(want)}[when]  # an odd step too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state, seen = run_until(data, kind, W, persistent, how, k)
        got = resume(data, kind, W, persistent, how, state, world, tmp_path, k)
    everything = seen + got
    assert [s for s, _ in everything] == list(range(len(want)))
    for s, inputs in everything:
        assert np.array_equal(inputs, want[s]), s


# -- the audit's six cases, one test each --------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_set_epoch_on_a_streaming_source_starts_that_epoch(data, workers):
    """What Trainer does at every epoch: set_epoch(1) on a fresh dataset (no pass 0 run here)."""
    ds = dataset(data, "streaming")
    n = len(ds)
    ds.set_epoch(1)
    got = [(int(b["step"]), b["inputs"].numpy()) for b in DataLoader(ds, batch_size=None, num_workers=workers)]
    assert [s for s, _ in got] == list(range(n, 2 * n))
    assert all(np.array_equal(x, reference(data, "streaming")[s]) for s, x in got)


def test_a_stateful_dataloader_state_after_the_last_batch_loads(data):
    """The state a job saves after its last step (a one-epoch config: the pass is all of it),
    taken in the loop, before the loader has seen the end: a worker's next step is past it."""
    import dataclasses

    cfg = dataclasses.replace(make_config(data, "stored"), num_epochs=1)
    make = lambda: GrainIterableDataset(cfg, rank=0, world_size=1, cache_dir=data["cache"])  # noqa: E731
    ds = make()
    dl = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    for i, _ in enumerate(dl):
        if i == ds.num_steps - 1:
            state = dl.state_dict()
            break
    again = StatefulDataLoader(make(), batch_size=None, num_workers=2)
    again.load_state_dict(state)
    assert list(again) == []  # nothing is left of the run
    assert [int(b["step"]) for b in again] == list(range(ds.num_steps))  # and a new pass is whole


def test_a_streaming_tracker_state_at_an_odd_step_resumes_under_two_workers(data):
    ds = dataset(data, "streaming")
    tracker = ds.tracker()
    for batch in DataLoader(ds, batch_size=None, num_workers=2):
        tracker.update(batch)
        if int(batch["step"]) == 6:
            break
    state = tracker.state_dict()
    assert state["step"] == 7
    again = dataset(data, "streaming")
    again.tracker().load_state_dict(state)
    got = [(int(b["step"]), b["inputs"].numpy()) for b in DataLoader(again, batch_size=None, num_workers=2)]
    assert [s for s, _ in got] == list(range(7, len(again)))
    assert all(np.array_equal(x, reference(data, "streaming")[s]) for s, x in got)


@pytest.mark.parametrize("kind", SOURCES)
def test_len_times_epochs_is_every_step(data, kind):
    ds = dataset(data, kind)
    assert len(ds) * EPOCHS == ds.num_steps == len(reference(data, kind))


def test_the_kempnerforge_streaming_drop_in_repeats_no_sample_under_workers(data):
    """With forge-grain's semantics, worker 0 makes the rank's one stream (KempnerForge's own
    semantics: `datasets` deals files to workers; see test_kempnerforge)."""
    from forge_grain.bridges.kempnerforge import StreamingHuggingFaceDataset
    from forge_grain.tokenizer import DEFAULT_TOKENIZER

    def samples(workers):
        ds = StreamingHuggingFaceDataset(data["files"][0], "train", "text", 32, str(DEFAULT_TOKENIZER),
                                         semantics="forge_grain", window=20, cache_dir=data["cache"])
        out = []
        for s in DataLoader(ds, batch_size=None, num_workers=workers):
            out.append(s["input_ids"].numpy().tobytes())
            if len(out) == 60:
                break
        return out

    alone, two = samples(0), samples(2)
    assert two == alone and len(set(two)) == len(two)


def test_padding_free_takes_either_convention(data):
    from forge_grain.bridges.torch_varlen import padding_free

    forge = next(iter(DataLoader(dataset(data, "stored"), batch_size=None)))
    hf_ds = GrainIterableDataset(make_config(data, "stored"), rank=0, world_size=1, convention="hf",
                                 cache_dir=data["cache"])
    hf = next(iter(DataLoader(hf_ds, batch_size=None)))
    a, b = padding_free(forge), padding_free(hf)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


# -- Lightning's Trainer ---------------------------------------------------------------------------


class _Crash(Exception):
    pass


@pytest.mark.parametrize("kind", ["stored", "streaming"])
def test_lightning_trainer_resumes_mid_epoch_from_its_checkpoint(data, tmp_path, kind):
    """The recipe: set_epoch in on_train_epoch_start, a StatefulDataLoader (Lightning saves its
    state in the checkpoint), 3 epochs, 2 workers; a crash mid-epoch 2 and fit(ckpt_path=...)."""
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Tiny(L.LightningModule):
        def __init__(self, seen):
            super().__init__()
            self.ds, self.seen = dataset(data, kind), seen
            self.emb = torch.nn.Embedding(8192, 16)
            self.out = torch.nn.Linear(16, 8192)

        def train_dataloader(self):
            return StatefulDataLoader(self.ds, batch_size=None, num_workers=2)

        def on_train_epoch_start(self):
            self.ds.set_epoch(self.current_epoch)  # Lightning sets samplers' epochs, not an iterable dataset's

        def training_step(self, batch, _):
            self.seen.append((int(batch["step"]), batch["inputs"].numpy().copy()))
            logits = self.out(self.emb(batch["inputs"]))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(),
                                                     reduction="none")
            return (loss * batch["loss_mask"].flatten()).sum() / batch["loss_mask"].sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class CrashAfter(L.Callback):
        def __init__(self, step):
            self.step = step

        def on_train_batch_start(self, trainer, *_):
            if trainer.global_step == self.step:
                raise _Crash

    epochs = 3
    n = len(dataset(data, kind))
    k = n + n // 2  # the middle of epoch 2
    trainer = lambda run, *callbacks: L.Trainer(  # noqa: E731
        accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path / run,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / run, every_n_train_steps=k, save_top_k=-1), *callbacks])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full: list = []
        trainer("full").fit(Tiny(full))
        before: list = []
        with pytest.raises(_Crash):
            trainer("crashed", CrashAfter(k)).fit(Tiny(before))
        (ckpt,) = (tmp_path / "crashed").glob(f"*step={k}.ckpt")
        after: list = []
        trainer("resumed").fit(Tiny(after), ckpt_path=ckpt)
    want = reference(data, kind)
    assert [s for s, _ in full] == list(range(epochs * n))  # 3 epochs of 4 passes' steps
    assert [s for s, _ in before + after] == list(range(epochs * n))
    assert all(np.array_equal(x, want[s]) for s, x in full + before + after)
