"""Sliding-window (banded causal) attention and attention sinks, on top of PyTorch's SDPA.

Sliding window (Mistral 7B, arXiv 2310.06825; GPT-OSS): query i attends keys i-w+1..i, the causal
mask intersected with a band of width w; with packed documents, also the document mask.

Attention sinks (GPT-OSS): each query head h has a learned logit s_h that joins the softmax's
denominator, so the weights of a row sum to exp(lse) / (exp(lse) + exp(s_h)) < 1:

    out_i = sum_j exp(l_ij) v_j / (exp(s_h) + sum_j exp(l_ij))

computed exactly as one more key per KV head whose key and value are zero: its score q.0 is 0, and
an additive float mask puts s_h there (per query head, which a key vector could not do under
grouped-query attention), while the value 0 keeps it out of the numerator. q keeps its width and
k/v their heads, so a tracer reads the same attention geometry as without sinks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from meshplan.errors import ConfigError

__all__ = ["band_mask", "banded_attention"]


def band_mask(T: int, window: int, device: torch.device | str | None = None) -> Tensor:
    """(T, T) bool, True where query i may attend key j: j <= i, and i - j < window when window > 0."""
    keep = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return keep.triu(1 - window) if window else keep


def banded_attention(q: Tensor, k: Tensor, v: Tensor, *, window: int = 0, sinks: Tensor | None = None,
                     mask: Tensor | None = None) -> Tensor:
    """Causal attention of q (B, n, T, hd) over k, v (B, n_kv, T, hd), restricted to a window of
    `window` keys (0: none) and to `mask` (B, 1, T, T) bool when given (packed documents), with
    per-head sink logits `sinks` (n,) when given. Returns (B, n, T, hd)."""
    B, n, T, _ = q.shape
    keep = band_mask(T, window, q.device)
    keep = keep[None, None] if mask is None else keep & mask            # (B|1, 1, T, T)
    gqa = n != k.shape[1]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=gqa)
    if sinks.shape != (n,):
        raise ConfigError(f"attention sinks of shape {tuple(sinks.shape)} for {n} query heads: one logit per "
                          "head is needed (a tensor-parallel split of the heads must split the sinks with them)")
    k = torch.cat([k, k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])], dim=2)   # (B, n_kv, T+1, hd)
    v = torch.cat([v, v.new_zeros(v.shape[0], v.shape[1], 1, v.shape[3])], dim=2)
    bias = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
    rows = bias.shape[0]
    sink_col = sinks.to(q.dtype).view(1, n, 1, 1).expand(rows, n, T, 1)
    bias = torch.cat([bias.expand(rows, n, T, T), sink_col], dim=-1)                 # (B|1, n, T, T+1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa)
