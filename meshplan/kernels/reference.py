"""Plain-PyTorch reference implementations of every fused kernel.

These define the semantics the Triton kernels must reproduce, run wherever PyTorch runs, and
are differentiated by autograd. Arithmetic is done in fp32 and cast once at the end, which is
also what the kernels do (so bf16 results differ from a bf16 eager chain by rounding only).
No validation here: the public wrappers in each kernel module validate first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

__all__ = [
    "rms_norm",
    "rms_norm_residual",
    "swiglu",
    "swiglu_packed",
    "rope",
    "linear_cross_entropy",
    "moe_route",
    "moe_permute",
    "moe_unpermute",
]


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype)


def rms_norm_residual(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6
                      ) -> tuple[Tensor, Tensor]:
    h = x + residual  # rounded to the storage dtype, as an unfused residual stream is
    return rms_norm(h, weight, eps), h


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def swiglu_packed(gate_up: Tensor) -> Tensor:
    """gate_up (..., 2F): gate is the first half of the last dim, up the second."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu(gate, up)


def _rotate(x: Tensor, interleaved: bool) -> Tensor:
    if interleaved:  # GPT-J / Meta's original layout: pairs (2i, 2i+1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)  # Llama / HF "rotate_half" layout: pairs (i, i + r/2)
    return torch.cat((-x2, x1), dim=-1)


def _rope_one(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, interleaved: bool) -> Tensor:
    # x (B, S, H, D); cos, sin (S, r) or (B, S, r) -> broadcast over heads
    c = cos.float().unsqueeze(-2)
    s = sin.float().unsqueeze(-2)
    xf = x.float()
    rot, keep = xf[..., :rotary_dim], xf[..., rotary_dim:]
    out = torch.cat((rot * c + _rotate(rot, interleaved) * s, keep), dim=-1)
    return out.to(x.dtype)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, rotary_dim: int | None = None,
         interleaved: bool = False) -> tuple[Tensor, Tensor]:
    r = cos.shape[-1] if rotary_dim is None else rotary_dim
    return (_rope_one(q, cos[..., :r], sin[..., :r], r, interleaved),
            _rope_one(k, cos[..., :r], sin[..., :r], r, interleaved))


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *,
                         ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0) -> Tensor:
    """Materialises the full (T, V) logits: the unfused baseline."""
    logits = hidden @ weight.t()  # (T, V) in the input dtype, as an eager lm_head does
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing)


def _scores(logits: Tensor, score_func: str) -> Tensor:
    lf = logits.float()
    return torch.softmax(lf, dim=-1) if score_func == "softmax" else torch.sigmoid(lf)


def moe_route(router_logits: Tensor, top_k: int, *, score_func: str = "softmax",
              expert_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(weights (T,k) fp32, experts (T,k) int64, prob_sum (E,) fp32, tokens_per_expert (E,)).

    softmax: pick the top-k probabilities, renormalise them to sum to 1.
    sigmoid (DeepSeek-V3): scores s = sigmoid(logits); pick top-k of s + bias (bias for
    selection only); weights = s[top-k] / sum(s[top-k]).
    prob_sum[e] = sum over tokens of the token's full distribution over experts: softmax
    probabilities, or the sigmoid scores normalised over all experts (DeepSeek-V3's s').
    """
    scores = _scores(router_logits, score_func)  # (T, E)
    select = scores if expert_bias is None else scores + expert_bias.float()
    experts = torch.topk(select, top_k, dim=-1).indices  # (T, k), sorted by selection score
    picked = scores.gather(-1, experts)
    weights = picked / picked.sum(-1, keepdim=True)
    probs = scores if score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
    counts = torch.zeros(router_logits.shape[-1], dtype=torch.int64, device=router_logits.device)
    counts.scatter_add_(0, experts.flatten(), torch.ones_like(experts.flatten()))
    return weights, experts, probs.sum(0), counts


def moe_permute(x: Tensor, experts: Tensor, num_experts: int
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(tokens (T*k, h) grouped by expert, counts (E,), row_map (T, k), permuted_from (T*k,)).

    Copies of one expert keep token order (stable sort). row_map[t, i] is the row of
    `tokens` holding copy i of token t; permuted_from[j] = t*k + i is the inverse.
    """
    t, k = experts.shape
    flat = experts.reshape(-1).long()
    permuted_from = torch.argsort(flat, stable=True)  # (T*k,)
    tokens = x[permuted_from // k]
    row_map = torch.empty_like(permuted_from)
    row_map[permuted_from] = torch.arange(t * k, device=x.device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return tokens, counts, row_map.view(t, k), permuted_from


def moe_unpermute(expert_out: Tensor, row_map: Tensor, weights: Tensor) -> Tensor:
    """y[t] = sum_i weights[t, i] * expert_out[row_map[t, i]]  (fp32 sum, cast to expert_out)."""
    gathered = expert_out[row_map].float()  # (T, k, h)
    return (gathered * weights.float().unsqueeze(-1)).sum(1).to(expert_out.dtype)
