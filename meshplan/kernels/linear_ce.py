"""Fused output projection + cross-entropy that never holds the full (T, V) logits.

Tokens are processed in chunks of `chunk_size`. For each chunk the logits (C, V) come from one
torch matmul; a Triton kernel turns them in place into the loss per row and dloss/dlogits;
two more matmuls turn those into this chunk's grad_hidden rows and its share of grad_weight.
Both gradients are therefore computed during the forward pass and stored (Liger-Kernel's idea,
our own code); backward only multiplies them by the incoming gradient of the loss.

Semantics follow F.cross_entropy(hidden @ weight.T, labels, ...) with the logits in the input
dtype and the softmax in fp32:
- reduction "mean" divides by the number of labels != ignore_index; "sum" does not divide.
- label_smoothing as in torch: (1 - eps) * nll + eps * mean over classes of -log p.
- every label ignored: "mean" returns NaN (0 / 0, as torch does) and zero gradients; "sum"
  returns 0 and zero gradients.
Peak extra memory: one chunk of logits (C x V in the input dtype) plus grad_weight (V x h).
grad_weight is accumulated in the weight dtype, one rounding per chunk (as torch.addmm does).
"""

from __future__ import annotations

import torch

from meshplan.errors import ConfigError
from meshplan.kernels import reference
from meshplan.kernels._checks import (
    INDEX_DTYPES,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
    is_traced,
)
from meshplan.kernels._common import NAMESPACE, require_triton
from meshplan.kernels.fusion import DEFAULT_CHUNK_LOGITS_BYTES, default_chunk_size
from meshplan.kernels.selection import backend

__all__ = ["fused_linear_cross_entropy", "default_chunk_size", "DEFAULT_CHUNK_LOGITS_BYTES", "REDUCTIONS"]

Tensor = torch.Tensor
REDUCTIONS = ("mean", "sum")
@torch.library.custom_op(f"{NAMESPACE}::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy_op(hidden: Tensor, weight: Tensor, labels: Tensor,
                                  ignore_index: int, reduction: str, label_smoothing: float,
                                  chunk_size: int, compute_grad: bool
                                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(loss fp32 scalar, grad_hidden (T, h), grad_weight (V, h)); grads are empty tensors
    when compute_grad is False."""
    require_triton("hidden", hidden)
    from meshplan.kernels import _linear_ce_triton as tk

    hidden, weight, labels = hidden.contiguous(), weight.contiguous(), labels.contiguous()
    t = hidden.shape[0]
    n_valid = (labels != ignore_index).sum()
    if reduction == "mean":
        # clamp: with every label ignored no row uses the scale (and the loss is 0/0 = NaN)
        scale = (1.0 / n_valid.clamp(min=1).float()).reshape(1)
    else:
        scale = torch.ones(1, device=hidden.device, dtype=torch.float32)
    loss_rows = torch.empty(t, device=hidden.device, dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden) if compute_grad else hidden.new_empty(0)
    grad_weight = torch.zeros_like(weight) if compute_grad else weight.new_empty(0)
    for start in range(0, t, chunk_size):
        end = min(start + chunk_size, t)
        h_chunk = hidden[start:end]  # (C, h)
        logits = h_chunk @ weight.t()  # (C, V), input dtype
        tk.ce_chunk(logits, labels[start:end], loss_rows[start:end], scale, ignore_index,
                    label_smoothing, compute_grad)
        if compute_grad:  # logits now hold scaled dloss/dlogits
            torch.mm(logits, weight, out=grad_hidden[start:end])
            grad_weight.addmm_(logits.t(), h_chunk)
    total = loss_rows.sum()
    loss = total / n_valid if reduction == "mean" else total
    return loss, grad_hidden, grad_weight


@fused_linear_cross_entropy_op.register_fake
def _(hidden, weight, labels, ignore_index, reduction, label_smoothing, chunk_size, compute_grad):
    loss = hidden.new_empty((), dtype=torch.float32)
    if not compute_grad:
        return loss, hidden.new_empty(0), weight.new_empty(0)
    return loss, torch.empty_like(hidden), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    _, grad_hidden, grad_weight = output
    ctx.compute_grad = inputs[-1]
    ctx.save_for_backward(grad_hidden, grad_weight)


def _backward(ctx, dloss, _dgh, _dgw):
    if not ctx.compute_grad:
        raise RuntimeError("fused_linear_cross_entropy ran with compute_grad=False; call it "
                           "with gradients enabled to differentiate it")
    grad_hidden, grad_weight = ctx.saved_tensors
    g = dloss.to(grad_hidden.dtype)
    return grad_hidden * g, grad_weight * g, None, None, None, None, None, None


fused_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup)


def _validate(hidden, weight, labels, ignore_index, reduction, label_smoothing, chunk_size):
    check_tensor("hidden", hidden, ndim=2)
    check_tensor("weight", weight, ndim=2)
    check_tensor("labels", labels, dtypes=INDEX_DTYPES, ndim=1)
    check_same_dtype(hidden=hidden, weight=weight)
    check_same_device(hidden=hidden, weight=weight, labels=labels)
    if weight.shape[1] != hidden.shape[1]:
        raise ConfigError(f"weight has shape {tuple(weight.shape)} but must be (vocab, "
                          f"{hidden.shape[1]}) to match hidden {tuple(hidden.shape)}")
    check_shape("labels", labels, (hidden.shape[0],), "one label per row of hidden")
    if reduction not in REDUCTIONS:
        raise ConfigError(f"reduction must be one of {REDUCTIONS}, got {reduction!r} "
                          "(per-token losses would need the full gradient per row)")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ConfigError(f"label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ConfigError(f"ignore_index must be an int, got {ignore_index!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size <= 0):
        raise ConfigError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if labels.numel() and not is_traced(labels):
        # One host sync per call: an out-of-range label would otherwise be a silent wrong loss.
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= weight.shape[0]))
        if bool(bad.any()):
            raise ConfigError(f"labels holds {int(bad.sum())} value(s) outside [0, vocab="
                              f"{weight.shape[0]}) that are not ignore_index={ignore_index}, "
                              f"e.g. {int(labels[bad][0])}")


def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *,
                               ignore_index: int = -100, reduction: str = "mean",
                               label_smoothing: float = 0.0,
                               chunk_size: int | None = None) -> Tensor:
    """Cross-entropy of (hidden (T, h) @ weight (V, h).T) against labels (T,), fp32 scalar.

    chunk_size: tokens per chunk (default: default_chunk_size). The reference backend
    materialises the full logits instead.
    """
    _validate(hidden, weight, labels, ignore_index, reduction, label_smoothing, chunk_size)
    if backend() != "triton":
        return reference.linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index,
                                              reduction=reduction,
                                              label_smoothing=float(label_smoothing))
    chunk = chunk_size or default_chunk_size(hidden.shape[0], weight.shape[0],
                                             hidden.element_size())
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss, _, _ = fused_linear_cross_entropy_op(hidden, weight, labels, ignore_index, reduction,
                                               float(label_smoothing), chunk, compute_grad)
    return loss
