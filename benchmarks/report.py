"""Benchmark output: printed, and kept in `benchmarks/results/NAME.txt` for the README to cite."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its module docstring as the help, as written; no
    abbreviated options (`--step` is not `--steps`)."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                   allow_abbrev=False)


def timed(fn, repeat: int) -> float:
    """Seconds a call of `fn` takes, averaged over `repeat` calls after one warm-up call (plans
    mapped, kernels compiled)."""
    import time

    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def publish(name: str, lines: list[str]) -> str:
    """Print the lines and write them to results/<name>.txt; returns the text."""
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.txt").write_text(text + "\n")
    return text


class kept:
    """`with kept(NAME):` prints as usual and also keeps what was printed in
    `results/NAME.txt`, for benchmarks that print as they go."""

    def __init__(self, name: str):
        self.name, self.lines = name, []

    def __enter__(self):
        self._stdout = sys.stdout
        sys.stdout = self
        return self

    def write(self, text: str) -> int:
        self.lines.append(text)
        return self._stdout.write(text)

    def flush(self) -> None:
        self._stdout.flush()

    def __exit__(self, *exc):
        sys.stdout = self._stdout
        if exc[0] is None:
            RESULTS.mkdir(exist_ok=True)
            (RESULTS / f"{self.name}.txt").write_text("".join(self.lines))
