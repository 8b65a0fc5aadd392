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
