"""Mixture-of-experts MLP with dropless token-choice routing (Mixtral, Qwen3-MoE, DeepSeek-V3).

    MoE
      router          nn.Linear(h, experts, bias=False)
      expert_bias     buffer (experts,), sigmoid router only: shifts the top-k choice, never the
                      weights (DeepSeek-V3's auxiliary-loss-free balancing; updated outside
                      autograd by the training loop, e.g. `update_expert_bias`)
      experts         GroupedExperts: w1 (E, f, h), w2 (E, h, f)[, w3 (E, f, h)]
      shared_experts  FeedForward of width shared_experts * f, applied to every token (or None)

Forward, with N = tokens and k = topk (every shape is static, so the block traces with
torch.export on meta / fake tensors):
  1. scores (N, E) from the router; top-k experts and weights per token;
  2. the N*k token copies are sorted by expert id (argsort) and counted per expert (scatter_add);
  3. `experts(x_sorted, counts)` runs one grouped matmul per projection (`meshplan::grouped_mm`);
  4. the copies are weighted and summed back into their tokens (index_add).
An expert-parallel runtime wraps step 3: `GroupedExperts.forward(x, counts)` receives tokens
sorted by expert together with the per-expert counts, which is what an all-to-all dispatch needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshplan.models.config import ModelConfig
from meshplan.models.grouped_mm import grouped_mm
from meshplan.models.layers import FeedForward

__all__ = ["MoE", "GroupedExperts"]


class GroupedExperts(nn.Module):
    """E expert MLPs stored as stacked weights in nn.Linear layout (out_features, in_features)."""

    def __init__(self, experts: int, hidden: int, ffn_hidden: int, *, activation: str):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, ffn_hidden, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn_hidden))
        self.w3 = nn.Parameter(torch.empty(experts, ffn_hidden, hidden)) if activation == "swiglu" else None

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """x (M, h) sorted by expert; counts (E,) rows per expert -> (M, h)."""
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)            # (E,) row ends
        h = grouped_mm(x, self.w1, offs)                                   # (M, f)
        if self.w3 is None:
            h = F.gelu(h)
        else:
            h = F.silu(h) * grouped_mm(x, self.w3, offs)
        return grouped_mm(h, self.w2, offs)                                # (M, h)


class MoE(nn.Module):
    """Routed experts (+ optional shared experts) replacing the dense MLP of a block."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.topk = config.topk
        self.score_func = config.router
        self.router = nn.Linear(config.hidden, config.experts, bias=False)
        self.experts = GroupedExperts(
            config.experts, config.hidden, config.moe_ffn_hidden, activation=config.activation)
        self.shared_experts = (
            FeedForward(config.hidden, config.shared_experts * config.moe_ffn_hidden,
                        activation=config.activation, bias=False)
            if config.shared_experts else None)
        if self.score_func == "sigmoid":
            self.register_buffer("expert_bias", torch.zeros(config.experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.aux_loss: Tensor | None = None        # set by every forward
        self.tokens_per_expert: Tensor | None = None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (N, h) -> top-k weights (N, k) float32, expert ids (N, k), router probabilities (N, E)."""
        logits = self.router(x).float()                                     # (N, E)
        if self.score_func == "softmax":
            # Mixtral / Qwen3: softmax over all experts, keep the top k, renormalise over them.
            probs = logits.softmax(dim=-1)
            weights, selected = probs.topk(self.topk, dim=-1)
        else:
            # DeepSeek-V3: independent sigmoid scores; the bias only steers which experts win.
            scores = logits.sigmoid()
            _, selected = (scores + self.expert_bias).topk(self.topk, dim=-1)
            weights = scores.gather(-1, selected)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, selected, probs

    def forward(self, x: Tensor) -> Tensor:
        B, T, H = x.shape
        E, k = self.experts.num_experts, self.topk
        tokens = x.reshape(-1, H)                                           # (N, h)
        weights, selected, probs = self.route(tokens)                       # (N, k), (N, k), (N, E)
        expert_of_copy = selected.flatten()                                 # (N*k,)
        order = torch.argsort(expert_of_copy, stable=True)                  # copies grouped by expert
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add(
            0, expert_of_copy, torch.ones_like(expert_of_copy))             # (E,)
        token_of_copy = order // k                                          # (N*k,)
        routed = self.experts(tokens.index_select(0, token_of_copy), counts)   # (N*k, h)
        routed = routed * weights.flatten()[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(tokens).index_add(0, token_of_copy, routed)  # (N, h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if not torch.compiler.is_exporting():
            # An exported program cannot keep tensors assigned to module attributes (they would
            # hold fake tensors), so the optional routing statistics are only kept when running.
            self.tokens_per_expert = counts.detach()
            self.aux_loss = load_balancing_loss(probs, counts, k)
        return out.view(B, T, H)

    @torch.no_grad()
    def update_expert_bias(self, rate: float = 1e-3) -> None:
        """DeepSeek-V3 balancing step: raise the bias of under-loaded experts, lower over-loaded."""
        if self.expert_bias is None or self.tokens_per_expert is None:
            return
        load = self.tokens_per_expert.float()
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))

    @torch.no_grad()
    def init_weights(self, std: float, residual_std: float, generator: torch.Generator | None = None) -> None:
        self.experts.w1.normal_(0.0, std, generator=generator)
        self.experts.w2.normal_(0.0, residual_std, generator=generator)
        if self.experts.w3 is not None:
            self.experts.w3.normal_(0.0, std, generator=generator)
        if self.expert_bias is not None:
            self.expert_bias.zero_()


def load_balancing_loss(probs: Tensor, counts: Tensor, topk: int) -> Tensor:
    """Switch Transformer / Mixtral auxiliary loss: E * sum_e (share of copies to e) * (mean prob of e).

    Equals 1 under perfectly uniform routing; gradients flow through `probs` only.
    """
    experts = probs.shape[-1]
    fraction = counts.float() / (probs.shape[0] * topk)                # (E,)
    return experts * (fraction * probs.mean(dim=0)).sum()
