"""Online data mixing: reweight the demo's two sources from their losses while training,
get killed, resume, and check that the loss curve and the weights after the resume match an
uninterrupted run.

    python examples/train_online_mixing.py [--steps 200] [--checkpoint-at 100] [--workers 2] [--plot weights.png]

Every `--every` steps the loop takes each source's mean loss over the last window
(`forge_grain.bridges.torch.source_losses` on the batch's `source_id`) and moves the weights by a
DoReMi-style exponentiated-gradient step towards the source whose loss fell least since the
first window (w_k <- w_k · exp(eta · excess_k), renormalized and mixed with uniform),
then `set_weights(..., at_step=step + AHEAD)`: DataLoader workers make batches ahead, so the
change is set for a step past those in flight. No source's row is repeated or skipped at a
change, and the data state (`tracker.state_dict()`, saved with the model) records the changes
and the weights, so the resumed run continues with them. The tiny GPT, its document masking
and its loss are those of `train_torch.py`.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from torch.utils.data import DataLoader

from forge_grain.bridges.torch import GrainIterableDataset, source_losses
from common import demo_config, example_main
from train_torch import TinyGPT

AHEAD = 8  # steps between setting weights and their first batch: past 2 workers x prefetch 2
ETA, SMOOTH = 1.0, 0.1


class Reweighter:
    """Per-source loss over a window, then an exponentiated-gradient step on the weights."""

    def __init__(self, names: list[str]):
        self.names, self.weights = names, np.full(len(names), 1.0 / len(names))
        self.total, self.count = np.zeros(len(names)), np.zeros(len(names))
        self.reference: list | None = None  # each source's loss in the first window
        self.history: list = []  # [at_step, weights]

    def add(self, per_token: torch.Tensor, batch: dict) -> None:
        mask = batch["loss_mask"].float()
        means = source_losses(per_token.detach(), batch["source_id"], mask, len(self.names)).numpy()
        tokens = np.bincount(batch["source_id"].numpy(), weights=mask.sum(1).numpy(), minlength=len(self.names))
        seen = tokens > 0
        self.total[seen] += means[seen] * tokens[seen]
        self.count += tokens

    def step(self) -> np.ndarray:
        loss = np.where(self.count > 0, self.total / np.maximum(self.count, 1), np.nan)
        if self.reference is None:
            self.reference = loss.tolist()
        excess = np.nan_to_num(loss - np.array(self.reference))  # how much less a source's loss has fallen
        w = self.weights * np.exp(ETA * (excess - excess.max()))
        self.weights = (1 - SMOOTH) * w / w.sum() + SMOOTH / len(w)
        self.total[:], self.count[:] = 0, 0
        return self.weights

    def state_dict(self) -> dict:
        return {"weights": self.weights.tolist(), "total": self.total.tolist(), "count": self.count.tolist(),
                "reference": self.reference, "history": self.history}

    def load_state_dict(self, s: dict) -> None:
        self.weights, self.total, self.count = (np.array(s[k]) for k in ("weights", "total", "count"))
        self.reference, self.history = s["reference"], s["history"]


def train(args, resume: bool) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the same reduction order in every run
    cfg = demo_config(args.workdir)
    names = [s.name for s in cfg.sources]
    data = GrainIterableDataset(cfg, rank=0, world_size=1)
    tracker, mixer = data.tracker(), Reweighter(names)
    model = TinyGPT(data.pipeline.stores[0].vocab_size, cfg.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ckpt = args.workdir / "checkpoints" / "online-mixing.pt"
    ckpt.parent.mkdir(exist_ok=True)
    if resume:
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"]), opt.load_state_dict(state["optimizer"])
        tracker.load_state_dict(state["data"])  # the weights set before the kill, and any on their way
        mixer.load_state_dict(state["mixer"])
    start = tracker.next_step
    loader = DataLoader(data, batch_size=None, num_workers=args.workers)
    losses = {}
    for step, batch in zip(range(start, args.steps), loader):
        assert int(batch["step"]) == step
        logits = model(batch["inputs"], batch["positions"], batch["segment_ids"])
        per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(),
                                                      reduction="none").view(batch["targets"].shape)
        mask = batch["loss_mask"].float()
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        tracker.update(batch)
        mixer.add(per_token, batch)
        losses[step] = loss.item()
        if (step + 1) % args.every == 0 and step + 1 + AHEAD < args.steps:
            weights = mixer.step()
            data.set_weights(dict(zip(names, weights.tolist())), at_step=step + 1 + AHEAD)
            mixer.history.append([step + 1 + AHEAD, weights.tolist()])
        if args.phase == "until-kill" and step + 1 == args.checkpoint_at:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "data": tracker.state_dict(),
                        "mixer": mixer.state_dict()}, tmp)
            os.replace(tmp, ckpt)  # atomic: a kill never leaves half a checkpoint
            print(f"checkpoint at step {step + 1}; killing the process", flush=True)
            os._exit(137)
        if step % 25 == 0:
            shares = ", ".join(f"{n} {w:.2f}" for n, w in zip(names, mixer.weights))
            print(f"[{args.phase}] step {step:4d}  loss {loss.item():.4f}  weights {shares}", flush=True)
    (args.workdir / f"weights-{args.phase}.json").write_text(json.dumps(mixer.history))
    if args.plot and args.phase != "until-kill":
        plot(mixer.history, names, args.plot)
    return losses


def plot(history: list, names: list[str], path: str) -> None:
    """The weights over the steps they applied from (needs forge-grain[plot])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [at for at, _ in history]
    fig, ax = plt.subplots(figsize=(6, 3))
    for k, name in enumerate(names):
        ax.step(steps, [w[k] for _, w in history], where="post", label=name)
    ax.set_xlabel("step"), ax.set_ylabel("weight"), ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    example_main(__doc__, __file__, train, "forge-grain-demo/online-mixing",
                 {"--workers": 2, "--every": 10, "--plot": ""})
