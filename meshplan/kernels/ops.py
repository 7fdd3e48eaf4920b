"""Importing this module registers every `meshplan_kernels::` custom op with PyTorch.

Needed before running or loading (torch.export.load) a program that calls the ops directly;
the public functions in meshplan.kernels import their own op module on first use.
"""

from __future__ import annotations

from meshplan.kernels import activation, linear_ce, moe, rmsnorm, rotary

__all__ = ["OPS"]

# name -> the CustomOpDef (call it, or use torch.ops.meshplan_kernels.<name>)
OPS = {
    "rms_norm": rmsnorm.rms_norm_op,
    "rms_norm_residual": rmsnorm.rms_norm_residual_op,
    "rms_norm_backward": rmsnorm.rms_norm_backward_op,
    "swiglu": activation.swiglu_op,
    "swiglu_backward": activation.swiglu_backward_op,
    "swiglu_packed": activation.swiglu_packed_op,
    "swiglu_packed_backward": activation.swiglu_packed_backward_op,
    "rope": rotary.rope_op,
    "rope_backward": rotary.rope_backward_op,
    "fused_linear_cross_entropy": linear_ce.fused_linear_cross_entropy_op,
    "moe_route": moe.moe_route_op,
    "moe_route_backward": moe.moe_route_backward_op,
    "moe_permute": moe.moe_permute_op,
    "moe_gather_sum": moe.moe_gather_sum_op,
    "moe_unpermute": moe.moe_unpermute_op,
    "moe_unpermute_backward": moe.moe_unpermute_backward_op,
}
