"""The README's first command runs `forge-grain demo`; it must work end to end."""

import subprocess
import sys

from conftest import noise


def test_demo_prepares_mixes_checkpoints_and_resumes_exactly(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "forge_grain", "demo", "--workdir", str(tmp_path), "--max-files", "60", "--steps", "24"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "on 1 shard(s): batches 8..23 match" in r.stdout
    assert "on 4 shard(s): batches 8..23 match" in r.stdout
    assert "resume on 1 and 4 shards exact: True" in r.stdout
    assert "train (2 shards)" in r.stderr  # the progress bar
    assert noise(r.stderr) == [], r.stderr  # and nothing else: no warning, no traceback at exit
    # the next steps need extras the demo's install lacks: the lines say which
    assert "first: pip install -e '.[torch]'" in r.stdout and "first: pip install -e '.[jax]'" in r.stdout

