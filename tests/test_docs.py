"""The documentation as a reader meets it: the site builds with warnings as errors (a broken
link or reference fails), the README fits on a few screens, and every code block of the
README and the docs runs (how each kind runs, and the notes that steer it: docs_blocks.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from docs_blocks import ROOT, blocks, cheap_commands, pages

from forge_grain import DataConfig, Phase, SourceConfig

RUNNER = r"""
import json, subprocess, sys, traceback
sys.path.insert(0, sys.argv[2])
from docs_blocks import NUMBERS_VARY, matches
ns = {"__name__": "__main__"}
for kind, what, code, where in json.load(open(sys.argv[1])):
    if kind == "file":
        open(what, "w").write(code)
    elif kind == "output":
        loose = what.endswith(NUMBERS_VARY)
        what = what.removesuffix(NUMBERS_VARY)
        r = subprocess.run(what, shell=True, capture_output=True, text=True)
        if r.returncode or not matches(code, r.stdout, any_numbers=loose):
            sys.exit(f"{where}: `{what}` printed other than the page shows ({r.returncode}):\n{r.stdout}\n{r.stderr[-2000:]}")
    elif kind == "bash":
        r = subprocess.run(what, shell=True, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"{where}: `{what}` failed ({r.returncode}):\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}")
    else:
        try:
            if what:
                exec(compile(what, where + " (before)", "exec"), ns)
            exec(compile(code, where, "exec"), ns)
        except BaseException:
            traceback.print_exc()
            sys.exit(f"{where}: the block failed")
"""


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert api.count("forge_grain.pipeline.pipeline.Pipeline.") > 10  # the docstrings, generated
    home = (tmp_path / "site" / "index.html").read_text()
    assert "What it does that its peers do not" in home  # the README, as the home page
    assert 'href="guides/pipeline/"' in home and 'href="docs/' not in home  # its links, made the site's
    assert "stylesheets/extra.css" in home  # long commands and outputs wrap


def test_the_readme_fits_on_a_few_screens():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 400


def test_code_lines_fit_88_columns():
    """A reader at 1280 px sees a code line whole, comment included (they hid behind horizontal
    scrollbars). The README's two commands stay one line each: `.ci/run` runs the second as
    written."""
    commands = {line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")}
    commands.add("python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/forge-grain demo")
    long = [f"{b.where}: {line[:60]}..." for p in pages() for b in blocks(p) if b.lang in ("python", "bash", "toml")
            for line in b.code.splitlines() if len(line) > 88 and line not in commands]
    assert not long, long


def test_every_block_not_run_says_why():
    skipped = [(b.where, b.not_run) for p in pages() for b in blocks(p) if b.not_run is not None]
    assert all(len(reason) > 10 for _, reason in skipped), skipped
    code = [b for p in pages() for b in blocks(p) if b.lang in ("python", "bash", "toml")]
    assert len(skipped) < len(code) / 4, skipped  # the exceptions stay exceptions


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Path:
    """What the pages' examples read: the demo's corpus (`forge-grain-demo/*.jsonl`, as the
    README's first command leaves it), two stores prepared from it (`data/web`, `data/code`),
    the pipeline guide's `data.toml` over them and the `plan` guide's KempnerForge job file (`job.toml`)."""
    from forge_grain import prepare
    from forge_grain.demo import write_demo_corpus

    ws = tmp_path_factory.mktemp("docs")
    corpus = write_demo_corpus(ws / "forge-grain-demo", max_files=300)
    prepare(corpus["docs"], ws / "data" / "web", progress=False)
    prepare(corpus["code"], ws / "data" / "code", progress=False)
    for page, name in (("pipeline.md", "data.toml"), ("plan-and-explain.md", "job.toml")):  # as the guides show them
        (ws / name).write_text(next(b for b in blocks(ROOT / "docs" / "guides" / page) if b.file == name).code)
    return ws


def check_toml(block) -> None:
    """A config block: a whole config, or the keys it shows among the required ones (the full
    batch and length from a schedule's last entry)."""
    d = tomllib.loads(block.code)
    if "train" in d:
        return  # a KempnerForge job file: the commands that read it run it (test_the_pages_code_runs)
    d = d.get("data", d)
    fields = {c: {f.name for f in dataclasses.fields(c)} for c in (DataConfig, SourceConfig, Phase)}
    if d and not set(d) & fields[DataConfig] and set(d) <= fields[SourceConfig]:  # a source's keys
        d = {"sources": [{"name": "web", **({} if {"path", "hf_dataset"} & set(d) else {"path": "web"}), **d}]}
    elif d and not set(d) & fields[DataConfig] and set(d) <= fields[Phase]:  # a phase's keys
        d = {"phases": [{"start_step": 10, "weights": {"web": 1.0}, **d}]}
    base = {"sources": [{"name": n, "path": n} for n in ("web", "code", "math")],
            "seq_len": d["seq_lens"][-1][1] if "seq_lens" in d else 8,
            "global_batch_size": d["batch_sizes"][-1][1] if "batch_sizes" in d else 256}
    DataConfig.from_dict({**base, **d}, where=block.where)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_pages_configs_are_valid(page):
    for b in blocks(page):
        if b.lang == "toml" and b.not_run is None:
            check_toml(b)


def steps_of(page: Path) -> list[list]:
    out = []
    for b in blocks(page):
        if b.not_run is not None:
            continue
        if b.before and b.lang != "python":
            out.append(["python", "", b.before, b.where + " (before)"])
        if b.file:
            out.append(["file", b.file, b.code, b.where])
        elif b.output_of:
            out.append(["output", b.output_of, b.code, b.where])
        elif b.lang == "python":
            out.append(["python", b.before or "", b.code, b.where])
        elif b.lang == "bash":
            out += [["bash", c, "", b.where] for c in cheap_commands(b.code)]
    return out


CODE_PAGES = [p for p in pages() if any(s[0] != "file" for s in steps_of(p))]


def test_an_output_block_is_compared_as_shown():
    from docs_blocks import matches

    shown = "plan: 2,000 steps (... epochs)\n...\nwarnings:\n  ! read ... times"
    assert matches(shown, "plan: 2,000 steps (3.5 epochs)\nsources:\n  a\n\nwarnings:\n  ! read 25.3 times")
    assert not matches(shown, "plan: 1,000 steps (3.5 epochs)\nwarnings:\n  ! read 25.3 times")
    assert not matches(shown, "plan: 2,000 steps (3.5 epochs)\nwarnings:\n  ! read 25.3 times\n  ! more")
    assert matches("a 1,234 rows (2.5 epochs)", "a 98,765 rows (0.25 epochs)", any_numbers=True)
    assert not matches("a 1,234 rows (2.5 epochs)", "a 98,765 rows (0.25 passes)", any_numbers=True)


@pytest.mark.parametrize("page", CODE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_pages_code_runs(page, workspace, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(workspace, work)
    (tmp_path / "steps.json").write_text(json.dumps(steps_of(page)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", RUNNER, str(tmp_path / "steps.json"), str(Path(__file__).parent)],
                       cwd=work, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{r.stderr[-6000:]}\n{r.stdout[-2000:]}"
