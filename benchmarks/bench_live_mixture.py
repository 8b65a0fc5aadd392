"""The cost of changing the mixture while training runs (`set_weights`), against the step it
interrupts and against building the pipeline afresh.

    python benchmarks/bench_live_mixture.py [--docs 1000000] [--seq-len 2048] [--batch 64] [--changes 10]

Two synthetic sources of `--docs` documents each (plans made once and cached, as in a run).
A live change builds the pipeline that resumes `state_at(at_step)` with the new weights
(opening the sources again from the plan cache, the mixture with one more history segment).
Timed, each with its first batch (a pipeline opens its sources when first read): a fresh
`Pipeline` from the config (what a restart's data side pays), `with_weights` after
`--changes` earlier changes (the history a long online-mixing run carries), a batch before and
after the changes (what each later step pays for the longer history), and `consumed` there.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_pipeline import forge_config, two_sources  # noqa: E402
from report import parser, publish, timed  # noqa: E402


def main():
    ap = parser(__doc__)
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--changes", type=int, default=10, help="live changes made before the one timed")
    a = ap.parse_args()
    from forge_grain import Pipeline

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        config = forge_config(two_sources(tmp, a.docs), a.seq_len, a.batch)
        p = Pipeline(config, 0, 1, num_threads=0)
        first = time.perf_counter() - t0
        # a pipeline opens its sources when first read: time the build and its first batch
        fresh = timed(lambda: Pipeline(config, 0, 1, num_threads=0, progress=False).batch(1000), 5)
        step_before = timed(lambda: p.batch(1000), 20)
        q = p
        for k in range(a.changes):  # the history of a long online-mixing run: a change every 100 steps
            q = q.with_weights({"s0": 1.0 + k % 3, "s1": 1.0}, 100 * (k + 1))
        at = 100 * (a.changes + 1)
        change = timed(lambda: q.with_weights({"s0": 0.5, "s1": 2.0}, at).batch(at), 5)
        r = q.with_weights({"s0": 0.5, "s1": 2.0}, at)
        step_after = timed(lambda: r.batch(at + 1000), 20)
        consumed = timed(lambda: r.consumed(at + 1000), 20)
    publish("live_mixture", [
        f"live mixture change: 2 sources x {a.docs:,} documents, batch {a.batch} x {a.seq_len} "
        f"(first build with planning {first:.1f} s)",
        f"  a fresh Pipeline and its first batch (plans cached) {fresh * 1e3:6.1f} ms",
        f"  with_weights after {a.changes} changes, and its first batch {change * 1e3:6.1f} ms "
        f"({change / fresh:.2f}x a fresh build; {change / step_before:.0f} steps' batches)",
        f"  a batch, no change / after {a.changes + 1} changes            {step_before * 1e3:6.2f} / "
        f"{step_after * 1e3:.2f} ms",
        f"  consumed(step) after {a.changes + 1} changes                 {consumed * 1e3:8.2f} ms",
    ])


if __name__ == "__main__":
    main()
