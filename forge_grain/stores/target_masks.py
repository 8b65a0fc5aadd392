"""A store's target masks: which of its tokens train (one byte a token, 1 for a target), for
stores whose data says so (`write_store(masks=)`, `prepare --chat`, OLMo-core's label
masks); a store without trains every token. `TokenStore` holds them in `_mask_arrays`,
laid out as its token arrays, and the gather reads them beside the tokens."""

from __future__ import annotations

import numpy as np

from forge_grain.stores.mapping import TokenArrays, token_arrays

# the masks of a store without: none to read (the gather is told `masked=False`)
NO_MASKS = TokenArrays(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint8))


class TargetMasks:
    """What a `TokenStore` answers about its target masks."""

    _mask_arrays: list  # one byte a token, laid out as `_arrays` (empty: no masks)

    def _forget_masks(self) -> None:
        self._mask_arrays, self._gather_masks = [], None

    @property
    def masked(self) -> bool:
        """Whether the store says which tokens are targets (a target mask): then only those train."""
        return bool(self._mask_arrays)

    @property
    def masks(self):
        """The target masks as the compiled gather takes them (arrays parallel to `pieces`'),
        `NO_MASKS` for a store without."""
        if not self._mask_arrays:
            return NO_MASKS
        if self._gather_masks is None:
            self._gather_masks = token_arrays(self._mask_arrays)
        return self._gather_masks

    def target_mask(self, i: int) -> np.ndarray:
        """Document `i`'s target mask (bool, one per token; all true for a store without masks)."""
        if not self._mask_arrays:
            return np.ones(len(self[i]), np.bool_)
        return self._runs.document(int(i), lambda k: self._mask_arrays[k]).astype(np.bool_)

    @property
    def num_targets(self) -> int | None:
        """The tokens the masks mark as targets (None for a store without masks: all train)."""
        return int(sum(int(np.count_nonzero(m)) for m in self._mask_arrays)) if self._mask_arrays else None
