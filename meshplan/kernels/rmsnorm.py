"""RMSNorm and RMSNorm fused with the residual add, as `meshplan_kernels::` custom ops.

    y = x * rsqrt(mean(x^2, -1) + eps) * weight          (statistics in fp32, one final cast)
    h = x + residual;  y = rms_norm(h)                   (fused: returns y and the new residual h)

The forward op also returns rstd (fp32, one per row) so the backward op need not recompute it.
"""

from __future__ import annotations

import torch

from meshplan.errors import ConfigError
from meshplan.kernels import lean, reference
from meshplan.kernels._checks import check_same_device, check_same_dtype, check_shape, check_tensor
from meshplan.kernels._common import NAMESPACE, require_triton
from meshplan.kernels.selection import backend

__all__ = ["rms_norm", "rms_norm_residual"]

Tensor = torch.Tensor


@torch.library.custom_op(f"{NAMESPACE}::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    require_triton("x", x)
    from meshplan.kernels import _rmsnorm_triton as tk

    n = x.shape[-1]
    x2d = x.contiguous().view(-1, n)
    if x2d.shape[0] == 0:
        return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)
    y, _, rstd = tk.forward(x2d, None, weight.contiguous(), eps)
    return y.view(x.shape), rstd.view(x.shape[:-1])


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_residual", mutates_args=())
def rms_norm_residual_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float
                         ) -> tuple[Tensor, Tensor, Tensor]:
    require_triton("x", x)
    from meshplan.kernels import _rmsnorm_triton as tk

    n = x.shape[-1]
    x2d = x.contiguous().view(-1, n)
    if x2d.shape[0] == 0:
        return (torch.empty_like(x), torch.empty_like(x),
                x.new_empty(x.shape[:-1], dtype=torch.float32))
    y, h, rstd = tk.forward(x2d, residual.contiguous().view(-1, n), weight.contiguous(), eps)
    return y.view(x.shape), h.view(x.shape), rstd.view(x.shape[:-1])


@rms_norm_residual_op.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(dy: Tensor, dh: Tensor | None, x: Tensor, weight: Tensor, rstd: Tensor
                         ) -> tuple[Tensor, Tensor]:
    """dx (plus dh, the gradient reaching the fused residual output) and dweight."""
    require_triton("dy", dy)
    from meshplan.kernels import _rmsnorm_triton as tk

    n = x.shape[-1]
    if x.numel() == 0:
        return torch.empty_like(x), torch.zeros_like(weight)
    dx, dw = tk.backward(dy.contiguous().view(-1, n),
                         None if dh is None else dh.contiguous().view(-1, n),
                         x.contiguous().view(-1, n), weight.contiguous(),
                         rstd.contiguous().view(-1))
    return dx.view(x.shape), dw


@rms_norm_backward_op.register_fake
def _(dy, dh, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(dy, None, x, weight, rstd)
    return dx, dw, None


rms_norm_op.register_autograd(_backward, setup_context=_setup)


def _setup_residual(ctx, inputs, output):
    _, _, weight, _ = inputs
    _, h, rstd = output
    ctx.save_for_backward(h, weight, rstd)  # the norm's input is the new residual h


def _backward_residual(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    d, dw = rms_norm_backward_op(dy, dh, h, weight, rstd)
    return d, d, dw, None  # h = x + residual: both get the same gradient


rms_norm_residual_op.register_autograd(_backward_residual, setup_context=_setup_residual)


def _validate(x: object, weight: object, eps: object, residual: object = None) -> None:
    x = check_tensor("x", x, min_ndim=1)
    weight = check_tensor("weight", weight, ndim=1)
    check_shape("weight", weight, (x.shape[-1],), "one scale per feature of x's last dim")
    if residual is not None:
        residual = check_tensor("residual", residual)
        check_shape("residual", residual, tuple(x.shape), "same shape as x")
        check_same_dtype(x=x, residual=residual)
    check_same_device(x=x, weight=weight, residual=residual)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ConfigError(f"eps must be a positive float, got {eps!r}")


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the last dim of x (..., N) with weight (N,); output has x's dtype.

    Non-contiguous x is copied with .contiguous() first.
    """
    _validate(x, weight, eps)
    if backend() == "triton":
        return rms_norm_op(x, weight, float(eps))[0]
    return lean.rms_norm(x, weight, eps)     # the reference math, keeping what the kernel keeps


def rms_norm_residual(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6
                      ) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm block's add and norm in one pass."""
    _validate(x, weight, eps, residual)
    if backend() == "triton":
        y, h, _ = rms_norm_residual_op(x, residual, weight, float(eps))
        return y, h
    return reference.rms_norm_residual(x, residual, weight, eps)
