"""forge-grain: token stores, packing, mixing and exact resume for LLM training on Grain.

Importing this package loads neither torch nor jax. Names are imported on first use:
`TokenStore` and `prepare` need only numpy; the packing and pipeline names load Grain
(which itself imports jax when jax is installed).
"""

from __future__ import annotations

import importlib

from forge_grain import moved
from forge_grain.absl_flags import quiet_grain_without_jax
from forge_grain.errors import ForgeGrainError, PrepareError, StoreError

quiet_grain_without_jax()
moved.install()  # modules moved by the layout by kind import by their old names for one release

__version__ = "0.1.0"

_LAZY = {
    "TokenStore": "stores",
    "prepare": "preparation.runners",
    "write_store": "stores.writer",
    "PackedDataset": "packing.packed",
    "pack": "packing.packed",
    "PackingError": "packing.plans",
    "PackingPlan": "packing.plans",
    "plan": "packing.plans",
    "plan_offsets": "packing.plans",
    "Mixture": "pipeline.mixture",
    "mix": "pipeline.mixture",
    "ConfigError": "pipeline.config",
    "DataConfig": "pipeline.config",
    "Phase": "pipeline.config",
    "SourceConfig": "pipeline.config",
    "Pipeline": "pipeline.pipeline",
    "PipelineIterator": "pipeline.iteration",
    "StateError": "errors",
    "StepError": "errors",
    "merge_states": "pipeline.states",
    "source_losses": "pipeline.live",
}

MODULES = {"checkpoint": "pipeline.checkpoint", "absl_flags": "absl_flags"}

__all__ = ["ForgeGrainError", "PrepareError", "StoreError", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in MODULES:  # modules users import by name: `from forge_grain import checkpoint`
        return importlib.import_module(f".{MODULES[name]}", __name__)
    raise AttributeError(f"module 'forge_grain' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
