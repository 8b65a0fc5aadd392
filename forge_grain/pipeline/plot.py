"""`forge-grain plan CONFIG --plot out.png`: the share of each source's rows over the steps,
from the mixture's closed form (`Pipeline.consumed_rows`; no batch is made)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from forge_grain.errors import ConfigError
from forge_grain.packing.summary import pyplot


def shares_over_steps(pipeline, end: int, points: int = 200) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Step boundaries b_0 = 0 < ... < b_n = end and, per source, its share of the rows of
    the steps [b_i, b_(i+1)): what the mixture draws, mixture changes and phases included."""
    if end is None:
        raise ConfigError("the run is unlimited (num_epochs = inf and no max_steps): give --steps N to plot")
    bounds = np.unique(np.linspace(0, end, min(points, end) + 1).round().astype(np.int64))
    rows = np.array([pipeline.consumed_rows(int(b)) for b in bounds], np.float64)
    per_step = np.diff(rows, axis=0)
    shares = per_step / per_step.sum(axis=1, keepdims=True)
    return bounds, dict(zip(pipeline.source_names, shares.T))


def changes(description: dict) -> list[tuple[int, str, str]]:
    """The steps the plot marks, with a label and a line style: each phase that starts (dashed),
    and each change of sequence length or batch size (dotted)."""
    end = description["steps"]
    marks = [(p["start_step"], "phase", "--") for p in description["phases"][1:] if p["reached"]]
    marks += [(s, f"seq_len {n:,}", ":") for s, n in description.get("seq_lens", [])[1:]]
    marks += [(s, f"{b:,} rows", ":") for s, b in description["batch_sizes"][1:]]
    return sorted(m for m in marks if end is None or m[0] < end)


def plot_shares(pipeline, description: dict, png: str | Path, title: str) -> Path:
    """Draw `shares_over_steps` as stacked areas, with the `changes` marked."""
    plt = pyplot()
    bounds, shares = shares_over_steps(pipeline, description["steps"])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.stackplot(bounds, *[np.append(s, s[-1]) for s in shares.values()], labels=list(shares), step="post")
    for step, label, style in changes(description):
        ax.axvline(step, color="black", linestyle=style, linewidth=0.8)
        ax.text(step, 1.01, label, transform=ax.get_xaxis_transform(), fontsize=7, ha="left", va="bottom")
    ax.set(xlim=(0, bounds[-1]), ylim=(0, 1), xlabel="step", ylabel="share of rows", title=title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
