"""The reference math of the element-wise kernels as autograd Functions that keep for backward
what the Triton kernels keep: their inputs (RMSNorm: also its fp32 rstd, one number per row).

`reference.py` defines the semantics and lets autograd differentiate them, which keeps every
fp32 intermediate (RMSNorm: the fp32 upcast, the rstd, the fp32 normalised tensor; SwiGLU: the
fp32 gate and up and silu's output) alive until backward. These Functions compute the same
forward (fp32 math, one cast to the input's dtype), keep only what the kernel's backward reads
and recompute the cheap element-wise forward in backward, so a run without the Triton kernels
holds the activation memory the cost model charges (cost_models/layer.py `activation_bytes`:
the norm's input, the gate and up projections) on every device. The public wrappers
(`rms_norm`, `swiglu`, `swiglu_packed`) run them on the reference backend; the runtime runs them
for the norms and SwiGLU modules whose Triton kernel is not swapped in (runtime/fused.py).
"""

from __future__ import annotations

import torch

__all__ = ["rms_norm", "swiglu", "swiglu_packed"]

Tensor = torch.Tensor


def _leading_sum(t: Tensor) -> Tensor:
    """Sum over every dim but the last (a per-feature weight's gradient)."""
    return t.reshape(-1, t.shape[-1]).sum(0)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd                              # recomputed: the normalised input
        dyf = dy.float()
        g = dyf * weight.float()
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        dw = _leading_sum(dyf * xhat).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dx.to(x.dtype), dw, None


def _swiglu_grads(dout: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(d gate, d up) of silu(gate) * up, in fp32, from the inputs alone (aten's silu_backward:
    one pass for silu's derivative instead of a chain of element-wise temporaries)."""
    gf, df = gate.float(), dout.float()
    dgate = torch.ops.aten.silu_backward(df * up.float(), gf)
    return dgate, df * torch.nn.functional.silu(gf)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):
        gate, up = ctx.saved_tensors
        dgate, dup = _swiglu_grads(dout, gate, up)
        return dgate.to(gate.dtype), dup.to(up.dtype)


class _SwiGLUPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:
        ctx.save_for_backward(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate_up.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        dgate, dup = _swiglu_grads(dout, gate, up)
        return torch.cat([dgate, dup], dim=-1).to(gate_up.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """reference.rms_norm, keeping x, weight and the fp32 rstd (one per row) for backward."""
    return _RMSNorm.apply(x, weight, float(eps))


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """reference.swiglu, keeping gate and up for backward."""
    return _SwiGLU.apply(gate, up)


def swiglu_packed(gate_up: Tensor) -> Tensor:
    """reference.swiglu_packed, keeping gate_up for backward."""
    return _SwiGLUPacked.apply(gate_up)
