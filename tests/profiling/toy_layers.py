"""Small modules the tracer tests build models from (shared by this folder's tests)."""

from __future__ import annotations

from torch import nn


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


class Layer(nn.Module):
    """A pre-norm residual layer around `inner` (width 32)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.inner = inner

    def forward(self, x):
        return x + self.inner(self.norm(x))
