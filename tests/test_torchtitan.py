"""forge-grain as torchtitan's data loader: the contract here (forge_grain/bridges/titan_batches.py, no
torchtitan needed), and with torchtitan itself (slow: in an environment of its own, made once
and kept under ~/.cache, since torchtitan pins datasets<4.8 and fsspec<=2026.2.0): its job
config names the loader, its `CheckpointManager` saves it with DCP under torchrun (2 ranks,
gloo), the job is killed after a checkpoint and restarted on 2 ranks (2 workers) and on 1.

The reference for every batch is the forge-grain pipeline itself (shard r of W, step s - 1 for
torchtitan's step s).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import SLOW
from framework_runs import REPO, SCRIPTS, framework_env, step_records, two_store_toml
from multiproc import free_port

from forge_grain.bridges.titan_batches import TitanBatches, titan_batch
from forge_grain.bridges.torch import to_torch
from forge_grain import DataConfig, Pipeline, StateError

TITAN = "torchtitan==0.3.0"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two small stores; 2 epochs of 8 rows x 64 tokens a step."""
    return two_store_toml(tmp_path_factory.mktemp("titan"), (90, 60), (4, 5), seed=5, weights=(0.5, 0.5))


def digest(input_dict, labels) -> str:
    return hashlib.sha256(input_dict["input"].numpy().tobytes() + labels.numpy().tobytes()).hexdigest()


def expected(toml, world: int) -> dict:
    """{(torchtitan step, rank): hash} of every step, from the pipeline."""
    out = {}
    for r in range(world):
        p = Pipeline(DataConfig.from_toml(toml), r, world, num_threads=0)
        for s in range(p.num_steps):
            out[(s + 1, r)] = digest(*titan_batch(to_torch(p.batch(s))))
    return out


def batches(toml, rank=0, world=2, **kw) -> TitanBatches:
    return TitanBatches(toml, dp_world_size=world, dp_rank=rank, seq_len=64, local_batch_size=8 // world, **kw)


# -- the contract ---------------------------------------------------------------------------------


def test_batches_are_input_positions_and_labels_of_the_trained_targets(data):
    (input_dict, labels), raw = next(iter(batches(data, rank=1))), Pipeline(DataConfig.from_toml(data), 1, 2).batch(0)
    assert set(input_dict) == {"input", "positions"} and labels.shape == input_dict["input"].shape == (4, 64)
    assert torch.equal(input_dict["input"], torch.from_numpy(raw["inputs"]).long())
    assert torch.equal(labels, torch.where(torch.from_numpy(raw["loss_mask"]), torch.from_numpy(raw["targets"]).long(),
                                           -100))
    assert (labels == -100).any() and (input_dict["positions"][:, 0] == 0).all()  # positions restart per document


@pytest.mark.parametrize("workers", [0, 2])
def test_one_iteration_runs_every_epoch_in_order(data, workers):
    want = expected(data, 2)
    for r in range(2):
        got = [digest(*b) for b in batches(data, rank=r, num_workers=workers)]
        assert got == [want[(s, r)] for s in range(1, len(want) // 2 + 1)]


def test_a_state_is_global_and_resumes_on_another_dp_size(data):
    two = [batches(data, rank=r) for r in range(2)]
    its = [iter(b) for b in two]
    n = Pipeline(DataConfig.from_toml(data), 0, 1).steps_per_epoch
    for _ in range(n + 3):  # into the second epoch
        for it in its:
            next(it)
    states = [b.state_dict() for b in two]
    assert states[0] == states[1] and list(states[0]) == ["forge_grain"]  # one key: DCP keeps one copy
    one = batches(data, world=1)
    one.load_state_dict(states[0])
    want = expected(data, 1)
    assert [digest(*b) for b in one] == [want[(s, 0)] for s in range(n + 4, len(want) + 1)]


def test_what_it_refuses_is_said(data):
    b = batches(data)
    b.load_state_dict({})  # torchtitan's fresh start: nothing to load
    with pytest.raises(ValueError, match=r"seq_len 64 and global_batch_size 8 must be .* \(4 × 4 = 16\)"):
        TitanBatches(data, dp_world_size=4, dp_rank=0, seq_len=64, local_batch_size=4)
    with pytest.raises(ValueError, match="not saved by forge-grain's torchtitan loader"):
        b.load_state_dict({"dp_rank_0": b"...", "world_size": 2})  # torchtitan's own loader's state
    other = DataConfig.from_toml(data)
    other.seed = 6
    with pytest.raises(StateError):
        TitanBatches(other, dp_world_size=2, dp_rank=0, seq_len=64, local_batch_size=4).load_state_dict(b.state_dict())


# -- torchtitan itself (slow) ---------------------------------------------------------------------


def titan_python() -> Path:
    """A venv with torchtitan, torch 2.13 (CPU) and forge-grain's dependencies (made once; see
    `framework_runs.framework_env`)."""
    def install(pip, timeout):
        # triton: torchtitan's models import it (its MoE kernels) even where none runs
        # forge-grain's own dependencies, not forge-grain: the runs import this checkout (PYTHONPATH)
        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
        torch_extra = [r for r in project["optional-dependencies"]["torch"] if not r.startswith("torch>")]
        subprocess.run([*pip, "torch==2.13.0", TITAN, "triton", "datasets<4.8", *project["dependencies"],
                        *torch_extra], check=True, timeout=timeout)

    return framework_env(f"{TITAN.replace('==', '-')}-py{sys.version_info.major}{sys.version_info.minor}", install)


def run(python, toml, folder, record, *, ranks, steps, crash_after=0, workers=0):
    cmd = [str(python), "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={free_port()}",
           str(SCRIPTS / "titan_loop.py"), str(toml), str(folder), str(record), str(steps), "4", str(crash_after),
           str(workers)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's forge-grain
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.skipif(not SLOW, reason="makes torchtitan's own environment (minutes, once); FORGE_GRAIN_SLOW=1")
def test_torchtitan_checkpoint_killed_and_restarted_on_2_and_1_ranks(data, tmp_path):
    python = titan_python()
    total = Pipeline(DataConfig.from_toml(data), 0, 1).num_steps
    crash, saved = total // 2 + 3, total // 2 + 3 - (total // 2 + 3) % 4  # a checkpoint every 4 steps
    whole = run(python, data, tmp_path / "whole", tmp_path / "whole", ranks=2, steps=total)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-5000:]
    assert step_records(tmp_path / "whole", 2) == expected(data, 2)  # the uninterrupted job: the pipeline's batches
    first = run(python, data, tmp_path / "job", tmp_path / "first", ranks=2, steps=total, crash_after=crash)
    assert first.returncode != 0, "the job was to die after its checkpoint"
    assert step_records(tmp_path / "first", 2) == {(s, r): h for (s, r), h in expected(data, 2).items() if s <= crash}
    for ranks, workers in ((2, 2), (1, 0)):
        folder = tmp_path / f"job-{ranks}"
        shutil.copytree(tmp_path / "job", folder)
        r = run(python, data, folder, tmp_path / f"after-{ranks}", ranks=ranks, steps=total, workers=workers)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
        want = {(s, q): h for (s, q), h in expected(data, ranks).items() if s > saved}
        assert step_records(tmp_path / f"after-{ranks}", ranks) == want, f"restart on {ranks} ranks"
