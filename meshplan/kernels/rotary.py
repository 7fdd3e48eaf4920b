"""Rotary position embedding on q and k (GQA, partial rotary dims), a `meshplan_kernels::` op.

Layouts
- q (B, S, Hq, D) and k (B, S, Hk, D): batch, position, heads, head_dim. Any strides with a unit
  stride on head_dim are read in place, so a (B, H, S, D) tensor can be passed as
  `q.transpose(1, 2)`. Outputs are new contiguous (B, S, H, D) tensors.
- cos, sin (S, r) or (B, S, r): the full-width tables of the HF convention (for the
  "rotate_half" layout, cos = cat([cos(f), cos(f)])), r = rotary_dim <= D and even. Columns r..D
  pass through unchanged (partial rotary, e.g. GPT-NeoX / Phi).
- interleaved=False: Llama/HF "rotate_half" pairs (i, i + r/2); True: GPT-J pairs (2i, 2i+1).

cos and sin receive no gradient (they are position tables, not parameters).
"""

from __future__ import annotations

import torch

from meshplan.errors import ConfigError
from meshplan.kernels import reference
from meshplan.kernels._checks import check_same_device, check_same_dtype, check_shape, check_tensor
from meshplan.kernels._common import NAMESPACE, require_triton
from meshplan.kernels.selection import backend

__all__ = ["rope"]

Tensor = torch.Tensor


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _run(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, backward: bool
         ) -> tuple[Tensor, Tensor]:
    from meshplan.kernels import _rope_triton as tk

    return tk.apply(_unit_last(q), _unit_last(k), _unit_last(cos), _unit_last(sin),
                    interleaved, backward)


@torch.library.custom_op(f"{NAMESPACE}::rope", mutates_args=())
def rope_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool
            ) -> tuple[Tensor, Tensor]:
    require_triton("q", q)
    return _run(q, k, cos, sin, interleaved, backward=False)


@torch.library.custom_op(f"{NAMESPACE}::rope_backward", mutates_args=())
def rope_backward_op(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, interleaved: bool
                     ) -> tuple[Tensor, Tensor]:
    require_triton("dq", dq)
    return _run(dq, dk, cos, sin, interleaved, backward=True)


def _fake(q, k, cos, sin, interleaved):
    return (q.new_empty(q.shape).contiguous(), k.new_empty(k.shape).contiguous())


rope_op.register_fake(_fake)
rope_backward_op.register_fake(_fake)


def _setup(ctx, inputs, output):
    _, _, cos, sin, interleaved = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved = interleaved


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq_in, dk_in = rope_backward_op(dq, dk, cos, sin, ctx.interleaved)
    return dq_in, dk_in, None, None, None


rope_op.register_autograd(_backward, setup_context=_setup)


def _validate(q, k, cos, sin, rotary_dim) -> None:
    check_tensor("q", q, ndim=4)
    check_tensor("k", k, ndim=4)
    check_same_dtype(q=q, k=k)
    bsz, s, _, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (bsz, s, d):
        raise ConfigError(f"k has shape {tuple(k.shape)} but q has {tuple(q.shape)}; both must "
                          "be (batch, seq, heads, head_dim) with equal batch, seq and head_dim")
    check_tensor("cos", cos)
    check_tensor("sin", sin)
    check_shape("sin", sin, tuple(cos.shape), "same shape as cos")
    r = cos.shape[-1]
    if cos.dim() == 2:
        check_shape("cos", cos, (s, r), "(seq, rotary_dim) or (batch, seq, rotary_dim)")
    elif cos.dim() == 3:
        check_shape("cos", cos, (bsz, s, r), "(seq, rotary_dim) or (batch, seq, rotary_dim)")
    else:
        raise ConfigError(f"cos must be (seq, rotary_dim) or (batch, seq, rotary_dim), got "
                          f"shape {tuple(cos.shape)}")
    if rotary_dim is not None and rotary_dim != r:
        raise ConfigError(f"rotary_dim={rotary_dim} but cos's last dim is {r}; pass tables of "
                          "width rotary_dim")
    if r % 2 or not 0 < r <= d:
        raise ConfigError(f"rotary_dim (cos's last dim) must be even and in 1..head_dim={d}, "
                          f"got {r}")
    check_same_device(q=q, k=k, cos=cos, sin=sin)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, rotary_dim: int | None = None,
         interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Rotate the first rotary_dim features of every head of q and k; see module docstring."""
    _validate(q, k, cos, sin, rotary_dim)
    if backend() == "triton":
        return rope_op(q, k, cos, sin, bool(interleaved))
    return reference.rope(q, k, cos, sin, interleaved=bool(interleaved))
