"""Hugging Face sources: streaming against eager on the same corpus, and the counting pass.

    python benchmarks/bench_hf.py [--max-files 800] [--seq-len 1024] [--batch 16]

Corpus: the demo corpus (this Python's standard library source) as JSONL, read through
`datasets.load_dataset("json", ...)`. Measured in one run, each with a fresh cache:
  - eager: tokenize once into a token store (first use), then one epoch of the pipeline;
  - streaming: one epoch of the pipeline tokenizing and packing on the fly;
  - the counting pass (document lengths only) as a fraction of one streaming epoch.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from forge_grain import DataConfig, Pipeline
from forge_grain.demo import write_demo_corpus


def epoch(cfg, cache):
    p = Pipeline(cfg, 0, 1, cache_dir=cache)
    t0 = time.perf_counter()
    n = sum(1 for _ in iter(p))
    return n, time.perf_counter() - t0, p


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-files", type=int, default=800)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_demo_corpus(Path(tmp) / "corpus", args.max_files)["code"]
        src = dict(name="code", hf_dataset="json", hf_data_files=str(corpus), strategy="bestfit")
        rows = {}
        for mode in ("eager", "streaming"):
            cfg = DataConfig(sources=[{**src, "hf_streaming": mode == "streaming"}], seq_len=args.seq_len,
                             global_batch_size=args.batch, seed=0)
            cache = Path(tmp) / f"cache-{mode}"
            t0 = time.perf_counter()
            p = Pipeline(cfg, 0, 1, cache_dir=cache)  # eager: tokenizes; streaming: the counting pass
            setup = time.perf_counter() - t0
            steps, dt, p = epoch(cfg, cache)
            rows[mode] = (setup, steps, dt, p)
        print(f"\ncorpus: {corpus.stat().st_size / 1e6:.1f} MB of JSONL; seq_len {args.seq_len}, batch {args.batch}")
        print(f"{'':<12}{'first use s':>13}{'epoch steps':>13}{'epoch s':>10}{'M tok/s (epoch)':>17}")
        for mode, (setup, steps, dt, _) in rows.items():
            label = "tokenize once" if mode == "eager" else "counting pass"
            print(f"{mode:<12}{setup:>13.2f}{steps:>13}{dt:>10.2f}"
                  f"{steps * args.batch * args.seq_len / dt / 1e6:>17.2f}   (first use: {label})")
        stream_setup, _, stream_epoch, p = rows["streaming"]
        counting = p.stores[0].counting_seconds()
        print(f"streaming epoch / eager epoch: {stream_epoch / rows['eager'][2]:.1f}x the time; "
              f"counting pass {counting:.2f} s = {counting / stream_epoch:.0%} of one streaming epoch "
              f"(cached: later runs and epochs pay nothing)")


if __name__ == "__main__":
    main()
