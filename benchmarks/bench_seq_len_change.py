"""The cost of a sequence-length change (`seq_lens`): planning the rest of an epoch at the new
length, beside a fresh plan of the whole epoch at it.

    python benchmarks/bench_seq_len_change.py [--docs 10000000] [--from-len 1024] [--to-len 2048]

Plans are made from document lengths alone (no token is read), so the store is its offsets:
`--docs` log-normal lengths (median 600 tokens, as `corpora.lognormal_lengths`). A change
interrupts an epoch at a share of its rows; the rest of that epoch is the rows not yet read,
taken apart into their untrained targets and planned at the new length
(`forge_grain.packing.rest.rest_plan`, in this process, as each pipeline process does when
it first reaches the change). A fresh plan is `plan_offsets` at the new length over every
document, in this process too (a pipeline plans a store this large in chunks and processes:
see bench_planning.py), so the two are compared on the same footing. Each strategy is timed
once (these take seconds; the machine's noise is small beside them).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from corpora import lognormal_lengths  # noqa: E402
from report import parser, publish  # noqa: E402


def main():
    ap = parser(__doc__)
    ap.add_argument("--docs", type=int, default=10_000_000)
    ap.add_argument("--from-len", type=int, default=1024)
    ap.add_argument("--to-len", type=int, default=2048)
    ap.add_argument("--strategies", default="bestfit,bos_bestfit")
    a = ap.parse_args()
    from forge_grain.packing import kernels
    from forge_grain.packing.plans import plan_offsets
    from forge_grain.packing.rest import rest_plan

    lengths = lognormal_lengths(a.docs)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    key = 12345
    lines = [f"sequence-length change {a.from_len} -> {a.to_len}: {a.docs:,} documents, "
             f"{int(offsets[-1]) / 1e9:.2f} B tokens (this machine: 2 cores; one process each)"]
    for strategy in a.strategies.split(","):
        t0 = time.perf_counter()
        before = plan_offsets(offsets, a.from_len, strategy, seed=1)
        t_before = time.perf_counter() - t0
        t0 = time.perf_counter()
        fresh = plan_offsets(offsets, a.to_len, strategy, seed=1)
        t_fresh = time.perf_counter() - t0
        n = before.num_rows
        lines.append(f"  {strategy}: the epoch at {a.from_len} has {n:,} rows (planned in {t_before:.1f} s); "
                     f"a fresh plan at {a.to_len}: {t_fresh:.1f} s, {fresh.num_rows:,} rows")
        for share in (0.1, 0.5, 0.9):
            read = int(n * share)
            t0 = time.perf_counter()
            unread = kernels.epoch_rows(np.arange(read, n, dtype=np.int64), n, key, True)
            rest = rest_plan(before, unread, offsets, a.to_len, 7)
            t_rest = time.perf_counter() - t0
            lines.append(f"    change at {share:.0%} of the epoch: the rest ({n - read:,} rows -> {rest.num_rows:,}) "
                         f"planned in {t_rest:.1f} s = {t_rest / t_fresh:.2f}x the fresh plan")
    publish("seq_len_change", lines)


if __name__ == "__main__":
    main()
