"""SwiGLU, silu(gate) * up, as `meshplan_kernels::` custom ops.

Two forms: from two tensors (`swiglu(gate, up)`) and from one fused gate/up projection output
(`swiglu_packed(gate_up)`, gate = first half of the last dim, up = second half, the order of
`torch.chunk(2, -1)`). The packed form reads both halves in place and writes its gradient into
one (..., 2F) buffer, so no split or concatenation copy is made.
"""

from __future__ import annotations

import torch

from meshplan.errors import ConfigError
from meshplan.kernels import lean
from meshplan.kernels._checks import check_same_device, check_same_dtype, check_shape, check_tensor
from meshplan.kernels._common import NAMESPACE, require_triton
from meshplan.kernels.selection import backend

__all__ = ["swiglu", "swiglu_packed"]

Tensor = torch.Tensor


def _rows(t: Tensor, f: int) -> Tensor:
    return t.contiguous().view(-1, f)


@torch.library.custom_op(f"{NAMESPACE}::swiglu", mutates_args=())
def swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
    require_triton("gate", gate)
    from meshplan.kernels import _swiglu_triton as tk

    f = gate.shape[-1]
    if gate.numel() == 0:
        return torch.empty_like(gate)
    return tk.forward(_rows(gate, f), _rows(up, f)).view(gate.shape)


@swiglu_op.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op(f"{NAMESPACE}::swiglu_backward", mutates_args=())
def swiglu_backward_op(dout: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    require_triton("dout", dout)
    from meshplan.kernels import _swiglu_triton as tk

    f = gate.shape[-1]
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    if gate.numel() == 0:
        return dgate, dup
    tk.backward(_rows(dout, f), _rows(gate, f), _rows(up, f), dgate.view(-1, f), dup.view(-1, f))
    return dgate, dup


@swiglu_backward_op.register_fake
def _(dout, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dout):
    gate, up = ctx.saved_tensors
    return swiglu_backward_op(dout, gate, up)


swiglu_op.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op(f"{NAMESPACE}::swiglu_packed", mutates_args=())
def swiglu_packed_op(gate_up: Tensor) -> Tensor:
    require_triton("gate_up", gate_up)
    from meshplan.kernels import _swiglu_triton as tk

    f = gate_up.shape[-1] // 2
    if gate_up.numel() == 0:
        return gate_up.new_empty(*gate_up.shape[:-1], f)
    x = _rows(gate_up, 2 * f)
    return tk.forward(x[:, :f], x[:, f:]).view(*gate_up.shape[:-1], f)


@swiglu_packed_op.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op(f"{NAMESPACE}::swiglu_packed_backward", mutates_args=())
def swiglu_packed_backward_op(dout: Tensor, gate_up: Tensor) -> Tensor:
    require_triton("dout", dout)
    from meshplan.kernels import _swiglu_triton as tk

    f = gate_up.shape[-1] // 2
    dx = torch.empty_like(gate_up)
    if gate_up.numel() == 0:
        return dx
    x, d = _rows(gate_up, 2 * f), dx.view(-1, 2 * f)
    tk.backward(_rows(dout, f), x[:, :f], x[:, f:], d[:, :f], d[:, f:])
    return dx


@swiglu_packed_backward_op.register_fake
def _(dout, gate_up):
    return torch.empty_like(gate_up)


def _setup_packed(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward_packed(ctx, dout):
    (gate_up,) = ctx.saved_tensors
    return swiglu_packed_backward_op(dout, gate_up)


swiglu_packed_op.register_autograd(_backward_packed, setup_context=_setup_packed)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up for gate, up of one shape and dtype (fp32 math, output in their dtype).

    Non-contiguous inputs are copied with .contiguous() first.
    """
    check_tensor("gate", gate, min_ndim=1)
    check_tensor("up", up)
    check_shape("up", up, tuple(gate.shape), "same shape as gate")
    check_same_dtype(gate=gate, up=up)
    check_same_device(gate=gate, up=up)
    if backend() == "triton":
        return swiglu_op(gate, up)
    return lean.swiglu(gate, up)             # the reference math, keeping what the kernel keeps


def swiglu_packed(gate_up: Tensor) -> Tensor:
    """silu(gate) * up where gate_up (..., 2F) = cat([gate, up], -1); returns (..., F)."""
    check_tensor("gate_up", gate_up, min_ndim=1)
    if gate_up.shape[-1] % 2:
        raise ConfigError(f"gate_up's last dim must be even (gate and up halves), got "
                          f"shape {tuple(gate_up.shape)}")
    if backend() == "triton":
        return swiglu_packed_op(gate_up)
    return lean.swiglu_packed(gate_up)
