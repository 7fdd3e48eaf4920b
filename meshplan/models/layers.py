"""Building blocks shared by the dense and MoE layers: norms, the dense MLP, rotary positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshplan.models.config import ModelConfig

__all__ = ["FeedForward", "make_norm", "rope_tables", "apply_rope"]


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.hidden, eps=config.norm_eps)
    return nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=config.bias)


def rope_tables(config: ModelConfig, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, (seq_len, head_dim // 2) each, in float32."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(config.seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (2i, 2i+1) of x (B, T, heads, head_dim) by position (Llama layout)."""
    pairs = x.float().unflatten(-1, (-1, 2))                         # (B, T, n, hd/2, 2)
    a, b = pairs[..., 0], pairs[..., 1]                              # (B, T, n, hd/2)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]          # (1, T, 1, hd/2)
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)                            # (B, T, n, hd)


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
