"""Document-bounded attention in PyTorch from a packed batch: FlexAttention, flash-attn varlen,
Hugging Face's padding-free path.

    block_mask = document_block_mask(batch["segment_ids"])          # flex_attention(q, k, v, block_mask=...)
    kwargs = flash_varlen_kwargs(batch)                              # flash_attn_varlen_func(q, k, v, **kwargs, causal=True)
    model(**padding_free(batch))                                     # transformers, no collator

`batch` is a pipeline batch (numpy) or the bridge's tensors in either convention
(`to_torch`: "forge" or "hf"). Segments and the padding of `cu_seqlens` are `forge_grain.packing.varlen`'s: a row's
boundaries always cut, and padding at a row's end is a sequence of its own.
"""

from __future__ import annotations

import numpy as np
import torch

from forge_grain.bridges.torch import hf_labels
from forge_grain.packing.varlen import varlen


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _segments(batch: dict) -> np.ndarray:
    if "segment_ids" not in batch:
        raise KeyError("the batch has no segment_ids: give a batch of the bridge (either convention) or of the "
                       "pipeline")
    return _numpy(batch["segment_ids"])


def document_mask_mod(segment_ids: torch.Tensor):
    """FlexAttention's `mask_mod`: causal attention within a segment (padding attends to
    padding, whose loss is masked)."""
    seg = segment_ids

    def mask_mod(b, h, q, kv):
        return (seg[b, q] == seg[b, kv]) & (q >= kv)

    return mask_mod


def document_block_mask(segment_ids, block_size: int = 128, device=None):
    """A FlexAttention `BlockMask` for causal-within-document attention over [rows, seq_len]
    segment ids (heads broadcast). Fully masked blocks are skipped by the kernel, so long
    rows of short documents cost far less than a dense causal mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    seg = segment_ids if isinstance(segment_ids, torch.Tensor) else torch.from_numpy(np.asarray(segment_ids))
    device = device if device is not None else seg.device
    seg = seg.to(device)
    rows, length = seg.shape
    return create_block_mask(document_mask_mod(seg), rows, None, length, length, device=device,
                             BLOCK_SIZE=min(block_size, length))


def flash_varlen_kwargs(batch: dict, max_segments: int | None = None, device=None) -> dict:
    """`cu_seqlens_q/k` (int32) and `max_seqlen_q/k` (host ints) for flash-attn's
    `flash_attn_varlen_func` over the batch flattened to [rows · seq_len, heads, dim]."""
    meta = varlen({"segment_ids": _segments(batch)}, max_segments)
    cu = torch.from_numpy(meta["cu_seqlens"]).to(device or "cpu")
    return {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": meta["max_seqlen"],
            "max_seqlen_k": meta["max_seqlen"]}


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Causal attention within each sequence of a flattened batch: what
    `flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, ..., causal=True)` computes,
    in plain PyTorch (a scaled-dot-product call per sequence), for CPUs and checks. q, k, v:
    [tokens, heads, dim]; empty sequences (the padding of `cu_seqlens`) are skipped."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for a, z in zip(bounds, bounds[1:]):
        if z > a:
            qs, ks, vs = (t[a:z].transpose(0, 1) for t in (q, k, v))
            out[a:z] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
    return out


def padding_free(batch: dict, max_segments: int | None = None, dtype: torch.dtype = torch.int64) -> dict:
    """The batch as one flattened sequence with the keyword arguments of Hugging Face's
    padding-free path (what `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`
    makes): `input_ids`, `labels` (-100 where no loss, so also at each document's first
    token), `position_ids` (restarting per segment) as [1, rows · seq_len], and
    `cu_seq_lens_q/k`, `max_length_q/k`, and `use_cache=False`. With flash-attention the
    model reads the cumulative lengths; with sdpa, eager or flex attention it finds the same
    documents from the positions, which transformers does only without a KV cache."""
    hf = "input_ids" in batch  # the bridge's "hf" convention: its labels are already made
    inputs = _numpy(batch["input_ids" if hf else "inputs"])
    positions = _numpy(batch["position_ids" if hf else "positions"])
    labels = _numpy(batch["labels"]) if hf else hf_labels(inputs, _numpy(batch["loss_mask"]))
    meta = varlen({"segment_ids": _segments(batch)}, max_segments)
    flat = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(1, -1)).to(dtype)  # noqa: E731
    cu = torch.from_numpy(meta["cu_seqlens"])
    return {"input_ids": flat(inputs), "labels": flat(labels), "position_ids": flat(positions),
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": meta["max_seqlen"],
            "max_length_k": meta["max_seqlen"], "use_cache": False}
