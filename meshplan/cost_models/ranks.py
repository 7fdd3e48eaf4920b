"""What one pipeline rank does for one micro-batch: its layers' forward/backward (+ recompute) time,
per-dimension communication, parameters held and activations stored (cost_models.md §6, §9).

`rank_work` composes `layer.layer_cost` over the layers the rank holds, plus the embedding on the
first rank and the output layer + loss on the last; `estimate.estimate_profile` turns the ranks into
a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from meshplan.cost_models import constants as K
from meshplan.cost_models.comm import collective_time
from meshplan.cost_models.context import WHOLE_ON_TP_ROLES
from meshplan.cost_models.compute import (
    elementwise_time,
    fp8_weight_casts,
    gemm_time,
    grad_accumulation_time,
)
from meshplan.cost_models.device import device_of
from meshplan.cost_models.layer import Context, activation_bytes, is_fp8_linear, layer_cost
from meshplan.cost_models.roofline import fp8_weight_gathered
from meshplan.ir.layout import Layout
from meshplan.ir.profile import ModelProfile
from meshplan.kernels.fusion import (
    linear_cross_entropy_bytes_saved,
    linear_cross_entropy_memory_bytes,
)

__all__ = ["RankWork", "LayerTable", "rank_layers", "layer_fp8_flags", "rank_work", "embedding_time",
           "fused_loss", "head_times", "head_activation_bytes", "clear_layer_cache"]

# Logits on the last stage at the loss: the bf16 logits kept for backward + one fp32 buffer
# (softmax, reused for its gradient by fused cross-entropy kernels) (derived).
_LOGIT_BYTES = K.BF16 + K.FP32
_LAYER_CACHE: dict = {}
_RANK_CACHE: dict = {}      # (layer table, a rank's layer sequence) -> its sums (_add_layers)
_LAYER_CACHE_MAX = 200_000
_DIMS = ("tp", "cp", "ep")


def clear_layer_cache() -> None:
    _LAYER_CACHE.clear()
    _RANK_CACHE.clear()


def embedding_time(profile: ModelProfile, cluster, tokens: float, sp_div: int) -> float:
    """Forward seconds of the embedding lookup (memory-bound write of the hidden state); backward is 2x."""
    return elementwise_time(2 * K.BF16 * profile.hidden * tokens / sp_div, cluster)


def fused_loss(profile: ModelProfile, tp: int) -> bool:
    """Whether the output layer + loss run as meshplan's fused linear + cross-entropy kernel: the
    runtime swaps it in when the tracer matched it and the head is not split over TP."""
    return tp == 1 and dict(profile.fusions).get("linear_cross_entropy", False)


def head_times(profile: ModelProfile, cluster, tokens: float, tp: int, fitted: K.Fitted = K.FITTED) -> tuple[float, float]:
    """(output-layer GEMM, cross-entropy) forward seconds; the output layer stays BF16 (standard FP8
    recipes). Backward is 2x the GEMM plus the same cross-entropy pass. Fused (fused_loss), the
    cross-entropy passes save meshplan.kernels.fusion's bytes over the eager ones. With
    multi-token prediction the output layer and loss also run on each depth's positions."""
    tokens = tokens * (1 + profile.mtp_depth)
    g = gemm_time(tokens, profile.vocab / tp, profile.hidden, cluster, fitted=fitted)
    logits = tokens * profile.vocab / tp
    ce_bytes = 3 * _LOGIT_BYTES * logits
    if fused_loss(profile, tp):
        ce_bytes = max(ce_bytes - linear_cross_entropy_bytes_saved(tokens=tokens, vocab=profile.vocab) / 2,
                       0.0)
    return g, elementwise_time(ce_bytes, cluster)


def head_activation_bytes(profile: ModelProfile, tokens: float, tp: int) -> float:
    """Bytes the output layer + loss hold for backward on the last stage, per micro-batch (with
    multi-token prediction, for the main and every depth's positions)."""
    tokens = tokens * (1 + profile.mtp_depth)
    if fused_loss(profile, tp):
        return linear_cross_entropy_memory_bytes(tokens=tokens, vocab=profile.vocab, hidden=profile.hidden)
    return _LOGIT_BYTES * tokens * profile.vocab / tp


def rank_layers(stage_layers, p: int) -> list[list[int]]:
    """Layer indices each pipeline rank holds (virtual stage s lives on rank s % p)."""
    out: list[list[int]] = [[] for _ in range(p)]
    start = 0
    for s, n in enumerate(stage_layers):
        out[s % p].extend(range(start, start + n))
        start += n
    return out


def layer_fp8_flags(profile: ModelProfile, fp8: bool, fp8_modules: frozenset | None) -> list:
    """Which of each layer's linears run their GEMMs in FP8: False (none), None (all but the
    router: precision="fp8" without a module set) or the frozenset of the block's linear names in
    the FP8 module set (the FP8 placement's choice: a layer's stacked expert weights, which the
    runtime keeps BF16, are priced BF16 while its attention and MLP linears run FP8)."""
    if not fp8:
        return [False] * profile.num_layers
    if fp8_modules is None:
        return [None] * profile.num_layers
    flags: list = []
    seen = {bi: 0 for bi in range(len(profile.blocks))}
    for bi in profile.layers:
        b = profile.blocks[bi]
        inst = b.instances[seen[bi]] if b.instances else ""
        seen[bi] += 1
        names = frozenset(li.name for li in b.linears if f"{inst}.{li.name}" in fp8_modules)
        flags.append(names or False)
    return flags


class LayerTable:
    """Memoised per-layer costs and activation bytes for one (profile, cluster, layout, shape).

    A layer's cost depends only on its block and the layout fields the layer sees, so it is shared
    (through a module-level cache) across every candidate of a search that differs in pp / vp / dp /
    zero / schedule."""

    def __init__(self, profile: ModelProfile, cluster, L: Layout, seq_len: int, ctx: Context, layer_fp8: list,
                 unfused: frozenset):
        self.profile, self.blocks, self.layer_fp8 = profile, profile.layer_blocks(), layer_fp8
        self.ctx = ctx                          # the context of the layout's FP8 setting
        self._ctxs: dict = {}
        self._local: dict[tuple, Any] = {}
        self._act: dict[tuple, float] = {}
        self._keys = [(bi, flag) for bi, flag in zip(profile.layers, layer_fp8)]
        self.key = (profile.fingerprint, cluster, L.tp, L.cp, L.ep, L.etp, L.mbs, L.sp, L.flash_attention,
                    L.attn_kernel, L.tp_comm_overlap, L.moe_dispatcher, seq_len, unfused,
                    getattr(L, "cp_comm_type", "p2p"), ctx.fp8_recipe,
                    getattr(L, "moe_capacity_factor", None), ctx.stack, ctx.fitted,
                    ctx.stack.runs_ep_overlap(L))    # pairs micro-batches: depends on pp / vp / recompute

    def ctx_of(self, i: int) -> Context:
        """Layer i's context: FP8 for the linears its flag names (layer_fp8_flags)."""
        flag = self.layer_fp8[i]
        c = self._ctxs.get(flag)
        if c is None:
            import dataclasses
            c = self._ctxs[flag] = dataclasses.replace(self.ctx, fp8=flag is not False,
                                                       fp8_linears=flag if isinstance(flag, frozenset) else None)
        return c

    def layer_key(self, i: int) -> tuple:
        """What layer i's costs depend on besides the layout and its policy: its block and FP8 flag."""
        return self._keys[i]

    def keys_of(self, layers) -> tuple:
        """layer_key of each of `layers`, in order."""
        keys = self._keys
        return tuple([keys[i] for i in layers])

    def cost(self, i: int, policy: str):
        lk = (self.profile.layers[i], policy, self.layer_fp8[i])
        hit = self._local.get(lk)
        if hit is None:
            key = (self.key, lk)
            hit = _LAYER_CACHE.get(key)
            if hit is None:
                if len(_LAYER_CACHE) > _LAYER_CACHE_MAX:
                    _LAYER_CACHE.clear()
                hit = _LAYER_CACHE[key] = layer_cost(self.blocks[i], self.ctx_of(i), policy=policy)
            self._local[lk] = hit
        return hit

    def act(self, i: int, policy: str) -> float:
        lk = (self.profile.layers[i], policy, self.layer_fp8[i])
        if lk not in self._act:
            self._act[lk] = activation_bytes(self.blocks[i], self.ctx_of(i), policy=policy)
        return self._act[lk]


@dataclass
class RankWork:
    """One pipeline rank, one micro-batch (all its chunks)."""

    fb: float = 0.0                 # forward + backward (+ recompute) seconds, exposed comm included
    wgrad: float = 0.0              # weight-gradient GEMMs inside the backward
    cast: float = 0.0               # once-per-step FP8 weight casts (compute.fp8_weight_casts)
    fp8_gathered: float = 0.0       # of dparams: weights FSDP all-gathers in FP8 (roofline.fp8_weight_gathered)
    fp8_weights: float = 0.0        # of dparams + eparams: weights whose GEMMs run in FP8 (memory.weight_copy_bytes)
    t_f: float = 0.0                # forward seconds (DP/FSDP gathers hide behind it)
    t_b: float = 0.0                # backward + recompute seconds (reduce-scatters hide behind it)
    dparams: float = 0.0            # dense parameters held (after TP)
    eparams: float = 0.0            # expert parameters held (after EP x ETP)
    edge_params: float = 0.0        # of dparams: the embedding, output layer and final norm (never FP8)
    act: float = 0.0                # activation bytes stored per micro-batch
    largest_full: float = 0.0       # the largest fully recomputed layer's bytes, rebuilt in backward
    moe_host: float = 0.0           # of the compute: the GPU waiting on the host in MoE layers (LayerCost.host_s)
    layers: list[int] = field(default_factory=list)
    parts: dict = field(default_factory=lambda: {"compute": 0.0, "tp": 0.0, "cp": 0.0, "ep": 0.0})
    comm: dict = field(default_factory=lambda: {k: 0.0 for k in _DIMS})
    twin: int | None = None         # an earlier pipeline rank with the same work (the estimate's copy)

    def twin_at(self, first: int, layers) -> "RankWork":
        """This work (pipeline rank `first`'s) for another rank holding `layers`: the same blocks in
        the same place, so only the layer indices differ; marked as `first`'s twin. A shallow copy
        built directly (copy.copy's reduce protocol costs more than the estimate around it)."""
        out = object.__new__(RankWork)
        out.__dict__.update(self.__dict__)
        out.layers, out.parts, out.comm, out.twin = list(layers), dict(self.parts), dict(self.comm), first
        return out


def _fp8_weight_elements(b, layout: Layout, ctx: Context) -> tuple[float, float]:
    """(dense, expert) weights of block `b` held by one GPU that run their GEMMs in FP8 (the router
    stays BF16)."""
    dense = expert = 0.0
    for li in b.linears:
        if not is_fp8_linear(li, ctx):
            continue
        if li.is_expert:
            expert += li.in_features * li.out_features * li.count / (layout.ep * layout.etp)
        else:
            dense += li.in_features * li.out_features * li.count / (1 if li.role in WHOLE_ON_TP_ROLES else layout.tp)
    return dense, expert


def _add_layers(w: RankWork, table: LayerTable, L: Layout) -> tuple[float, float, tuple[float, ...]]:
    """Accumulate the rank's transformer layers into `w`; returns (forward, backward + recompute)
    seconds and the (dense, expert) weights held that run in FP8, then those of fully recomputed layers.

    Most pipeline ranks hold the same sequence of layers (same blocks, policies and FP8 flags), and
    candidates that differ only in what the layer table does not see (dp, zero, schedule, pp
    where the per-rank sequence repeats) hold it again: the sums are computed once per sequence
    and reused (the same additions in the same order, so the result is the same)."""
    key = (table.key, L.recompute, table.keys_of(w.layers))
    hit = _RANK_CACHE.get(key)
    if hit is None:
        if len(_RANK_CACHE) > _LAYER_CACHE_MAX:
            _RANK_CACHE.clear()
        hit = _RANK_CACHE[key] = _sum_layers(w.layers, table, L)
    for k, v in hit.parts.items():
        w.parts[k] += v
    for k, v in hit.comm.items():
        w.comm[k] += v
    w.wgrad += hit.wgrad
    w.act += hit.act
    w.largest_full = max(w.largest_full, hit.largest_full)
    w.dparams += hit.dparams
    w.eparams += hit.eparams
    w.moe_host += hit.moe_host
    return hit.fwd, hit.bwd, hit.fp8_weights


class _LayerSums(NamedTuple):
    """What a rank's sequence of transformer layers adds up to (_sum_layers, for _add_layers)."""

    fwd: float                      # forward seconds
    bwd: float                      # backward + recompute seconds
    fp8_weights: tuple              # (dense, expert) FP8 weights, then those of fully recomputed layers
    parts: dict                     # exposed seconds by RankWork.parts key
    comm: dict                      # total communication seconds by dimension
    wgrad: float
    act: float
    largest_full: float             # the largest fully recomputed layer's activation bytes
    dparams: float
    eparams: float
    moe_host: float


def _sum_layers(layers: list[int], table: LayerTable, L: Layout) -> _LayerSums:
    """The sums _add_layers applies."""
    w = RankWork(layers=list(layers))
    fwd = bwd = fp8_d = fp8_e = full_d = full_e = 0.0
    cluster = table.ctx.cluster
    dev = device_of(cluster)
    for j, i in enumerate(w.layers):
        b = table.blocks[i]
        pol = L.recompute_policy(j)
        c = table.cost(i, pol)
        fwd += c.fwd_s
        bwd += c.bwd_s + c.recompute_s
        for k, (hf, hb) in dev.layer_host(b, L, cluster, pol).items():
            fwd += hf
            bwd += hb
            w.parts[k] += hf + hb
        w.wgrad += c.wgrad_s
        w.moe_host += c.host_s
        w.parts["compute"] += c.compute_s
        for k in _DIMS:
            w.parts[k] += c.exposed_s[k]
            w.comm[k] += c.comm_s[k]
        w.act += table.act(i, pol)
        if pol == "full":
            w.largest_full = max(w.largest_full, table.act(i, "none"))
        folded = sum(li.params for li in b.linears if li.role in WHOLE_ON_TP_ROLES)   # whole on every TP rank
        w.dparams += (b.params - b.expert_params - folded) / L.tp + folded
        w.eparams += b.expert_params / (L.ep * L.etp)
        if table.layer_fp8[i] is not False:
            d, e = _fp8_weight_elements(b, L, table.ctx_of(i))
            fp8_d, fp8_e = fp8_d + d, fp8_e + e
            if pol == "full":
                full_d, full_e = full_d + d, full_e + e
    return _LayerSums(fwd, bwd, (fp8_d, fp8_e, full_d, full_e), dict(w.parts), dict(w.comm), w.wgrad, w.act,
                      w.largest_full, w.dparams, w.eparams, w.moe_host)


def _add_edges(w: RankWork, profile: ModelProfile, ctx: Context, r: int, p: int) -> tuple[float, float]:
    """Embedding on rank 0, final norm + output layer + loss on the last rank; returns (fwd, bwd) seconds."""
    L, cluster, T = ctx.layout, ctx.cluster, ctx.tokens
    sp_div = L.tp if L.sp else 1
    extra_f = extra_b = extra_tp = 0.0
    if r == 0:
        e = embedding_time(profile, cluster, T, sp_div)
        extra_f, extra_b = e, 2 * e
        w.dparams += profile.embedding_params / L.tp
        w.edge_params += profile.embedding_params / L.tp
    if r == p - 1:
        g, ce = head_times(profile, cluster, T, L.tp, ctx.fitted)
        extra_f += g + ce
        extra_b += 2 * g + ce
        w.wgrad += g
        head = profile.head_params if profile.head_params else \
            (profile.embedding_params if profile.tied_embeddings and p > 1 else 0)
        w.dparams += head / L.tp + profile.other_params / L.tp
        w.edge_params += head / L.tp + profile.other_params / L.tp
        if L.tp > 1:   # gather the sequence-parallel hidden state before the output layer
            size = K.BF16 * T * profile.hidden
            extra_tp = 2 * collective_time("all_gather" if L.sp else "all_reduce", size, ctx.tp, cluster)
            w.parts["tp"] += extra_tp
            w.comm["tp"] += extra_tp
    w.parts["compute"] += extra_f + extra_b
    hf, hb = device_of(cluster).edge_host(profile, L, cluster, first=r == 0, last=r == p - 1)
    w.parts["tp"] += hf + hb
    return extra_f + extra_tp / 2 + hf, extra_b + extra_tp / 2 + hb


def _add_mtp(w: RankWork, profile: ModelProfile, table: LayerTable, ctx: Context) -> tuple[float, float]:
    """The multi-token-prediction depths (models/mtp.py) on the last rank; returns (fwd, bwd) seconds.

    Each depth runs one block of the main model's last layer's kind, priced as that layer (Megatron-LM
    counts it so: num_floating_point_operations adds mtp_num_layers layers of the last layer's kind),
    never recomputed (the runtime recomputes the main blocks only), plus the (2h -> h) projection
    of the concatenated normed inputs, column-parallel over TP as in Megatron-Core. The output layer and
    loss over each depth's positions are in head_times / head_activation_bytes; the norms and the
    projection's weights are other_params, the block's are counted here as a layer's."""
    D = profile.mtp_depth
    if not D or not profile.layers:
        return 0.0, 0.0
    L, T, h = ctx.layout, ctx.tokens, profile.hidden
    i = profile.num_layers - 1
    b, c = table.blocks[i], table.cost(i, "none")
    g = gemm_time(T, h / L.tp, 2 * h, ctx.cluster, fitted=ctx.fitted)
    w.wgrad += D * (c.wgrad_s + g)
    w.parts["compute"] += D * (c.compute_s + 3 * g)
    for k in _DIMS:
        w.parts[k] += D * c.exposed_s[k]
        w.comm[k] += D * c.comm_s[k]
    # kept for backward: the block's activations, the embedding and both normed inputs (the
    # projection's input, 2h) and the depth's output before its norm
    w.act += D * (table.act(i, "none") + K.BF16 * T * 4 * h / (L.tp if L.sp else 1))
    folded = sum(li.params for li in b.linears if li.role in WHOLE_ON_TP_ROLES)
    w.dparams += D * ((b.params - b.expert_params - folded) / L.tp + folded)
    w.eparams += D * b.expert_params / (L.ep * L.etp)
    return D * (c.fwd_s + g), D * (c.bwd_s + 2 * g)


def rank_work(profile: ModelProfile, table: LayerTable, ctx: Context, layers: list[int], r: int, p: int, *,
              grad_accum_fusion: bool = True, grad_buffer_bytes: float = K.GRAD_BYTES) -> RankWork:
    """Pipeline rank `r` of `p` holding `layers`, for one micro-batch."""
    L = ctx.layout
    w = RankWork(layers=list(layers))
    fwd, bwd, (fp8_d, fp8_e, full_d, full_e) = _add_layers(w, table, L)
    # the weights' FP8 casts where the stack runs them: once a step (w.cast), or in each micro-batch
    casts = fp8_weight_casts(fp8_d, fp8_e, ctx.cluster, L, ctx.fp8_recipe, ctx.stack)
    gathered = fp8_weight_gathered(L, ctx.fp8_recipe, ctx.stack)
    # a fully recomputed layer's forward casts its weights again, but for those FSDP gathered in FP8
    # (Transformer Engine's recompute reads its cached copies: no fwd_s)
    recast = fp8_weight_casts(0.0 if gathered else full_d, full_e, ctx.cluster, L, ctx.fp8_recipe,
                              ctx.stack).fwd_s
    w.cast = casts.step_s
    fwd, bwd = fwd + casts.fwd_s, bwd + casts.bwd_s + recast
    w.parts["compute"] += casts.fwd_s + casts.bwd_s + recast
    w.fp8_gathered = fp8_d if gathered else 0.0
    w.fp8_weights = fp8_d + fp8_e
    ef, eb = _add_edges(w, profile, ctx, r, p)
    if r == p - 1:
        mf, mb = _add_mtp(w, profile, table, ctx)
        ef, eb = ef + mf, eb + mb
    # Without gradient-accumulation fusion every micro-batch's weight gradients are added into the
    # gradient buffer by a separate pass (compute.grad_accumulation_time); ZeRO-3 accumulates only
    # its shard after the reduce-scatter, which the FSDP collectives already stand for.
    if not grad_accum_fusion and L.zero < 3:
        acc = grad_accumulation_time(w.dparams + w.eparams, grad_buffer_bytes, ctx.cluster)
        eb += acc
        w.parts["compute"] += acc
    w.t_f, w.t_b = fwd + ef, bwd + eb
    w.fb = w.t_f + w.t_b
    return w
