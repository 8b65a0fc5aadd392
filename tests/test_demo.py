"""The README's first command runs `forge-grain demo`; it must work end to end."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import noise

from forge_grain import DataConfig, Pipeline


README = Path(__file__).resolve().parents[1] / "README.md"
EXPLAIN_PAGE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "plan-and-explain.md"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The README's first command: `forge-grain demo` with its defaults (about 30 s)."""
    workdir = tmp_path_factory.mktemp("demo")
    r = subprocess.run([sys.executable, "-m", "forge_grain", "demo", "--workdir", str(workdir)],
                       capture_output=True, text=True, timeout=900)
    return workdir, r


def test_demo_prepares_mixes_checkpoints_and_resumes_exactly(demo):
    tmp_path, r = demo
    assert r.returncode == 0, r.stdout + r.stderr
    assert "on 1 shard(s): batches 20..59 match" in r.stdout
    assert "on 4 shard(s): batches 20..59 match" in r.stdout
    assert "resume on 1 and 4 shards exact: True" in r.stdout
    assert "train (2 shards)" in r.stderr  # the progress bar
    code = int(re.search(r"stores/code .*\n  documents   ([\d,]+)", r.stdout).group(1).replace(",", ""))
    if code < 600:  # a standard library file with no text: the summary says why it is not a document
        assert f"({600 - code} empty one(s) skipped: a document of no text has no tokens to train)" in r.stdout
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
    seen = sum(np.bincount(pipeline.batch(step)["source_id"], minlength=2) for step in range(60))
    assert [described["code"]["rows"], described["docs"]["rows"]] == seen.tolist()
    assert described["docs"]["epochs"] == seen[1] / described["docs"]["rows_per_epoch"]


def test_the_readmes_explain_example_is_what_the_demo_gives(demo):
    """The docs show `forge-grain explain` on the demo's config with its output: that output
    is what the command prints on the demo the README's first command makes (an earlier README
    showed lines no demo could give)."""
    workdir, r = demo
    assert r.returncode == 0, r.stderr
    text = EXPLAIN_PAGE.read_text()
    block = re.search(r"```bash\n(forge-grain explain forge-grain-demo/data\.toml (?:[^\n]*\\\n)*[^\n]+)\n"
                      r"((?:#[^\n]*\n)+)", text)
    assert block, "the docs' explain example"
    command = re.sub(r"\\\n\s*", " ", block.group(1))  # (a command continued over lines)
    shown = [line[1:].strip() for line in block.group(2).splitlines()]
    args = command.replace("forge-grain-demo", str(workdir)).split()[1:]
    out = subprocess.run([sys.executable, "-m", "forge_grain", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    printed = [line.strip() for line in out.stdout.splitlines()][: len(shown)]
    for want, got in zip(shown, printed):
        head, _, tail = want.partition("...")  # "..." stands for the demo's directory and a text's end
        assert got.startswith(head.rstrip("' ")) and (not tail or tail.rstrip("'") in got), (want, got)
