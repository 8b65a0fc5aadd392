"""Train OLMo-core's smallest model with OLMo-core's own `Trainer` on the demo corpus, fed by
forge-grain; checkpoint, get killed, resume, and check that the loss curve after the resume
matches an uninterrupted run.

    pip install "forge-grain[olmo]"
    python examples/train_olmo_core.py [--steps 40] [--checkpoint-at 20]

Data: `forge_grain.bridges.olmo.ForgeGrainDataLoaderConfig` builds OLMo-core's data loader from a
forge-grain config (here the examples' two-source config, as a `DataConfig`; a TOML path works
the same); OLMo-core's `CheckpointerCallback` saves the loader's state with the model and
optimizer, and `Trainer.load_checkpoint` restores all three. One process on CPU (OLMo-core's
`prepare_training_environment` over gloo; under `torchrun` each rank reads its own shard).
Intra-document masking is off on CPU: OLMo-core's CPU attention refuses `doc_lens`; its
flash-attention backends take them on a GPU (`intra_document=True`, the default).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import torch
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, TrainerConfig, prepare_training_environment, teardown_training_environment
from olmo_core.train.callbacks import Callback, CheckpointerCallback
from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig

from forge_grain.bridges.olmo import ForgeGrainDataLoaderConfig
from common import demo_config, example_main


@dataclass
class Losses(Callback):
    """Each step's training loss (keyed by the 0-based step it trained), and the kill: the
    process dies as the step after `kill_after` begins, its checkpoint already written."""

    losses: dict = field(default_factory=dict)
    kill_after: int = 0

    def pre_step(self, batch):
        if self.kill_after and self.step == self.kill_after + 1:
            print(f"checkpoint at step {self.kill_after}; killing the process", flush=True)
            os._exit(137)

    def log_metrics(self, step, metrics):
        if "train/CE loss" in metrics:  # (some calls carry other metrics only)
            self.losses[step - 1] = float(metrics["train/CE loss"])


def single_process() -> None:
    """torch.distributed's environment for one process, where `torchrun` did not set it."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def train(args, resume: bool) -> dict:
    torch.set_num_threads(1)  # the same reduction order in every run
    single_process()
    prepare_training_environment(seed=0, backend="gloo")
    cfg = demo_config(args.workdir)
    # the killed run and its resume share a folder; the uninterrupted run's checkpoints are its own
    save_folder = str(args.workdir / "checkpoints" / ("full" if args.phase == "full" else "killed"))
    data_loader = ForgeGrainDataLoaderConfig(config=cfg, work_dir=str(args.workdir / "olmo-work"),
                                             intra_document=False).build()
    vocab = -(-data_loader.pipeline.stores[0].vocab_size // 128) * 128  # OLMo-core pads its embedding
    model = TransformerConfig.olmo2_1M(vocab_size=vocab).build(init_device="cpu")
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=data_loader.rank_batch_size, max_sequence_length=cfg.seq_len,
        optim=AdamWConfig(lr=3e-3), dp_config=TransformerDataParallelConfig(name=DataParallelType.ddp),
    ).build(model, device=torch.device("cpu"))
    losses = Losses(kill_after=args.checkpoint_at if args.phase == "until-kill" else 0)
    trainer = TrainerConfig(
        save_folder=save_folder, max_duration=Duration.steps(args.steps), device="cpu",
        metrics_collect_interval=1, save_overwrite=True,
        callbacks={"checkpointer": CheckpointerCallback(save_interval=args.checkpoint_at, save_async=False,
                                                        ephemeral_save_interval=None),
                   "losses": losses},
    ).build(train_module, data_loader)
    if resume:
        trainer.load_checkpoint(trainer.checkpointer.latest_checkpoint(save_folder))
        print(f"[resume] from OLMo-core's checkpoint at step {trainer.global_step}", flush=True)
    trainer.fit()
    teardown_training_environment()
    for step in sorted(losses.losses)[::10]:
        print(f"[{args.phase}] step {step:4d}  loss {losses.losses[step]:.4f}", flush=True)
    return losses.losses


if __name__ == "__main__":
    example_main(__doc__, __file__, train, "forge-grain-demo/olmo-core-example")
