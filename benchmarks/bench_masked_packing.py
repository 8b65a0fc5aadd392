"""Packing conversations with their loss masks: forge-grain's `bestfit` against TRL's best-fit
decreasing (`pack_dataset(strategy="bfd")`, and `"bfd_split"`), on the same conversations.

    pip install trl   # (benchmarks only)
    python benchmarks/bench_masked_packing.py [--conversations 4000] [--seq-len 2048] [--seed 0]

The conversations are rendered with a ChatML template (as Qwen 2.5 writes it) and encoded
with the shipped tokenizer, once; both packers get the same ids and the same assistant masks.
What is counted, per packer: rows, trained tokens (the assistant tokens that some position
predicts: a sequence's first token is predicted by none), trained tokens per row, the
padding share of rows of `seq_len`, and the assistant tokens lost to truncation.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from report import parser, publish  # noqa: E402

WORDS = ("the model data token train loss batch row mask chat answer question because which when where how "
         "value number first second result every example").split()


def conversations(n: int, seed: int) -> list[list[dict]]:
    """Multi-turn conversations of skewed lengths (most short, a few long), deterministic."""
    rng = np.random.default_rng(seed)

    def text(mean_words):
        k = max(1, int(rng.lognormal(np.log(mean_words), 0.9)))
        return " ".join(rng.choice(WORDS, k))

    out = []
    for _ in range(n):
        turns = int(rng.integers(1, 5))
        chat = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.5 else []
        for _ in range(turns):
            chat += [{"role": "user", "content": text(40)}, {"role": "assistant", "content": text(120)}]
        out.append(chat)
    return out


def encoded(chats, tmp: Path):
    """(ids, masks) of each conversation, with the ChatML template and the shipped tokenizer."""
    from test_chat import CHATML, SPECIALS  # the template the tests check against transformers'
    from tokenizers import Tokenizer

    from forge_grain.corpora.chat import ChatTemplate
    from forge_grain.tokenizer import DEFAULT_TOKENIZER, load_tokenizer

    tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
    tok.add_special_tokens(SPECIALS)
    tok.save(str(tmp / "tokenizer.json"))
    text = load_tokenizer(str(tmp / "tokenizer.json"))
    template = ChatTemplate(CHATML, {"eos_token": "<|im_end|>"})
    pairs = [template.encode(text, c, lambda: "") for c in chats]
    return [p[0] for p in pairs], [p[1] for p in pairs], text.vocab_size


def trained_in(masks) -> int:
    """Assistant tokens some position predicts: not a sequence's first."""
    return int(sum(m[1:].sum() for m in masks))


def trl_packed(ids, masks, seq_len: int, strategy: str) -> dict:
    import datasets
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()

    ds = Dataset.from_dict({"input_ids": [i.tolist() for i in ids], "assistant_masks": [m.astype(int).tolist()
                                                                                       for m in masks]})
    t0 = time.perf_counter()
    packed = pack_dataset(ds, seq_len, strategy=strategy)
    seconds = time.perf_counter() - t0
    rows = packed[:]
    trained = 0
    for mask, lengths in zip(rows["assistant_masks"], rows["seq_lengths"]):
        at = 0
        for n in lengths:  # each packed sequence's first token is predicted by no position
            trained += int(np.sum(mask[at + 1:at + n]))
            at += n
    tokens = sum(len(r) for r in rows["input_ids"])
    return {"rows": len(packed), "trained": trained, "padding": 1 - tokens / (len(packed) * seq_len),
            "seconds": seconds}


def forge_packed(ids, masks, vocab_size: int, seq_len: int, tmp: Path) -> dict:
    from forge_grain import TokenStore, pack, write_store

    store = TokenStore.open(write_store(tmp / "store", ids, vocab_size=vocab_size, masks=masks))
    t0 = time.perf_counter()
    ds = pack(store, seq_len, "bestfit", seed=0, cache_dir=tmp / "plans", progress=False)
    seconds = time.perf_counter() - t0
    trained = int(ds.loss_positions.sum())
    b = ds.get_batch(np.arange(ds.num_rows))
    assert trained == int(b["loss_mask"].sum())  # the closed form is what the batches train
    return {"rows": ds.num_rows, "trained": trained, "padding": 1 - ds.stats["fill"], "seconds": seconds}


def main():
    ap = parser(__doc__)
    ap.add_argument("--conversations", type=int, default=4000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ids, masks, vocab = encoded(conversations(a.conversations, a.seed), tmp)
        available = trained_in(masks)
        results = {"forge-grain bestfit": forge_packed(ids, masks, vocab, a.seq_len, tmp)}
        for strategy in ("bfd", "bfd_split"):
            results[f"TRL {strategy}"] = trl_packed(ids, masks, a.seq_len, strategy)
    import trl

    lengths = np.array([len(i) for i in ids])
    lines = [f"packing conversations with loss masks: {a.conversations:,} ChatML conversations "
             f"({int(lengths.sum()):,} tokens, {available:,} assistant tokens to train; lengths median "
             f"{int(np.median(lengths))}, max {int(lengths.max()):,}; {int((lengths > a.seq_len).sum())} longer than a "
             f"row), seq_len {a.seq_len}, TRL {trl.__version__}",
             f"  {'packer':22} {'rows':>7} {'trained tokens':>15} {'a row':>8} {'padding':>8} {'lost':>7} {'seconds':>8}"]
    for name, r in results.items():
        lost = available - r["trained"]
        lines.append(f"  {name:22} {r['rows']:7,} {r['trained']:15,} {r['trained'] / r['rows']:8.1f} "
                     f"{r['padding']:8.2%} {lost / available:7.2%} {r['seconds']:8.2f}")
    publish("masked_packing", lines)


if __name__ == "__main__":
    main()
