"""The torch bridge: DDP ranks, StatefulDataLoader resume, elastic resume, conventions, devices."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import config, write_toml
from multiproc import free_port
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from forge_grain.bridges.torch import DeviceLoader, GrainIterableDataset
from forge_grain import DataConfig, Pipeline, StateError

SCRIPTS = Path(__file__).parent / "scripts"


def small(stores, **kw):
    return config(stores, num_epochs=0.5, **kw)  # a few dozen steps


def steps_and_inputs(batches):
    return [(int(b["step"]), b["inputs"].numpy().copy()) for b in batches]


def assert_same(a, b):
    assert [s for s, _ in a] == [s for s, _ in b]
    assert all(np.array_equal(x, y) for (_, x), (_, y) in zip(a, b))


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_workers_yield_the_steps_in_order(stores, workers):
    ds = GrainIterableDataset(small(stores), rank=0, world_size=1)
    got = steps_and_inputs(DataLoader(ds, batch_size=None, num_workers=workers))
    assert [s for s, _ in got] == list(range(ds.num_steps))
    ref = Pipeline(small(stores), 0, 1, num_threads=0)
    assert all(np.array_equal(x, ref.batch(s)["inputs"]) for s, x in got)


@pytest.mark.parametrize("workers, persistent", [(0, False), (1, False), (2, False), (1, True), (2, True)])
def test_stateful_dataloader_resumes_exactly_across_an_epoch_boundary(stores, workers, persistent):

    def loader():
        ds = GrainIterableDataset(small(stores), rank=0, world_size=1)
        return StatefulDataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=persistent)

    n = loader().dataset.num_steps
    full = loader()
    reference = steps_and_inputs(list(full)) + steps_and_inputs(list(full))  # two epochs
    first = loader()
    it = iter(first)
    consumed = steps_and_inputs(next(it) for _ in range(n - 3))
    state = first.state_dict()
    del it
    second = loader()
    second.load_state_dict(state)
    rest = steps_and_inputs(list(second))  # the end of epoch 0 ...
    rest += steps_and_inputs(list(second))  # ... and a whole epoch 1 (not just the leftovers)
    assert_same(consumed + rest, reference)


@pytest.mark.parametrize("taken", [0, 1])
def test_a_stateful_dataloader_resumed_from_the_global_step_saves_its_own_state_at_once(stores, taken):
    """A StatefulDataLoader whose dataset resumed from the tracker's global state (a resume that
    changed something: another world size, a skip) saves its own state before every worker has
    made a batch: that state resumes where the run is, not at the pass start (a worker that had
    not begun reported step 1, and the next process trained steps 1, 3, ... again)."""
    cfg = small(stores)
    want = steps_and_inputs(DataLoader(GrainIterableDataset(cfg, rank=0, world_size=1), batch_size=None))
    state = Pipeline(cfg, 0, 1, num_threads=0).state_at(4)
    ds = GrainIterableDataset(cfg, rank=0, world_size=1)
    ds.tracker().load_state_dict(state)
    first = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    it = iter(first)
    head = steps_and_inputs(next(it) for _ in range(taken))
    saved = first.state_dict()
    del it
    again = StatefulDataLoader(GrainIterableDataset(cfg, rank=0, world_size=1), batch_size=None, num_workers=2)
    again.load_state_dict(saved)
    assert_same(head + steps_and_inputs(again), want[4:])


def test_hf_convention_follows_the_loss_mask(stores):
    forge = next(iter(GrainIterableDataset(small(stores), rank=0, world_size=1)))
    hf = next(iter(GrainIterableDataset(small(stores), rank=0, world_size=1, convention="hf", dtype=torch.int32)))
    assert set(hf) == {"input_ids", "labels", "attention_mask", "position_ids", "is_natural_stop", "segment_ids",
                       "source_id", "step"}
    assert torch.equal(hf["segment_ids"].long(), forge["segment_ids"])  # for the attention helpers
    assert hf["input_ids"].dtype == torch.int32 and forge["inputs"].dtype == torch.int64
    assert torch.equal(hf["input_ids"].long(), forge["inputs"])
    # the model shifts labels: labels[j + 1] is the target of position j
    expected = torch.where(forge["loss_mask"][:, :-1], forge["targets"][:, :-1], torch.tensor(-100))
    assert torch.equal(hf["labels"][:, 1:].long(), expected)
    assert (hf["labels"][:, 0] == -100).all()
    assert torch.equal(hf["attention_mask"].bool(), forge["segment_ids"] > 0)
    assert torch.equal(hf["position_ids"].long(), forge["positions"])
    # helix's is_natural_stop, aligned with labels: the label there is its document's true last token
    assert torch.equal(hf["is_natural_stop"][:, 1:], forge["natural_stop"][:, :-1])
    assert forge["natural_stop"].any() and not hf["is_natural_stop"][:, 0].any()


def test_elastic_resume_from_the_global_step(stores):
    cfg = small(stores)
    k = 5
    # 2 ranks x 2 workers, training k steps
    ranks = [GrainIterableDataset(cfg, rank=r, world_size=2) for r in range(2)]
    trackers = [ds.tracker() for ds in ranks]
    for ds, tracker in zip(ranks, trackers):
        for _, batch in zip(range(k), DataLoader(ds, batch_size=None, num_workers=2)):
            tracker.update(batch)
    state = trackers[0].state_dict()
    assert state == trackers[1].state_dict() and state["step"] == k
    whole = Pipeline(cfg, 0, 1, num_threads=0)
    for world, workers in ((1, 0), (4, 3)):
        parts = []
        for r in range(world):
            ds = GrainIterableDataset(cfg, rank=r, world_size=world)
            ds.tracker().load_state_dict(state)
            parts.append(list(DataLoader(ds, batch_size=None, num_workers=workers)))
        assert all(len(p) == whole.num_steps - k for p in parts)
        for i, step in enumerate(range(k, whole.num_steps)):
            got = torch.cat([p[i]["inputs"] for p in parts]).numpy()
            assert np.array_equal(got, whole.global_batch(step)["inputs"]), (world, workers, step)


def test_tracker_state_after_resume_pass_does_not_leak_into_the_next_epoch(stores):
    cfg = small(stores)
    ds = GrainIterableDataset(cfg, rank=0, world_size=1)
    tracker = ds.tracker()
    tracker.load_state_dict(Pipeline(cfg, 0, 1, num_threads=0).state_at(4))
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    first = []
    for b in loader:
        tracker.update(b)
        first.append(int(b["step"]))
    assert first == list(range(4, ds.num_steps))
    assert [int(b["step"]) for b in loader] == list(range(ds.num_steps))  # the next epoch is whole


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loaded_state_applies_to_the_next_pass_only_whatever_the_workers(stores, workers):
    """Without tracker.update() too: the pass after the resumed one starts at 0 for any worker count."""
    cfg = small(stores)
    ds = GrainIterableDataset(cfg, rank=0, world_size=1)
    ds.tracker().load_state_dict(Pipeline(cfg, 0, 1, num_threads=0).state_at(4))
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    assert [int(b["step"]) for b in loader] == list(range(4, ds.num_steps))
    assert [int(b["step"]) for b in loader] == list(range(ds.num_steps))


def test_a_state_loaded_while_persistent_workers_run_is_applied(stores):
    cfg = small(stores)
    ds = GrainIterableDataset(cfg, rank=0, world_size=1)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    assert [int(b["step"]) for b in loader] == list(range(ds.num_steps))  # the workers are now running
    ds.tracker().load_state_dict(Pipeline(cfg, 0, 1, num_threads=0).state_at(3))
    assert [int(b["step"]) for b in loader] == list(range(3, ds.num_steps))
    assert [int(b["step"]) for b in loader] == list(range(ds.num_steps))


def test_tracker_is_a_dcp_stateful(tmp_path, stores):
    import torch.distributed.checkpoint as dcp

    cfg = small(stores)
    ds = GrainIterableDataset(cfg, rank=0, world_size=1)
    tracker = ds.tracker()
    for _, b in zip(range(3), DataLoader(ds, batch_size=None)):
        tracker.update(b)
    dcp.save({"data": tracker}, checkpoint_id=tmp_path / "ckpt")
    fresh = GrainIterableDataset(cfg, rank=0, world_size=1)
    restored = fresh.tracker()
    dcp.load({"data": restored}, checkpoint_id=tmp_path / "ckpt")
    assert restored.state_dict()["step"] == 3
    assert int(next(iter(DataLoader(fresh, batch_size=None)))["step"]) == 3


def test_states_from_other_configs_or_worker_counts_are_refused(stores):
    ds = GrainIterableDataset(small(stores), rank=0, world_size=1)
    other = GrainIterableDataset(small(stores, seed=99), rank=0, world_size=1)
    with pytest.raises(StateError):
        other.tracker().load_state_dict(ds.tracker().state_dict())
    worker_state = {"kind": "worker", "next_step": 4, "num_workers": 2, "fingerprint": ds.pipeline.fingerprint}
    ds.load_state_dict(worker_state)
    with pytest.raises(StateError, match="saved with 2 workers cannot resume 1"):
        next(iter(ds))


def test_device_loader_on_cpu_and_pinned_memory(stores):
    ds = GrainIterableDataset(small(stores), rank=0, world_size=1)
    loader = DataLoader(ds, batch_size=None, num_workers=1, pin_memory=torch.cuda.is_available())
    ref = list(DataLoader(ds, batch_size=None))
    got = list(DeviceLoader(loader, "cpu"))
    assert len(got) == len(ref) and all(torch.equal(a["inputs"], b["inputs"]) for a, b in zip(got, ref))


def test_torchrun_two_ranks_with_gloo_concatenate_to_the_global_batch(tmp_path, stores):
    cfg_path = write_toml(tmp_path / "data.toml", stores)
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
         str(SCRIPTS / "torch_ddp.py"), str(cfg_path), "6", str(tmp_path / "rank")],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    parts = [np.load(tmp_path / f"rank{i}.npz") for i in range(2)]
    whole = Pipeline(DataConfig.from_toml(cfg_path), 0, 1, num_threads=0)
    for i in range(6):
        assert [int(p["steps"][i]) for p in parts] == [i, i]
        union = np.concatenate([p[f"inputs_{i}"] for p in parts])
        assert np.array_equal(union, whole.global_batch(i)["inputs"])


# -- trainers that want a length and epochs ------------------------------------------------------


def test_len_is_one_pass_and_set_epoch_continues_with_the_next_epoch(stores):
    cfg = config(stores, num_epochs=3)
    ds = GrainIterableDataset(cfg, rank=0, world_size=1)
    n = ds.pipeline.rows_per_epoch // cfg.global_batch_size
    assert len(ds) == n and ds.num_steps >= 3 * n
    first = [int(b["step"]) for b in DataLoader(ds, batch_size=None)]
    replay = [int(b["step"]) for b in DataLoader(ds, batch_size=None)]
    assert first == replay == list(range(n))  # without set_epoch: each pass is pass 0
    for epoch in (1, 2):
        ds.set_epoch(epoch)
        for workers in (0, 2):
            got = sorted(int(b["step"]) for b in DataLoader(ds, batch_size=None, num_workers=workers))
            assert got == list(range(epoch * n, (epoch + 1) * n))
    ds.set_epoch(4)  # (epoch 3 holds the 0-2 steps that 3 epochs of rows leave over whole passes)
    with pytest.raises(StateError, match=r"epoch 4 starts at step \d+, past the pipeline's \d+ steps"):
        next(iter(ds))
    one = GrainIterableDataset(config(stores, num_epochs=1), rank=0, world_size=1)
    assert len(one) == one.num_steps  # one epoch: a pass is the whole pipeline


def test_hugging_face_trainer_schedules_exactly_and_sees_the_next_epoch(stores, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    cfg = config(stores, num_epochs=2)
    ds = GrainIterableDataset(cfg, rank=0, world_size=1, convention="hf")
    seen = []

    def collate(items):  # the dataset yields whole batches: keep the model's keys, note the step
        (batch,) = items
        seen.append(int(batch["step"]))
        return {k: batch[k] for k in ("input_ids", "labels", "attention_mask", "position_ids")}

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=1000, n_positions=64, n_embd=32, n_layer=1, n_head=2))
    import inspect

    # a warm-up ratio: `warmup_ratio` before transformers 5, a float `warmup_steps` below 1 since
    ratio = ({"warmup_ratio": 0.25} if "warmup_ratio" in inspect.signature(transformers.TrainingArguments).parameters
             else {"warmup_steps": 0.25})
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), num_train_epochs=2, per_device_train_batch_size=1, **ratio,
        learning_rate=1e-3, lr_scheduler_type="linear", report_to=[], save_strategy="no", logging_steps=1,
        use_cpu=True, remove_unused_columns=False, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, data_collator=collate)
    trainer.train()
    n = len(ds)
    assert trainer.state.max_steps == 2 * n  # the schedule's total is exact
    assert seen == list(range(2 * n))  # epoch 1 is the pipeline's next epoch, not a replay of epoch 0
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    warmup = args.get_warmup_steps(2 * n)
    assert warmup == -(-2 * n // 4) and lrs[warmup - 1] == pytest.approx(1e-3, rel=0.05)  # peak after warm-up
    assert lrs[0] < lrs[warmup - 1] and lrs[-1] < lrs[warmup]


def test_a_resume_inside_a_later_pass_runs_to_that_pass_end(stores):
    cfg = config(stores, num_epochs=3)
    ds = GrainIterableDataset(cfg, rank=0, world_size=1)
    n = len(ds)
    tracker = ds.tracker()
    ds.set_epoch(1)
    for batch in DataLoader(ds, batch_size=None):
        tracker.update(batch)
        if int(batch["step"]) == n + 3:
            break
    state = tracker.state_dict()
    again = GrainIterableDataset(cfg, rank=0, world_size=1)  # a restarted job that forgot set_epoch
    again.tracker().load_state_dict(state)
    assert [int(b["step"]) for b in DataLoader(again, batch_size=None)] == list(range(n + 4, 2 * n))


def large(stores):
    """Batches whose id tensors reach 64 KiB: those go through the workers' shared-memory slots."""
    return config(stores, seq_len=512, global_batch_size=16, num_epochs=None, max_steps=40)


def test_worker_batches_through_shared_memory_slots_are_never_overwritten_while_held(stores):
    from forge_grain.bridges import torch_slots

    cfg = large(stores)
    ref = Pipeline(cfg, 0, 1, num_threads=0, dtype=np.int64)
    mapped_before = set(torch_slots._RINGS)
    it = iter(DataLoader(GrainIterableDataset(cfg, rank=0, world_size=1), batch_size=None, num_workers=2))
    held = [next(it) for _ in range(3)]  # kept while the workers refill their other slots many times over
    later = [(int(b["step"]), b["inputs"].numpy().copy(), b["loss_mask"].numpy().copy()) for b in it]
    rings = set(torch_slots._RINGS) - mapped_before
    assert len(rings) == 2  # one ring a worker, mapped by this process ...
    assert not any(os.path.exists(p) for p in rings)  # ... and its name removed once mapped
    assert [int(b["step"]) for b in held] + [s for s, _, _ in later] == list(range(ref.num_steps))
    assert ref.num_steps - 3 > 2 * torch_slots.SLOTS
    for b in held:
        want = ref.batch(int(b["step"]))
        assert np.array_equal(b["inputs"].numpy(), want["inputs"])
        assert np.array_equal(b["positions"].numpy(), want["positions"])
    for s, inputs, mask in later:
        want = ref.batch(s)
        assert np.array_equal(inputs, want["inputs"]) and np.array_equal(mask, want["loss_mask"])


def test_a_caller_holding_every_batch_gets_them_all_intact(stores):
    """More batches held than a worker has slots: the rest go torch's own way, none overwritten."""
    cfg = large(stores)
    ref = Pipeline(cfg, 0, 1, num_threads=0, dtype=np.int64)
    got = list(DataLoader(GrainIterableDataset(cfg, rank=0, world_size=1, convention="hf"), batch_size=None,
                          num_workers=2))
    assert len(got) == ref.num_steps
    for b in got:
        assert np.array_equal(b["input_ids"].numpy(), ref.batch(int(b["step"]))["inputs"])


def test_without_dev_shm_worker_batches_go_torch_s_way(stores, tmp_path, monkeypatch):
    from forge_grain.bridges import torch_slots

    monkeypatch.setattr(torch_slots, "SHM_DIR", str(tmp_path / "no-shm"))  # forked workers see it too
    cfg = large(stores)
    ref = Pipeline(cfg, 0, 1, num_threads=0, dtype=np.int64)
    got = steps_and_inputs(DataLoader(GrainIterableDataset(cfg, rank=0, world_size=1), batch_size=None,
                                      num_workers=2))
    assert_same(got, [(s, ref.batch(s)["inputs"]) for s in range(ref.num_steps)])


def test_rings_of_exited_workers_are_swept_and_live_ones_kept_whatever_their_pid(tmp_path, monkeypatch):
    """A worker's ring is its own while the worker lives: one whose worker exited before the
    main process mapped it goes when the next ring is made; a live one stays, also when the
    pid in its name is free here (a container of the same pod, sharing /dev/shm and the host
    name, runs in its own pid namespace: the sweep by pid removed its rings)."""
    from forge_grain.bridges import torch_slots
    from forge_grain.locks import hold_for_life

    monkeypatch.setattr(torch_slots, "SHM_DIR", str(tmp_path))
    make = "import sys; from forge_grain.bridges import torch_slots as t; t.SHM_DIR = sys.argv[1]; print(t.SlotRing(1 << 16).path)"
    exited = Path(subprocess.run([sys.executable, "-c", make, str(tmp_path)], capture_output=True, text=True,
                                 check=True).stdout.strip())
    assert exited.exists()  # (no main process mapped it)
    live = torch_slots.SlotRing(1 << 16)
    elsewhere = tmp_path / exited.name.replace(exited.name.rsplit("-", 1)[1], "abc")  # the exited pid, alive elsewhere
    held = hold_for_life(tmp_path / ".held", elsewhere)
    other_host = tmp_path / f"{torch_slots.PREFIX}otherhost-1-abc"
    other_host.write_bytes(b"x")
    try:
        ring = torch_slots.SlotRing(1 << 16)  # a new ring sweeps first
        assert not exited.exists()
        assert Path(live.path).exists() and elsewhere.exists() and Path(ring.path).exists() and other_host.exists()
    finally:
        os.close(held)


def test_a_full_dev_shm_makes_worker_batches_go_torch_s_way(stores, monkeypatch):
    """The ring's pages are reserved when it is made: no room is an error there (and torch's own
    way), never a SIGBUS on a later write."""
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)  # forked workers see it too
    cfg = large(stores)
    ref = Pipeline(cfg, 0, 1, num_threads=0, dtype=np.int64)
    got = steps_and_inputs(DataLoader(GrainIterableDataset(cfg, rank=0, world_size=1), batch_size=None,
                                      num_workers=2))
    assert_same(got, [(s, ref.batch(s)["inputs"]) for s in range(ref.num_steps)])
    from forge_grain.bridges import torch_slots
    assert not list(Path(torch_slots.SHM_DIR).glob(f"{torch_slots.PREFIX}{torch_slots._HOST}-*"))  # none left


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_a_job_stopped_by_a_signal_leaves_no_resume_directory_once_the_next_starts(stores, tmp_path, monkeypatch,
                                                                                    request):
    """A dataset keeps a small directory in the temporary directory for its DataLoader workers.
    A job preempted (SIGTERM) or killed runs no exit handler: the next job on the host removes
    what it left, and never the directory of a job still running."""
    import select
    import shutil
    import signal
    import tempfile

    from forge_grain.bridges.torch_channel import ResumeChannel

    # (a short path: torch's workers hand batches over AF_UNIX sockets made there, and a path
    # longer than 107 bytes fails in their feeder thread, which leaves the DataLoader waiting)
    tmp = Path(tempfile.mkdtemp(prefix="fg-"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    toml = write_toml(tmp_path / "run.toml", stores)
    job = ("import sys, torch\n"
           "from forge_grain import DataConfig\n"
           "from forge_grain.bridges.torch import GrainIterableDataset\n"
           f"ds = GrainIterableDataset(DataConfig.from_toml({str(toml)!r}), rank=0, world_size=1)\n"
           "it = iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1))\n"
           "next(it)\n"
           "print('running', flush=True)\n"
           "sys.stdin.read()\n")

    def start():
        proc = subprocess.Popen([sys.executable, "-c", job], env={**os.environ, "TMPDIR": str(tmp)},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        if not ready:
            proc.kill()
        assert ready and proc.stdout.readline() == "running\n", f"the job gave no batch within 120 s (pid {proc.pid})"
        return proc

    def channels():
        return sorted(p.name for p in tmp.glob("forge-grain-resume-*"))

    stopped = start()
    left = channels()
    workers = children(stopped.pid)
    assert workers  # (its DataLoader worker)
    running = start()
    stopped.send_signal(signal.SIGTERM)
    assert stopped.wait(60) == -signal.SIGTERM
    deadline = time.monotonic() + 60  # its DataLoader worker, which shares the directory, exits on its own
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left[0] in channels() and len(channels()) == 2  # (no exit handler ran)

    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    mine = ResumeChannel()
    assert channels() == sorted(set(channels()) - set(left)) and len(channels()) == 2  # its own and the running job's
    running.stdin.close()
    assert running.wait(60) == 0
    assert channels() == [mine.dir.name]


def test_a_temporary_directory_too_long_for_torchs_sockets_is_an_error_not_a_hang(stores, tmp_path):
    """DataLoader workers hand batches to the main process over Unix sockets made in the
    temporary directory; Linux refuses a socket path past 107 bytes, in a worker thread no one
    hears from, and the DataLoader then waits for ever. A dataset's worker says so instead,
    naming TMPDIR."""
    long = tmp_path / ("t" * 90)
    long.mkdir()
    toml = write_toml(tmp_path / "run.toml", stores)
    job = ("import torch\n"
           "from forge_grain import DataConfig\n"
           "from forge_grain.bridges.torch import GrainIterableDataset\n"
           f"ds = GrainIterableDataset(DataConfig.from_toml({str(toml)!r}), rank=0, world_size=1)\n"
           "next(iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1)))\n")
    got = subprocess.run([sys.executable, "-c", job], env={**os.environ, "TMPDIR": str(long)}, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode != 0
    assert "ConfigError" in got.stderr and str(long) in got.stderr and "Set TMPDIR to a shorter directory" in got.stderr
