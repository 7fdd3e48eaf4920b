"""The cost tables the planner reads: priced alternatives, built from (profile, cluster, layout,
stack, fitted constants), so the search's bound and the three integer programs choose between
the cost model's own numbers instead of re-pricing layers from its internals.

- `layer_table` -> `LayerTable`: per transformer layer and recompute policy, the `LayerCost`
  (forward, backward, recompute seconds, communication) and the activation bytes of one
  micro-batch on one GPU, exactly as `estimate_profile` prices them (it reads the same table).
  With `edge_costs` (embedding, output layer + loss), `layer_state_bytes` and `edge_state_bytes`
  (weights, gradients, optimizer state), `in_flight_by_rank`, `pipeline_p2p_s`, `pipeline_floor_s` and
  `grad_accumulation_s` it is what the stage ILP (planner/ilp/stage_refine.py) and the search's
  lower bound (planner/bound.py) read.
- `LinearCostTable` -> `LinearCosts`: per linear, its GEMMs in BF16 and in FP8, the once-per-step
  cast of its weights and their FP8 copy, and the bytes its saved input takes: the FP8 placement
  ILP's alternatives (planner/ilp/fp8.py).
- `OpCostTable`: per op of a traced block on a TP group, the seconds of its GEMMs, attention,
  element-wise and roofline work, its gradient synchronisation and the collectives that reshard
  a tensor between layouts: the sharding ILP's alternatives (planner/ilp/sharding_graph.py,
  sharding_problem.py).

Every function here is pure; the tables memoise what they have priced.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.cost_models import constants as K
from meshplan.cost_models.comm import collective_time, group, p2p_time
from meshplan.cost_models.compute import (
    attention_time,
    elementwise_time,
    fp8_weight_casts,
    gemm_time,
    grad_accumulation_time,
    matmul_rate,
)
from meshplan.cost_models.device import device_of
from meshplan.cost_models.layer import (
    LAYER_FUSIONS,
    NORM_ACT,
    Context,
    LayerCost,
    gemm_shape,
    routing_layout,
    unfused_of,
)
from meshplan.cost_models.memory import fp8_cache_bytes, fp8_copies_held, grad_store_bytes, optimizer_bytes, state_bytes
from meshplan.cost_models.pipeline import in_flight
from meshplan.cost_models.ranks import (
    LayerTable,
    embedding_time,
    head_activation_bytes,
    head_times,
    layer_fp8_flags,
)
from meshplan.ir.layout import Layout
from meshplan.ir.precision import Precision
from meshplan.ir.profile import BlockProfile, ModelProfile
from meshplan.ir.stack import Stack, resolve_stack

__all__ = ["LayerCost", "LayerTable", "layer_table", "stack_unfused", "EdgeCosts", "edge_costs", "edge_state_bytes",
           "layer_state_bytes", "in_flight_by_rank", "pipeline_p2p_s", "pipeline_floor_s", "grad_accumulation_s",
           "LinearCosts", "LinearCostTable", "OpCostTable", "STATE_BYTES_PER_PARAM", "GEMMS_PER_PASS"]

# Training state per parameter in the sharding ILP: bf16 weight + fp32 gradient + Adam master, m, v.
STATE_BYTES_PER_PARAM = K.PARAM_BYTES + K.GRAD_BYTES + K.OPTIMIZER_BYTES
# Per micro-batch a linear runs its GEMM three times: forward, input gradient, weight gradient
# (cost_models.layer: backward = 2 x forward GEMMs); full recompute adds the forward again.
GEMMS_PER_PASS = 3


# ---- per layer: the estimate's own table -----------------------------------------------------------
def stack_unfused(profile: ModelProfile, cluster, stack: Stack) -> frozenset:
    """The per-layer fusions (layer.LAYER_FUSIONS) that run as separate eager kernels on `stack`:
    none where torch.compile fuses the element-wise work (on GPUs: the runtime compiles on CUDA
    only), the traced model's own eager ones where the stack has fused kernels or runs the model
    as traced (meshplan's runtime on CPU), and all of them for an eager stack priced from a profile
    that records no fusions (a config's analytic profile: torchtitan without compile)."""
    if device_of(cluster).runs_compile(stack):
        return frozenset()
    if stack.fused_elementwise or profile.fusions:
        return unfused_of(profile)
    return frozenset(LAYER_FUSIONS)


def layer_table(profile: ModelProfile, cluster, layout: Layout | dict, *, seq_len: int, precision: str = Precision.BF16,
                fp8_modules: frozenset | None = None, fp8_recipe: str | None = None,
                stack: Stack | str | None = None, fitted: K.Fitted = K.FITTED) -> LayerTable:
    """The per-layer costs (`LayerTable.cost(i, policy)`: a `LayerCost`) and activation bytes
    (`LayerTable.act(i, policy)`) of `layout`, one micro-batch on one GPU, exactly as
    `estimate_profile` prices them. `LayerTable.layer_key(i)` names what layer i's costs depend on
    besides the layout (its block and FP8 flag), so layers with equal keys cost the same;
    `LayerTable.ctx.tokens` is the GEMM rows of one micro-batch on one GPU."""
    L = Layout.coerce(layout)
    stack = resolve_stack(stack, default="reference")
    fp8 = precision == Precision.FP8
    unfused = stack_unfused(profile, cluster, stack)
    ctx = Context.build(cluster, routing_layout(L, profile.moe_balance, stack), seq_len, fp8, unfused,
                        fp8_recipe=fp8_recipe or L.fp8_recipe, stack=stack, fitted=fitted)
    return LayerTable(profile, cluster, ctx.layout, seq_len, ctx, layer_fp8_flags(profile, fp8, fp8_modules), unfused)


@dataclass(frozen=True)
class EdgeCosts:
    """What the first and last pipeline ranks run besides their layers, one micro-batch on one GPU."""

    embedding_fwd_s: float          # the embedding lookup's forward; its backward is 2x
    head_gemm_fwd_s: float          # the output layer's GEMM forward (BF16); its backward is 2x
    loss_s: float                   # the cross-entropy pass, once forward and once backward
    embedding_act_bytes: float      # the embedding output the first rank keeps per micro-batch in flight
    head_act_bytes: float           # what the output layer + loss keep for backward on the last rank

    @property
    def first_s(self) -> float:
        """Forward + backward seconds the first rank adds per micro-batch."""
        return 3 * self.embedding_fwd_s

    @property
    def last_s(self) -> float:
        """Forward + backward seconds the last rank adds per micro-batch."""
        return 3 * self.head_gemm_fwd_s + 2 * self.loss_s


def _state_sum(params: float, shard: int, layout: Layout, stack=None) -> float:
    return sum(state_bytes(params, shard, layout.zero, optimizer_bytes=optimizer_bytes(layout, stack)).values())


def edge_costs(profile: ModelProfile, table: LayerTable) -> EdgeCosts:
    """The embedding's and the output layer + loss's costs at `table`'s layout and shape, as the
    estimate's pipeline ranks charge them (ranks.rank_work's first and last rank; the output
    layer's sequence-parallel gather under TP aside)."""
    ctx = table.ctx
    L, T = ctx.layout, ctx.tokens
    sp_div = L.tp if L.sp else 1
    g, ce = head_times(profile, ctx.cluster, T, L.tp, ctx.fitted)
    return EdgeCosts(embedding_fwd_s=embedding_time(profile, ctx.cluster, T, sp_div), head_gemm_fwd_s=g, loss_s=ce,
                     embedding_act_bytes=K.BF16 * profile.hidden * T / sp_div,
                     head_act_bytes=head_activation_bytes(profile, T, L.tp))


def edge_state_bytes(profile: ModelProfile, layout: Layout | dict, stack=None) -> tuple[float, float]:
    """(embedding, output layer) bytes of weights, gradients and optimizer state one GPU holds: split
    over TP, sharded over DP x CP by ZeRO (a tied output layer holds the embedding's again); `stack`:
    the optimizer's main copy of the weights (memory.master_bytes; None: fp32)."""
    L = Layout.coerce(layout)
    head_params = profile.head_params or (profile.embedding_params if profile.tied_embeddings else 0)
    return (_state_sum(profile.embedding_params / L.tp, L.dp * L.cp, L, stack),
            _state_sum(head_params / L.tp, L.dp * L.cp, L, stack))


def layer_state_bytes(profile: ModelProfile, layout: Layout | dict, stack=None) -> list[float]:
    """Per transformer layer, the bytes of weights, gradients and optimizer state one GPU holds:
    dense weights split over TP and sharded over DP x CP by ZeRO, experts over EP x ETP and EDP;
    `stack` as in edge_state_bytes."""
    L = Layout.coerce(layout)
    ob = optimizer_bytes(L, stack)
    out = []
    for b in profile.layer_blocks():
        sd = state_bytes((b.params - b.expert_params) / L.tp, L.dp * L.cp, L.zero, optimizer_bytes=ob)
        se = state_bytes(b.expert_params / (L.ep * L.etp), L.edp, L.zero, optimizer_bytes=ob)
        out.append(sum(sd.values()) + sum(se.values()))
    return out


def in_flight_by_rank(layout: Layout | dict, microbatches: int) -> list[float]:
    """Per pipeline rank, the micro-batches whose activations it holds at its peak under the
    layout's schedule (in units of all of the rank's layers for one micro-batch)."""
    L = Layout.coerce(layout)
    return [in_flight(L.schedule, microbatches, L.pp, L.vp, r) for r in range(L.pp)]


def pipeline_p2p_s(profile: ModelProfile, cluster, layout: Layout, microbatches: int,
                   tokens: float, stack: Stack | None = None) -> tuple[float, float]:
    """(exposed, total) seconds of pipeline p2p per step: every micro-batch's activations cross every
    stage boundary forward and back; fill and drain put (pp * vp - 1) round trips on the critical
    path. Where the stack's sends block the compute stream (Stack.pp_blocking_p2p), a middle stage
    also stops for its four transfers of every micro-batch (receive and send the activation, receive
    and send its gradient). The exposed part includes the sends' and receives' host work
    (Device.pp_host_time)."""
    L, m = layout, microbatches
    p, v = L.pp, L.vp
    if p == 1:
        exposed, total = 0.0, 0.0
    else:
        sliced = L.sp or (stack is not None and stack.pp_scatter_gather)
        size = K.BF16 * tokens * profile.hidden / (L.tp if sliced else 1)
        cross = group(cluster, p, L.tp * L.cp * L.dp).domains > 1   # neighbouring stages in other domains
        hop = p2p_time(size, cluster, cross_domain=cross)
        total = 2 * m * v * hop                     # each micro-batch crosses every boundary fwd and bwd
        exposed = 2 * (p * v - 1) * hop             # fill and drain put the hops on the critical path
        if stack is not None and stack.pp_blocking_p2p:
            exposed += 4 * m * v * hop
        total = max(total, exposed)                 # with m < p the fill/drain hops are all there is
    return exposed + device_of(cluster).pp_host_time(L, cluster, m), total


def pipeline_floor_s(cluster, layout: Layout, microbatches: int, total_fb_s: float) -> float:
    """The least busy + bubble seconds of a step whose pipeline ranks' forward + backward seconds
    per micro-batch sum to `total_fb_s`, however the layers are split (Device.pipeline_lower_bound)."""
    return device_of(cluster).pipeline_lower_bound(layout, microbatches, total_fb_s)


def grad_accumulation_s(weights: float, layout: Layout, stack: Stack, cluster) -> float:
    """One micro-batch's unfused gradient accumulation over `weights` weights into the layout's
    gradient buffer on `stack` (compute.grad_accumulation_time, memory.grad_store_bytes)."""
    return grad_accumulation_time(weights, grad_store_bytes(layout, stack), cluster)


# ---- per linear: the FP8 placement's alternatives --------------------------------------------------
@dataclass(frozen=True)
class LinearCosts:
    """One linear on one GPU, one micro-batch: `count` GEMMs of (rows x k) @ (k x n)."""

    rows: float
    n: float
    k: float
    weights: float                  # its weights on this GPU
    bf16_s: float                   # one pass of its GEMMs in BF16 (each of the GEMMS_PER_PASS costs this)
    fp8_s: float                    # the same in FP8, the activations' quantisation (and torchao's weight casts) included
    weight_cast_s: float            # the once-per-step FP8 casts of its weights (compute.fp8_weight_casts)
    weight_cache_bytes: float       # the FP8 copy of its weights kept between micro-batches


class LinearCostTable:
    """The linears of `profile` priced at `layout` for the FP8 placement: BF16 and FP8 GEMM
    seconds, weight cast and cache, the bytes of the input each saves for backward.

    Priced BF16 everywhere else (the choice is per linear), on the stack-neutral reference with
    the traced model's own eager fusions, except the FP8 casts: those are priced as `stack` runs them
    (eager torchao's unfused passes where it does not compile: compute.fp8_eager), with the
    layout's FP8 recipe."""

    def __init__(self, profile: ModelProfile, cluster, layout: Layout | dict, *, seq_len: int,
                 fitted: K.Fitted = K.FITTED, stack: Stack | str | None = None):
        self.profile, self.cluster, self.layout, self.fitted = profile, cluster, Layout.coerce(layout), fitted
        self.stack = resolve_stack(stack, default="reference")
        if self.layout.offload_activations and self.stack.compile and not self.stack.compile_offloaded:
            self.stack = self.stack.replace(compile=False)     # as estimate_profile: offloaded blocks run eagerly
        self.ctx = Context.build(cluster, self.layout, seq_len, fp8=False, unfused=unfused_of(profile),
                                 fitted=fitted)
        self._linears: dict[tuple[int, str], LinearCosts] = {}

    @property
    def tokens(self) -> float:
        """GEMM rows of one micro-batch on one GPU (mbs * seq / cp)."""
        return self.ctx.tokens

    def _costs(self, rows: float, n: float, k: float, count: float, weights: float,
               expert: bool = False) -> LinearCosts:
        c = self.cluster
        held = fp8_copies_held(0.0 if expert else weights, weights if expert else 0.0, self.layout)
        casts = fp8_weight_casts(0.0 if expert else weights, weights if expert else 0.0, c, self.layout,
                                 self.layout.fp8_recipe, self.stack)
        # a micro-batch's weight casts (torchao) ride on its GEMM passes, as the estimate puts them in
        # each micro-batch's forward and backward
        per_pass = (casts.fwd_s + casts.bwd_s) / GEMMS_PER_PASS
        return LinearCosts(rows=rows, n=n, k=k, weights=weights,
                           bf16_s=gemm_time(rows, n, k, c, fp8=False, count=count, fitted=self.fitted),
                           fp8_s=gemm_time(rows, n, k, c, fp8=True, count=count, recipe=self.layout.fp8_recipe,
                                           stack=self.stack, fitted=self.fitted) + per_pass,
                           weight_cast_s=casts.step_s,
                           weight_cache_bytes=fp8_cache_bytes(self.stack) * held)

    def linear(self, block_index: int, li) -> LinearCosts:
        """Linear `li` of block `profile.blocks[block_index]`."""
        key = (block_index, li.name)
        hit = self._linears.get(key)
        if hit is None:
            rows, n, k, count, weights = gemm_shape(li, self.ctx)
            hit = self._linears[key] = self._costs(rows, n, k, count, weights,
                                                   expert=li.is_expert)
        return hit

    def head(self) -> LinearCosts:
        """The output layer: vocab-parallel over TP, on every token of the micro-batch."""
        p, L = self.profile, self.layout
        weights = (p.head_params or (p.embedding_params if p.tied_embeddings else 0)) / L.tp
        return self._costs(self.tokens, p.vocab / L.tp, p.hidden, 1.0, weights)

    @property
    def head_input_bytes_per_token(self) -> float:
        """The BF16 input the output layer saves for backward (the final norm's output, whole)."""
        return K.BF16 * self.profile.hidden

    def stored_input(self, role: str, b: BlockProfile, policy: str) -> tuple[str, float]:
        """(input group suffix or "", bytes per token of the BF16 input a linear of `role` saves for
        backward on one GPU under recompute `policy`).

        As layer.activation_bytes keeps them: full recompute keeps only the layer input; selective
        recompute drops the attention output and the MLP activation output; "norm_act" drops the
        norm outputs (the QKV / MLP / router inputs) and the experts' activation output. Linears
        reading one tensor (QKV; gate and up; router and shared experts) share a group."""
        L = self.layout
        sp_div = L.tp if L.sp else 1
        if policy == "full":
            return ("", 0.0)
        if policy == NORM_ACT and role in ("attn_qkv", "mlp_in", "router", "shared_in", "expert_out"):
            return ("", 0.0)
        h = b.hidden
        if role == "attn_qkv":
            return ("attn_in", K.BF16 * h / sp_div)
        if role == "attn_out":
            return ("", 0.0 if policy == "selective" else K.BF16 * b.q_dim / L.tp)
        if role == "mlp_in":
            return ("mlp_in", K.BF16 * h / sp_div)
        if role == "mlp_out":
            return ("", 0.0 if policy == "selective" else K.BF16 * b.ffn_hidden / L.tp)
        if role in ("router", "shared_in"):     # both read the MoE block's normed input
            return ("moe_in", K.BF16 * h / sp_div)
        if role == "shared_out":
            return ("", K.BF16 * b.shared_ffn_hidden / L.tp)
        if role == "expert_in":
            return ("expert_in", b.topk * K.BF16 * h / sp_div)
        if role == "expert_out":
            return ("", 0.0 if policy == "selective" else b.topk * K.BF16 * b.moe_ffn_hidden / L.etp / sp_div)
        return ("", 0.0)   # "other": its saved input is unknown, count no saving

    def in_flight(self, microbatches: int) -> list[float]:
        """Per pipeline rank, the micro-batches whose activations it holds at its peak."""
        return in_flight_by_rank(self.layout, microbatches)


# ---- per op of a traced block on a TP group: the sharding ILP's alternatives ------------------------
class OpCostTable:
    """Prices of a traced block's ops on a TP group of `tp` adjacent GPUs (TP is the innermost mesh
    axis), per GPU and per micro-batch of a step of `microbatches`: what each sharding strategy of
    an op costs and what resharding a tensor between layouts costs."""

    state_bytes_per_param = STATE_BYTES_PER_PARAM

    def __init__(self, cluster, *, tp: int, microbatches: int):
        self.cluster, self.tp, self.microbatches = cluster, tp, microbatches
        self.group = group(cluster, tp, 1)

    def linear_s(self, m: float, n: float, k: float) -> float:
        """A linear's forward, input-gradient and weight-gradient GEMMs for (m x k) @ (k x n), BF16."""
        c = self.cluster
        return gemm_time(m, n, k, c) + gemm_time(m, k, n, c) + gemm_time(n, k, m, c)

    def attention_s(self, flops_fwd: float) -> float:
        """Flash attention's forward + backward on `flops_fwd` forward FLOPs (plateau rate)."""
        return attention_time(flops_fwd, self.cluster, backward=False) + \
            attention_time(flops_fwd, self.cluster, backward=True)

    def elementwise_s(self, nbytes: float) -> float:
        """One memory-bound pass over `nbytes`."""
        return elementwise_time(nbytes, self.cluster)

    def roofline_s(self, flops: float, kernels: int) -> float:
        """Matmul-like work without a clean GEMM shape: `flops` at the BF16 matmul rate plus each
        of `kernels` launches' fixed cost."""
        return flops / matmul_rate(self.cluster, False) + kernels * K.GEMM_FIXED_S

    def grad_sync_s(self, params_per_gpu: float) -> float:
        """The all-reduce of a replicated weight's gradients over the TP group, per micro-batch."""
        return collective_time("all_reduce", params_per_gpu * K.GRAD_BYTES, self.group,
                               self.cluster) / self.microbatches

    def reshard_s(self, kind: str, nbytes: float) -> float:
        """One collective of `kind` (comm.KINDS) over the TP group on `nbytes` per rank."""
        return collective_time(kind, nbytes, self.group, self.cluster)
