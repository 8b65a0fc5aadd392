"""Train a tiny GPT-2 with the Hugging Face `Trainer` over forge-grain for 3 epochs with 2
DataLoader workers, get killed in the middle of epoch 2, resume from the Trainer's own
checkpoint, and check that every batch after the resume is the uninterrupted run's.

    pip install "forge-grain[trainer]"   # transformers, torch and accelerate (the Trainer needs it)
    python examples/train_hf_trainer.py [--source streaming|stored] [--epochs 3] [--workers 2]

The recipe is the Trainer's defaults but for the batch size:

    ds = GrainIterableDataset(config, convention="hf", rows=True)   # rows: the Trainer batches them
    args = TrainingArguments(per_device_train_batch_size=config.global_batch_size // world_size,
                             num_train_epochs=config.num_epochs, dataloader_num_workers=2, ...)
    Trainer(model=model, args=args, train_dataset=ds).train()       # later: .train(resume_from_checkpoint=True)

Each DataLoader batch is then exactly one pipeline step; `len(ds)` makes the Trainer's
schedule exact (its epochs tile the pipeline's steps); the Trainer calls `set_epoch`, so
epoch e is the pipeline's pass e, not a replay; its default `remove_unused_columns` drops
the keys the model does not take (`step`, `source_id`, `segment_ids`, `is_natural_stop`).
On resume the Trainer sets the epoch and skips the batches of it already trained by reading
them again: the pass starts without reading the ones before (stored sources, and a single
streaming source, whose epochs start every stream afresh), so the data continues exactly.

`--source streaming`: one streaming source (JSON Lines, tokenized on the fly); `stored`: a
mixture of two prepared stores with a phase switch. Both come from the Python standard
library (no download).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from forge_grain.bridges.torch import GrainIterableDataset
from forge_grain import DataConfig, Phase, SourceConfig, prepare
from forge_grain.demo import write_demo_corpus


def make_config(source: str, workdir: Path, epochs: int) -> DataConfig:
    corpus = write_demo_corpus(workdir / "corpus", max_files=12)
    if source == "streaming":
        src = [SourceConfig("code", hf_dataset="json", hf_data_files=[str(corpus["code"])], hf_streaming=True,
                            window=64)]
        return DataConfig(sources=src, seq_len=128, global_batch_size=8, seed=0, num_epochs=epochs,
                          canonical_workers=2)
    stores = {name: prepare(corpus[name], workdir / "stores" / name, progress=False) for name in corpus}
    return DataConfig(sources=[SourceConfig("code", str(stores["code"]), 0.7, "bestfit"),
                               SourceConfig("docs", str(stores["docs"]), 0.3, "bos_bestfit")],
                      seq_len=128, global_batch_size=8, seed=0, num_epochs=epochs,
                      phases=[Phase(10, {"code": 0.3, "docs": 0.7})])


def show_a_batch(ds: GrainIterableDataset) -> None:
    """What the Trainer's collator makes of the rows: one step, labels -100 where no loss."""
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=ds.pipeline.local_batch_size)))
    labels = batch["labels"]
    print(f"a collated batch (step {sorted(set(batch['step'].tolist()))}): input_ids {list(batch['input_ids'].shape)}; "
          f"labels -100 at {int((labels == -100).sum())} of {labels.numel()} positions (each row's first token, each "
          f"document's first, padding: {int((batch['attention_mask'] == 0).sum())}); is_natural_stop at "
          f"{int(batch['is_natural_stop'].sum())} (a document's true last token)")


def train(args, resume: bool) -> dict:
    import transformers

    config = make_config(args.source, args.workdir, args.epochs)
    ds = GrainIterableDataset(config, rank=0, world_size=1, convention="hf", rows=True,
                              cache_dir=args.workdir / "cache")
    if args.phase == "full":
        show_a_batch(ds)
    tokens = ds.pipeline.stores[0]
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=tokens.vocab_size, bos_token_id=tokens.bos_id, eos_token_id=tokens.eos_id,
        n_positions=config.seq_len, n_embd=32, n_layer=1, n_head=2))
    seen: dict[int, str] = {}

    class Recording(transformers.Trainer):  # notes what each step trained on: one digest a step
        def training_step(self, model, inputs, *rest, **kw):
            seen[self.state.global_step] = hashlib.sha256(inputs["input_ids"].numpy().tobytes()).hexdigest()[:16]
            return super().training_step(model, inputs, *rest, **kw)

    class KillAfterCheckpoint(transformers.TrainerCallback):
        def on_save(self, targs, state, control, **kw):
            if args.phase == "until-kill" and state.global_step == args.kill_at:
                (args.workdir / f"steps-{args.phase}.json").write_text(json.dumps(seen))
                print(f"checkpoint at step {args.kill_at} (epoch {args.kill_at // ds.steps_per_pass + 1} of {args.epochs}); "
                      "killing the process", flush=True)
                os._exit(0)

    targs = transformers.TrainingArguments(
        output_dir=str(args.workdir / "checkpoints"), per_device_train_batch_size=ds.pipeline.local_batch_size,
        num_train_epochs=args.epochs, dataloader_num_workers=args.workers, save_strategy="steps",
        save_steps=args.kill_at, learning_rate=1e-3, report_to=[], logging_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True,
    )
    trainer = Recording(model=model, args=targs, train_dataset=ds, callbacks=[KillAfterCheckpoint()])
    trainer.train(resume_from_checkpoint=True if resume else None)
    assert trainer.state.max_steps == ds.num_steps, (trainer.state.max_steps, ds.num_steps)
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=["streaming", "stored"], default="streaming")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("forge-grain-hf-trainer"))
    ap.add_argument("--phase", choices=["full", "until-kill", "resume"], help=argparse.SUPPRESS)
    ap.add_argument("--kill-at", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.phase is not None:
        seen = train(args, resume=args.phase == "resume")
        (args.workdir / f"steps-{args.phase}.json").write_text(json.dumps(seen))
        return
    probe = GrainIterableDataset(make_config(args.source, args.workdir, args.epochs), rank=0, world_size=1,
                                 cache_dir=args.workdir / "cache")
    n = probe.steps_per_pass
    kill_at = n + n // 2  # the middle of epoch 2
    base = [sys.executable, __file__, "--source", args.source, "--epochs", str(args.epochs), "--workers",
            str(args.workers), "--workdir", str(args.workdir), "--kill-at", str(kill_at)]
    for phase in ("full", "until-kill", "resume"):
        if phase != "resume":
            shutil.rmtree(args.workdir / "checkpoints", ignore_errors=True)
        r = subprocess.run(base + ["--phase", phase])
        if r.returncode != 0:
            raise SystemExit(f"phase {phase} failed")
    full, before, after = (json.loads((args.workdir / f"steps-{p}.json").read_text())
                           for p in ("full", "until-kill", "resume"))
    assert len(full) == args.epochs * n, (len(full), args.epochs * n)
    same_before = all(before[s] == full[s] for s in before)
    same_after = sorted(map(int, after)) == list(range(kill_at, args.epochs * n)) and all(
        after[s] == full[s] for s in after)
    print(f"{args.source}: {args.epochs} epochs of {n} steps; killed after step {kill_at}, resumed from the Trainer's "
          f"checkpoint: {len(after)} steps after the resume")
    if not (same_before and same_after):
        raise SystemExit("the resumed run trained on other batches than the uninterrupted one")
    print("resumed batches are identical to the uninterrupted run")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
