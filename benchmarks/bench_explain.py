"""The flight recorder's cost: `Pipeline.explain(step)` per row, against making the batches.

    python benchmarks/bench_explain.py [--docs 20000] [--seq-len 2048] [--batch 64] [--step 100000]

`explain` answers "which documents were in step N" from the config alone. The alternative a
loader without it offers is to make the batches up to that step (or, at best, to seek to it
and make that batch) and to log their ids: both are timed on the same two-source mixture.
Then the cost of skipping documents at resume: the same batch made by a pipeline resumed at
step 10 without the documents of 8 rows of step 20, against the uninterrupted one.
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
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--step", type=int, default=100_000, help="the step explained")
    a = ap.parse_args()
    from forge_grain import Pipeline

    with tempfile.TemporaryDirectory() as tmp:
        p = Pipeline(forge_config(two_sources(tmp, a.docs), a.seq_len, a.batch), 0, 1, num_threads=0)
        explain = timed(lambda: p.explain(a.step), 20)
        one_batch = timed(lambda: p.batch(a.step), 20)
        steps = 200
        t0 = time.perf_counter()
        for s in range(steps):
            p.batch(s)
        per_step = (time.perf_counter() - t0) / steps
        segments = sum(len(r["segments"]) for r in p.explain(a.step))
        docs = {}
        for r in p.explain(20)[:8]:
            docs.setdefault(r["source"], []).append(r["segments"][0]["document"])
        skipping = Pipeline(p.config, 0, 1, num_threads=0, resume_from=p.state_at(10), skip_documents=docs)
        skipped_batch = timed(lambda: skipping.batch(a.step), 20)
        plain_batch = timed(lambda: p.batch(a.step), 20)
    walk = per_step * a.step
    publish("explain", [
        f"explain: 2 sources x {a.docs:,} documents, batch {a.batch} x {a.seq_len}, step {a.step:,} "
        f"({segments} segments in its rows)",
        f"  explain(step)                      {explain * 1e3:8.2f} ms  ({explain / a.batch * 1e6:.1f} us per row)",
        f"  make that one batch (seek + batch) {one_batch * 1e3:8.2f} ms  (explain takes {explain / one_batch:.1f}x as long)",
        f"  make the batches up to the step    {walk:8.1f} s   (estimated: {per_step * 1e3:.2f} ms a step x {a.step:,}; "
        f"explain is {walk / explain:,.0f}x faster)",
        f"  skip_documents ({sum(map(len, docs.values()))} documents, from step 10): batch {a.step:,} takes "
        f"{skipped_batch * 1e3:.2f} ms against {plain_batch * 1e3:.2f} ms without skips "
        f"(+{(skipped_batch - plain_batch) * 1e3:.2f} ms a step)",
    ])


if __name__ == "__main__":
    main()
