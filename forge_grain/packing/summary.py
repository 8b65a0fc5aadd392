"""`forge-grain inspect`: what a token store holds, as text (and optionally a PNG)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from forge_grain.stores import TokenStore

PERCENTILES = (0, 10, 50, 90, 99, 100)


def describe(store: TokenStore) -> dict:
    lengths = store.lengths
    pct = np.percentile(lengths, PERCENTILES).round().astype(int) if len(lengths) else np.zeros(len(PERCENTILES), int)
    return {
        "path": str(getattr(store, "url", None) or store.path),  # a store at a URL: the URL, not its cache copy
        "layout": store.layout,
        "documents": len(store),
        "skipped_empty": int((store.manifest.source if store.manifest is not None else {}).get("skipped_empty", 0)),
        "tokens": store.num_tokens,
        "dtype": str(store.dtype),
        "vocab_size": store.vocab_size,
        "bos_id": store.bos_id,
        "eos_id": store.eos_id,
        "shards": len(store.files),
        "fingerprint": store.fingerprint,
        "length_percentiles": dict(zip(PERCENTILES, pct.tolist())),
        "mean_length": float(lengths.mean()) if len(lengths) else 0.0,
        "targets": store.num_targets,
    }


def histogram_text(lengths: np.ndarray, bins: int = 16, width: int = 40) -> str:
    """A log-spaced histogram of document lengths, one text line a bin."""
    if len(lengths) == 0:
        return "(no documents)"
    lo, hi = max(1, int(lengths.min())), max(2, int(lengths.max()) + 1)
    edges = np.unique(np.geomspace(lo, hi, bins + 1).astype(np.int64))
    counts, _ = np.histogram(np.clip(lengths, lo, hi - 1), bins=edges)
    top = max(1, counts.max())
    rows = []
    for a, b, c in zip(edges[:-1], edges[1:], counts):
        rows.append(f"{a:>9,}-{b - 1:<9,} {'#' * int(round(width * c / top)):<{width}} {c:,}")
    return "\n".join(rows)


def format_summary(store: TokenStore) -> str:
    d = describe(store)
    pct = "  ".join(f"p{k}={v:,}" for k, v in d["length_percentiles"].items())
    return "\n".join(
        [
            f"{d['path']}  ({d['layout']}, {d['shards']} shard(s))",
            f"  documents   {d['documents']:,}" + (f"  ({d['skipped_empty']:,} empty one(s) skipped: a document "
                                                   "of no text has no tokens to train)" if d["skipped_empty"] else ""),
            f"  tokens      {d['tokens']:,}  (mean {d['mean_length']:,.1f} per document)",
            *([f"  targets     {d['targets']:,} ({d['targets'] / max(d['tokens'], 1):.1%} of the tokens: the "
               "store's target masks mark them; only they train)"] if d["targets"] is not None else []),
            f"  dtype       {d['dtype']}   vocab_size {d['vocab_size']}   bos_id {d['bos_id']}   eos_id {d['eos_id']}",
            f"  lengths     {pct}",
            f"  fingerprint {d['fingerprint']}",
            "  length histogram (tokens per document):",
            *("    " + line for line in histogram_text(store.lengths).splitlines()),
        ]
    )


def pyplot():
    """matplotlib's pyplot drawing to files (no display needed), or how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'forge-grain[plot]'") from None
    return plt


def plot_lengths(store: TokenStore, png: str | Path) -> Path:
    """Write a log-log histogram of document lengths to `png` (needs matplotlib)."""
    plt = pyplot()
    lengths = store.lengths[store.lengths > 0]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(lengths, bins=np.geomspace(1, max(2, lengths.max() + 1), 50))
    ax.set(xscale="log", yscale="log", xlabel="tokens per document", ylabel="documents", title=str(store.path))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def packing_report(store: TokenStore, seq_len: int, seed: int = 0, max_segments: int | None = None) -> str:
    """Plan every strategy and tabulate rows, fill, cropped and lost shares, documents per row;
    with `max_segments`, also each strategy under that cap and the fill it costs."""
    from forge_grain.packing.plans import STRATEGIES, PackingError, min_crop_share, plan

    lines = [
        f"packing at seq_len {seq_len} (crop floor for BOS-aligned rows: {min_crop_share(store.lengths, seq_len):.2%})",
        f"  {'strategy':<22}{'rows':>12}{'fill':>9}{'cropped':>9}{'lost':>9}{'docs/row':>10}{'plan s':>9}",
    ]
    for strategy in STRATEGIES:
        fills = {}
        for cap in (None, max_segments) if max_segments else (None,):
            label = strategy if cap is None else f"{strategy}, <= {cap}/row"
            try:
                s = plan(store, seq_len, strategy, seed=seed, max_segments=cap).stats
            except PackingError as e:
                lines.append(f"  {label:<22}  {e}")
                continue
            fills[cap] = s["fill"]
            cost = f"  (fill {100 * (s['fill'] - fills[None]):+.2f} points)" if cap and None in fills else ""
            lines.append(
                f"  {label:<22}{s['rows']:>12,}{s['fill']:>9.2%}{s['cropped_share']:>9.2%}"
                f"{s['lost_share']:>9.2%}{s['docs_per_row']:>10.2f}{s['planning_seconds']:>9.3f}{cost}"
            )
    return "\n".join(lines)
