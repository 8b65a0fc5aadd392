"""torchtitan's data-loader contract over a forge-grain config, without torchtitan itself.

`forge_grain.bridges.torchtitan.ForgeGrainDataLoader` is this with torchtitan's `BaseDataLoader` and its
`Config` added; kept apart so the contract is importable (and tested) where torchtitan is not
installed: torchtitan pins `datasets<4.8` and `fsspec<=2026.2.0`, which most environments that
hold forge-grain's other extras do not satisfy.

What torchtitan asks of a data loader: built with the data-parallel rank and size, `seq_len`
and `local_batch_size`; iterating `(input_dict, labels)` of `local_batch_size` rows (`input`,
and `positions` restarting at each document, from which its Trainer makes block-causal masks;
labels the next tokens, -100 where no target is trained); a `Stateful` (`state_dict`,
`load_state_dict`) that its DCP checkpoints save. Each forge-grain step is one of torchtitan's
micro-batches, so the config's `global_batch_size` is `local_batch_size` × the DP size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

from forge_grain import DataConfig

from forge_grain.bridges.torch import GrainIterableDataset, IGNORE_INDEX

STATE_KEY = "forge_grain"


def titan_batch(batch: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A forge-grain batch (tensors, forge convention) as torchtitan's `(input_dict, labels)`."""
    labels = torch.where(batch["loss_mask"], batch["targets"], IGNORE_INDEX)
    return {"input": batch["inputs"], "positions": batch["positions"]}, labels


class TitanBatches:
    """A rank's batches in torchtitan's shape, with a state that resumes on any DP size.

    torchtitan's own loader keys its state by DP rank and refuses another DP size on restart
    ("dataloader resharding is not supported yet"). This state is the next global step and the
    pipeline's fingerprint, the same on every rank, under one key (DCP keeps one copy).
    """

    def __init__(self, data: DataConfig | str | Path, *, dp_world_size: int, dp_rank: int, seq_len: int,
                 local_batch_size: int, num_workers: int = 0, pin_memory: bool = False, cache_dir=None):
        where = str(data) if not isinstance(data, DataConfig) else "the forge-grain config"
        data = data if isinstance(data, DataConfig) else DataConfig.from_toml(data)
        if data.seq_len != seq_len or data.global_batch_size != local_batch_size * dp_world_size:
            raise ValueError(
                f"{where}: seq_len {data.seq_len} and global_batch_size {data.global_batch_size} must be "
                f"torchtitan's training.seq_len ({seq_len}) and local_batch_size × DP size "
                f"({local_batch_size} × {dp_world_size} = {local_batch_size * dp_world_size})")
        self.dataset = GrainIterableDataset(data, rank=dp_rank, world_size=dp_world_size, cache_dir=cache_dir)
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.tracker = self.dataset.tracker()

    @property
    def pipeline(self):
        """The dataset's pipeline (rebuilt when a state with weights set live is loaded)."""
        return self.dataset.pipeline

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """Every step from the next one to the pipeline's end, pass after pass (torchtitan stops
        at `training.steps`, or when this ends: "Ran out of data")."""
        end = self.pipeline.num_steps  # None: one endless pass
        while end is None or self.tracker.next_step < end:
            before = self.tracker.next_step
            # the pass holding the next step (a loaded state starts its pass where it says)
            self.dataset.set_epoch(before // self.dataset.steps_per_pass if end is not None else 0)
            loader = DataLoader(self.dataset, batch_size=None, num_workers=self.num_workers,
                                pin_memory=self.pin_memory)
            for batch in loader:
                self.tracker.update(batch)
                yield titan_batch(batch)
            if self.tracker.next_step == before:
                raise RuntimeError(f"no batch after step {before}: the pipeline ends at step {end}")

    def state_dict(self) -> dict[str, Any]:
        """One key, the same on every rank; a collective when the pipeline has streaming sources
        (their positions are gathered from the ranks), as torchtitan's checkpoint save is."""
        return {STATE_KEY: json.dumps(self.tracker.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # torchtitan loads an empty state for a fresh start
            return
        if STATE_KEY not in state_dict:
            raise ValueError("this dataloader state was not saved by forge-grain's torchtitan loader "
                             f"(it has {sorted(state_dict)}): exclude 'dataloader' from loading "
                             "(checkpoint.exclude_from_loading) or use the loader that saved it")
        self.tracker.load_state_dict(json.loads(state_dict[STATE_KEY]))
