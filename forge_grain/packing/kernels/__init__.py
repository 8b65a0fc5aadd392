"""Compiled (numba) kernels: packing plans from document lengths, row gathers, index shuffles.

Plans are arrays of *segments*: a run of `length` tokens starting at `start` in the
store's concatenated token space, with a loss-masked head of `skip` positions and
`flags` (bit 0: the segment ends where its document really ends). `row_ptr[r]` to
`row_ptr[r + 1]` are row r's segments, laid out from slot 0 of a buffer of
`seq_len + 1` slots: inputs are slots [0, seq_len), targets slots [1, seq_len + 1).

One module per job: `planning` (plans from lengths), `gather` (rows from plans), `shuffle`
(epoch orders), `mixing` (the mixture's closed forms); `cache` says where compiled code is
kept. Callers use `kernels.<name>`.
"""

from forge_grain.packing.kernels.gather import (
    arrays_read, arrays_read_each, fill_rows, one_piece, row_loss_positions, row_segments, token_arrays,
)
from forge_grain.packing.kernels.mixing import mix_counts, mix_locate
from forge_grain.packing.kernels.planning import (
    NATURAL_END, best_fit, clear_natural_ends, fill_gaps, group_by_bin, plan_concat, plan_concat_capped, row_targets, runs_in_documents,
    split_items,
)
from forge_grain.stores.target_masks import NO_MASKS  # (the masks of a source without: streaming rows)
from forge_grain.packing.kernels.shuffle import (
    EXACT_SHUFFLE_MAX, epoch_permutation, epoch_positions, epoch_rows, permutation, window_rows,
)

__all__ = ["NATURAL_END", "NO_MASKS", "EXACT_SHUFFLE_MAX", "arrays_read", "arrays_read_each", "best_fit", "clear_natural_ends", "epoch_permutation", "epoch_positions", "epoch_rows", "fill_gaps",
           "fill_rows", "group_by_bin", "mix_counts", "mix_locate", "one_piece", "permutation", "plan_concat",
           "plan_concat_capped", "row_loss_positions", "row_segments", "row_targets", "runs_in_documents", "split_items", "window_rows",
           "token_arrays"]
