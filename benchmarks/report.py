"""Benchmark output: printed, and kept in `benchmarks/results/NAME.txt` for the README to cite."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def publish(name: str, lines: list[str]) -> str:
    """Print the lines and write them to results/<name>.txt; returns the text."""
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.txt").write_text(text + "\n")
    return text
