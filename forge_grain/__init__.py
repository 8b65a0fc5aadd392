"""forge-grain: token stores, packing, mixing and exact resume for LLM training on Grain.

Importing this package loads neither torch nor jax; the bridges do.
"""

from .errors import ForgeGrainError, PrepareError, StoreError
from .preparation import prepare
from .store import TokenStore

__version__ = "0.1.0"

__all__ = ["ForgeGrainError", "PrepareError", "StoreError", "TokenStore", "prepare", "__version__"]
