"""Building blocks shared by the dense and MoE layers: norms, the dense MLP, rotary positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshplan.models.config import ModelConfig

__all__ = ["FeedForward", "make_norm", "rope_tables", "apply_rope", "document_layout"]


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.hidden, eps=config.norm_eps)
    return nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=config.bias)


def rope_tables(config: ModelConfig, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, (seq_len, rotary dim // 2) each, in float32; the rotary dim
    is head_dim, or MLA's decoupled qk_rope_head_dim."""
    half = (config.qk_rope_head_dim if config.attention == "mla" else config.head_dim) // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(config.seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (2i, 2i+1) of x (B, T, heads, head_dim) by position (Llama layout).

    cos/sin are (T, hd/2) for positions 0..T-1, or (B, T, hd/2) for per-row positions (packed
    documents, each restarting at position 0)."""
    pairs = x.float().unflatten(-1, (-1, 2))                         # (B, T, n, hd/2, 2)
    a, b = pairs[..., 0], pairs[..., 1]                              # (B, T, n, hd/2)
    if cos.dim() == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]            # (B, T, 1, hd/2)
    else:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]      # (1, T, 1, hd/2)
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)                            # (B, T, n, hd)


def document_layout(document_ids: Tensor) -> tuple[Tensor, Tensor]:
    """For packed sequences (B, T) of document ids: the attention mask that keeps each token to
    the earlier tokens of its own document, (B, 1, T, T) bool (True: may attend; block-diagonal
    causal, never an empty row: a token always sees itself), and each token's position inside its
    document (B, T) int64, so rotary or learned positions restart at 0 with every document."""
    T = document_ids.shape[1]
    idx = torch.arange(T, device=document_ids.device)                           # (T,)
    same = document_ids[:, :, None] == document_ids[:, None, :]                 # (B, T, T)
    mask = same & (idx[:, None] >= idx[None, :])                                # (B, T, T)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]                 # (B, T) first token of a document
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return mask[:, None], idx - first


class FeedForward(nn.Module):
    """Dense MLP: w2(gelu(w1 x)) or SwiGLU w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, ffn_hidden: int, *, activation: str, bias: bool):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.w2 = nn.Linear(ffn_hidden, hidden, bias=bias)
        self.w3 = nn.Linear(hidden, ffn_hidden, bias=bias) if activation == "swiglu" else None

    def forward(self, x: Tensor) -> Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
