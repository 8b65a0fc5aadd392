"""forge-grain: token stores, packing, mixing and exact resume for LLM training on Grain.

Importing this package loads neither torch nor jax. Names are imported on first use:
`TokenStore` and `prepare` need only numpy; the packing and pipeline names load Grain
(which itself imports jax when jax is installed).
"""

from __future__ import annotations

import importlib

from .errors import ForgeGrainError, PrepareError, StoreError

__version__ = "0.1.0"

_LAZY = {
    "TokenStore": "stores",
    "prepare": "preparation",
    "write_store": "writer",
    "PackedDataset": "packed",
    "pack": "packed",
    "PackingError": "packing",
    "PackingPlan": "packing",
    "plan": "packing",
    "plan_offsets": "packing",
    "Mixture": "mixture",
    "mix": "mixture",
    "ConfigError": "config",
    "DataConfig": "config",
    "Phase": "config",
    "SourceConfig": "config",
    "Pipeline": "pipeline",
    "PipelineIterator": "pipeline",
    "StateError": "errors",
    "merge_states": "pipeline",
}

__all__ = ["ForgeGrainError", "PrepareError", "StoreError", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in ("checkpoint", "absl_flags"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'forge_grain' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
