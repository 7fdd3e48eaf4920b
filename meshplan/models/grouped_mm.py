"""`meshplan::grouped_mm`: one matmul per expert over contiguous row groups, as a custom op.

    grouped_mm(x, w, offs) -> out
      x:    (M, K)     rows sorted by group (expert)
      w:    (G, N, K)  one weight per group, nn.Linear layout (out_features, in_features)
      offs: (G,) int32 cumulative row ends: group g owns rows offs[g-1]:offs[g] (offs[-1] = 0)
      out:  (M, N)     out[rows of g] = x[rows of g] @ w[g].T; rows at or past offs[G-1] are 0

Why a custom op rather than `torch._grouped_mm`: that op takes the weight as (G, K, N) and its
backward does not run on CPU in torch 2.13, while the reference models must train on CPU. A
custom op also keeps the MoE traceable: `torch.export` under FakeTensorMode or on the meta device
sees one node with static output shape, `register_fake` gives the shape without running the
data-dependent loop, and the FLOP formulas below let `FlopCounterMode` (and the tracer, through
`torch.utils.flop_counter.flop_registry`) count it.

The real implementation runs `torch._grouped_mm` (one grouped GEMM kernel, forward and both
backward products) where the device supports it: CUDA with compute capability >= 9.0 (Hopper),
bf16, the matmuls' inner and outer sizes multiples of 8 (16-byte rows). Elsewhere (CPU, older GPUs, fp32) it
loops over the groups in Python (`offs.tolist()`), which is fine on real tensors in eager mode.
`USE_TORCH_GROUPED_MM = False` forces the loop.

The op computes in its operands' dtype. Autocast casts the operands of the matmuls it knows, not a
custom op's, so callers running under autocast cast first (`amp_operands`): without it the expert
GEMMs of a model trained with autocast (meshplan's DDP path: fp32 master weights) ran their
forward on bf16 copies of each slice and their backward in fp32, at half the bf16 rate on CPU, and
on a Hopper GPU missed `torch._grouped_mm` (which takes bf16 only) for the Python loop.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from meshplan.errors import MeshplanError

__all__ = ["grouped_mm", "grouped_mm_backward", "grouped_mm_reference", "torch_grouped_mm_supported", "amp_operands"]

USE_TORCH_GROUPED_MM = True


def torch_grouped_mm_supported(*tensors: Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these operands: bf16 CUDA tensors on a GPU of compute
    capability >= 9.0, feature sizes multiples of 8 (its 16-byte alignment rule)."""
    if not USE_TORCH_GROUPED_MM or not hasattr(torch, "_grouped_mm"):
        return False
    if not all(t.is_cuda and t.dtype == torch.bfloat16 for t in tensors):
        return False
    # rows (the grouped dim) may be any number; the GEMM's inner and outer sizes must be aligned
    if any(d % 8 for t in tensors for d in (t.shape[1:] if t.dim() == 3 else t.shape[-1:])):
        return False
    return torch.cuda.get_device_capability(tensors[0].device) >= (9, 0)


def amp_operands(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors as a matmul under the active autocast would see them: floating-point ones cast
    to the autocast dtype of their device, unchanged when autocast is off (module docstring)."""
    if not tensors:
        return tensors
    dev = tensors[0].device.type
    if dev == "meta" or not torch.is_autocast_enabled(dev):
        return tensors
    dtype = torch.get_autocast_dtype(dev)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def _zero_tail(out: Tensor, offs: Tensor) -> Tensor:
    # rows past the last group are not written (torch._grouped_mm leaves them undefined, the loop
    # empty); the contract says 0
    end = int(offs[-1]) if offs.numel() else 0
    if end < out.shape[0]:
        out[end:] = 0
    return out


def _check(x: Tensor, w: Tensor, offs: Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1:
        raise MeshplanError(
            f"grouped_mm expects x (M, K), w (G, N, K) and offs (G,); got shapes {tuple(x.shape)}, "
            f"{tuple(w.shape)}, {tuple(offs.shape)}")
    if x.shape[1] != w.shape[2] or offs.shape[0] != w.shape[0]:
        raise MeshplanError(
            f"grouped_mm: x has K={x.shape[1]} columns and offs {offs.shape[0]} groups, but w is "
            f"(G={w.shape[0]}, N={w.shape[1]}, K={w.shape[2]}); w must be (offs groups, N, x columns)")
    if offs.dtype not in (torch.int32, torch.int64):
        raise MeshplanError(f"grouped_mm: offs must be an integer tensor (int32), got {offs.dtype}")


def _bounds(offs: Tensor, rows: int) -> list[tuple[int, int]]:
    """[(start, end)] per group, checked against the row count (eager only: reads offs' values)."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if any(e < s for s, e in zip(starts, ends)) or (ends and not 0 <= ends[-1] <= rows):
        raise MeshplanError(
            f"grouped_mm: offs must be non-decreasing cumulative row ends within 0..{rows}, got {ends}")
    return list(zip(starts, ends))


@torch.library.custom_op("meshplan::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Per-group ``x[rows] @ w[g].T``; see the module docstring for shapes."""
    _check(x, w, offs)
    if torch_grouped_mm_supported(x, w):
        _bounds(offs, x.shape[0])
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs.to(torch.int32))   # (M, N)
        return _zero_tail(out, offs)
    # every row is written once (no zero fill first), in the operands' dtype
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)    # (M, N)
    with torch.autocast(x.device.type, enabled=False):
        for g, (start, end) in enumerate(_bounds(offs, x.shape[0])):
            if end > start:
                out[start:end] = x[start:end] @ w[g].t()                # (m_g, K) @ (K, N)
    return _zero_tail(out, offs)


@grouped_mm.register_fake
def _grouped_mm_fake(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    _check(x, w, offs)
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("meshplan::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(grad: Tensor, x: Tensor, w: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of `grouped_mm`: dx (M, K) and dw (G, N, K); groups with no rows get dw = 0."""
    if torch_grouped_mm_supported(grad, x, w):
        _bounds(offs, x.shape[0])
        offs32 = offs.to(torch.int32)
        dx = _zero_tail(torch._grouped_mm(grad, w, offs=offs32), offs)              # (M, N) x (G, N, K)
        # 2-D x 2-D: the groups split the reduction dim (rows): dw[g] = grad[g].T @ x[g]
        dw = torch._grouped_mm(grad.t(), x, offs=offs32)                            # (G, N, K)
        empty = (torch.diff(offs, prepend=offs.new_zeros(1)) == 0).view(-1, 1, 1)
        return dx, dw.masked_fill(empty, 0)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)           # (M, K)
    dw = torch.empty(w.shape, dtype=w.dtype, device=w.device)           # (G, N, K)
    with torch.autocast(x.device.type, enabled=False):
        for g, (start, end) in enumerate(_bounds(offs, x.shape[0])):
            if end > start:
                dx[start:end] = grad[start:end] @ w[g]                  # (m_g, N) @ (N, K)
                dw[g] = grad[start:end].t() @ x[start:end]              # (N, m_g) @ (m_g, K)
            else:
                dw[g].zero_()
    return _zero_tail(dx, offs), dw


@grouped_mm_backward.register_fake
def _grouped_mm_backward_fake(grad: Tensor, x: Tensor, w: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx, inputs, output) -> None:
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, grad: Tensor):
    x, w, offs = ctx.saved_tensors
    dx, dw = grouped_mm_backward(grad.contiguous(), x, w, offs)
    return dx, dw, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


# FLOPs: a multiply-add is 2. Rows past offs[-1] are counted too: the shapes are all a tracer
# has, and the models never leave such rows.
@register_flop_formula(torch.ops.meshplan.grouped_mm)
def _grouped_mm_flops(x_shape, w_shape, offs_shape, *args, out_shape=None, **kwargs) -> int:
    rows, k = x_shape
    n = w_shape[1]
    return 2 * rows * k * n


@register_flop_formula(torch.ops.meshplan.grouped_mm_backward)
def _grouped_mm_backward_flops(grad_shape, x_shape, w_shape, offs_shape, *args, out_shape=None, **kwargs) -> int:
    rows, k = x_shape
    n = w_shape[1]
    return 2 * (2 * rows * k * n)  # dx and dw, each as large as the forward


def grouped_mm_reference(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Plain autograd-able loop (no custom op), for tests and for readers."""
    _check(x, w, offs)
    pieces, start = [], 0
    for g, end in enumerate(offs.tolist()):
        pieces.append(x[start:end] @ w[g].t())
        start = end
    pieces.append(x.new_zeros(x.shape[0] - start, w.shape[1]))
    return torch.cat(pieces)
