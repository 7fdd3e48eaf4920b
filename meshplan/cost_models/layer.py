"""Cost of one transformer layer for one micro-batch on one GPU: compute, per-dimension
communication (total and exposed), and stored activations.

The sharding pattern assumed here is Megatron's (column-parallel QKV/FC1, row-parallel out/FC2,
sequence-parallel norms, vocab-parallel embedding/output, experts over EP x ETP, ring attention
over CP); the planner's intra-block ILP rediscovers the same pattern for traced models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import NormalDist

from meshplan.cost_models import constants as K
from meshplan.cost_models.attention import AttnShape, layer_calls
from meshplan.cost_models.comm import (
    Group,
    collective_time,
    dedup_all_to_all_time,
    dedup_copies,
    group,
    p2p_time,
)
from meshplan.cost_models.compute import (
    attention_time,
    cpu_op_overhead,
    elementwise_time,
    gemm_time,
    grouped_gemm_time,
    is_cpu,
    matmul_rate,
    permute_time,
)
from meshplan.cost_models.flops import attention_fwd_flops_per_token
from meshplan.ir.profile import BlockProfile
from meshplan.kernels import fusion as FU  # pure Python, no torch

__all__ = ["Context", "LayerCost", "layer_cost", "gemm_shape", "activation_bytes", "unfused_of", "cp_comm", "cp_comm_type",
           "cp_kv_gathered_bytes", "attention_shape", "moe_load_factor", "routing_layout", "expected_max_std_normal",
           "NORM_ACT"]

# Fusions whose fused form the per-layer baseline below already assumes (a norm is one read +
# one write, silu*mul reads two and writes one, rotary reads and writes q and k once), as Megatron
# and Transformer Engine run them; a model that runs one of them eagerly pays
# meshplan.kernels.fusion's extra bytes on top.
LAYER_FUSIONS = ("rms_norm", "swiglu", "rope")

_COL = ("attn_qkv", "mlp_in", "shared_in", "other")     # output dim split over TP
_ROW = ("attn_out", "mlp_out", "shared_out")             # input dim split over TP
# element-wise passes over h-wide bf16 tensors per layer forward: 2 norms (read x, write y) +
# 2 residual adds (read 2, write 1) = 10 (derived)
_NORM_RESIDUAL_PASSES = 10.0
# Recompute policy of Megatron-Core's --recompute-modules layernorm moe_act (see activation_bytes)
NORM_ACT = "norm_act"


@dataclass(frozen=True)
class Context:
    """Everything per-layer costs need, computed once per (profile, cluster, layout, shape)."""

    cluster: object
    layout: object
    seq_len: int
    fp8: bool
    tokens: float            # rows of the GEMMs on one GPU per micro-batch: mbs * seq / cp
    tp: Group
    cp: Group
    ep: Group
    etp: Group
    fp8_modules: frozenset = field(default_factory=frozenset)
    unfused: frozenset = field(default_factory=frozenset)   # LAYER_FUSIONS the model runs eagerly
    fp8_recipe: str = "tensorwise"                           # constants.FP8_RECIPES

    @classmethod
    def build(cls, cluster, layout, seq_len: int, fp8: bool, unfused: frozenset = frozenset(),
              fp8_recipe: str = "tensorwise") -> "Context":
        L = layout
        return cls(cluster=cluster, layout=L, seq_len=seq_len, fp8=fp8,
                   tokens=L.mbs * seq_len / L.cp,
                   tp=group(cluster, L.tp, 1), cp=group(cluster, L.cp, L.tp),
                   ep=group(cluster, L.ep, L.etp), etp=group(cluster, L.etp, 1), unfused=unfused,
                   fp8_recipe=fp8_recipe)


def unfused_of(profile) -> frozenset:
    """The per-layer fusions a traced model runs in eager form (see ModelProfile.fusions)."""
    return frozenset(name for name, fused in profile.fusions if not fused and name in LAYER_FUSIONS)


@dataclass(frozen=True)
class LayerCost:
    fwd_s: float             # forward compute + exposed comm
    bwd_s: float             # backward compute + exposed comm (no recompute)
    recompute_s: float       # forward work redone in backward under the layer's recompute policy
    wgrad_s: float           # the weight-gradient GEMMs inside bwd_s (zero-bubble schedules defer them)
    comm_s: dict             # dim -> total comm seconds (fwd + bwd [+ recompute])
    exposed_s: dict          # dim -> exposed comm seconds
    compute_s: float         # pure compute (fwd + bwd + recompute), no comm


def expected_max_std_normal(n: int) -> float:
    """E[max of n independent standard normals], Blom's approximation Phi^-1((n - 0.375) / (n + 0.25))
    (Blom 1958, "Statistical Estimates and Transformed Beta-Variables"). Against the exact integral
    of x n phi(x) Phi(x)^(n-1): 0.590 vs 0.564 at n=2, 1.434 vs 1.424 at n=8, 2.067 vs 2.070 at n=32,
    2.585 vs 2.595 at n=128 (within 1% from n=8 on)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def moe_load_factor(b: BlockProfile, c: Context) -> float:
    """Busiest EP rank's routed (token, expert) rows over the mean, for one MoE layer and micro-batch.

    Every EP rank waits for the slowest at the combine all-to-all, so a dropless MoE layer runs at
    the pace of the rank that received the most rows. With a router balanced in expectation (the
    auxiliary load-balancing loss holds each expert's expected share at 1/E: Shazeer et al. 2017;
    Fedus et al. 2021, Switch Transformer eq. 4) and tokens routed independently, each of the N tokens
    of the EP group places its k distinct choices on rank r (E/ep of the E experts) as a
    hypergeometric draw: mean k p, variance k p (1-p) (E-k)/(E-1), p = 1/ep. A rank's load is the sum
    over N tokens, approximately normal with relative spread s = sqrt((1-p)(E-k) / ((E-1) N k p)).
    The loads sum to N k, so the ranks' deviations are exchangeable normals with correlation
    -1/(ep-1), i.e. sqrt(ep/(ep-1)) (W_r - mean W) for independent W; the expected maximum over the ep
    ranks is then 1 + sqrt(ep/(ep-1)) z_ep s, z_ep = expected_max_std_normal(ep).
    This is the floor of dropless imbalance: correlated routing (tokens of one document choosing alike)
    only adds to it. Mixtral 8x22B at tp2 ep8, seq 4096: +2.1% rows on the busiest rank.

    Layout.moe_capacity_factor (read with getattr: absent means dropless) c > 0: every expert is padded
    to (or dropped at) c times its mean rows (Megatron-Core --moe-expert-capacity-factor c
    --moe-pad-expert-input-to-capacity), so every rank runs c times the mean; forced balance
    (--moe-router-force-load-balancing) is c = 1."""
    if not b.is_moe:
        return 1.0
    return _load_factor(b.experts, b.topk, c)


def _load_factor(E: int, k: float, c: Context) -> float:
    L = c.layout
    cap = getattr(L, "moe_capacity_factor", None)
    if cap:
        return float(cap)
    if L.ep <= 1 or E <= 1:
        return 1.0
    k, ep = min(max(1.0, k), float(E)), L.ep
    n_tokens = c.tokens / L.tp * ep * L.etp          # tokens the EP group routes per micro-batch
    p = 1.0 / ep
    s = ((1 - p) * (E - k) / ((E - 1) * n_tokens * k * p)) ** 0.5
    return 1.0 + (ep / (ep - 1)) ** 0.5 * expected_max_std_normal(ep) * s


def routing_layout(layout, moe_balance: str):
    """`layout` as its MoE layers are priced for a model routing with `moe_balance`
    (ModelProfile.moe_balance). Forced balance (round-robin over the experts: Megatron-Core
    --moe-router-force-load-balancing, meshplan's moe_force_balance) hands every expert exactly its
    mean rows, whatever the router: `_load_factor`'s capacity factor 1.0, without the statistical
    excess of a router balanced only in expectation (the layer cost cache keys on that field, so
    the two are never confused). A layout that sets its own capacity factor, any other balance: as is."""
    if moe_balance == "forced" and hasattr(layout, "moe_capacity_factor") and layout.moe_capacity_factor is None:
        import dataclasses
        return dataclasses.replace(layout, moe_capacity_factor=1.0)
    return layout


def activation_bytes(b: BlockProfile, c: Context, *, policy: str) -> float:
    """Bytes stored for backward by one layer for one micro-batch on one GPU.

    Generalised Korthikanti count (cost_models.md §4) from the traced geometry: per token,
    norm inputs and the two GEMM inputs that TP does not shard (8h, divided by tp under SP),
    Q/K/V and attention output (4h_q + 4h_kv), fp32 log-sum-exp (4 bytes/head), MLP
    intermediates (6f gated / 4f GELU), MoE copies; FP8 stores linear inputs in 1 byte.
    policy: "none" | "selective" (core attention + activation function recomputed) | "full" |
    "norm_act" (Megatron-Core --recompute-granularity selective --recompute-modules layernorm moe_act:
    the two norms' outputs and the routed experts' activation outputs are recomputed, not stored).
    """
    L = c.layout
    tp, T = L.tp, c.tokens
    sp_div = tp if L.sp else 1
    h = b.hidden
    if policy == "full":
        return K.BF16 * h * T / sp_div           # only the layer input
    if b.heads and not L.flash_attention and policy != "selective":
        # materialised scores of the local heads (selective recompute exists to drop exactly these)
        scores = K.EAGER_ATTN_STORED_BYTES_PER_SCORE * (b.heads / tp) * T * c.seq_len
    else:
        scores = 0.0
    half = 0.5 if c.fp8 else 1.0                  # FP8 (TE) stores GEMM inputs in 1 byte
    norm_out = 0.0 if policy == NORM_ACT else 2 * K.BF16 * h * half   # QKV-in and FC1/router-in
    rep = (2 * K.BF16 * h + norm_out) / sp_div    # + the two norm inputs
    shard = 0.0
    if b.heads:
        shard += K.BF16 * (2 * b.q_dim + 2 * b.kv_dim)           # Q, K, V (k and v: h_kv each)
        if policy != "selective":
            shard += K.BF16 * b.q_dim * half + K.FP32 * b.heads    # attn output (out-proj input) + LSE
    f_mult_store = 3 if b.gated else 2            # gated: gate, up, act-out; GELU: fc1-out, act-out
    if b.ffn_hidden:
        f = b.ffn_hidden
        store = K.BF16 * f * (f_mult_store - 1) + (0 if policy == "selective" else K.BF16 * f * half)
        shard += store
    per_token = rep + shard / tp
    if b.is_moe:
        etp = L.etp
        fm = b.moe_ffn_hidden
        act_out = 0 if policy in ("selective", NORM_ACT) else K.BF16 * fm * half    # FC2's input
        moe = b.topk * (K.BF16 * h * half                                     # permuted expert inputs
                        + (K.BF16 * fm * (f_mult_store - 1) + act_out) / etp
                        + K.BF16 * h)                                        # expert outputs before combine
        moe += K.FP32 * b.experts * 2                                       # router logits + probs
        if b.shared_ffn_hidden:
            fs = b.shared_ffn_hidden
            moe += (K.BF16 * fs * (f_mult_store - 1) + K.BF16 * fs * half) / tp
        per_token += moe / sp_div                 # MoE tokens are the SP-sharded ones
    kept_kv = cp_kv_gathered_bytes(b, c) if policy != "selective" else 0.0
    return per_token * T + scores + kept_kv


def gemm_shape(li, c: Context) -> tuple[float, float, float, float, float]:
    """(rows, n, k, count, parameters on this GPU) of one linear's GEMM on one GPU: the router over
    the TP group's tokens, routed experts as `count` local experts of balanced rows each (EP x ETP),
    the rest split over TP by output (column-parallel) or input (row-parallel) features."""
    L, T = c.layout, c.tokens
    n, k = li.out_features, li.in_features
    if li.role == "router":
        return T / L.tp, n, k, 1.0, li.params / L.tp
    if li.role == "shared_folded":      # whole weights on this TP rank's tokens (MoE folding)
        return T / L.tp * li.tokens_per_token, n, k, float(li.count), li.params
    if li.role in ("expert_in", "expert_out"):
        local = max(1.0, li.count / L.ep)                       # experts held by this GPU
        rows = (T / L.tp) * L.ep * L.etp * li.tokens_per_token   # tokens per local expert (balanced)
        rows *= _load_factor(li.count, li.tokens_per_token * li.count, c)   # ... on the busiest EP rank
        if li.role == "expert_in":
            n = n / L.etp
        else:
            k = k / L.etp
        return rows, n, k, local, li.params / (L.ep * L.etp)
    if li.role in _ROW:
        k = k / L.tp
    else:
        n = n / L.tp
    return T * li.tokens_per_token, n, k, float(li.count), li.params / L.tp


def _gemms(b: BlockProfile, c: Context) -> tuple[float, float]:
    """(forward seconds, weight-grad seconds) of the layer's GEMMs on one GPU."""
    fwd = wgrad = 0.0
    for li in b.linears:
        fp8 = c.fp8 and li.role != "router"
        rows, n, k, count, _ = gemm_shape(li, c)
        if li.role == "router":
            t = gemm_time(rows, n, k, c.cluster)
        elif li.role in ("expert_in", "expert_out"):
            t = grouped_gemm_time(rows, n, k, c.cluster, groups=count, fp8=fp8, recipe=c.fp8_recipe)
        else:
            t = gemm_time(rows, n, k, c.cluster, fp8=fp8, count=li.count, recipe=c.fp8_recipe)
        fwd += t
        wgrad += t
    return fwd, wgrad


def _elementwise_bytes(b: BlockProfile, c: Context) -> float:
    """Forward HBM bytes of the memory-bound ops of one layer on one GPU."""
    L, T = c.layout, c.tokens
    sp_div = L.tp if L.sp else 1
    h = b.hidden
    nbytes = _NORM_RESIDUAL_PASSES * K.BF16 * h * T / sp_div
    if b.heads:   # rotary on q and k: read + write
        nbytes += 2 * K.BF16 * (b.q_dim + b.kv_dim) * T / L.tp
    act_passes = 3 if b.gated else 2              # gated: read gate+up, write out; GELU: read, write
    if b.ffn_hidden:
        nbytes += act_passes * K.BF16 * b.ffn_hidden * T / L.tp
    if b.is_moe:        # (the token permutation: _permute_bytes)
        tok = T / sp_div * moe_load_factor(b, c)                           # the busiest EP rank's rows
        nbytes += act_passes * K.BF16 * b.moe_ffn_hidden * b.topk * tok / L.etp
        if b.shared_ffn_hidden:
            nbytes += act_passes * K.BF16 * b.shared_ffn_hidden * T / L.tp
    # eager forms: charged a third in forward, and twice that in backward (layer_cost)
    return nbytes + _unfused_bytes(b, c) / 3


def _permute_bytes(b: BlockProfile, c: Context) -> float:
    """Forward bytes of a MoE layer's token permutation on one GPU: each token's top-k copies
    gathered into expert order and scattered back (read + write each way)."""
    if not b.is_moe:
        return 0.0
    L = c.layout
    tok = c.tokens / (L.tp if L.sp else 1) * moe_load_factor(b, c)       # the busiest EP rank's rows
    return 4 * b.topk * K.BF16 * b.hidden * tok


def _norm_act_bytes(b: BlockProfile, c: Context) -> float:
    """HBM bytes the "norm_act" policy re-runs in backward: the block's two norms (read the input,
    write the output) and the routed experts' activation function (gated: read gate and up, write)."""
    L, T = c.layout, c.tokens
    sp_div = L.tp if L.sp else 1
    nbytes = 2 * 2 * K.BF16 * b.hidden * T / sp_div
    if b.is_moe:
        act_passes = 3 if b.gated else 2
        nbytes += act_passes * K.BF16 * b.moe_ffn_hidden * b.topk * T / sp_div * moe_load_factor(b, c) / L.etp
    return nbytes


def _unfused_bytes(b: BlockProfile, c: Context) -> float:
    """Extra HBM bytes (forward + backward) of the fusions in c.unfused (meshplan.kernels.fusion)."""
    if not c.unfused:
        return 0.0
    L, T = c.layout, c.tokens
    extra = 0.0
    if "rms_norm" in c.unfused and b.norm == "rmsnorm":    # the two pre-norms of the block
        extra += 2 * FU.rms_norm_bytes_saved(tokens=T / (L.tp if L.sp else 1), hidden=b.hidden)
    if "swiglu" in c.unfused and b.gated and b.ffn_hidden:
        extra += FU.swiglu_bytes_saved(tokens=T, ffn_hidden=b.ffn_hidden / L.tp)
    if "rope" in c.unfused and b.heads:
        extra += FU.rope_bytes_saved(tokens=T, q_heads=b.heads / L.tp, kv_heads=b.kv_heads / L.tp,
                                     head_dim=b.head_dim)
    return extra


def _tp_comm(b: BlockProfile, c: Context) -> float:
    """TP (+SP) collective seconds for ONE forward pass of the layer (backward is the same)."""
    L = c.layout
    if L.tp == 1:
        return 0.0
    size = K.BF16 * c.tokens * b.hidden          # the full (unsharded) activation tensor
    n_sub = (1 if b.heads else 0) + (1 if (b.ffn_hidden or b.shared_ffn_hidden) else 0)
    if L.sp:
        one = collective_time("all_gather", size, c.tp, c.cluster) + \
            collective_time("reduce_scatter", size, c.tp, c.cluster)
    else:
        one = collective_time("all_reduce", size, c.tp, c.cluster)
    t = n_sub * one
    if b.is_moe and L.etp > 1:
        tok = c.tokens / L.tp * b.topk * L.etp * moe_load_factor(b, c)
        sz = K.BF16 * tok * b.hidden
        t += collective_time("all_gather", sz, c.etp, c.cluster) + \
            collective_time("reduce_scatter", sz, c.etp, c.cluster)
    return t


def _ep_comm(b: BlockProfile, c: Context) -> float:
    """All-to-all seconds for ONE forward pass (dispatch + combine); backward is the same."""
    if not b.is_moe or c.layout.ep == 1:
        return 0.0
    # the all-to-all ends when the busiest rank has received (dispatch) and sent back (combine) its rows
    tok = c.tokens / c.layout.tp * moe_load_factor(b, c)
    scale = 0.5 if c.fp8 else 1.0                # FP8 dispatch halves the dispatch payload
    if c.layout.moe_dispatcher == "deepep":
        per_token = K.BF16 * tok * b.hidden      # one copy of every local token
        gpus, domains = dedup_copies(b.experts, b.topk, c.ep)
        return dedup_all_to_all_time(per_token * gpus * scale, per_token * domains * scale, c.ep, c.cluster) + \
            dedup_all_to_all_time(per_token * gpus, per_token * domains, c.ep, c.cluster)
    size = b.topk * tok * b.hidden * K.BF16
    return collective_time("all_to_all", size * scale, c.ep, c.cluster) + \
        collective_time("all_to_all", size, c.ep, c.cluster)


def _ep_counts_comm(b: BlockProfile, c: Context) -> float:
    """Seconds of the all-to-all of tokens-per-expert counts the all-to-all dispatcher runs before
    the rows move (forward only: its sizes are known to the backward): each rank sends every EP
    peer its int64 count for each of that peer's experts (runtime/expert_parallel.py; Megatron-Core's
    MoEAlltoAllTokenDispatcher.preprocess). Latency-bound; a CPU host's rescheduling wait dominates."""
    if not b.is_moe or c.layout.ep == 1 or c.layout.moe_dispatcher == "deepep":
        return 0.0
    return collective_time("all_to_all", 8 * b.experts, c.ep, c.cluster)


def cp_comm_type(layout) -> str:
    """The layout's CP attention implementation (Layout.cp_comm_type; Megatron-Core --cp-comm-type,
    Transformer Engine's AttnFuncWithCPAndKVP2P / ...KVAllGather / ...QKVOA2A)."""
    return layout.cp_comm_type


def _cp_ring(b: BlockProfile, c: Context, t_attn_fwd: float, t_attn_bwd: float) -> tuple[float, float, float, float]:
    """Ring attention (Liu et al. 2023, arXiv 2310.01889; Megatron-Core cp_comm_type "p2p"): cp-1 steps,
    each sending one K/V chunk to the next rank while attention runs on the chunk in hand; with the
    load-balanced (zig-zag) split every step carries 1/cp of the rank's attention. A step's transfer
    is exposed only where it outlasts that step's attention; backward sends K/V and dK/dV."""
    L = c.layout
    kv = 2 * K.BF16 * c.tokens * b.kv_dim / L.tp          # one chunk's K and V
    step = p2p_time(kv, c.cluster, cross_domain=c.cp.domains > 1)
    steps = L.cp - 1
    if not c.cluster.gpu.comm_overlap:                   # the ring's transfers cannot hide behind compute
        t_attn_fwd = t_attn_bwd = 0.0
    fwd_exp = steps * max(0.0, step - t_attn_fwd / L.cp)
    bwd_exp = steps * max(0.0, 2 * step - t_attn_bwd / L.cp)
    return steps * step, fwd_exp, 2 * steps * step, bwd_exp


def _cp_all_gather(b: BlockProfile, c: Context) -> tuple[float, float, float, float]:
    """All-gather CP as Llama 3 ran it (Dubey et al. 2024, arXiv 2407.21783, §3.3.2): all-gather the
    full-sequence K and V, then attend with the local (load-balanced) Q chunk. The gather is not
    overlapped ("the all-gather communication latency is exposed in the critical path"), which is
    cheap with GQA: K/V are kv_heads/heads the size of Q. Backward reduce-scatters dK/dV (the
    gather's transpose), also exposed; the gathered K/V are kept for it (activation_bytes)."""
    kv_full = 2 * K.BF16 * c.tokens * c.layout.cp * b.kv_dim / c.layout.tp
    ag = collective_time("all_gather", kv_full, c.cp, c.cluster)
    rs = collective_time("reduce_scatter", kv_full, c.cp, c.cluster)
    return ag, ag, rs, rs


def _cp_a2a(b: BlockProfile, c: Context) -> tuple[float, float, float, float]:
    """Ulysses-style CP (Jacobs et al. 2023, arXiv 2309.14509; Megatron-Core cp_comm_type "a2a"): an
    all-to-all turns the sequence split of Q, K, V into a head split before attention and one turns
    the output back after it; backward runs the same four on the gradients. Each all-to-all sends the
    rank's local tensor, (cp-1)/cp of it off-GPU; none overlaps attention (it needs the whole input)."""
    t_local = c.tokens / c.layout.tp
    size = K.BF16 * t_local * (2 * b.q_dim + 2 * b.kv_dim)      # q + k + v in, attention output back
    t = collective_time("all_to_all", size, c.cp, c.cluster)
    return t, t, t, t


def cp_comm(b: BlockProfile, c: Context, t_attn_fwd: float, t_attn_bwd: float,
            kind: str | None = None) -> tuple[float, float, float, float]:
    """Context-parallel attention communication of one layer: (fwd total, fwd exposed, bwd total,
    bwd exposed) seconds. `kind` defaults to the layout's (cp_comm_type)."""
    if c.layout.cp == 1 or not b.heads:
        return 0.0, 0.0, 0.0, 0.0
    kind = kind or cp_comm_type(c.layout)
    if kind == "all_gather":
        return _cp_all_gather(b, c)
    if kind == "a2a":
        return _cp_a2a(b, c)
    return _cp_ring(b, c, t_attn_fwd, t_attn_bwd)


def cp_kv_gathered_bytes(b: BlockProfile, c: Context) -> float:
    """Activation bytes all-gather CP keeps beyond the local chunk: the other ranks' K and V."""
    if c.layout.cp == 1 or not b.heads or cp_comm_type(c.layout) != "all_gather":
        return 0.0
    return 2 * K.BF16 * c.tokens * (c.layout.cp - 1) * b.kv_dim / c.layout.tp


def attention_shape(b: BlockProfile, c: Context) -> AttnShape:
    """The flash-attention calls one GPU runs for one layer and micro-batch: mbs sequences x the
    query heads of this TP rank, split by the layout's CP implementation (attention.layer_calls)."""
    L = c.layout
    return layer_calls(c.seq_len, L.mbs * b.heads / L.tp, causal=b.causal, cp=L.cp, cp_kind=cp_comm_type(L))


def layer_cost(b: BlockProfile, c: Context, *, policy: str) -> LayerCost:
    L = c.layout
    g_fwd, g_wgrad = _gemms(b, c)
    attn_flops = attention_fwd_flops_per_token(b, c.seq_len) * c.tokens / L.tp
    if L.flash_attention:
        shape = attention_shape(b, c)
        a_fwd = attention_time(attn_flops, c.cluster, backward=False, kernel=L.attn_kernel, shape=shape)
        a_bwd = attention_time(attn_flops, c.cluster, backward=True, kernel=L.attn_kernel, shape=shape)
    else:
        # two batched GEMMs at matmul efficiency (no causal skipping) + memory-bound softmax passes
        full = 2 * attn_flops if b.causal else attn_flops
        score_bytes = K.EAGER_ATTN_BYTES_PER_SCORE * (b.heads / L.tp) * c.tokens * c.seq_len
        a_fwd = full / matmul_rate(c.cluster, False) + elementwise_time(score_bytes, c.cluster)
        a_bwd = 2 * a_fwd
    e_fwd = elementwise_time(_elementwise_bytes(b, c), c.cluster) + permute_time(_permute_bytes(b, c), c.cluster)
    o_fwd = o_bwd = K.LAYER_OVERHEAD_S
    if is_cpu(c.cluster) and b.ops:      # CPU processes: host dispatch + autograd cost of every traced op
        o_fwd, o_bwd = cpu_op_overhead(b.ops, c.cluster)
    compute_fwd = g_fwd + a_fwd + e_fwd + o_fwd
    compute_bwd = 2 * g_fwd + a_bwd + 2 * e_fwd + o_bwd   # dgrad + wgrad GEMMs

    tp_one = _tp_comm(b, c)
    tp_hidden = K.TP_OVERLAP_HIDDEN if L.tp_comm_overlap and c.cluster.gpu.comm_overlap else 0.0
    ep_one = _ep_comm(b, c)
    ep_fwd = ep_one + _ep_counts_comm(b, c)
    cp_f, cp_fx, cp_b, cp_bx = cp_comm(b, c, a_fwd, a_bwd)

    if policy == "full":
        recompute = compute_fwd + tp_one * (1 - tp_hidden) + ep_fwd + cp_fx
        rc_comm = {"tp": tp_one, "ep": ep_fwd, "cp": cp_f}
    elif policy == "selective":
        recompute = a_fwd
        rc_comm = {}
    elif policy == NORM_ACT:
        recompute = elementwise_time(_norm_act_bytes(b, c), c.cluster)
        rc_comm = {}
    else:
        recompute = 0.0
        rc_comm = {}
    comm = {"tp": 2 * tp_one + rc_comm.get("tp", 0.0),
            "ep": ep_fwd + ep_one + rc_comm.get("ep", 0.0),
            "cp": cp_f + cp_b + rc_comm.get("cp", 0.0)}
    exposed = {"tp": comm["tp"] * (1 - tp_hidden),
               "ep": comm["ep"],
               "cp": cp_fx + cp_bx + (cp_fx if policy == "full" else 0.0)}
    fwd = compute_fwd + tp_one * (1 - tp_hidden) + ep_fwd + cp_fx
    bwd = compute_bwd + tp_one * (1 - tp_hidden) + ep_one + cp_bx
    return LayerCost(fwd_s=fwd, bwd_s=bwd, recompute_s=recompute, wgrad_s=g_wgrad,
                     comm_s=comm, exposed_s=exposed,
                     compute_s=compute_fwd + compute_bwd + (compute_fwd if policy == "full" else
                                                            a_fwd if policy == "selective" else recompute))
