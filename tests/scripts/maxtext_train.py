"""MaxText's own training loop (`maxtext.trainers.pre_train.train.main`) fed by forge-grain, as a
user's launcher does it: `create_data_iterator` replaced by `data_iterators()` (the three lines of
forge_grain/bridges/maxtext.py) and the TOML named by `grain_train_files`, a tiny decoder on the CPU, MaxText's own Orbax
checkpoints (synchronous, every PERIOD steps, with the iterator's state).

    python maxtext_train.py TOML OUT RECORD STEPS PERIOD CRASH_AT

Appends {"step", "hash"} to RECORD for each batch MaxText takes; with CRASH_AT >= 0 the
process dies (os._exit) when MaxText asks for the batch of pipeline step CRASH_AT. A run
whose OUT holds a checkpoint resumes from it (MaxText's own restore).
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

toml, out, record, steps, period, crash_at = sys.argv[1:7]

import maxtext.input_pipeline.input_pipeline_interface as maxtext_inputs  # noqa: E402

from forge_grain.bridges.maxtext import MaxTextBatches, data_iterators  # noqa: E402

maxtext_inputs.create_data_iterator = data_iterators()  # the user's line

taken = MaxTextBatches.__next__


def recorded(self):
    batch = taken(self)
    if self.last_step == int(crash_at):
        os._exit(3)  # killed: the checkpoint before this step is on disk, nothing after it
    digest = hashlib.sha256(b"".join(np.asarray(batch[k]).tobytes() for k in
                                     ("inputs", "targets", "targets_segmentation"))).hexdigest()
    with open(record, "a") as f:
        f.write(json.dumps({"step": self.last_step, "hash": digest}) + "\n")
    return batch


MaxTextBatches.__next__ = recorded

from maxtext.trainers.pre_train import train  # noqa: E402

base = Path(train.__file__).resolve().parents[2] / "configs" / "base.yml"
train.main(["train", str(base), "run_name=run", f"base_output_directory={out}", "hardware=cpu",
            "dataset_type=grain", f"grain_train_files={toml}", f"steps={steps}", f"checkpoint_period={period}", "enable_checkpointing=True",
            "async_checkpointing=False", "per_device_batch_size=8", "max_target_length=64", "vocab_size=1024",
            "base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2", "base_mlp_dim=64",
            "base_num_decoder_layers=2", "head_dim=16", "attention=dot_product", "dtype=float32",
            "eval_interval=-1", "enable_tensorboard=False", "enable_goodput_recording=False",
            "monitor_goodput=False", "log_period=1000", "skip_jax_distributed_system=True",
            f"metrics_file={Path(out) / 'metrics.jsonl'}"])
