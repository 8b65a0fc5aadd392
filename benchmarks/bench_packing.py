"""Packing: forge-grain against Grain's packers and a nanochat-style loop, on the same documents.

    python benchmarks/bench_packing.py [--docs 20000] [--seq-lens 512 2048 8192] [--corpus synthetic demo]
                                       [--plan-docs 10000000]

For each corpus and seq_len, one table: rows/s and tokens/s, fill, cropped and lost
shares, for
  - forge-grain's three strategies, read one row at a time (`ds[i]`, random i) and a
    whole batch at a time (`ds.get_batch(indices)` into preallocated arrays);
  - Grain's ConcatThenSplitIterDataset, FirstFitPackIterDataset and
    BestFitPackIterDataset (512 bins) over the same store, iterated to the end;
  - a nanochat-style BOS-aligned best-fit-crop loop over a 1000-document buffer
    (largest document that fits, else crop the shortest), written here from that rule;
  - a plain numpy copy of the same number of tokens (the memory-bandwidth limit).
Then forge-grain's speed as a ratio to each peer. Finally, planning time for
--plan-docs documents (lengths only) per strategy.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import grain
import numpy as np

from corpora import demo_store, lognormal_lengths, synthetic_store
from report import kept, parser
from forge_grain import pack, plan_offsets
from forge_grain.packing.plans import min_crop_share

BATCH = 64
SHORT = {
    "grain ConcatThenSplit": "CTS",
    "grain FirstFitPack (512 bins)": "FirstFit",
    "grain BestFitPack (512 bins)": "BestFit",
    "nanochat-style best-fit crop (1000 docs)": "nanochat",
}


def forge_rows(store, seq_len, work):
    out = []
    for strategy in ("concat", "bos_bestfit", "bestfit"):
        ds = pack(store, seq_len, strategy, num_epochs=None, cache_dir=work / "plans")
        st = ds.stats
        rng = np.random.default_rng(0)
        n_single = max(200, min(5000, 4_000_000 // seq_len))
        idx = rng.integers(0, ds.num_rows, n_single)
        ds[int(idx[0])]
        t0 = time.perf_counter()
        for i in idx:
            ds[int(i)]
        per_row = n_single / (time.perf_counter() - t0)
        batches = [rng.integers(0, ds.num_rows, BATCH) for _ in range(max(10, 200_000_000 // (BATCH * seq_len * 20)))]
        buf = ds.get_batch(batches[0])
        t0 = time.perf_counter()
        for b in batches:
            ds.get_batch(b, out=buf)
        per_batch_rows = len(batches) * BATCH / (time.perf_counter() - t0)
        quality = (st["fill"], st["cropped_share"], st["lost_share"])
        out.append((f"forge-grain {strategy}, per row", per_row, *quality))
        out.append((f"forge-grain {strategy}, batch of {BATCH}", per_batch_rows, *quality))
    return out


def grain_peer(store, seq_len, kind):
    from grain.experimental import BestFitPackIterDataset, ConcatThenSplitIterDataset, FirstFitPackIterDataset

    # Grain's bin packers need documents truncated to seq_len (their tails are lost)
    limit = None if kind == "ConcatThenSplit" else seq_len
    docs = grain.MapDataset.source(store).map(lambda d: {"inputs": d[:limit].astype(np.int32)}).to_iter_dataset()
    lengths = {"inputs": seq_len}
    if kind == "ConcatThenSplit":
        packed = ConcatThenSplitIterDataset(docs, length_struct=lengths)
    else:
        cls = BestFitPackIterDataset if kind == "BestFitPack" else FirstFitPackIterDataset
        packed = cls(docs, length_struct=lengths, num_packing_bins=512, shuffle_bins=False)
    rows = real = 0
    t0 = time.perf_counter()
    for row in packed:
        rows += 1
        seg = row.get("inputs_segment_ids")
        real += int((seg > 0).sum()) if seg is not None else len(row["inputs"])
    dt = time.perf_counter() - t0
    lost = 1 - real / store.num_tokens
    return (f"grain {kind}" + ("" if kind == "ConcatThenSplit" else " (512 bins)"), rows / dt, real / (rows * seq_len), 0.0, lost)


def nanochat_loop(store, seq_len, buffer_size=1000):
    """BOS-aligned best-fit with cropping, nanochat's rule: rows of seq_len + 1 tokens;
    put in the largest buffered document that fits, and when none fits, crop the shortest."""
    cap = seq_len + 1
    n = len(store)
    buf_docs, buf_len = [], np.zeros(0, np.int64)
    nxt = rows = cropped = 0
    row = np.empty(cap, np.int32)
    t0 = time.perf_counter()
    while True:
        while len(buf_docs) < buffer_size and nxt < n:
            buf_docs.append(store[nxt])
            buf_len = np.append(buf_len, len(buf_docs[-1]))
            nxt += 1
        if not buf_docs or (nxt >= n and buf_len.sum() < cap):
            break
        pos = 0
        while pos < cap and buf_docs:
            room = cap - pos
            fits = np.where(buf_len <= room, buf_len, -1)
            k = int(fits.argmax())
            if fits[k] < 0:  # nothing fits: crop the shortest
                k = int(buf_len.argmin())
                row[pos:] = buf_docs[k][:room]
                cropped += int(buf_len[k]) - room
                pos = cap
            else:
                row[pos : pos + buf_len[k]] = buf_docs[k]
                pos += int(buf_len[k])
            buf_docs.pop(k)
            buf_len = np.delete(buf_len, k)
        if pos < cap:
            break
        rows += 1
    dt = time.perf_counter() - t0
    lost = 1 - rows * cap / store.num_tokens
    return ("nanochat-style best-fit crop (1000 docs)", rows / dt, 1.0, cropped / store.num_tokens, lost)


def numpy_copy(store, seq_len):
    src = store.pieces[0].arrays[0]  # the first token array (a one-file store: all of it)
    dst = np.empty(BATCH * seq_len, np.int32)
    n_tok = BATCH * seq_len
    starts = np.random.default_rng(0).integers(0, len(src) - n_tok, 50)
    t0 = time.perf_counter()
    for s in starts:
        np.copyto(dst, src[s : s + n_tok])
    return ("numpy copy of the same tokens", len(starts) * BATCH / (time.perf_counter() - t0), 1.0, 0.0, 0.0)


def table(title, rows, seq_len):
    peers = [r for r in rows if r[0].startswith(("grain", "nanochat"))]
    print(f"\n{title}")
    head = f"{'method':<42}{'rows/s':>11}{'M tok/s':>10}{'fill':>8}{'cropped':>9}{'lost':>8}"
    print(head + "".join(f"{'vs ' + SHORT[p[0]]:>14}" for p in peers))
    for name, rps, fill, crop, lost in rows:
        line = f"{name:<42}{rps:>11,.0f}{rps * seq_len / 1e6:>10.1f}{fill:>8.2%}{crop:>9.2%}{lost:>8.2%}"
        if name.startswith("forge"):
            line += "".join(f"{rps / p[1]:>13.1f}x" for p in peers)
        print(line)
    copy = next(r for r in rows if r[0].startswith("numpy"))
    best = max(r[1] for r in rows if "batch" in r[0])
    print(f"{'':<42}fastest forge-grain batch = {best / copy[1]:.2f} of the numpy copy's speed")


def planning(num_docs):
    lengths = lognormal_lengths(num_docs, seed=3)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    print(f"\nplanning {num_docs:,} documents (lengths only, one core), seq_len 2048")
    plan_offsets(offsets[:1001], 2048, "bestfit")  # compile
    for strategy in ("concat", "bos_bestfit", "bestfit"):
        t0 = time.perf_counter()
        p = plan_offsets(offsets, 2048, strategy)
        print(f"  {strategy:<12}{time.perf_counter() - t0:>8.2f} s   {p.num_rows:,} rows")


def main():
    ap = parser(__doc__)
    ap.add_argument("--docs", type=int, default=20_000, help="synthetic documents (20k to 1M)")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[2048])
    ap.add_argument("--corpus", nargs="+", default=["synthetic", "demo"], choices=["synthetic", "demo"])
    ap.add_argument("--plan-docs", type=int, default=10_000_000, help="documents for the planning benchmark (0: skip)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, kept("packing"):
        work = Path(tmp)
        stores = {}
        if "synthetic" in args.corpus:
            stores[f"synthetic log-normal (median 600, sigma 1.0), {args.docs:,} documents"] = synthetic_store(
                work / "synthetic", args.docs
            )
        if "demo" in args.corpus:
            stores["demo corpus (Python standard library source)"] = demo_store(work / "demo")
        for name, store in stores.items():
            for seq_len in args.seq_lens:
                rows = forge_rows(store, seq_len, work)
                for kind in ("ConcatThenSplit", "FirstFitPack", "BestFitPack"):
                    rows.append(grain_peer(store, seq_len, kind))
                rows.append(nanochat_loop(store, seq_len))
                rows.append(numpy_copy(store, seq_len))
                floor = min_crop_share(store.lengths, seq_len)
                table(f"{name}: {store.num_tokens / 1e6:.1f} M tokens, seq_len {seq_len} "
                      f"(crop floor for BOS-aligned rows {floor:.2%})", rows, seq_len)
        if args.plan_docs:
            planning(args.plan_docs)


if __name__ == "__main__":
    main()
