"""Fused kernels (Triton) with plain-PyTorch references, registered as `meshplan_kernels::` ops.

Public API (see docs/kernels.md):
    rms_norm, rms_norm_residual, swiglu, swiglu_packed, rope, fused_linear_cross_entropy,
    moe_route, load_balancing_loss, moe_permute, moe_unpermute, MoeRouting, MoePermutation
    set_backend("triton" | "reference" | "auto"), backend(), use_backend(...)

Names load on first access (PEP 562), so `meshplan.kernels.fusion` is usable without importing
torch, and triton is imported only when a Triton kernel first runs.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "BACKENDS": "selection", "backend": "selection", "interpreter_enabled": "selection",
    "requested_backend": "selection", "set_backend": "selection",
    "triton_unavailable_reason": "selection", "use_backend": "selection",
    "fused_linear_cross_entropy": "linear_ce",
    "MoePermutation": "moe", "MoeRouting": "moe", "load_balancing_loss": "moe",
    "moe_permute": "moe", "moe_route": "moe", "moe_unpermute": "moe",
    "rms_norm": "rmsnorm", "rms_norm_residual": "rmsnorm",
    "rope": "rotary",
    "swiglu": "activation", "swiglu_packed": "activation",
}

__all__ = sorted([*_WHERE, "reference", "fusion", "lean"])


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"meshplan.kernels.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    if name in ("reference", "fusion", "lean"):
        return importlib.import_module(f"meshplan.kernels.{name}")
    raise AttributeError(f"module 'meshplan.kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
