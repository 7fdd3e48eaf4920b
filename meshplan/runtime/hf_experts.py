"""Expert parallelism for transformers-style experts modules that route inside their forward.

transformers' MoE experts (Mixtral, Qwen2-MoE, ...) hold the experts as two stacked weights,
`gate_up_proj` (E, 2f, h) (the gate rows, then the up rows) and `down_proj` (E, h, f), with an
activation `act_fn`, and take `forward(hidden_states, top_k_index, top_k_weights)`: (T, h) tokens,
(T, k) chosen experts and (T, k) routing weights. Such a module is recognised by that STRUCTURE
(`is_routed_experts`; class names are never read) and, under expert parallelism, keeps its
parameters and FQNs but gets a forward that

  1. expands each token into its k copies and stable-sorts the copies by expert
     (counts = copies per expert, (E,));
  2. runs the sorted rows through expert_parallel's dispatch (`_ep_forward`: all-to-all to the
     ranks owning the experts, the local experts' act(gate) * up then down on their rows via
     `grouped_forward`, all-to-all back), exactly as for meshplan's GroupedExperts;
  3. multiplies each copy by its routing weight and sums the k copies of each token (index_add),
     as the module's own forward does.

Under expert tensor parallelism (etp > 1) each expert's inner features f are split over the ETP
group (`ETP_SPLIT`): `down_proj` on its f dim, and `gate_up_proj` so that rank r holds its slice of
each half, [gate_r; up_r], in that order (`ETP_PARTS`), so the forward's `chunk(2)` splits the
local weight exactly as it splits the whole one. The local output is then a partial sum over the
group (moe_folding.etp_compute sums it). The global view of `gate_up_proj` is kept in ETP order
(rank 0's [gate_0; up_0], then rank 1's, ...), the packed projections' TP order
(runtime/packed_projections.py): state_dict and ParallelModel.full_grads give the user's order.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ETP_SPLIT", "ETP_PARTS", "grouped_forward", "routed_forward", "wrap_routed_experts"]

# parameter -> the dim of each expert's inner features f (split over etp)
ETP_SPLIT = {"gate_up_proj": 1, "down_proj": 2}
# parameter -> how many equal parts of width f its split dim holds (gate rows, then up rows)
ETP_PARTS = {"gate_up_proj": 2}

def _expert_mlp(module: nn.Module, x: torch.Tensor, e: int) -> torch.Tensor:
    gate, up = F.linear(x, module.gate_up_proj[e]).chunk(2, dim=-1)
    return F.linear(module.act_fn(gate) * up, module.down_proj[e])


def grouped_forward(self: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The GroupedExperts contract on the module's (local) weights: x (M, h) sorted by expert,
    counts (n,) rows per expert -> (M, h)."""
    n = self.gate_up_proj.shape[0]
    if x.device.type == "meta" or _is_fake(x):
        # shape inference: no data-dependent split (every row through the first expert)
        return _expert_mlp(self, x, 0)
    sizes = [int(c) for c in counts.tolist()]
    if len(sizes) != n or sum(sizes) != x.shape[0]:
        raise ValueError(f"grouped_forward: counts {sizes} do not match {n} experts and {x.shape[0]} rows")
    outs = [_expert_mlp(self, xe, e) for e, xe in enumerate(x.split(sizes))]
    return torch.cat(outs) if outs else x.new_zeros(0, self.down_proj.shape[1])


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)


def routed_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """forward(hidden_states, top_k_index, top_k_weights) of an expert-parallel routed module."""
    from meshplan.runtime.expert_parallel import _ep_forward
    tokens, k = top_k_index.shape
    n_experts = self.gate_up_proj.shape[0]              # global E (a DTensor's global shape)
    flat = top_k_index.reshape(-1)
    if hidden_states.device.type == "meta" or _is_fake(hidden_states):
        order = torch.arange(tokens * k, device=hidden_states.device)
        counts = torch.zeros(n_experts, dtype=torch.int64, device=hidden_states.device)
    else:
        order = torch.argsort(flat, stable=True)                            # copies sorted by expert
        counts = torch.bincount(flat, minlength=n_experts)
    token = torch.div(order, k, rounding_mode="floor")                      # token of each sorted copy
    y = _ep_forward(self, hidden_states.index_select(0, token), counts)     # (T*k, h) in sorted order
    w = top_k_weights.reshape(-1).index_select(0, order)
    y = y * w[:, None]
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, token, y.to(out.dtype))


def wrap_routed_experts(module: nn.Module) -> None:
    """Give an expert-parallel routed module (its parameters already sharded, its `_meshplan_ep`
    set) the sorted-rows contract for dispatch and the routed forward."""
    module.__meshplan_orig_forward__ = types.MethodType(grouped_forward, module)
    module.forward = types.MethodType(routed_forward, module)
