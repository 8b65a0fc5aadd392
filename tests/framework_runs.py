"""Shared by the tests that run trainers' own loops (OLMo-core, torchtitan, MaxText): a small
two-store config, the per-rank step records their scripts write, and the environments of
those whose pins (or Python) differ from the project's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

from conftest import store

from forge_grain.locks import file_lock

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "tests" / "scripts"
# kept across checkouts and runs (the environments hold no forge-grain: the runs import the
# checkout under test through PYTHONPATH)
ENVS = Path(os.environ.get("FORGE_GRAIN_TEST_ENVS", Path.home() / ".cache" / "forge-grain" / "envs"))


def framework_env(name: str, install, python: str | None = None, timeout: int = 1800) -> Path:
    """The python of a virtual environment `name` under `ENVS`, made once: under a lock, into a
    temporary name, `install(pip)` run in it (a function given the env's pip command), then
    renamed, so a run killed mid-install leaves nothing a later run would take as made.
    `python`: the interpreter to make it with (default this one)."""
    env = ENVS / name
    ENVS.mkdir(parents=True, exist_ok=True)
    with file_lock(ENVS / ".lock"):
        if not (env / "bin" / "python").exists():
            tmp = ENVS / f".{name}.{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            if python is None:
                venv.create(tmp, with_pip=True)
            else:
                subprocess.run([python, "-m", "venv", str(tmp)], check=True, timeout=300)
            install([str(tmp / "bin" / "python"), "-m", "pip", "install", "-q"], timeout)
            tmp.rename(env)  # (the env's scripts name the temporary path in their #! line: run it with `python -m`)
    return env / "bin" / "python"


def two_store_toml(base: Path, docs: tuple[int, int], seeds: tuple[int, int], seed: int,
                   weights: tuple[float, float]) -> Path:
    """`web` (bos_bestfit) and `code` stores, 2 epochs of 8 rows x 64 tokens a step."""
    web, code = store(base / "web", docs[0], seeds[0]), store(base / "code", docs[1], seeds[1])
    toml = base / "data.toml"
    toml.write_text(f"""seq_len = 64\nglobal_batch_size = 8\nseed = {seed}\nnum_epochs = 2\n
[[sources]]\nname = "web"\npath = "{web}"\nweight = {weights[0]}\nstrategy = "bos_bestfit"\n
[[sources]]\nname = "code"\npath = "{code}"\nweight = {weights[1]}\n""")
    return toml


def step_records(record: Path, ranks: int) -> dict:
    """{(step, rank): batch hash} from RECORD + rank + ".jsonl", each step once per rank."""
    out = {}
    for r in range(ranks):
        for line in Path(f"{record}{r}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            assert (rec["step"], r) not in out, f"step {rec['step']} seen twice on rank {r}"
            out[(rec["step"], r)] = rec["hash"]
    return out
