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

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from common import example_main
from forge_grain import DataConfig, Phase, SourceConfig, prepare
from forge_grain.bridges.torch import GrainIterableDataset
from forge_grain.demo import write_demo_corpus
from forge_grain.tokenizer import DEFAULT_TOKENIZER
from train_torch import TinyGPT, loss_fn

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


def train(args, resume: bool) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the same reduction order in every run
    cfg = config(args.workdir, args.anneal_at)
    data = GrainIterableDataset(cfg, rank=0, world_size=1)
    loader = StatefulDataLoader(data, batch_size=None, num_workers=args.workers)
    model = TinyGPT(data.pipeline.stores[0].vocab_size, cfg.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ckpt = args.workdir / "checkpoints" / "midtraining-checkpoint.pt"
    ckpt.parent.mkdir(exist_ok=True)
    start = 0
    if resume:
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"]), opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        start = state["step"]
    chat = data.pipeline.source_names.index("chat")
    losses = {}
    for step, batch in zip(range(start, args.steps), loader):
        assert int(batch["step"]) == step
        loss = loss_fn(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses[step] = loss.item()
        if args.phase == "until-kill" and step + 1 == args.checkpoint_at:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": loader.state_dict(),
                        "step": step + 1}, tmp)
            os.replace(tmp, ckpt)  # atomic: a kill never leaves half a checkpoint
            print(f"checkpoint at step {step + 1}; killing the process", flush=True)
            os._exit(137)
        rows = batch["source_id"] == chat
        if step % 10 == 0 or (rows.any() and step == args.anneal_at):
            chat_rows = int(rows.sum())
            share = (batch["loss_mask"][rows].sum() / (batch["segment_ids"][rows] > 0).sum()).item() if chat_rows else 0
            print(f"[{args.phase}] step {step:4d}  loss {loss.item():.4f}  chat rows {chat_rows} of "
                  f"{len(rows)}" + (f" ({share:.0%} of their tokens are targets: the assistant's turns)"
                                   if chat_rows else ""), flush=True)
    return losses


if __name__ == "__main__":
    example_main(__doc__, __file__, train, "forge-grain-demo/midtraining-example",
                 {"--workers": 2, "--anneal-at": 40})
