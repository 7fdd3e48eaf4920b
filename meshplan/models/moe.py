"""Mixture-of-experts MLP with dropless token-choice routing (Mixtral, Qwen3-MoE, DeepSeek-V3).

    MoE
      router          nn.Linear(h, experts, bias=False)
      expert_bias     fp32 buffer (experts,), sigmoid router or `moe_expert_bias`: shifts the
                      top-k choice, never the weights (DeepSeek-V3's auxiliary-loss-free
                      balancing; `update_expert_bias` after each optimizer step; stays fp32
                      whatever the model's dtype; saved in checkpoints as a persistent buffer)
      experts         GroupedExperts: w1 (E, f, h), w2 (E, h, f)[, w3 (E, f, h)]
      shared_experts  FeedForward of width shared_experts * f, applied to every token (or None)

Routing (DeepSeek-V3, `moe_router_*` options): with groups, the experts form
`moe_router_num_groups` equal groups and each token picks its top k only inside its
`moe_router_group_topk` best groups (a group scored by its two best selection scores); the
weights come from the unbiased scores, renormalised over the k picks, times
`moe_router_topk_scaling_factor`.

Forward, with N = tokens and k = topk (every shape is static, so the block traces with
torch.export on meta / fake tensors):
  1. scores (N, E) from the router; top-k experts and weights per token;
  2. the N*k token copies are sorted by expert id (argsort) and counted per expert (scatter_add);
  3. `experts(x_sorted, counts)` runs one grouped matmul per projection (`meshplan::grouped_mm`);
  4. the copies are weighted and summed back into their tokens (index_add).
An expert-parallel runtime wraps step 3: `GroupedExperts.forward(x, counts)` receives tokens
sorted by expert together with the per-expert counts, which is what an all-to-all dispatch needs.

Load balancing (ModelConfig's `moe_*` options; names follow Megatron-Core):
  - aux loss (`moe_aux_loss_coeff`): the Switch loss E * sum_e f_e P_e, f_e = copies to e / (T k),
    P_e = mean probability of e. Scope "global" (default, Megatron's global_aux_loss): the counts
    are all-reduced over `balance_group` (the dp x cp ranks, set by the runtime's MoEBalancer)
    and micro-batch i uses their running mean over micro-batches 1..i of the step; T is the
    global token count of the micro-batch. Each rank back-propagates its share
    coeff / m * E / (k T^2) * sum_e mean_count_e * (its own summed P_e), so the gradients,
    summed over ranks like every gradient, are those of the global loss on one device.
    Scope "local": each rank's own micro-batch loss, averaged over ranks and micro-batches.
  - z-loss (`moe_z_loss_coeff`, ST-MoE): mean over tokens of logsumexp(logits)^2.
  - the losses join the training loss through `_AttachLoss` (no change to the loss function),
    so pipeline schedules and recompute train them too; a recomputed forward replays the first
    forward's constants (no collective in backward).
  - capacity (`moe_capacity_factor`): at most ceil(cf * N k / E) copies per expert on each rank,
    the first in token order (Megatron's "position" drop policy); dropped copies add nothing.
  - forced balance (`moe_force_balance`, benchmarking): copy j of token t goes to expert
    (t k + j) mod E.
Statistics of the step (global counts, the losses' values, the dropped fraction) are in
`window` until `step_stats()` reads and resets them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshplan.models.config import ModelConfig
from meshplan.models.grouped_mm import amp_operands, grouped_mm
from meshplan.models.layers import FeedForward

__all__ = ["MoE", "GroupedExperts", "RoutingWindow", "flush_windows", "load_balancing_loss"]


class GroupedExperts(nn.Module):
    """E expert MLPs stored as stacked weights in nn.Linear layout (out_features, in_features)."""

    # expert tensor parallelism (meshplan.runtime.expert_parallel): the inner-feature dim of each
    # weight, split over the ETP group (w1, w3 column-parallel, w2 row-parallel); forward on the
    # slices then returns a partial sum of the output over the group
    etp_split = {"w1": 1, "w2": 2, "w3": 1}

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
        # under autocast the GEMMs run in its dtype, as nn.Linear's do (grouped_mm.amp_operands)
        x, w1, w2 = amp_operands(x, self.w1, self.w2)
        h = grouped_mm(x, w1, offs)                                        # (M, f)
        if self.w3 is None:
            h = F.gelu(h)
        else:
            h = F.silu(h) * grouped_mm(x, *amp_operands(self.w3), offs)
        return grouped_mm(h, w2, offs)                                     # (M, h)


class _AttachLoss(torch.autograd.Function):
    """Return `out` unchanged; in backward, give `loss` the gradient 1 (Megatron's
    MoEAuxLossAutoScaler): the balancing losses join the training loss without passing through
    the loss function, so every loop, pipeline schedule and recompute policy trains them."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor) -> Tensor:
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, torch.ones(ctx.loss_shape, dtype=ctx.loss_dtype, device=grad.device)


class RoutingWindow:
    """Routing statistics of one optimizer step (its micro-batches), global over `group`.

    `counts` sums the copies routed to each expert over the micro-batches seen so far, all-reduced
    over the data-parallel x context-parallel ranks; the global auxiliary loss of micro-batch i
    uses their running mean (Megatron-Core's global aux loss). `aux`, `z` are the losses' values
    (mean over micro-batches, global); `dropped` / `copies` count token copies a capacity dropped.
    `replay` keeps each micro-batch's constants for a recomputation in backward (no collective
    there, and the same numbers as the first forward).

    When no loss needs the global counts during the step (no aux loss or z-loss with the global
    scope) the micro-batches' local statistics are summed in `pending` and all-reduced once, when
    the step's statistics are read (MoE.step_stats / update_expert_bias): one collective per layer
    and step instead of a blocking all-reduce in every micro-batch's forward, which on CPU
    processes made each MoE layer a synchronisation point of all data-parallel ranks.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.counts: Tensor | None = None        # (E,) float64
        self.microbatches = 0
        self.aux = 0.0
        self.z = 0.0
        self.dropped = 0.0
        self.copies = 0.0
        self.replay: list[tuple[Tensor, float]] = []
        self.pending: Tensor | None = None       # deferred: summed local statistics, not yet reduced


def kernel_route(logits: Tensor, moe: "MoE") -> tuple[Tensor, Tensor, Tensor]:
    """`MoE.route_fn` running meshplan's fused router (`meshplan.kernels.moe_route`: Triton on
    GPUs, the reference elsewhere): the same top-k, weights and summed probabilities as the
    eager route, in one kernel."""
    from meshplan.kernels.moe import moe_route
    r = moe_route(logits, moe.topk, score_func=moe.score_func, expert_bias=moe._selection_bias())
    weights = r.weights * moe.routed_scale if moe.routed_scale != 1.0 else r.weights
    return weights, r.experts, r.prob_sum


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
        if self.score_func == "sigmoid" or config.moe_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(config.experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.aux_loss_coeff = float(config.moe_aux_loss_coeff)
        self.aux_loss_scope = config.moe_aux_loss_scope
        self.z_loss_coeff = float(config.moe_z_loss_coeff)
        self.bias_update = config.moe_expert_bias
        self.bias_update_rate = float(config.moe_bias_update_rate)
        self.capacity_factor = config.moe_capacity_factor
        self.force_balance = config.moe_force_balance
        # group-limited routing (DeepSeek-V3): 0 groups = every expert is a candidate
        self.num_groups = config.moe_router_num_groups or 0
        self.group_topk = config.moe_router_group_topk or 0
        self.routed_scale = float(config.moe_router_topk_scaling_factor or 1.0)
        # set by the runtime (meshplan.runtime.expert_parallel.MoEBalancer): the process group of
        # the ranks holding other tokens of this layer (dp x cp), and micro-batches per step
        self.balance_group = None
        self.num_microbatches = 1
        self.window = RoutingWindow()
        self.route_fn = None                   # a fused router kernel (runtime/fused.py), or None
        self.probing = False                   # a shape-inference run (pipelining): no statistics
        self.aux_loss: Tensor | None = None        # set by every forward
        self.tokens_per_expert: Tensor | None = None

    def _apply(self, fn, recurse: bool = True):
        # the expert bias stays fp32 whatever the model's dtype (model.to(torch.bfloat16), FSDP's
        # param dtype): DeepSeek-V3's updates of 1e-3 are below bf16's resolution near 1
        out = super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return out

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (N, h) -> top-k weights (N, k) float32, expert ids (N, k), router probabilities (N, E)."""
        return self._route(self.router(x).float())[:3]

    def _selection_bias(self) -> Tensor | None:
        return self.expert_bias if self.bias_update or self.score_func == "sigmoid" else None

    def _route(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """logits (N, E) fp32 -> weights (N, k), experts (N, k), probabilities (N, E)."""
        bias = self._selection_bias()
        if self.score_func == "softmax":
            # Mixtral / Qwen3: softmax over all experts, keep the top k, renormalise over them.
            probs = logits.softmax(dim=-1)
            scores = probs
        else:
            # DeepSeek-V3: independent sigmoid scores; the bias only steers which experts win.
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        if self.force_balance:
            # Megatron's forced balance (benchmarking): copy j of token t goes to expert
            # (t k + j) mod E, the same load on every expert whatever the router learnt. The choice
            # is still a top-k over the router's scores (lifted by 2 at the round-robin experts; the
            # scores lie in [0, 1]), as Megatron's top-k over replaced logits is: the planner's trace
            # finds a MoE layer by a top-k fed by a router linear, and prices its dispatch.
            n, e = logits.shape
            rr = (torch.arange(n * self.topk, device=logits.device) % e).view(n, self.topk)
            lift = torch.zeros_like(scores).scatter_(1, rr, 2.0)
            _, selected = (scores.detach() + lift).topk(self.topk, dim=-1)
        else:
            choice = scores if bias is None else scores + bias
            if self.num_groups > 1:
                choice = self._limit_groups(choice)
            _, selected = choice.topk(self.topk, dim=-1)
        weights = scores.gather(-1, selected)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        return weights, selected, probs

    def _limit_groups(self, choice: Tensor) -> Tensor:
        """Selection scores (N, E) with every expert outside the token's `group_topk` best groups
        at -inf. A group's score is the sum of its two best selection scores (bias included, as
        DeepSeek-V3's node-limited routing ranks them), so a group wins by two strong experts,
        not by one."""
        n, e = choice.shape
        grouped = choice.view(n, self.num_groups, e // self.num_groups)          # (N, G, E/G)
        group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)                 # (N, G)
        kept = group_score.topk(self.group_topk, dim=-1).indices                 # (N, group_topk)
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, e)

    def forward(self, x: Tensor) -> Tensor:
        out = self.routed(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def routed(self, x: Tensor) -> Tensor:
        """The routed experts' part of `forward` (no shared experts): x (B, T, h) -> (B, T, h).
        Per token apart from the balancing statistics, so a runtime may call it on any subset of
        the tokens (MoE parallel folding runs it on each TP rank's own sequence shard while the
        shared experts stay tensor-parallel: meshplan.runtime.moe_folding)."""
        B, T, H = x.shape
        E, k = self.experts.num_experts, self.topk
        tokens = x.reshape(-1, H)                                           # (N, h)
        logits = self.router(tokens).float()                                # (N, E)
        if self.route_fn is not None and not self.force_balance and self.num_groups <= 1:
            # fused router (meshplan.kernels.moe_route): top-k, scores, bias and summed probabilities
            weights, selected, prob_sum = self.route_fn(logits, self)       # (N, k), (N, k), (E,)
        else:
            weights, selected, probs = self._route(logits)                  # (N, k), (N, k), (N, E)
            prob_sum = probs.sum(dim=0)                                     # (E,)
        expert_of_copy = selected.flatten()                                 # (N*k,)
        order = torch.argsort(expert_of_copy, stable=True)                  # copies grouped by expert
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add(
            0, expert_of_copy, torch.ones_like(expert_of_copy))             # (E,)
        running = not torch.compiler.is_exporting() and x.device.type != "meta" and not _is_fake(x)
        kept_counts, dropped = counts, 0
        if self.capacity_factor is not None and running:
            order, kept_counts = self._drop_over_capacity(order, expert_of_copy, counts)
            dropped = expert_of_copy.numel() - order.numel()
        token_of_copy = order // k                                          # (M,) M <= N*k
        # the copies in the experts' GEMM dtype (autocast's): half the bytes gathered and, under
        # expert parallelism, sent
        (rows,) = amp_operands(tokens)
        routed = self.experts(rows.index_select(0, token_of_copy), kept_counts)   # (M, h)
        routed = routed * weights.flatten()[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(tokens, dtype=routed.dtype).index_add(0, token_of_copy, routed)  # (N, h)
        if running:
            # An exported program cannot keep tensors assigned to module attributes (they would
            # hold fake tensors), so the routing statistics and losses only exist when running.
            self.tokens_per_expert = counts.detach()
            # a training-mode forward without autograd is a probe (the pipeline's shape inference
            # runs the stage once on a real micro-batch): it must not count in the step's window
            if (torch.is_grad_enabled() or not self.training) and not self.probing:
                loss = self._balancing(logits, prob_sum, tokens.shape[0], counts, dropped)
                if loss is not None:
                    out = _AttachLoss.apply(out, loss)
        return out.view(B, T, H)

    def _drop_over_capacity(self, order: Tensor, expert_of_copy: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """Keep at most ceil(cf * N k / E) copies per expert, the first ones in token order
        (Megatron's "position" drop policy); returns the kept copies' order and counts."""
        copies, experts = expert_of_copy.numel(), counts.numel()
        capacity = math.ceil(self.capacity_factor * copies / experts)
        starts = torch.cumsum(counts, 0) - counts                          # (E,)
        sorted_expert = expert_of_copy[order]                               # (N*k,)
        position = torch.arange(copies, device=order.device) - starts[sorted_expert]   # rank within expert
        return order[position < capacity], counts.clamp(max=capacity)

    def _balancing(self, logits: Tensor, prob_sum: Tensor, n: int, counts: Tensor, dropped: int) -> Tensor | None:
        """Routing statistics of this micro-batch (global over `balance_group`) and the balancing
        losses' term to back-propagate (None when no loss is on). See `RoutingWindow`.
        prob_sum (E,): the router probabilities summed over this rank's n tokens (differentiable)."""
        E, k = prob_sum.shape[0], self.topk
        recompute = torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled()
        z_sum = torch.logsumexp(logits, dim=-1).square().sum() if self.z_loss_coeff else None
        # this micro-batch's own Switch loss (local), kept for inspection
        self.aux_loss = E * (counts.float() / (n * k) * prob_sum / n).sum()
        if recompute and self.window.replay:
            mean_counts, tokens = self.window.replay.pop(0)
        else:
            w = self.window
            if w.microbatches >= self.num_microbatches:
                w.reset()                      # a new step (the runtime also resets explicitly)
            local = torch.cat([counts.double(), prob_sum.detach().double(), prob_sum.new_tensor(
                [float(z_sum.detach()) if z_sum is not None else 0.0, n, dropped, float(self.aux_loss.detach())],
                dtype=torch.float64)])
            if self._defers_statistics():
                # no loss term needs global numbers now: sum locally, reduce once per step
                w.pending = local if w.pending is None else w.pending + local
                w.microbatches += 1
                mean_counts, tokens = counts.float(), float(n)
                if torch.is_grad_enabled():
                    w.replay.append((mean_counts, tokens))
                return self._loss_terms(logits, prob_sum, z_sum, n, mean_counts, tokens)
            ranks = self._all_reduce_statistics(local)
            m = self.num_microbatches
            glob_counts, glob_probs, glob_z, tokens, aux_sum = self._absorb(local)
            w.microbatches += 1
            w.z += glob_z / tokens / m
            if self.aux_loss_scope == "global":
                mean_counts = (w.counts / w.microbatches).float()           # (E,) running mean
                w.aux += float(E / (k * tokens ** 2) * (mean_counts.double() * glob_probs).sum()) / m
            else:
                mean_counts = counts.float()
                tokens = float(n)
                w.aux += aux_sum / ranks / m
            if torch.is_grad_enabled():
                w.replay.append((mean_counts, tokens))
        return self._loss_terms(logits, prob_sum, z_sum, n, mean_counts, tokens)

    def _defers_statistics(self) -> bool:
        """Whether this step's statistics can wait for the end of the step (RoutingWindow.pending):
        only losses with the global scope read global counts or token totals in the forward."""
        return self.aux_loss_scope != "global" or not (self.aux_loss_coeff or self.z_loss_coeff)

    def _flush_window(self) -> None:
        """All-reduce the deferred statistics (collective over `balance_group`) into the window's
        global counts, token copies, drops and loss values."""
        flush_windows([self])

    def _absorb_window(self, glob: Tensor, ranks: int) -> None:
        """Take this step's reduced statistics (the sum of `pending` over `ranks` ranks) into the window."""
        w = self.window
        E, k, m = self.experts.num_experts, self.topk, max(1, w.microbatches)
        glob_counts, glob_probs, glob_z, tokens, aux_sum = self._absorb(glob)
        per_mb = tokens / m                      # every micro-batch has the same token count
        w.z += glob_z / per_mb / m if per_mb else 0.0
        if self.aux_loss_scope == "global":      # the global Switch loss of the step's mean counts
            w.aux += float(E / (k * per_mb ** 2) * ((glob_counts / m) * (glob_probs / m)).sum()) if per_mb else 0.0
        else:
            w.aux += aux_sum / ranks / m

    def _all_reduce_statistics(self, local: Tensor) -> int:
        """Sum a statistics vector over `balance_group` in place (collective); the group's size."""
        if self.balance_group is None:
            return 1
        import torch.distributed as dist
        dist.all_reduce(local, group=self.balance_group)
        return dist.get_world_size(self.balance_group)

    def _absorb(self, glob: Tensor) -> tuple[Tensor, Tensor, float, float, float]:
        """Add a reduced statistics vector [counts (E), probabilities (E), z, tokens, dropped, aux]
        to the window's counts, drops and token copies; returns (counts, probabilities, z, tokens,
        aux) for the loss values."""
        w, E = self.window, self.experts.num_experts
        counts, probs = glob[:E], glob[E:2 * E]
        z, tokens, dropped, aux = (float(v) for v in glob[2 * E:])
        w.counts = counts.clone() if w.counts is None else w.counts + counts
        w.dropped += dropped
        w.copies += tokens * self.topk
        return counts, probs, z, tokens, aux

    def _loss_terms(self, logits: Tensor, prob_sum: Tensor, z_sum, n: int, mean_counts: Tensor,
                    tokens: float) -> Tensor | None:
        E, k = prob_sum.shape[0], self.topk
        terms = []
        m = self.num_microbatches
        if self.aux_loss_coeff:
            # sums over the ranks' shares make the global loss: the shares' gradients are summed
            # over dp x cp like every gradient; "local" averages the ranks' own losses instead
            share = 1.0 if self.aux_loss_scope == "global" else 1.0 / self._ranks()
            terms.append(self.aux_loss_coeff * share / m * E / (k * tokens ** 2) * (mean_counts * prob_sum).sum())
        if self.z_loss_coeff:
            glob_tokens = tokens if self.aux_loss_scope == "global" else n * self._ranks()
            terms.append(self.z_loss_coeff / m / glob_tokens * z_sum)
        if not terms or not torch.is_grad_enabled():
            return None
        return sum(terms[1:], terms[0])

    def _ranks(self) -> int:
        if self.balance_group is None:
            return 1
        import torch.distributed as dist
        return dist.get_world_size(self.balance_group)

    def step_stats(self, *, reset: bool = True) -> dict[str, float | list[float]]:
        """This step's routing statistics (global): copies per expert, max/mean load, the aux and
        z losses' values, the dropped fraction; starts a new window when `reset`."""
        self._flush_window()
        w = self.window
        if w.counts is None:
            return {}
        load = w.counts.tolist()
        mean = sum(load) / len(load)
        stats = {"tokens_per_expert": load, "imbalance": max(load) / mean if mean else 0.0,
                 "aux_loss": w.aux, "z_loss": w.z, "dropped": w.dropped / w.copies if w.copies else 0.0}
        if reset:
            w.reset()
        return stats

    @torch.no_grad()
    def update_expert_bias(self, rate: float | None = None, counts: Tensor | None = None) -> None:
        """DeepSeek-V3 balancing step: raise the bias of under-loaded experts, lower over-loaded.

        `counts`: the copies per expert of the whole step (default: this step's window, global
        over the data-parallel ranks and micro-batches, else the last forward's)."""
        if self.expert_bias is None:
            return
        if counts is None:
            self._flush_window()
            counts = self.window.counts if self.window.counts is not None else self.tokens_per_expert
        if counts is None:
            return
        rate = self.bias_update_rate if rate is None else rate
        load = counts.to(self.expert_bias.device, torch.float32)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))

    @torch.no_grad()
    def init_weights(self, std: float, residual_std: float, generator: torch.Generator | None = None) -> None:
        self.experts.w1.normal_(0.0, std, generator=generator)
        self.experts.w2.normal_(0.0, residual_std, generator=generator)
        if self.experts.w3 is not None:
            self.experts.w3.normal_(0.0, std, generator=generator)
        if self.expert_bias is not None:
            self.expert_bias.zero_()


def flush_windows(layers) -> None:
    """All-reduce the deferred routing statistics of several routed layers with one collective per
    balance group (the layers' vectors concatenated), instead of one per layer: each is a blocking
    all-reduce over every data-parallel rank, and at the end of the step nothing hides its wait
    (4 processes on 2 cores, tiny-moe's 3 layers: 17.7 ms of the step, 2026-11-25). Collective:
    every rank of a group passes its layers in the same order (the model's)."""
    groups: dict[int, list] = {}
    for m in layers:
        if m.window.pending is not None:
            groups.setdefault(id(m.balance_group), []).append(m)
    for ms in groups.values():
        parts = [m.window.pending for m in ms]
        for m in ms:
            m.window.pending = None
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        ranks = ms[0]._all_reduce_statistics(flat)
        for m, glob in zip(ms, flat.split([p.numel() for p in parts])):
            m._absorb_window(glob, ranks)


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)


def load_balancing_loss(probs: Tensor, counts: Tensor, topk: int) -> Tensor:
    """Switch Transformer / Mixtral auxiliary loss: E * sum_e (share of copies to e) * (mean prob of e).

    Equals 1 under perfectly uniform routing; gradients flow through `probs` only.
    """
    experts = probs.shape[-1]
    fraction = counts.float() / (probs.shape[0] * topk)                # (E,)
    return experts * (fraction * probs.mean(dim=0)).sum()
