"""forge-grain: token stores, packing, mixing and exact resume for LLM training on Grain.

Importing this package loads neither torch nor jax; the bridges do.
"""

from .config import ConfigError, DataConfig, Phase, SourceConfig
from .errors import ForgeGrainError, PrepareError, StoreError
from .mixture import Mixture, mix
from .packed import PackedDataset, pack
from .packing import PackingError, PackingPlan, plan, plan_offsets
from .pipeline import Pipeline, PipelineIterator, StateError
from .preparation import prepare
from .store import TokenStore
from .writer import write_store

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DataConfig",
    "Mixture",
    "Phase",
    "Pipeline",
    "PipelineIterator",
    "SourceConfig",
    "StateError",
    "mix",
    "ForgeGrainError",
    "PackedDataset",
    "PackingError",
    "PackingPlan",
    "PrepareError",
    "StoreError",
    "TokenStore",
    "pack",
    "plan",
    "plan_offsets",
    "prepare",
    "write_store",
    "__version__",
]
