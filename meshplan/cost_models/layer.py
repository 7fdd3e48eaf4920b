"""Cost of one transformer layer for one micro-batch on one GPU: compute, per-dimension
communication (total and exposed), and stored activations.

The sharding pattern assumed here is Megatron's (column-parallel QKV/FC1, row-parallel out/FC2,
sequence-parallel norms, vocab-parallel embedding/output, experts over EP x ETP, ring attention
over CP); the planner's intra-block ILP rediscovers the same pattern for traced models.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.cost_models import constants as K
from meshplan.cost_models.comm import collective_time, dedup_all_to_all_time, dedup_copies
from meshplan.cost_models.compute import (
    attention_time,
    elementwise_time,
    gemm_time,
    grouped_gemm_time,
    matmul_rate,
    permute_time,
)
from meshplan.cost_models.device import device_of
from meshplan.cost_models.context import (
    COL_ROLES,
    LAYER_FUSIONS,
    ROW_ROLES,
    Context,
    _fp8_share,
    is_fp8_linear,
    unfused_of,
)
from meshplan.cost_models.cp import (attention_shape, cp_comm, cp_comm_type, cp_kv_gathered_bytes, cp_ring_work,
                                     runs_dense_band)
from meshplan.cost_models.flops import attention_fwd_flops_per_token
from meshplan.cost_models.moe_load import expected_max_std_normal, load_factor, moe_load_factor, routing_layout
from meshplan.ir.gpu_arch import gpu_generation, orders_kernels_by_queue
from meshplan.ir.profile import EXPERT_ROLES, MOE_ROLES, BlockProfile
from meshplan.kernels import fusion as FU  # pure Python, no torch

# re-exported: callers import the per-layer pieces from here
__all__ = ["Context", "LayerCost", "layer_cost", "gemm_shape", "activation_bytes", "unfused_of", "cp_comm", "cp_comm_type",
           "cp_kv_gathered_bytes", "attention_shape", "moe_load_factor", "moe_host_exposed", "routing_layout", "expected_max_std_normal",
           "NORM_ACT", "NORM_MOE", "MLA_UP", "OP_SAC", "is_fp8_linear", "LAYER_FUSIONS"]

_COL, _ROW = COL_ROLES, ROW_ROLES
# element-wise passes over h-wide bf16 tensors per layer forward: 2 norms (read x, write y) +
# 2 residual adds (read 2, write 1) = 10 (derived)
_NORM_RESIDUAL_PASSES = 10.0
# Recompute policies (see activation_bytes): Megatron-Core's --recompute-modules layernorm moe_act,
# layernorm moe and mla_up_proj mlp, torchtitan's op-level selective activation checkpointing
NORM_ACT, NORM_MOE, MLA_UP, OP_SAC = "norm_act", "norm_moe", "mla_up", "op_sac"


@dataclass(frozen=True)
class LayerCost:
    fwd_s: float             # forward compute + exposed comm
    bwd_s: float             # backward compute + exposed comm (no recompute)
    recompute_s: float       # forward work redone in backward under the layer's recompute policy
    wgrad_s: float           # the weight-gradient GEMMs inside bwd_s (zero-bubble schedules defer them)
    comm_s: dict             # dim -> total comm seconds (fwd + bwd [+ recompute])
    exposed_s: dict          # dim -> exposed comm seconds
    compute_s: float         # pure compute (fwd + bwd + recompute), no comm
    host_s: float = 0.0      # of compute_s: the GPU waiting on the host in a MoE layer (moe_host_exposed)


def activation_bytes(b: BlockProfile, c: Context, *, policy: str) -> float:
    """Bytes stored for backward by one layer for one micro-batch on one GPU.

    Generalised Korthikanti count (cost_models.md §4) from the traced geometry: per token,
    norm inputs and the two GEMM inputs that TP does not shard (8h, divided by tp under SP),
    Q/K/V and attention output (4h_q + 4h_kv), fp32 log-sum-exp (4 bytes/head), MLP
    intermediates (6f gated / 4f GELU), MoE copies; FP8 stores linear inputs in 1 byte.
    policy: "none" | "selective" (core attention recomputed, Korthikanti's; with Stack.selective_sac
    meshplan's op-level checkpointing, which also re-runs the norms, the activation and the output
    projection) | "full" |
    "norm_act" (Megatron-Core --recompute-granularity selective --recompute-modules layernorm moe_act:
    the two norms' outputs and the routed experts' activation outputs are recomputed, not stored) |
    "norm_moe" (--recompute-modules layernorm moe: the norms' outputs and everything inside the MoE
    layer are recomputed; only its input is kept) | "mla_up" (--recompute-modules mla_up_proj mlp:
    latent attention's Q, K, V are rebuilt from the saved latents before attention's backward and a
    dense MLP from its input; everything else is kept as with "none") | "op_sac" (torchtitan's
    op-level selective checkpointing: `_op_sac_bytes`).
    """
    L = c.layout
    tp, T = L.tp, c.tokens
    sp_div = tp if L.sp else 1
    h = b.hidden
    if policy == "full":
        return K.BF16 * h * T / sp_div           # only the layer input
    if policy == OP_SAC:
        return _op_sac_bytes(b, c)
    if b.heads and not L.flash_attention and policy != "selective":
        # materialised scores of the local heads (selective recompute exists to drop exactly these)
        scores = K.EAGER_ATTN_STORED_BYTES_PER_SCORE * (b.heads / tp) * T * c.seq_len
    else:
        scores = 0.0
    # FP8 (TE) stores the inputs of its FP8 GEMMs in 1 byte
    half = 0.5 if _fp8_share(b, c, COL_ROLES + ROW_ROLES) else 1.0
    half_e = 0.5 if _fp8_share(b, c, EXPERT_ROLES) else 1.0
    sac = policy == "selective" and c.stack.selective_sac    # Stack.selective_sac: norms re-run too
    norm_out = 0.0 if policy in (NORM_ACT, NORM_MOE) or sac else 2 * K.BF16 * h * half   # QKV-in, FC1/router-in
    rep = (2 * K.BF16 * h + norm_out) / sp_div    # + the two norm inputs
    if sac:
        rep += K.BF16 * h / sp_div                # the MLP's reduced output, kept as a collective's
    shard = 0.0
    if b.heads:
        # Q, K, V (k and v: h_kv each) and the flash kernel's saved output (heads x the value width);
        # mla_up rebuilds latent attention's Q, K, V in backward (Megatron's CheckpointWithoutOutput
        # frees them once attention's forward has run)
        qkv = 0 if policy == MLA_UP and b.latent_dim else b.q_dim + b.kv_dim + b.v_dim
        shard += K.BF16 * qkv
        # SAC re-runs the output projection; TE's FP8 Linear keeps its input in FP8; where the
        # projection's input is the kernel's saved output (Stack.attn_out_shared: SDPA's, not a CP
        # ring's, whose merged output is a fresh tensor the projection copies) it is counted below
        if not sac and not (c.stack.attn_out_shared and L.cp == 1 and policy != "selective"):
            shard += K.BF16 * b.o_dim * half
        if policy != "selective":       # the flash kernel's own saved output + LSE (selective re-runs it)
            shard += K.BF16 * b.o_dim + K.FP32 * b.heads
        # MLA: the down-projections' outputs and the normed latents, whole on every TP rank
        per_token_latent = 2 * K.BF16 * b.latent_dim
    else:
        per_token_latent = 0.0
    f_mult_store = 3 if b.gated else 2            # gated: gate, up, act-out; GELU: fc1-out, act-out
    if b.ffn_hidden and policy != MLA_UP:         # mla_up re-runs a dense MLP from its (kept) input
        f = b.ffn_hidden
        # the activation's output (FC2's input) is re-run only by SAC: Korthikanti's and Megatron-Core's
        # selective (recompute_modules core_attn) keep it
        store = K.BF16 * f * (f_mult_store - 1) + (0 if sac else K.BF16 * f * half)
        shard += store
    per_token = rep + shard / tp + per_token_latent
    if b.is_moe and policy != NORM_MOE:           # NORM_MOE keeps only the MoE layer's input (norm_out's)
        etp = L.etp
        fm = b.moe_ffn_hidden
        act_out = 0 if policy in ("selective", NORM_ACT) else K.BF16 * fm * half_e    # FC2's input
        moe = b.topk * (K.BF16 * h * half_e                                   # permuted expert inputs
                        + (K.BF16 * fm * (f_mult_store - 1) + act_out) / etp
                        + K.BF16 * h)                                        # expert outputs before combine
        moe += K.FP32 * b.experts * 2                                       # router logits + probs
        if b.shared_ffn_hidden:
            fs = b.shared_ffn_hidden
            moe += (K.BF16 * fs * (f_mult_store - 1) + K.BF16 * fs * half) / tp
        per_token += moe / sp_div                 # MoE tokens are the SP-sharded ones
    elif b.is_moe:
        per_token += K.BF16 * h / sp_div          # the MoE layer's input (its norm is recomputed)
    kept_kv = cp_kv_gathered_bytes(b, c) if policy != "selective" else 0.0
    return per_token * T + scores + kept_kv


def _op_sac_bytes(b: BlockProfile, c: Context) -> float:
    """Bytes one layer keeps under torchtitan's op-level selective activation checkpointing
    (torchtitan/distributed/activation_checkpoint.py, "op" mode): the saved ops are matmuls,
    scaled-dot-product attention (output and log-sum-exp) and reduce-scatters, except that every
    second matmul is recomputed instead; everything else (norms, rotary, activation functions,
    residual adds) is recomputed from those. So a layer keeps its input, about half of its matmul
    outputs (Q, K, V, the attention projection, the MLP's up/gate and down outputs, each h- or
    f-wide) and the attention output; the recomputed matmuls' inputs are outputs of saved ops."""
    L, T = c.layout, c.tokens
    tp, sp_div = L.tp, (L.tp if L.sp else 1)
    h = b.hidden
    kept = K.BF16 * h / sp_div                                   # the layer input
    mm_out = 0.0                                                 # per token, all matmul outputs
    if b.heads:
        mm_out += K.BF16 * (b.q_dim + b.kv_dim + b.v_dim) / tp + K.BF16 * h / sp_div + K.BF16 * b.latent_dim
        kept += (K.BF16 * b.o_dim + K.FP32 * b.heads) / tp      # attention output + log-sum-exp
    if b.ffn_hidden:
        mm_out += K.BF16 * b.ffn_hidden * (2 if b.gated else 1) / tp + K.BF16 * h / sp_div
    if b.is_moe:
        rows = b.topk * moe_load_factor(b, c) / sp_div
        mm_out += rows * K.BF16 * (b.moe_ffn_hidden * (2 if b.gated else 1) / L.etp + h)
        kept += K.FP32 * b.experts * 2 / sp_div                 # router logits + probs
    return (kept + mm_out / 2) * T


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
    if li.role == "attn_down":          # MLA's down-projections: whole weights on every token on each TP rank
        return T * li.tokens_per_token, n, k, float(li.count), li.params
    if li.is_expert:
        local = max(1.0, li.count / L.ep)                       # experts held by this GPU
        rows = (T / L.tp) * L.ep * L.etp * li.tokens_per_token   # tokens per local expert (balanced)
        rows *= load_factor(li.count, li.tokens_per_token * li.count, c)   # ... on the busiest EP rank
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
        fp8 = is_fp8_linear(li, c)
        rows, n, k, count, _ = gemm_shape(li, c)
        if li.role == "router":
            t = gemm_time(rows, n, k, c.cluster, fitted=c.fitted)
        elif li.is_expert:
            t = grouped_gemm_time(rows, n, k, c.cluster, groups=count, fp8=fp8, recipe=c.fp8_recipe, fitted=c.fitted)
        else:
            t = gemm_time(rows, n, k, c.cluster, fp8=fp8, count=li.count, recipe=c.fp8_recipe, stack=c.stack,
                          fitted=c.fitted)
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
    return sum(_ep_comm_parts(b, c))


def _ep_comm_parts(b: BlockProfile, c: Context) -> tuple[float, float]:
    """(dispatch, combine) all-to-all seconds of ONE forward pass."""
    if not b.is_moe or c.layout.ep == 1:
        return 0.0, 0.0
    # the all-to-all ends when the busiest rank has received (dispatch) and sent back (combine) its rows
    tok = c.tokens / c.layout.tp * moe_load_factor(b, c)
    # FP8 experts get their inputs dispatched in FP8: half the dispatch payload
    scale = 0.5 if _fp8_share(b, c, ("expert_in",)) else 1.0
    if c.layout.moe_dispatcher == "deepep":
        per_token = K.BF16 * tok * b.hidden      # one copy of every local token
        gpus, domains = dedup_copies(b.experts, b.topk, c.ep)
        return (dedup_all_to_all_time(per_token * gpus * scale, per_token * domains * scale, c.ep, c.cluster),
                dedup_all_to_all_time(per_token * gpus, per_token * domains, c.ep, c.cluster))
    size = b.topk * tok * b.hidden * K.BF16
    return (collective_time("all_to_all", size * scale, c.ep, c.cluster),
            collective_time("all_to_all", size, c.ep, c.cluster))


def _ep_counts_comm(b: BlockProfile, c: Context) -> float:
    """Seconds of the all-to-all of tokens-per-expert counts the all-to-all dispatcher runs before
    the rows move (forward only: its sizes are known to the backward): each rank sends every EP
    peer its int64 count for each of that peer's experts (runtime/expert_parallel.py; Megatron-Core's
    MoEAlltoAllTokenDispatcher.preprocess). Latency-bound; a CPU host's rescheduling wait dominates."""
    if not b.is_moe or c.layout.ep == 1 or c.layout.moe_dispatcher == "deepep":
        return 0.0
    return collective_time("all_to_all", 8 * b.experts, c.ep, c.cluster)


def _tp_hidden(c: Context) -> tuple[float, float]:
    """(forward, backward) fractions of the layer's TP communication hidden behind its GEMMs when
    the layout turns TP overlap on, by the stack's mechanism (a full recompute's forward as the
    forward). Megatron's userbuffers: TP_OVERLAP_HIDDEN (fitted) both ways. PyTorch's async TP
    (inductor's micro-pipeline TP pass: torchtitan, meshplan's runtime) splits each forward
    all-gather -> matmul (matmul -> reduce-scatter) into tp steps, each step's transfer under the
    previous step's matmul, so one of the tp transfers stays exposed (derived); the backward's
    transfers stayed exposed in the runs measured: Llama 3 70B ran ~20% faster forward and ~8% end
    to end with it (PyTorch dev-discuss, "Introducing Async Tensor Parallelism in PyTorch", 2024),
    torchtitan's 256-GPU table 829 -> 876 tokens/s (constants.ASYNC_TP_BWD_HIDDEN). None without
    overlap, or where compute and communication share cores, or where the TP group spans scale-up
    domains: both mechanisms reach the peers' memory directly (estimate_profile turns the flag off there)."""
    L = c.layout
    if not L.tp_comm_overlap or not c.cluster.gpu.comm_overlap or L.tp == 1 or c.tp.domains > 1:
        return 0.0, 0.0
    kind = c.stack.tp_overlap
    if kind == "userbuffers":
        if c.stack.runs_ep_overlap(L) and orders_kernels_by_queue(c.cluster.gpu.id):
            # the expert all-to-all overlap needs several hardware queues (Megatron-Bridge then sets
            # CUDA_DEVICE_MAX_CONNECTIONS=32, as meshplan's export does); with them the userbuffers
            # kernels lose the issue order their overlap needs before Blackwell (Stack.kernel_queues)
            return 0.0, 0.0
        return c.fitted.tp_overlap_hidden, c.fitted.tp_overlap_hidden
    if kind == "async_tp":
        return (L.tp - 1) / L.tp, K.ASYNC_TP_BWD_HIDDEN
    return 0.0, 0.0


def _moe_forward(b: BlockProfile, c: Context) -> float:
    """Forward seconds of the MoE part of a layer alone (router, experts, shared expert, token
    permutation, the activation): what --recompute-modules moe runs again in backward."""
    t = 0.0
    for li in b.linears:
        if li.role in MOE_ROLES:
            rows, n, k, count, _ = gemm_shape(li, c)
            fp8 = is_fp8_linear(li, c)
            if li.is_expert:
                t += grouped_gemm_time(rows, n, k, c.cluster, groups=count, fp8=fp8, recipe=c.fp8_recipe,
                                       fitted=c.fitted)
            else:
                t += gemm_time(rows, n, k, c.cluster, fp8=fp8, count=li.count, recipe=c.fp8_recipe, stack=c.stack,
                               fitted=c.fitted)
    L = c.layout
    act_passes = 3 if b.gated else 2
    tok = c.tokens / (L.tp if L.sp else 1) * moe_load_factor(b, c)
    nbytes = act_passes * K.BF16 * b.moe_ffn_hidden * b.topk * tok / L.etp
    return t + elementwise_time(nbytes, c.cluster) + permute_time(_permute_bytes(b, c), c.cluster)


def _mla_up_recompute(b: BlockProfile, c: Context) -> float:
    """Backward re-run under "mla_up": latent attention's up-projection GEMMs (Q, K, V from the
    latents) with their rotary embedding, and a dense MLP's forward (Megatron-Core's mla_up_proj and
    mlp recompute modules)."""
    t = 0.0
    mla = b.latent_dim > 0
    for li in b.linears:
        if (mla and li.role == "attn_qkv") or (b.ffn_hidden and li.role in ("mlp_in", "mlp_out")):
            rows, n, k, count, _ = gemm_shape(li, c)
            t += gemm_time(rows, n, k, c.cluster, fp8=is_fp8_linear(li, c), count=li.count, recipe=c.fp8_recipe,
                           stack=c.stack, fitted=c.fitted)
    L = c.layout
    nbytes = 0.0
    if mla:    # rotary on the rebuilt Q and K (read and write)
        nbytes += 2 * K.BF16 * (b.q_dim + b.kv_dim) * c.tokens / L.tp
    if b.ffn_hidden:    # the activation function (gated: read gate and up, write one)
        nbytes += (3 if b.gated else 2) * K.BF16 * b.ffn_hidden * c.tokens / L.tp
    return t + elementwise_time(nbytes, c.cluster)


def _ep_overlapped(c: Context, comm: float, compute: float) -> float:
    """Seconds of an expert all-to-all of `comm` seconds left exposed when it runs beside `compute`
    seconds of another micro-batch's work: while the transfer runs, compute has the SMs the
    communication kernels leave it (constants.EP_COMM_SMS), so the pair takes
    max(comm, compute + share x comm) instead of compute + comm."""
    if comm <= 0.0:
        return 0.0
    sms = K.SM_COUNT.get(gpu_generation(c.cluster.gpu.id), 0)
    share = K.EP_COMM_SMS / sms if sms else 0.0
    return max(comm, compute + share * comm) - compute


def _ep_pairs_exposed(b: BlockProfile, c: Context, compute_fwd: float, compute_bwd: float,
                      counts: float) -> float:
    """Exposed all-to-all seconds of one layer's forward + backward under Megatron-Core's 1F1B
    all-to-all overlap (Stack.runs_ep_overlap). The merged schedule runs one micro-batch's forward
    beside another's backward chunk by chunk, each transfer under one chunk of the other's compute
    (DeepSeek-V3 report §3.2.1, Fig. 4; Megatron-Core's combined_1f1b): the forward dispatch under the
    experts' backward, the backward's combine under the attention forward, the backward's dispatch
    under the experts' forward and the forward combine under the attention backward. A transfer
    longer than its chunk shows the rest."""
    disp, comb = _ep_comm_parts(b, c)
    moe_f = _moe_forward(b, c)
    moe_b = 2 * moe_f                              # dgrad + wgrad GEMMs of the same shapes
    attn_f, attn_b = max(0.0, compute_fwd - moe_f), max(0.0, compute_bwd - moe_b)
    return (_ep_overlapped(c, disp + counts, moe_b) + _ep_overlapped(c, comb, attn_f)
            + _ep_overlapped(c, disp, moe_f) + _ep_overlapped(c, comb, attn_b))


def moe_host_exposed(b: BlockProfile, c: Context) -> tuple[float, float]:
    """(forward, backward) seconds the GPU waits for the host in a MoE layer whose dispatch makes the
    host wait once per layer (Device.moe_host_wait). The EP overlap schedule does not hide it: the
    host issues both paired micro-batches' kernels, and the wait is on its path either way
    (Megatron-Bridge PR #5094's A/B on Qwen3-30B-A3B: the overlap took 24.71 s to 20.99 s, what hiding
    the all-to-all alone predicts; docs/cost_model.md)."""
    fp8 = any(is_fp8_linear(li, c) for li in b.linears if li.is_expert)
    return device_of(c.cluster).moe_host_wait(b, c.layout, c.stack, c.fp8_recipe if fp8 else None)


def _sac_extra_recompute(b: BlockProfile, c: Context) -> float:
    """What selective activation checkpointing over every op (Stack.selective_sac) re-runs beyond the
    attention core: the two norms and the attention output projection's GEMM (its input, the
    attention output, is not kept; the MLP's down projection lies past the last tensor backward
    needs, so it does not run again)."""
    t = 0.0
    for li in b.linears:
        if li.role == "attn_out":
            rows, n, k, count, _ = gemm_shape(li, c)
            t += gemm_time(rows, n, k, c.cluster, fp8=is_fp8_linear(li, c), count=li.count, recipe=c.fp8_recipe,
                           stack=c.stack, fitted=c.fitted)
    L = c.layout
    norms = 2 * 2 * K.BF16 * b.hidden * c.tokens / (L.tp if L.sp else 1)    # two norms: read, write
    return t + elementwise_time(norms, c.cluster)


def _op_sac_recompute(b: BlockProfile, c: Context, g_fwd: float, e_fwd: float) -> float:
    """Backward re-run of torchtitan's op-level SAC (see _op_sac_bytes): every second matmul and
    every element-wise op of the forward."""
    return g_fwd / 2 + e_fwd


def layer_cost(b: BlockProfile, c: Context, *, policy: str) -> LayerCost:
    L = c.layout
    g_fwd, g_wgrad = _gemms(b, c)
    attn_flops = attention_fwd_flops_per_token(b, c.seq_len) * c.tokens / L.tp
    dense_band = runs_dense_band(b, c)
    if dense_band or not (L.flash_attention and c.stack.attention != "eager"):
        # a masked or eager kernel computes the whole (s x s) score matrix, window or not (the eager
        # branch below doubles the causal count; a masked SDPA call is priced unmasked: attention_shape)
        attn_flops = attention_fwd_flops_per_token(replace(b, attn_window=0), c.seq_len,
                                                   causal_half=not dense_band) * c.tokens / L.tp
    if L.flash_attention and c.stack.attention != "eager":
        shape = attention_shape(b, c)
        a_fwd = attention_time(attn_flops, c.cluster, backward=False, kernel=c.attn_kernel, shape=shape, fitted=c.fitted)
        a_bwd = attention_time(attn_flops, c.cluster, backward=True, kernel=c.attn_kernel, shape=shape, fitted=c.fitted)
        if L.cp > 1 and b.heads:      # the CP implementation's merges and copies around the kernels
            m_f, m_b = cp_ring_work(b, c)
            a_fwd, a_bwd = a_fwd + m_f, a_bwd + m_b
    else:
        # two batched GEMMs at matmul efficiency (no causal skipping) + memory-bound softmax passes
        full = 2 * attn_flops if b.causal else attn_flops
        score_bytes = K.EAGER_ATTN_BYTES_PER_SCORE * (b.heads / L.tp) * c.tokens * c.seq_len
        a_fwd = full / matmul_rate(c.cluster, False, c.fitted) + elementwise_time(score_bytes, c.cluster)
        a_bwd = 2 * a_fwd
    e_fwd = elementwise_time(_elementwise_bytes(b, c), c.cluster) + permute_time(_permute_bytes(b, c), c.cluster)
    o_fwd, o_bwd = device_of(c.cluster).op_overhead(b.ops, c.cluster, c.fitted)
    compute_fwd = g_fwd + a_fwd + e_fwd + o_fwd
    compute_bwd = 2 * g_fwd + a_bwd + 2 * e_fwd + o_bwd   # dgrad + wgrad GEMMs
    h_fwd, h_bwd = moe_host_exposed(b, c)
    compute_fwd, compute_bwd = compute_fwd + h_fwd, compute_bwd + h_bwd

    tp_one = _tp_comm(b, c)
    tp_hf, tp_hb = _tp_hidden(c)
    ep_one = _ep_comm(b, c)
    ep_fwd = ep_one + _ep_counts_comm(b, c)
    cp_f, cp_fx, cp_b, cp_bx = cp_comm(b, c, a_fwd, a_bwd)

    if policy == "full":
        recompute = compute_fwd + tp_one * (1 - tp_hf) + ep_fwd + cp_fx
        rc_comm = {"tp": tp_one, "ep": ep_fwd, "cp": cp_f}
    elif policy == "selective":
        recompute = a_fwd + (_sac_extra_recompute(b, c) if c.stack.selective_sac else 0.0)
        rc_comm = {}
    elif policy == NORM_ACT:
        recompute = elementwise_time(_norm_act_bytes(b, c), c.cluster)
        rc_comm = {}
    elif policy == NORM_MOE:
        # the norms, and the MoE layer with its dispatch and combine all-to-alls
        norms = elementwise_time(2 * 2 * K.BF16 * b.hidden * c.tokens / (L.tp if L.sp else 1), c.cluster)
        moe = _moe_forward(b, c) + ep_fwd if b.is_moe else 0.0
        recompute = norms + moe
        rc_comm = {"ep": ep_fwd} if b.is_moe else {}
    elif policy == OP_SAC:
        recompute = _op_sac_recompute(b, c, g_fwd, e_fwd)
        rc_comm = {}
    elif policy == MLA_UP:
        recompute = _mla_up_recompute(b, c)
        rc_comm = {}
    else:
        recompute = 0.0
        rc_comm = {}
    comm = {"tp": 2 * tp_one + rc_comm.get("tp", 0.0),
            "ep": ep_fwd + ep_one + rc_comm.get("ep", 0.0),
            "cp": cp_f + cp_b + rc_comm.get("cp", 0.0)}
    rc_compute = recompute - rc_comm.get("ep", 0.0)    # norm_moe's recompute includes its all-to-alls
    ep_x = 1.0
    if comm["ep"] and policy != "full" and c.cluster.gpu.comm_overlap and c.stack.runs_ep_overlap(L):
        # the pairs' exposed share; a recompute's own all-to-alls (norm_moe) have no partner
        ep_x = _ep_pairs_exposed(b, c, compute_fwd, compute_bwd, ep_fwd - ep_one) / (ep_fwd + ep_one)
    exposed = {"tp": (tp_one + rc_comm.get("tp", 0.0)) * (1 - tp_hf) + tp_one * (1 - tp_hb),
               "ep": (ep_fwd + ep_one) * ep_x + rc_comm.get("ep", 0.0),
               "cp": cp_fx + cp_bx + (cp_fx if policy == "full" else 0.0)}
    fwd = compute_fwd + tp_one * (1 - tp_hf) + ep_fwd * ep_x + cp_fx
    bwd = compute_bwd + tp_one * (1 - tp_hb) + ep_one * ep_x + cp_bx
    return LayerCost(fwd_s=fwd, bwd_s=bwd, recompute_s=recompute, wgrad_s=g_wgrad,
                     comm_s=comm, exposed_s=exposed,
                     compute_s=compute_fwd + compute_bwd + (compute_fwd if policy == "full" else
                                                            recompute if policy == "selective" else
                                                            rc_compute),
                     host_s=h_fwd + h_bwd + (h_fwd if policy == "full" else 0.0))
