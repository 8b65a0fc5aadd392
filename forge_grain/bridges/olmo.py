"""forge-grain as an OLMo-core data loader (`pip install "forge-grain[olmo]"`).

    data_loader = ForgeGrainDataLoaderConfig(config="data.toml", work_dir="/tmp/work").build(
        dp_process_group=train_module.dp_process_group)
    trainer = trainer_config.build(train_module, data_loader)

`ForgeGrainDataLoader` is an OLMo-core `TextDataLoaderBase`: the `Trainer` calls
`reshuffle(epoch)`, iterates the rank's batches, counts `batches_processed`, and saves
`state_dict()` in its checkpoints (one file per rank, falling back to rank 0's on a restart
with more ranks). forge-grain's state in it is the next *global* step and the pipeline's
fingerprint, the same on every rank, so a restart resumes exactly on any data-parallel size
the global batch divides.

OLMo-core counts batch sizes in tokens: `global_batch_size` is the config's global batch
(rows) times `seq_len`. Its batches hold `input_ids` [rows, seq_len], `label_mask` (False where
a label would cross into another document or is padding; OLMo-core shifts `input_ids` to make
labels, so a row's last target is not trained, as in its own loaders), and for intra-document
masking `doc_lens` / `max_doc_lens` (each row's documents, as OLMo-core's collator makes them).
An OLMo-core epoch (1-based) is the pipeline's pass `epoch - 1` (see
`GrainIterableDataset.steps_per_pass`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

import numpy as np
import torch
import torch.distributed as dist
from olmo_core.config import Config
from olmo_core.data.collator import DataCollator
from olmo_core.data.data_loader import TextDataLoaderBase
from olmo_core.distributed.utils import get_fs_local_rank, get_rank, get_world_size
from torch.utils.data import DataLoader

from forge_grain import DataConfig, Pipeline
from forge_grain.packing.varlen import doc_lens

from forge_grain.bridges.torch import GrainIterableDataset

STATE_KEY = "forge_grain"


def olmo_batch(batch: dict, intra_document: bool = True) -> dict:
    """A pipeline batch (numpy, forge-grain's keys) in OLMo-core's keys, as tensors."""
    inputs = np.asarray(batch["inputs"])
    label_mask = np.zeros(inputs.shape, np.bool_)  # token i is a label for position i - 1
    label_mask[:, 1:] = batch["loss_mask"][:, :-1]
    out = {"input_ids": torch.from_numpy(inputs.astype(np.int64, copy=False)),
           "label_mask": torch.from_numpy(label_mask)}
    if intra_document:
        lens = doc_lens(batch["segment_ids"])
        width = int((lens > 0).sum(axis=1).max())  # as OLMo-core's collator: the batch's most documents
        out["doc_lens"] = torch.from_numpy(lens[:, :width].astype(np.int64))
        out["max_doc_lens"] = lens.max(axis=1).tolist()
    return out


class _OlmoDataset(GrainIterableDataset):
    """The rank's batches, made into OLMo-core's keys where they are made (in a DataLoader worker
    when there are workers); `step` and the streams' positions ride along for the tracker."""

    def __init__(self, *args, intra_document: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.intra_document = intra_document

    def _tensors(self, batch: dict) -> dict:
        out = olmo_batch(batch, self.intra_document)
        out["step"] = torch.tensor(int(batch["step"]), dtype=torch.int64)
        return out


class ForgeGrainDataLoader(TextDataLoaderBase):
    """An OLMo-core data loader over a forge-grain config (a `DataConfig`, or a TOML path), or a
    `Pipeline` built for this rank (one resumed with `skip_steps`, `skip_documents` or a mixture
    change: what a config alone cannot say).

    num_workers: torch DataLoader workers making the batches (each worker makes whole steps,
    in order; see `forge_grain.bridges.torch`). intra_document: add `doc_lens`/`max_doc_lens`, which
    OLMo-core's attention reads to keep attention within documents.
    """

    def __init__(self, config: DataConfig | Pipeline | str | Path, *, work_dir, dp_world_size: Optional[int] = None,
                 dp_rank: Optional[int] = None, fs_local_rank: Optional[int] = None, num_workers: int = 0,
                 cache_dir=None, intra_document: bool = True):
        built = config if isinstance(config, Pipeline) else None  # (resumed with skips or a mixture change)
        if built is None and not isinstance(config, DataConfig):
            config = DataConfig.from_toml(config)
        world = dp_world_size if dp_world_size is not None else built.shard_count if built else get_world_size()
        rank = dp_rank if dp_rank is not None else built.shard_index if built else get_rank()
        self.dataset = _OlmoDataset(config, rank=rank, world_size=world, cache_dir=cache_dir,
                                    intra_document=intra_document)
        config = built.config if built else config
        pipeline: Pipeline = self.dataset.pipeline
        if not pipeline.batches.constant:
            raise ValueError("OLMo-core changes batch sizes itself (its BatchSizeSchedulerCallback): "
                             "remove batch_sizes / batch_ramp from the forge-grain config")
        if len({n for _, n in pipeline.order.seq_lens}) > 1:
            raise ValueError("OLMo-core's loader keeps one batch size in tokens and one sequence length: remove "
                             "seq_lens from the forge-grain config (or feed the pipeline through the torch bridge)")
        pad = pipeline.datasets[0].pad_id
        super().__init__(collator=DataCollator(pad_token_id=int(pad)), work_dir=work_dir,
                         global_batch_size=config.global_batch_size * config.seq_len,
                         dp_world_size=world, dp_rank=rank, fs_local_rank=fs_local_rank)
        self.num_workers = num_workers
        self.tracker = self.dataset.tracker()

    @property
    def pipeline(self) -> Pipeline:
        """The dataset's pipeline (rebuilt when a state with weights set live is loaded)."""
        return self.dataset.pipeline

    @property
    def global_batch_size(self) -> int:
        return self._global_batch_size

    @global_batch_size.setter
    def global_batch_size(self, value: int) -> None:
        if value != self._global_batch_size:
            raise RuntimeError("forge-grain's batch size is the config's: set global_batch_size (and a "
                               "batch_sizes schedule) in the forge-grain config, not through OLMo-core")

    @property
    def total_batches(self) -> Optional[int]:
        """This epoch's steps: the pipeline's pass (the last pass of a fractional `num_epochs`
        is shorter); None for a pipeline without end."""
        return self.batches_in_epoch(self._epoch or 1)

    def batches_in_epoch(self, epoch: int) -> Optional[int]:
        if self.pipeline.num_steps is None:
            return None
        n = self.dataset.steps_per_pass
        return max(0, min(n, self.pipeline.num_steps - (epoch - 1) * n))

    def reshuffle(self, epoch: Optional[int] = None, **kwargs) -> None:
        """Move to OLMo-core epoch `epoch` (1-based): the pipeline's pass epoch - 1. Nothing is
        shuffled here: the pipeline's order is already a function of seed, epoch and step."""
        del kwargs
        epoch = epoch if epoch is not None else (self._epoch or 0) + 1
        if epoch < 1:
            raise ValueError(f"'epoch' must be at least 1, got {epoch}")
        self.dataset.set_epoch(epoch - 1)
        self._epoch = epoch

    def _epoch_start(self) -> int:
        if self.pipeline.num_steps is None:  # a pipeline without end is one pass: OLMo-core's epoch 1
            return 0
        return ((self._epoch or 1) - 1) * self.dataset.steps_per_pass

    def state_dict(self) -> Dict[str, Any]:
        """The next global step and fingerprint (forge-grain's state, the same on every rank), with
        OLMo-core's own counters. A collective when the pipeline has streaming sources (the
        ranks' stream positions are gathered): OLMo-core calls it on every rank."""
        return {STATE_KEY: self.tracker.state_dict(), "batches_processed": self.batches_processed,
                "tokens_processed": self.tokens_processed, "epoch": self._epoch}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if STATE_KEY not in state_dict:
            raise ValueError("this data-loader state was not saved by forge-grain's OLMo-core loader "
                             f"(it has {sorted(state_dict)}): start without it or use the loader that saved it")
        self._epoch = state_dict["epoch"] or self._epoch
        self.tracker.load_state_dict(state_dict[STATE_KEY])  # the next pass starts at its step
        step = self.tracker.next_step
        most = self.dataset.steps_per_pass if self.pipeline.num_steps is not None else step
        if self._epoch is not None and not 0 <= step - self._epoch_start() <= most:
            raise ValueError(f"the saved step {step} is not in epoch {self._epoch}'s steps")
        self.batches_processed = step - self._epoch_start()
        self.tokens_processed = self.batches_processed * self.global_batch_size

    def _iter_batches(self) -> Iterable[Dict[str, Any]]:
        if self.total_batches is not None and self.batches_processed >= self.total_batches:
            return
        loader = DataLoader(self.dataset, batch_size=None, num_workers=self.num_workers)
        for batch in loader:
            self.tracker.update(batch)
            del batch["step"]
            batch.pop("stream_states", None)
            yield batch

    def get_mock_batch(self) -> Dict[str, Any]:
        """Zeros in the shape of a real batch: one document a row."""
        rows, seq_len = self.pipeline.local_batch_size, self.pipeline.config.seq_len
        out = {"input_ids": torch.zeros((rows, seq_len), dtype=torch.int64),
               "label_mask": torch.ones((rows, seq_len), dtype=torch.bool)}
        if self.dataset.intra_document:
            out["doc_lens"] = torch.full((rows, 1), seq_len, dtype=torch.int64)
            out["max_doc_lens"] = [seq_len] * rows
        return out


@dataclass
class ForgeGrainDataLoaderConfig(Config):
    """What a training script's config names (`config`: a forge-grain TOML); `build` makes the
    loader for this rank from OLMo-core's data-parallel group."""

    config: str
    work_dir: str
    num_workers: int = 0
    cache_dir: Optional[str] = None
    intra_document: bool = True

    def build(self, *, dp_process_group: Optional[dist.ProcessGroup] = None) -> ForgeGrainDataLoader:
        return ForgeGrainDataLoader(self.config, work_dir=self.work_dir,
                                    dp_world_size=get_world_size(dp_process_group),
                                    dp_rank=get_rank(dp_process_group), fs_local_rank=get_fs_local_rank(),
                                    num_workers=self.num_workers, cache_dir=self.cache_dir,
                                    intra_document=self.intra_document)
