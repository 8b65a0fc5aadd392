"""forge-grain as a torchtitan data loader (`pip install "forge-grain[torchtitan]"`).

A torchtitan job names it in its config (a function in the job's `config_registry`):

    from forge_grain.bridges.torchtitan import ForgeGrainDataLoader

    def my_job() -> Trainer.Config:
        config = llama3_debugmodel()
        config.dataloader = ForgeGrainDataLoader.Config(config="data.toml", num_workers=2)
        return config

torchtitan's Trainer builds it (`config.dataloader.build(dp_world_size=..., dp_rank=...,
tokenizer=..., seq_len=..., local_batch_size=..., snapshot_every_n_steps=...)`), iterates its
`(input_dict, labels)` and saves its state in each checkpoint; see `forge_grain.bridges.titan_batches` for
what it yields and why its state resumes on any DP size.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan.components.dataloader import BaseDataLoader

from forge_grain.bridges.titan_batches import TitanBatches


class ForgeGrainDataLoader(TitanBatches, BaseDataLoader):
    """torchtitan's `BaseDataLoader` over a forge-grain config."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        config: str = ""
        """A forge-grain data config (TOML)."""

        num_workers: int = 0
        """torch DataLoader workers making the batches (each makes whole steps, in order)."""

        pin_memory: bool = False

        cache_dir: str | None = None

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int, local_batch_size: int,
                 tokenizer=None, snapshot_every_n_steps: int | None = None, **kwargs):
        del tokenizer, snapshot_every_n_steps, kwargs  # forge-grain's stores hold tokens; its state is a step
        if not config.config:
            raise ValueError("ForgeGrainDataLoader.Config needs `config`: the path of a forge-grain data TOML")
        super().__init__(config.config, dp_world_size=dp_world_size, dp_rank=dp_rank, seq_len=seq_len,
                         local_batch_size=local_batch_size, num_workers=config.num_workers,
                         pin_memory=config.pin_memory, cache_dir=config.cache_dir)
