"""Mid-training: pre-train a tiny GPT on code and docstrings, then anneal into a mix with chat
data whose loss is on the assistant's turns only; checkpoint, get killed, resume, and check
that the loss curve after the resume matches an uninterrupted run.

    pip install "forge-grain[torch]"
    python examples/train_midtraining.py [--steps 120] [--checkpoint-at 70] [--anneal-at 40]

Data: the demo corpus (the standard library's code and docstrings) and a chat corpus made
from it (a user asks what a module, class or function does; the assistant answers with its
docstring), prepared with `forge-grain prepare --chat messages` and a ChatML template, so the
chat store carries a target mask. The config mixes the three by weight; a phase at
`--anneal-at` brings the chat data in (OLMo 2's mid-training, Llama 3's annealing). Every
row's `loss_mask` is the packing's and the data's: on a chat row only the assistant's turns
train. The model, loop and checkpoint are `train_torch.py`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from common import example_main
from forge_grain import DataConfig, Phase, SourceConfig, prepare
from forge_grain.demo import write_demo_corpus
from forge_grain.tokenizer import DEFAULT_TOKENIZER
from train_torch import train_loop

CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def chat_tokenizer(workdir: Path) -> Path:
    """The shipped tokenizer with ChatML's markers and template (a real model's tokenizer
    directory, or its Hub name, has its own)."""
    from tokenizers import Tokenizer

    d = workdir / "tokenizer"
    if not (d / "tokenizer_config.json").exists():
        d.mkdir(parents=True, exist_ok=True)
        tok = Tokenizer.from_file(str(DEFAULT_TOKENIZER))
        tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return d


def chat_corpus(docs: Path, out: Path) -> Path:
    """Conversations from the docstrings: "What does X in Y do?" answered with its docstring
    (written once: a rewritten input is another input to prepare)."""
    if out.exists():
        return out
    rows = []
    for line in docs.read_text().splitlines():
        doc = json.loads(line)
        first = doc["text"].strip().split("\n\n")[0]
        question = f"In {doc['file']}, what does the code documented as {first.split('.')[0][:60]!r} do?"
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": first}]})
    tmp = out.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, out)
    return out


def config(workdir: Path, anneal_at: int) -> DataConfig:
    corpus = write_demo_corpus(workdir / "corpus", 120)
    tokenizer = str(chat_tokenizer(workdir))
    stores = {name: prepare(corpus[name], workdir / "stores" / name, tokenizer=tokenizer, progress=False)
              for name in ("code", "docs")}
    stores["chat"] = prepare(chat_corpus(corpus["docs"], workdir / "corpus" / "chat.jsonl"),
                             workdir / "stores" / "chat", tokenizer=tokenizer, chat="messages", progress=False)
    return DataConfig(
        sources=[SourceConfig("code", str(stores["code"]), 0.7, "bestfit"),
                 SourceConfig("docs", str(stores["docs"]), 0.3, "bestfit"),
                 SourceConfig("chat", str(stores["chat"]), 0.0, "bestfit")],
        seq_len=128, global_batch_size=8, seed=0, num_epochs=None,
        phases=[Phase(anneal_at, {"code": 0.3, "docs": 0.2, "chat": 0.5})],
    )


def chat_rows(step: int, batch: dict, pipeline) -> str:
    """How many of the batch's rows are chat rows, and what share of their tokens train."""
    rows = batch["source_id"] == pipeline.source_names.index("chat")
    if not rows.any():
        return f"  chat rows 0 of {len(rows)}"
    share = (batch["loss_mask"][rows].sum() / (batch["segment_ids"][rows] > 0).sum()).item()
    return (f"  chat rows {int(rows.sum())} of {len(rows)} ({share:.0%} of their tokens are targets: the "
            "assistant's turns)")


def train(args, resume: bool) -> dict:
    return train_loop(args, resume, config(args.workdir, args.anneal_at), "midtraining-checkpoint.pt", chat_rows,
                      every=4)


if __name__ == "__main__":
    example_main(__doc__, __file__, train, "forge-grain-demo/midtraining-example",
                 {"--workers": 2, "--anneal-at": 40})
