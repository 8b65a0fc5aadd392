"""The training examples run to completion (short mode) and their resumed loss curves match."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.mark.parametrize("script", ["train_torch.py", "train_jax.py"])
def test_example_resumes_to_the_same_loss_curve(tmp_path, script):
    # JAX's compilation cache, the test's own: the killed and the resumed run load the programs
    # the uninterrupted one compiled (44 -> 33 s of the example's 52 s on two cores)
    jax_cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--steps", "16", "--checkpoint-at", "8", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=os.environ | jax_cache,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checkpoint at step 8; killing the process" in r.stdout
    assert "resumed loss curve matches the uninterrupted run" in r.stdout


# (the streaming source only in a slow run: each is four processes importing the Trainer, a minute on
# two cores, the suite's longest test; the stored mixture meets the same Trainer paths and a phase switch)
@pytest.mark.parametrize("source", [pytest.param("streaming", marks=pytest.mark.slow), "stored"])
def test_hugging_face_trainer_resumes_from_its_checkpoint_to_the_same_batches(tmp_path, source):
    """3 epochs, 2 DataLoader workers, killed in the middle of epoch 2, resumed with
    Trainer.train(resume_from_checkpoint=True): every batch is the uninterrupted run's."""
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, str(EXAMPLES / "train_hf_trainer.py"), "--source", source, "--workdir",
                        str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "killing the process" in r.stdout and "(epoch 2 of 3)" in r.stdout
    assert "labels -100 at" in r.stdout and "is_natural_stop at" in r.stdout
    assert "resumed batches are identical to the uninterrupted run" in r.stdout


def test_each_example_names_an_extra_that_installs_what_it_imports():
    """The install line in an example's docstring gives every package it needs beyond the base
    install (the Trainer example once needed accelerate, which only [test] installed)."""
    import ast
    import re
    import tomllib

    project = tomllib.loads((EXAMPLES.parent / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def packages(extra: str) -> set[str]:
        out = set()
        for req in extras[extra]:
            name = re.match(r"[\w.-]+(\[[\w,]+\])?", req)
            if name.group().startswith("forge-grain["):
                out |= {p for e in name.group(1)[1:-1].split(",") for p in packages(e)}
            else:
                out.add(re.match(r"[\w.-]+", req).group().lower())
        return out

    script = EXAMPLES / "train_hf_trainer.py"
    named = re.search(r'pip install "forge-grain\[(\w+)\]"', ast.get_docstring(ast.parse(script.read_text())))
    assert named, "the docstring says how to install what the example needs"
    assert {"transformers", "torch", "accelerate"} <= packages(named.group(1))


def test_online_mixing_resumes_to_the_same_losses_and_weights(tmp_path):
    """Weights moved from per-source loss every 4 steps, set 8 steps ahead (2 workers), killed
    after the checkpoint at step 14: the resumed run's losses and weights are the uninterrupted
    run's, and the weights did move."""
    import json

    r = subprocess.run([sys.executable, str(EXAMPLES / "train_online_mixing.py"), "--steps", "28", "--checkpoint-at",
                        "14", "--every", "4", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed loss curve matches the uninterrupted run" in r.stdout
    full, resumed = (json.loads((tmp_path / f"weights-{p}.json").read_text()) for p in ("full", "resume"))
    assert full == resumed and len(full) >= 3
    assert len({tuple(w) for _, w in full}) > 1  # the weights changed
    assert any(at > 14 for at, _ in full) and any(at <= 14 + 8 for at, _ in full)  # some set before the kill


def test_olmo_core_example_resumes_to_the_same_loss_curve(tmp_path):
    """OLMo-core's own Trainer, model and Checkpointer over a forge-grain config: killed after
    the checkpoint at step 8, resumed by `Trainer.load_checkpoint`, the same losses after."""
    pytest.importorskip("olmo_core")
    r = subprocess.run([sys.executable, str(EXAMPLES / "train_olmo_core.py"), "--steps", "16", "--checkpoint-at", "8",
                        "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checkpoint at step 8; killing the process" in r.stdout
    assert "[resume] from OLMo-core's checkpoint at step 8" in r.stdout
    assert "resumed loss curve matches the uninterrupted run" in r.stdout


def test_midtraining_example_anneals_into_chat_data_and_resumes_to_the_same_losses(tmp_path):
    """The anneal brings a masked chat source in (its rows train the assistant's turns only),
    and a kill after the checkpoint resumes to the uninterrupted run's losses."""
    r = subprocess.run([sys.executable, str(EXAMPLES / "train_midtraining.py"), "--steps", "16", "--checkpoint-at",
                        "10", "--anneal-at", "4", "--workdir", str(tmp_path)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "step    0  loss" in r.stdout and "chat rows 0 of 8" in r.stdout
    assert "of their tokens are targets: the assistant's turns" in r.stdout
    assert "checkpoint at step 10; killing the process" in r.stdout
    assert "resumed loss curve matches the uninterrupted run" in r.stdout
