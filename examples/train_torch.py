"""Train a tiny GPT in PyTorch on the demo corpus, checkpoint, get killed, resume, and check
that the loss curve after the resume matches an uninterrupted run.

    python examples/train_torch.py [--steps 200] [--checkpoint-at 100] [--workers 2]

Data: forge-grain's pipeline through `forge_grain.bridges.torch.GrainIterableDataset` and torchdata's
`StatefulDataLoader`, whose `state_dict()` goes into the same checkpoint as the model and
optimizer. Document masking: on CUDA, attention is FlexAttention (compiled) with the
batch's document block mask (`forge_grain.bridges.torch_varlen.document_block_mask`: query i sees key j
iff same segment and j <= i; blocks with no such pair are skipped). torch 2.13's
FlexAttention has no backward pass on CPU ("FlexAttention does not support backward on
CPU"), so on CPU the same attention runs over the batch's varlen metadata instead: the rows
flattened and each document attended on its own (`varlen_attention` over `cu_seqlens`, what
flash-attn's varlen kernel computes). Position embeddings use `positions` (restarting at
each document), and the loss is averaged over `loss_mask` (no target that crosses into
another document, none on padding).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention
from torchdata.stateful_dataloader import StatefulDataLoader

from forge_grain.bridges.torch import GrainIterableDataset
from forge_grain.bridges.torch_varlen import document_block_mask, flash_varlen_kwargs, varlen_attention
from common import demo_config, example_main

FLEX = torch.cuda.is_available()  # FlexAttention trains on GPUs only (no backward on CPU)
attention = torch.compile(flex_attention) if FLEX else None


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        if FLEX:
            a = attention(q, k, v, block_mask=mask)
        else:  # [B, H, T, d] -> [B·T, H, d], attended per document, and back
            flat = [t.transpose(1, 2).reshape(B * T, self.heads, -1) for t in (q, k, v)]
            a = varlen_attention(*flat, mask).view(B, T, self.heads, -1).transpose(1, 2)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, inputs, positions, segment_ids):
        # padding (segment 0) attends to padding only
        mask = document_block_mask(segment_ids) if FLEX else flash_varlen_kwargs({"segment_ids": segment_ids})["cu_seqlens_q"]
        x = self.tok(inputs) + self.pos(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def loss_fn(model, batch):
    logits = model(batch["inputs"], batch["positions"], batch["segment_ids"])
    per_token = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten().float()
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def train(args, resume: bool) -> dict:
    return train_loop(args, resume, demo_config(args.workdir), "torch-checkpoint.pt")


def train_loop(args, resume: bool, cfg, checkpoint: str, describe=None, every: int = 25) -> dict:
    """Train from scratch or from `checkpoint` (model, optimizer and loader state in one file),
    dying right after saving it in the "until-kill" phase; {step: loss}. `describe(step,
    batch, pipeline)` adds to the line printed every `every` steps."""
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the same reduction order in every run
    data = GrainIterableDataset(cfg, rank=0, world_size=1)
    loader = StatefulDataLoader(data, batch_size=None, num_workers=args.workers)
    model = TinyGPT(data.pipeline.stores[0].vocab_size, cfg.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ckpt = args.workdir / "checkpoints" / checkpoint
    ckpt.parent.mkdir(exist_ok=True)
    start = 0
    if resume:
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"]), opt.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        start = state["step"]
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
        if step % every == 0:
            extra = describe(step, batch, data.pipeline) if describe else ""
            print(f"[{args.phase}] step {step:4d}  loss {loss.item():.4f}{extra}", flush=True)
    return losses


if __name__ == "__main__":
    example_main(__doc__, __file__, train, "forge-grain-demo/torch-example", {"--workers": 2})
