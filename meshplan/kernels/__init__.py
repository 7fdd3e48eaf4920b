"""Fused kernels (Triton) with plain-PyTorch references, registered as `meshplan_kernels::` ops.

Importing this package never imports triton; the Triton kernels load on first use.
"""

from __future__ import annotations

from meshplan.kernels import reference
from meshplan.kernels.backend import (
    BACKENDS,
    backend,
    interpreter_enabled,
    requested_backend,
    set_backend,
    triton_unavailable_reason,
    use_backend,
)
from meshplan.kernels.linear_ce import fused_linear_cross_entropy
from meshplan.kernels.moe import (
    MoePermutation,
    MoeRouting,
    load_balancing_loss,
    moe_permute,
    moe_route,
    moe_unpermute,
)
from meshplan.kernels.rmsnorm import rms_norm, rms_norm_residual
from meshplan.kernels.rope import rope
from meshplan.kernels.swiglu import swiglu, swiglu_packed

__all__ = [
    "BACKENDS",
    "MoePermutation",
    "MoeRouting",
    "backend",
    "fused_linear_cross_entropy",
    "interpreter_enabled",
    "load_balancing_loss",
    "moe_permute",
    "moe_route",
    "moe_unpermute",
    "reference",
    "requested_backend",
    "rms_norm",
    "rms_norm_residual",
    "rope",
    "set_backend",
    "swiglu",
    "swiglu_packed",
    "triton_unavailable_reason",
    "use_backend",
]
