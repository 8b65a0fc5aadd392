"""Shared by the examples: the demo corpus as a two-source data config, and run comparison."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from forge_grain import DataConfig, Phase, SourceConfig, prepare
from forge_grain.demo import write_demo_corpus


def demo_config(workdir: Path, *, seq_len: int = 128, batch: int = 8, max_files: int = 120) -> DataConfig:
    """Two sources from the standard library (code and docstrings), a phase switch at step 40."""
    corpus = write_demo_corpus(workdir / "corpus", max_files)
    stores = {name: prepare(corpus[name], workdir / "stores" / name, progress=False) for name in corpus}
    return DataConfig(
        sources=[SourceConfig("code", str(stores["code"]), 0.7, "bestfit"),
                 SourceConfig("docs", str(stores["docs"]), 0.3, "bos_bestfit")],
        seq_len=seq_len, global_batch_size=batch, seed=0, num_epochs=None,
        phases=[Phase(40, {"code": 0.3, "docs": 0.7})],
    )


def run_phases(script: str, args: list[str], workdir: Path, steps: int, kill_at: int) -> None:
    """Run uninterrupted; run again but die (os._exit) right after the checkpoint at `kill_at`;
    resume in a fresh process; then compare the two loss curves after `kill_at`."""
    base = [sys.executable, script, *args, "--workdir", str(workdir), "--steps", str(steps), "--checkpoint-at", str(kill_at)]
    for phase in ("full", "until-kill", "resume"):
        r = subprocess.run(base + ["--phase", phase])
        if phase != "until-kill" and r.returncode != 0:
            raise SystemExit(f"phase {phase} failed")
    full = json.loads((workdir / "losses-full.json").read_text())
    resumed = json.loads((workdir / "losses-resume.json").read_text())
    after = [str(s) for s in range(kill_at, steps)]
    diff = max(abs(full[s] - resumed[s]) for s in after)
    print(f"steps {kill_at}..{steps - 1}: uninterrupted loss {full[after[0]]:.4f} -> {full[after[-1]]:.4f}; "
          f"resumed after a kill at step {kill_at}: max |difference| = {diff:.2e}")
    if diff > 1e-5:
        raise SystemExit("the resumed loss curve differs from the uninterrupted one")
    print("resumed loss curve matches the uninterrupted run")


def example_main(doc: str, script: str, train, default_workdir: str, extra_args: dict | None = None) -> None:
    """The examples' command line: with no --phase, run all three phases and compare.

    `train(args, resume)` trains from scratch or from the latest checkpoint and returns
    {step: loss}; `extra_args` are {flag: default} passed through to every phase.
    """
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--checkpoint-at", type=int, default=100)
    ap.add_argument("--workdir", type=Path, default=Path(default_workdir))
    for flag, default in (extra_args or {}).items():
        ap.add_argument(flag, type=type(default), default=default)
    ap.add_argument("--phase", choices=["full", "until-kill", "resume"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.phase is None:
        shutil.rmtree(args.workdir / "checkpoints", ignore_errors=True)
        passed = [str(x) for flag in (extra_args or {}) for x in (flag, getattr(args, flag.lstrip("-").replace("-", "_")))]
        run_phases(script, passed, args.workdir, args.steps, args.checkpoint_at)
        return
    losses = train(args, resume=args.phase == "resume")
    (args.workdir / f"losses-{args.phase}.json").write_text(json.dumps(losses))
