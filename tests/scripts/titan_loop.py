"""torchtitan's pieces fed by forge-grain, under torchrun (gloo, CPU), in an environment with
torchtitan installed (tests/test_torchtitan.py makes one).

    titan_loop.py DATA_TOML FOLDER RECORD STEPS INTERVAL CRASH_AFTER NUM_WORKERS

torchtitan's Trainer cannot start on a machine without an accelerator (its device falls back
to "cuda" and it calls `torch.cuda.set_device`), so this is its training step by hand with its
own parts. Nor can its language models learn on a CPU: their attention is flex attention (which
has no backward on CPU), flex_flash or varlen (GPU kernels); "sdpa is no longer supported for
language models". So each step runs the model forward and its loss only: the job config of its llama3 debug model (`llama3_debugmodel()`) with forge-grain
as `config.dataloader`, the loader built as the Trainer builds it, that model with the block-causal masks
the Trainer makes from `positions` (`model.get_attention_masks`), its loss, its `CheckpointManager` (DCP) saving every INTERVAL steps and loading the latest
checkpoint in FOLDER at start. Each rank appends {step, hash of its batch} to RECORD + rank +
".jsonl"; with CRASH_AFTER > 0 the process dies (`os._exit`) right after step CRASH_AFTER is saved.
"""

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from forge_grain.bridges.torchtitan import ForgeGrainDataLoader


class TrainState:
    """The step, as torchtitan's Trainer saves it (`states={"train_state": trainer}`)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def main(data_toml, folder, record, steps, interval, crash_after, num_workers):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = llama3_debugmodel()  # torchtitan's own job config, forge-grain as its dataloader
    config.dataloader = ForgeGrainDataLoader.Config(config=data_toml, num_workers=int(num_workers))
    config.training.seq_len, config.training.local_batch_size = 64, 8 // world
    config.checkpoint = CheckpointManager.Config(enable=True, folder="checkpoint", interval=int(interval),
                                                 last_save_model_only=False)
    loader = config.dataloader.build(dp_world_size=world, dp_rank=rank, tokenizer=None,
                                     seq_len=config.training.seq_len,
                                     local_batch_size=config.training.local_batch_size,
                                     snapshot_every_n_steps=config.checkpoint.interval)
    torch.manual_seed(0)
    model = config.model_spec.model.build()
    model.init_weights(buffer_device=None)
    optimizers = config.optimizer.build(model_parts=[model])
    lr_schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=int(steps))
    loss_fn = torch.nn.functional.cross_entropy
    state = TrainState()
    checkpointer = config.checkpoint.build(dataloader=loader, model_parts=[model], optimizers=optimizers,
                                           lr_schedulers=lr_schedulers, states={"train_state": state},
                                           sd_adapter=None, base_folder=folder)
    checkpointer.load()
    batches = iter(loader)
    while state.step < int(steps):
        state.step += 1
        input_dict, labels = next(batches)
        h = hashlib.sha256(input_dict["input"].numpy().tobytes() + labels.numpy().tobytes()).hexdigest()
        with open(f"{record}{rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": state.step, "hash": h, "shape": list(labels.shape)}) + "\n")
        with torch.no_grad():  # as Trainer.post_dataloading_process: masks within documents from positions
            masks = model.get_attention_masks(positions=input_dict["positions"])
            pred = model(input_dict["input"], positions=input_dict["positions"], attention_masks=masks)
            loss = loss_fn(pred.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100)
        assert torch.isfinite(loss), f"step {state.step}: loss {loss}"
        checkpointer.save(state.step, last_step=state.step == int(steps))
        if int(crash_after) and state.step == int(crash_after):
            os._exit(3)
    checkpointer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
