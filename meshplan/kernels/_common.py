"""Helpers shared by the custom-op modules."""

from __future__ import annotations

import torch

from meshplan.errors import ConfigError
from meshplan.kernels import selection

NAMESPACE = "meshplan_kernels"


def require_triton(name: str, t: torch.Tensor) -> None:
    """Raise ConfigError unless a Triton kernel can run on tensor `name` right now."""
    reason = selection.triton_unavailable_reason()
    if reason is not None:
        raise ConfigError(f"{NAMESPACE} Triton kernel cannot run: {reason}")
    if t.device.type != "cuda" and not selection.interpreter_enabled():
        raise ConfigError(f"{name} is on {t.device}; the Triton kernels need CUDA tensors "
                          "(or TRITON_INTERPRET=1 for CPU tensors)")
