"""An OLMo-core training run fed by forge-grain, under torchrun (gloo, CPU).

    olmo_train.py CONFIG SAVE_FOLDER RECORD EPOCHS SAVE_INTERVAL CRASH_AFTER NUM_WORKERS

Intra-document masking is off: OLMo-core's CPU attention (its torch backend) refuses `doc_lens`
("'TorchAttentionBackend' doesn't support intra-document masking"); its flash-attention backends
take them on a GPU.

OLMo-core's own pieces: its smallest model config (`olmo2_1M`), `TransformerTrainModule`
(DDP over gloo), `Trainer` with `CheckpointerCallback` (loads the latest checkpoint in
SAVE_FOLDER when there is one). Each rank appends, for every step it trains, the global step
and the hash of its batch to RECORD + rank + ".jsonl". With CRASH_AFTER > 0 the process dies
(`os._exit`) as step CRASH_AFTER + 1 begins, after step CRASH_AFTER's checkpoint is written.
"""

import hashlib
import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, TrainerConfig, prepare_training_environment, teardown_training_environment
from olmo_core.train.callbacks import Callback, CheckpointerCallback
from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig

from forge_grain.bridges.olmo import ForgeGrainDataLoaderConfig


@dataclass
class Record(Callback):
    """Note each trained batch; die on request (the checkpoint before it is on disk)."""

    path: str = ""
    crash_after: int = 0

    def pre_step(self, batch):
        if self.crash_after and self.step == self.crash_after + 1:
            os._exit(3)
        h = hashlib.sha256()
        for key in ("input_ids", "label_mask"):
            h.update(batch[key].contiguous().numpy().tobytes())
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": self.step, "epoch": self.trainer.epoch, "hash": h.hexdigest(),
                                "shape": list(batch["input_ids"].shape)}) + "\n")


def main(config, save_folder, record, epochs, save_interval, crash_after, num_workers):
    prepare_training_environment(seed=0, backend="gloo")
    rank = dist.get_rank()
    model = TransformerConfig.olmo2_1M(vocab_size=1024).build(init_device="cpu")
    data_loader = ForgeGrainDataLoaderConfig(config=config, work_dir=f"{save_folder}/work",
                                             num_workers=int(num_workers), intra_document=False).build()
    seq_len = data_loader.pipeline.config.seq_len
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=data_loader.rank_batch_size, max_sequence_length=seq_len,
        optim=AdamWConfig(lr=1e-3), dp_config=TransformerDataParallelConfig(name=DataParallelType.ddp),
    ).build(model, device=torch.device("cpu"))
    trainer = TrainerConfig(
        save_folder=save_folder, max_duration=Duration.epochs(int(epochs)), device="cpu",
        metrics_collect_interval=1000, save_overwrite=True,
        callbacks={"checkpointer": CheckpointerCallback(save_interval=int(save_interval), save_async=False,
                                                        ephemeral_save_interval=None),
                   "record": Record(path=f"{record}{rank}.jsonl", crash_after=int(crash_after))},
    ).build(train_module, data_loader)
    if trainer.checkpointer.contains_checkpoint(save_folder):
        trainer.load_checkpoint(trainer.checkpointer.latest_checkpoint(save_folder))
    trainer.fit()
    teardown_training_environment()


if __name__ == "__main__":
    main(*sys.argv[1:])
