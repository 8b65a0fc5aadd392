"""The command line's answer to a config mistake: wall time and modules imported.

    python benchmarks/bench_cli.py [--before CHECKOUT]

Each case runs `python -m forge_grain ...` in a fresh process 7 times (warm: the files in the
page cache, numba's kernels compiled), from a directory outside the checkout so that the
checkout measured is the one on `PYTHONPATH`; the median wall time, and the modules imported
as `python -X importtime` counts them. `--before` measures another checkout the same way
beside this one (a `git worktree` of an older commit).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import parser, publish

HEAVY = ("jax", "grain", "numba", "torch", "transformers")


def cases(work: Path) -> dict[str, list[str]]:
    (work / "misspelt.toml").write_text('seq_len = 128\nglobal_batch_size = 4\n[[sources]]\nname = "a"\npathh = "x"\n')
    return {"plan MISSING.toml": ["plan", str(work / "MISSING.toml")],
            "plan misspelt.toml": ["plan", str(work / "misspelt.toml")],
            "--version": ["--version"]}


def measure(root: Path, args: list[str], work: Path) -> tuple[float, int, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    times = []
    for _ in range(7):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "forge_grain", *args], env=env, cwd=work, capture_output=True)
        times.append(time.perf_counter() - t)
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "forge_grain", *args], env=env, cwd=work,
                       capture_output=True, text=True)
    names = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    return statistics.median(times), len(names) - 1, [m for m in HEAVY if m in names]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--before", type=Path, help="another checkout to measure beside this one")
    a = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    lines = ["`forge-grain` answering a config mistake, a fresh process each time (median of 7, warm):"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for label, root in (("before", a.before), ("this checkout", here)):
            if root is None:
                continue
            lines.append(f" {label} ({root}):")
            for name, args in cases(work).items():
                wall, count, heavy = measure(root.resolve(), args, work)
                lines.append(f"  {name:<20} {wall:5.2f} s, {count:5d} modules imported"
                             + (f" (among them {', '.join(heavy)})" if heavy else ""))
                print(lines[-1], flush=True)
    publish("cli", lines)


if __name__ == "__main__":
    main()
