"""The two training examples run to completion (short mode) and their resumed loss curves match."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.mark.parametrize("script", ["train_torch.py", "train_jax.py"])
def test_example_resumes_to_the_same_loss_curve(tmp_path, script):
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--steps", "16", "--checkpoint-at", "8", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checkpoint at step 8; killing the process" in r.stdout
    assert "resumed loss curve matches the uninterrupted run" in r.stdout


@pytest.mark.parametrize("source", ["streaming", "stored"])
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
