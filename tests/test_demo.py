"""The README's first command runs `forge-grain demo`; it must work end to end."""

import json
import subprocess
import sys

import numpy as np
from conftest import noise

from forge_grain import DataConfig, Pipeline


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


    # the config it ran is written beside it, and `forge-grain plan` on it matches iterating it
    assert f"forge-grain plan {tmp_path / 'data.toml'}" in r.stdout
    plan = subprocess.run([sys.executable, "-m", "forge_grain", "plan", str(tmp_path / "data.toml"), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr
    described = {s["name"]: s for s in json.loads(plan.stdout)["sources"]}
    pipeline = Pipeline(DataConfig.from_toml(tmp_path / "data.toml"), 0, 1, num_threads=0)
    seen = sum(np.bincount(pipeline.batch(step)["source_id"], minlength=2) for step in range(24))
    assert [described["code"]["rows"], described["docs"]["rows"]] == seen.tolist()
    assert described["docs"]["epochs"] == seen[1] / described["docs"]["rows_per_epoch"]
