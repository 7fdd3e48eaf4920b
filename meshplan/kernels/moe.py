"""MoE routing (top-k with softmax or DeepSeek-V3 sigmoid+bias), the Switch load-balancing
loss, and token permute / unpermute by expert, as `meshplan_kernels::` custom ops.

Routing: `moe_route(router_logits (T, E), top_k)` ->
  weights (T, k) fp32, renormalised over the k picks; experts (T, k) int64, best first;
  prob_sum (E,) fp32, each expert's summed probability over tokens (differentiable, for the
  auxiliary loss); tokens_per_expert (E,) int64.
  - softmax: probabilities p = softmax(logits); picks = top-k of p (+ expert_bias if given).
  - sigmoid (DeepSeek-V3): scores s = sigmoid(logits); picks = top-k of s + expert_bias; the
    bias only steers selection: weights = s[picks] / sum(s[picks]). prob_sum uses s / sum(s).
  The router math is fp32 whatever the logits' dtype; expert_bias gets no gradient (DeepSeek
  adjusts it by a rule outside backprop). Ties go to the lower expert index.
Auxiliary loss (Switch Transformer, Fedus et al. 2021, eq. 4): E * sum_e f_e * P_e with
  f_e = tokens_per_expert / (T k) and P_e = prob_sum / T; perfectly balanced routing gives 1.
Permutation (dropless): `moe_permute(x (T, h), experts (T, k), E)` copies each token once per
  pick into `tokens` (T k, h) grouped by expert (token order kept within an expert); expert e
  owns rows offsets[e]:offsets[e+1]. `moe_unpermute(expert_out, perm, weights)` returns
  y[t] = sum_i weights[t, i] * expert_out[perm.row_map[t, i]] (fp32 sum, expert_out's dtype).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from meshplan.errors import ConfigError
from meshplan.kernels import reference
from meshplan.kernels._checks import (
    INDEX_DTYPES,
    check_positive_int,
    check_same_device,
    check_shape,
    check_tensor,
    is_traced,
)
from meshplan.kernels._common import NAMESPACE, require_triton
from meshplan.kernels.selection import backend

__all__ = ["SCORE_FUNCS", "MoeRouting", "MoePermutation", "moe_route", "load_balancing_loss",
           "moe_permute", "moe_unpermute"]

Tensor = torch.Tensor
SCORE_FUNCS = ("softmax", "sigmoid")


class MoeRouting(NamedTuple):  # a NamedTuple so torch.export / compile see a pytree
    weights: Tensor            # (T, k) fp32
    experts: Tensor            # (T, k) int64
    prob_sum: Tensor           # (E,) fp32
    tokens_per_expert: Tensor  # (E,) int64


class MoePermutation(NamedTuple):
    tokens: Tensor         # (T k, h) rows grouped by expert
    counts: Tensor         # (E,) int64 rows per expert
    offsets: Tensor        # (E + 1,) int64, offsets[e]:offsets[e+1] are expert e's rows
    row_map: Tensor        # (T, k) int64: row of `tokens` holding pick i of token t
    permuted_from: Tensor  # (T k,) int64: row j of `tokens` is pick (f % k) of token f // k

    @property
    def source_token(self) -> Tensor:
        return self.permuted_from // self.row_map.shape[1]


def _counts(experts: Tensor, num_experts: int) -> Tensor:
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


# --- routing -------------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::moe_route", mutates_args=())
def moe_route_op(logits: Tensor, expert_bias: Tensor | None, top_k: int, score_func: str
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    require_triton("router_logits", logits)
    from meshplan.kernels import _moe_triton as tk

    t, e = logits.shape
    if t == 0:
        w, idx = logits.new_empty(0, top_k, dtype=torch.float32), logits.new_empty(
            0, top_k, dtype=torch.int64)
        return w, idx, logits.new_zeros(e, dtype=torch.float32), _counts(idx, e)
    bias = None if expert_bias is None else expert_bias.contiguous()
    w, idx, psum = tk.route(logits.contiguous(), bias, top_k, score_func == "sigmoid")
    return w, idx, psum, _counts(idx, e)


@moe_route_op.register_fake
def _(logits, expert_bias, top_k, score_func):
    t, e = logits.shape
    return (logits.new_empty(t, top_k, dtype=torch.float32),
            logits.new_empty(t, top_k, dtype=torch.int64),
            logits.new_empty(e, dtype=torch.float32), logits.new_empty(e, dtype=torch.int64))


@torch.library.custom_op(f"{NAMESPACE}::moe_route_backward", mutates_args=())
def moe_route_backward_op(dweights: Tensor, dprob_sum: Tensor, logits: Tensor, experts: Tensor,
                          weights: Tensor, score_func: str) -> Tensor:
    require_triton("dweights", dweights)
    from meshplan.kernels import _moe_triton as tk

    if logits.shape[0] == 0:
        return torch.zeros_like(logits)
    return tk.route_backward(dweights.contiguous(), dprob_sum.contiguous(), logits.contiguous(),
                             experts.contiguous(), weights.contiguous(), score_func == "sigmoid")


@moe_route_backward_op.register_fake
def _(dweights, dprob_sum, logits, experts, weights, score_func):
    return torch.empty_like(logits)


def _route_setup(ctx, inputs, output):
    logits, _, _, score_func = inputs
    weights, experts, _, _ = output
    ctx.score_func = score_func
    ctx.save_for_backward(logits, experts, weights)


def _route_backward(ctx, dweights, _dexperts, dprob_sum, _dcounts):
    logits, experts, weights = ctx.saved_tensors
    if dweights is None:
        dweights = torch.zeros_like(weights)
    if dprob_sum is None:
        dprob_sum = logits.new_zeros(logits.shape[1], dtype=torch.float32)
    dlogits = moe_route_backward_op(dweights, dprob_sum, logits, experts, weights, ctx.score_func)
    return dlogits, None, None, None


moe_route_op.register_autograd(_route_backward, setup_context=_route_setup)


def moe_route(router_logits: Tensor, top_k: int, *, score_func: str = "softmax",
              expert_bias: Tensor | None = None) -> MoeRouting:
    """Top-k expert choice per token; see the module docstring for the two score functions."""
    check_tensor("router_logits", router_logits, ndim=2)
    e = router_logits.shape[1]
    check_positive_int("top_k", top_k)
    if top_k > e:
        raise ConfigError(f"top_k={top_k} exceeds the number of experts {e} (router_logits "
                          f"has shape {tuple(router_logits.shape)})")
    if score_func not in SCORE_FUNCS:
        raise ConfigError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if expert_bias is not None:
        check_tensor("expert_bias", expert_bias, ndim=1)
        check_shape("expert_bias", expert_bias, (e,), "one selection bias per expert")
        check_same_device(router_logits=router_logits, expert_bias=expert_bias)
    if backend() == "triton":
        return MoeRouting(*moe_route_op(router_logits, expert_bias, top_k, score_func))
    return MoeRouting(*reference.moe_route(router_logits, top_k, score_func=score_func,
                                           expert_bias=expert_bias))


def load_balancing_loss(routing: MoeRouting) -> Tensor:
    """Switch auxiliary loss E * sum_e f_e P_e (1.0 when perfectly balanced); fp32 scalar."""
    t, k = routing.experts.shape
    e = routing.prob_sum.shape[0]
    f = routing.tokens_per_expert.float() / max(t * k, 1)
    p = routing.prob_sum / max(t, 1)
    return e * (f * p).sum()


# --- permutation ---------------------------------------------------------------------------

@torch.library.custom_op(f"{NAMESPACE}::moe_permute", mutates_args=())
def moe_permute_op(x: Tensor, experts: Tensor, num_experts: int
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    require_triton("x", x)
    from meshplan.kernels import _moe_triton as tk

    t, k = experts.shape
    flat = experts.reshape(-1).long()
    permuted_from = torch.argsort(flat, stable=True)  # (T k,): the one sort; rows move in Triton
    row_map = torch.empty_like(permuted_from)
    row_map[permuted_from] = torch.arange(t * k, device=x.device)
    counts = _counts(flat, num_experts)
    if t * k == 0 or x.shape[1] == 0:
        return x.new_empty(t * k, x.shape[1]), counts, row_map.view(t, k), permuted_from
    tokens = tk.gather_rows(x.contiguous(), permuted_from, k)
    return tokens, counts, row_map.view(t, k), permuted_from


@moe_permute_op.register_fake
def _(x, experts, num_experts):
    t, k = experts.shape
    return (x.new_empty(t * k, x.shape[1]), x.new_empty(num_experts, dtype=torch.int64),
            x.new_empty(t, k, dtype=torch.int64), x.new_empty(t * k, dtype=torch.int64))


@torch.library.custom_op(f"{NAMESPACE}::moe_gather_sum", mutates_args=())
def moe_gather_sum_op(src: Tensor, row_map: Tensor, weights: Tensor | None) -> Tensor:
    """out[t] = sum_i weights[t, i] * src[row_map[t, i]] (weights None: plain sum)."""
    require_triton("src", src)
    from meshplan.kernels import _moe_triton as tk

    if row_map.numel() == 0 or src.shape[1] == 0:
        return src.new_zeros(row_map.shape[0], src.shape[1])
    return tk.gather_sum(src.contiguous(), row_map.contiguous(),
                         None if weights is None else weights.contiguous())


@moe_gather_sum_op.register_fake
def _(src, row_map, weights):
    return src.new_empty(row_map.shape[0], src.shape[1])


def _permute_setup(ctx, inputs, output):
    _, _, row_map, _ = output
    ctx.save_for_backward(row_map)


def _permute_backward(ctx, dtokens, _dcounts, _drow_map, _dfrom):
    (row_map,) = ctx.saved_tensors
    return moe_gather_sum_op(dtokens, row_map, None), None, None


moe_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op(f"{NAMESPACE}::moe_unpermute", mutates_args=())
def moe_unpermute_op(expert_out: Tensor, row_map: Tensor, weights: Tensor,
                     permuted_from: Tensor) -> Tensor:
    return moe_gather_sum_op(expert_out, row_map, weights)


@moe_unpermute_op.register_fake
def _(expert_out, row_map, weights, permuted_from):
    return expert_out.new_empty(row_map.shape[0], expert_out.shape[1])


@torch.library.custom_op(f"{NAMESPACE}::moe_unpermute_backward", mutates_args=())
def moe_unpermute_backward_op(dy: Tensor, expert_out: Tensor, weights: Tensor,
                              permuted_from: Tensor) -> tuple[Tensor, Tensor]:
    require_triton("dy", dy)
    from meshplan.kernels import _moe_triton as tk

    if expert_out.numel() == 0:
        return torch.zeros_like(expert_out), torch.zeros_like(weights)
    return tk.unpermute_backward(dy.contiguous(), expert_out.contiguous(),
                                 permuted_from.contiguous(), weights.contiguous())


@moe_unpermute_backward_op.register_fake
def _(dy, expert_out, weights, permuted_from):
    return torch.empty_like(expert_out), torch.empty_like(weights)


def _unpermute_setup(ctx, inputs, output):
    expert_out, _, weights, permuted_from = inputs
    ctx.save_for_backward(expert_out, weights, permuted_from)


def _unpermute_backward(ctx, dy):
    expert_out, weights, permuted_from = ctx.saved_tensors
    dexp, dweights = moe_unpermute_backward_op(dy, expert_out, weights, permuted_from)
    return dexp, None, dweights, None


moe_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def moe_permute(x: Tensor, experts: Tensor, num_experts: int) -> MoePermutation:
    """Group token copies by expert; see the module docstring."""
    check_tensor("x", x, ndim=2)
    check_tensor("experts", experts, dtypes=INDEX_DTYPES, ndim=2)
    check_positive_int("num_experts", num_experts)
    check_shape("experts", experts, (x.shape[0], experts.shape[1]), "(tokens of x, top_k)")
    check_same_device(x=x, experts=experts)
    if experts.numel() and not is_traced(experts):
        # One host sync: an out-of-range expert id would index out of bounds, never a result.
        lo, hi = int(experts.min()), int(experts.max())
        if lo < 0 or hi >= num_experts:
            raise ConfigError(f"experts holds ids in [{lo}, {hi}] but num_experts={num_experts}")
    experts = experts.long()
    if backend() == "triton":
        tokens, counts, row_map, permuted_from = moe_permute_op(x, experts, num_experts)
    else:
        tokens, counts, row_map, permuted_from = reference.moe_permute(x, experts, num_experts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return MoePermutation(tokens, counts, offsets, row_map, permuted_from)


def moe_unpermute(expert_out: Tensor, permutation: MoePermutation, weights: Tensor) -> Tensor:
    """Weighted sum of each token's k expert outputs: (T k, h) -> (T, h)."""
    row_map = permutation.row_map
    t, k = row_map.shape
    check_tensor("expert_out", expert_out, ndim=2)
    check_shape("expert_out", expert_out, (t * k, expert_out.shape[1]),
                "one row per permuted token")
    check_tensor("weights", weights, ndim=2)
    check_shape("weights", weights, (t, k), "(tokens, top_k), as the permutation's row_map")
    check_same_device(expert_out=expert_out, weights=weights, row_map=row_map)
    if backend() == "triton":
        return moe_unpermute_op(expert_out, row_map, weights, permutation.permuted_from)
    return reference.moe_unpermute(expert_out, row_map, weights)
