"""Compose per-layer costs into a training step: `estimate_profile(profile, cluster, layout, ...)`.

T_step = m * t_slowest_rank + bubble(schedule) + exposed PP p2p + exposed DP/FSDP
         + optimizer step + fixed step overhead                       (cost_models.md §9)
where t_rank is one micro-batch's forward + backward (+ recompute) over the rank's chunks,
including the exposed TP/CP/EP communication inside each layer.
"""

from __future__ import annotations

from typing import Any

from meshplan.cost_models import constants as K
from meshplan.cost_models.comm import collective_time, group, p2p_time
from meshplan.cost_models.compute import elementwise_time, fp8_weight_cast_time, gemm_time
from meshplan.cost_models.flops import model_flops_per_step, recompute_flops_per_step
from meshplan.cost_models.layer import Context, activation_bytes, layer_cost, unfused_of
from meshplan.ir.estimate import GB, PRECISIONS, TIME_KEYS, Estimate
from meshplan.ir.layout import Layout, check_layout
from meshplan.cost_models.memory import grad_bytes, optimizer_bytes, state_bytes, zero3_working_bytes
from meshplan.cost_models.pipeline import in_flight, pipeline_time
from meshplan.cost_models.uncertainty import regime_of, step_uncertainty
from meshplan.errors import ConfigError
from meshplan.ir.profile import ModelProfile

__all__ = ["estimate_profile", "clear_caches"]

# Logits on the last stage at the loss: the bf16 logits kept for backward + one fp32 buffer
# (softmax, reused for its gradient by fused cross-entropy kernels) (derived).
_LOGIT_BYTES = K.BF16 + K.FP32
_LAYER_CACHE: dict = {}
_LAYER_CACHE_MAX = 200_000


def embedding_time(profile: ModelProfile, cluster, tokens: float, sp_div: int) -> float:
    """Forward seconds of the embedding lookup (memory-bound write of the hidden state); backward is 2x."""
    return elementwise_time(2 * K.BF16 * profile.hidden * tokens / sp_div, cluster)


def fused_loss(profile: ModelProfile, tp: int) -> bool:
    """Whether the output layer + loss run as meshplan's fused linear + cross-entropy kernel: the
    runtime swaps it in when the tracer matched it and the head is not split over TP."""
    return tp == 1 and dict(profile.fusions).get("linear_cross_entropy", False)


def head_times(profile: ModelProfile, cluster, tokens: float, tp: int) -> tuple[float, float]:
    """(output-layer GEMM, cross-entropy) forward seconds; the output layer stays BF16 (standard FP8
    recipes). Backward is 2x the GEMM plus the same cross-entropy pass. Fused (fused_loss), the
    cross-entropy passes save meshplan.kernels.fusion's bytes over the eager ones."""
    g = gemm_time(tokens, profile.vocab / tp, profile.hidden, cluster)
    logits = tokens * profile.vocab / tp
    ce_bytes = 3 * _LOGIT_BYTES * logits
    if fused_loss(profile, tp):
        from meshplan.kernels.fusion import linear_cross_entropy_bytes_saved
        ce_bytes = max(ce_bytes - linear_cross_entropy_bytes_saved(tokens=tokens, vocab=profile.vocab) / 2,
                       0.0)
    return g, elementwise_time(ce_bytes, cluster)


def head_activation_bytes(profile: ModelProfile, tokens: float, tp: int) -> float:
    """Bytes the output layer + loss hold for backward on the last stage, per micro-batch."""
    if fused_loss(profile, tp):
        from meshplan.kernels.fusion import linear_cross_entropy_memory_bytes
        return linear_cross_entropy_memory_bytes(tokens=tokens, vocab=profile.vocab, hidden=profile.hidden)
    return _LOGIT_BYTES * tokens * profile.vocab / tp


_FLOPS_CACHE: dict = {}


def clear_caches() -> None:
    """Forget memoised layer costs: needed after changing a constant in `constants` (the fit does)."""
    _LAYER_CACHE.clear()
    _FLOPS_CACHE.clear()


def _model_flops(profile: ModelProfile, seq_len: int, global_batch: int) -> float:
    key = (profile.fingerprint, profile.name, seq_len, global_batch)
    if key not in _FLOPS_CACHE:
        if len(_FLOPS_CACHE) > 10_000:
            _FLOPS_CACHE.clear()
        _FLOPS_CACHE[key] = model_flops_per_step(profile, seq_len, global_batch)
    return _FLOPS_CACHE[key]


def _fp8_weight_elements(b, layout: Layout) -> float:
    """Weights of block `b` held by one GPU that run their GEMMs in FP8 (the router stays BF16)."""
    n = 0.0
    for li in b.linears:
        if li.role == "router":
            continue
        div = layout.ep * layout.etp if li.role in ("expert_in", "expert_out") else layout.tp
        n += li.in_features * li.out_features * li.count / div
    return n


def _zero3_units(layout: Layout, blocks) -> int:
    """Collectives per pass over a rank's parameters under ZeRO-3: one per block (FSDP, Megatron-FSDP)
    plus the root unit (embedding, head), or one per linear sub-module for DeepSpeed."""
    if layout.fsdp_impl == "deepspeed":
        return max(1, sum(li.count for b in blocks for li in b.linears) + 1)
    return len(blocks) + 1


def _fsdp_overlap(layout: Layout, cluster) -> float:
    """Overlap efficiency of ZeRO-3's per-micro-batch gathers and reduce-scatters. Megatron-FSDP
    issues them through the same bucketed asynchronous machinery as Megatron's distributed optimizer
    (--overlap-param-gather / --overlap-grad-reduce, double-buffered, zero-copy), so it shares that
    constant; PyTorch FSDP and DeepSpeed ZeRO-3 use the separately fitted FSDP constant."""
    if not cluster.gpu.comm_overlap:
        return 0.0
    return K.DP_OVERLAP_EFF if layout.fsdp_impl == "megatron" else K.FSDP_OVERLAP_EFF


def _policy_for(layout: Layout, index_in_rank: int) -> str:
    rc = layout.recompute
    if isinstance(rc, str):
        return rc
    return "full" if index_in_rank < rc else "none"


def estimate_profile(profile: ModelProfile, cluster, layout: Layout | dict, *, seq_len: int, global_batch: int,
                     precision: str = "bf16", fp8_modules: frozenset | None = None) -> Estimate:
    """Score one layout. Pure: (profile, cluster, layout, shapes) -> Estimate."""
    L = Layout.coerce(layout)
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r}: use one of {PRECISIONS}")
    fp8 = precision == "fp8"
    if fp8 and not cluster.gpu.fp8_tflops:
        raise ConfigError(f"{cluster.gpu.name} has no FP8 matrix units; use precision='bf16'")
    stage_layers = check_layout(L, profile, cluster, seq_len=seq_len, global_batch=global_batch)
    m = global_batch // (L.dp * L.mbs)
    unfused = unfused_of(profile)
    ctx = Context.build(cluster, L, seq_len, fp8, unfused)
    blocks = profile.layer_blocks()
    p, v = L.pp, L.vp
    T = ctx.tokens
    sp_div = L.tp if L.sp else 1

    # --- which layers each pipeline rank holds (virtual stage s lives on rank s % p) -------
    starts = [sum(stage_layers[:s]) for s in range(len(stage_layers))]
    rank_layers: list[list[int]] = [[] for _ in range(p)]
    for s, (st, n) in enumerate(zip(starts, stage_layers)):
        rank_layers[s % p].extend(range(st, st + n))

    # Which layers run their GEMMs in FP8: all of them under precision="fp8", unless an FP8 module
    # set is given (the FP8 placement ILP's choice), in which case a layer counts as FP8 when any of
    # its linears is in the set (layer granularity; the ILP excludes whole first/last blocks).
    layer_fp8 = [fp8] * profile.num_layers
    if fp8 and fp8_modules is not None:
        seen = {bi: 0 for bi in range(len(profile.blocks))}
        for i, bi in enumerate(profile.layers):
            inst = profile.blocks[bi].instances[seen[bi]] if profile.blocks[bi].instances else ""
            seen[bi] += 1
            layer_fp8[i] = any(m.startswith(inst + ".") for m in fp8_modules)
    ctxs = {True: ctx, False: ctx if not fp8 else Context.build(cluster, L, seq_len, False, unfused)}

    # A layer's cost depends only on its block and the layout fields the layer sees, so it is
    # shared across every candidate of a search that differs in pp / vp / dp / zero / schedule.
    ctx_key = (profile.fingerprint, cluster, L.tp, L.cp, L.ep, L.etp, L.mbs, L.sp, L.flash_attention, L.attn_kernel,
               L.tp_comm_overlap, L.moe_dispatcher, seq_len, unfused)

    local: dict[tuple, Any] = {}

    def cost(i: int, policy: str):
        lk = (profile.layers[i], policy, layer_fp8[i])
        hit = local.get(lk)
        if hit is None:
            key = (ctx_key, lk)
            hit = _LAYER_CACHE.get(key)
            if hit is None:
                if len(_LAYER_CACHE) > _LAYER_CACHE_MAX:
                    _LAYER_CACHE.clear()
                hit = _LAYER_CACHE[key] = layer_cost(blocks[i], ctxs[layer_fp8[i]], policy=policy)
            local[lk] = hit
        return hit

    act_local: dict[tuple, float] = {}

    def act_bytes(i: int, policy: str) -> float:
        lk = (profile.layers[i], policy, layer_fp8[i])
        if lk not in act_local:
            act_local[lk] = activation_bytes(blocks[i], ctxs[layer_fp8[i]], policy=policy)
        return act_local[lk]

    # --- per-rank time and memory ---------------------------------------------------------
    tp_g = ctx.tp
    rank_fb, rank_w, rank_parts, rank_cast = [], [], [], []
    emb_params = profile.embedding_params / L.tp
    head_params = (profile.head_params if profile.head_params else
                   (profile.embedding_params if profile.tied_embeddings and p > 1 else 0)) / L.tp
    for r in range(p):
        fwd = bwd = rcmp = wgrad = 0.0
        parts = {k: 0.0 for k in ("compute", "tp", "cp", "ep")}
        comm_layers = {k: 0.0 for k in ("tp", "cp", "ep")}
        act = 0.0
        largest_full = 0.0
        dense_params = expert_params = fp8_w = 0.0
        for j, i in enumerate(rank_layers[r]):
            b = blocks[i]
            pol = _policy_for(L, j)
            c = cost(i, pol)
            fwd += c.fwd_s
            bwd += c.bwd_s
            rcmp += c.recompute_s
            wgrad += c.wgrad_s
            parts["compute"] += c.compute_s
            for k in ("tp", "cp", "ep"):
                parts[k] += c.exposed_s[k]
                comm_layers[k] += c.comm_s[k]
            act += act_bytes(i, pol)
            if pol == "full":
                largest_full = max(largest_full, act_bytes(i, "none"))
            dense_params += (b.params - b.expert_params) / L.tp
            expert_params += b.expert_params / (L.ep * L.etp)
            if layer_fp8[i]:
                fp8_w += _fp8_weight_elements(b, L)
        # embedding on rank 0, final norm + output layer + loss on the last rank
        extra_f = extra_b = extra_tp = 0.0
        if r == 0:
            e = embedding_time(profile, cluster, T, sp_div)
            extra_f += e
            extra_b += 2 * e
            dense_params += emb_params
        if r == p - 1:
            g, ce = head_times(profile, cluster, T, L.tp)
            extra_f += g + ce
            extra_b += 2 * g + ce
            wgrad += g
            dense_params += head_params + profile.other_params / L.tp
            if L.tp > 1:   # gather the sequence-parallel hidden state before the output layer
                size = K.BF16 * T * profile.hidden
                t_tp = collective_time("all_gather" if L.sp else "all_reduce", size, tp_g, cluster)
                extra_tp = 2 * t_tp
                parts["tp"] += extra_tp
                comm_layers["tp"] += extra_tp
        parts["compute"] += extra_f + extra_b
        extra_f += extra_tp / 2
        extra_b += extra_tp / 2
        fb = fwd + bwd + rcmp + extra_f + extra_b
        rank_fb.append(fb)
        rank_w.append(wgrad)
        rank_cast.append(fp8_weight_cast_time(fp8_w, cluster))
        rank_parts.append((parts, comm_layers, fwd + extra_f, bwd + rcmp + extra_b, dense_params, expert_params,
                           act, largest_full))

    # --- pipeline -------------------------------------------------------------------------
    busy, bubble = pipeline_time(L.schedule, m, v, rank_fb, rank_w)
    slow = max(range(p), key=lambda r: rank_fb[r])
    parts_slow, comm_slow = rank_parts[slow][0], rank_parts[slow][1]
    pp_exposed = pp_total = 0.0
    if p > 1:
        size = K.BF16 * T * profile.hidden / sp_div
        cross = group(cluster, p, L.tp * L.cp * L.dp).domains > 1   # neighbouring stages in other domains
        hop = p2p_time(size, cluster, cross_domain=cross)
        pp_total = 2 * m * v * hop                     # each micro-batch crosses every boundary fwd and bwd
        pp_exposed = 2 * (p * v - 1) * hop             # fill and drain put the hops on the critical path
        pp_total = max(pp_total, pp_exposed)            # with m < p the fill/drain hops are all there is

    # --- data parallel / FSDP -------------------------------------------------------------
    shard = L.shard
    dp_group = group(cluster, max(1, shard), L.tp)               # the group parameters are sharded over
    rep_group = group(cluster, L.dp * L.cp // max(1, shard), L.tp * max(1, shard))   # HSDP replicas
    edp_group = group(cluster, L.edp, L.ep * L.etp)
    dp_exposed_max = dp_total_max = opt_max = 0.0
    gb = grad_bytes(L)
    for r in range(p):
        parts, _, t_f, t_b, dparams, eparams, _, _ = rank_parts[r]
        ag = collective_time("all_gather", K.PARAM_BYTES * dparams, dp_group, cluster) + \
            collective_time("all_gather", K.PARAM_BYTES * eparams, edp_group, cluster)
        rs = collective_time("reduce_scatter", gb * dparams, dp_group, cluster) + \
            collective_time("reduce_scatter", gb * eparams, edp_group, cluster)
        eta = K.DP_OVERLAP_EFF if cluster.gpu.comm_overlap else 0.0
        if L.zero == 0:
            dp_full = group(cluster, L.dp * L.cp, L.tp)
            ar = collective_time("all_reduce", gb * dparams, dp_full, cluster) + \
                collective_time("all_reduce", gb * eparams, edp_group, cluster)
            total, exposed = ar, max(0.0, ar - eta * t_b)
        elif L.zero in (1, 2):
            total = ag + rs
            exposed = max(0.0, rs - eta * t_b) + max(0.0, ag - eta * t_f)
        else:   # FSDP: gather for forward (and again for backward when resharded), reduce-scatter,
            #      every micro-batch; HSDP adds one all-reduce of the gradient shards across replicas.
            # ZeRO-3 issues one collective per gathering unit (a block, or a sub-module for DeepSpeed),
            # so each pays its own latency: ring all-gather / reduce-scatter take n-1 steps, which
            # dominates at thousands of ranks (SC'21 Table 2's ZeRO-3 throughput falling with N).
            units = _zero3_units(L, [blocks[i] for i in rank_layers[r]])
            ag = units * (collective_time("all_gather", K.PARAM_BYTES * dparams / units, dp_group, cluster) +
                          collective_time("all_gather", K.PARAM_BYTES * eparams / units, edp_group, cluster))
            rs = units * (collective_time("reduce_scatter", gb * dparams / units, dp_group, cluster) +
                          collective_time("reduce_scatter", gb * eparams / units, edp_group, cluster))
            eta = _fsdp_overlap(L, cluster)
            n_ag = 2 if L.reshard_after_forward else 1
            n_layers = max(1, len(rank_layers[r]))
            per_mb = max(0.0, ag - eta * t_f) + max(0.0, (n_ag - 1) * ag + rs - eta * t_b) + 2 * ag / n_layers
            per_mb = min(per_mb, n_ag * ag + rs)       # never more than all of it exposed
            rep = collective_time("all_reduce", gb * dparams / max(1, shard), rep_group, cluster)
            total, exposed = m * (n_ag * ag + rs) + rep, m * per_mb + max(0.0, rep - eta * t_b)
        shard_d = shard
        shard_e = L.edp if L.zero >= 1 else 1
        opt = K.OPTIMIZER_STEP_BYTES * (dparams / shard_d + eparams / shard_e) / \
            (cluster.gpu.hbm_tb_s * 1e12 * K.HBM_EFF)
        dp_exposed_max = max(dp_exposed_max, exposed)
        dp_total_max = max(dp_total_max, total)
        opt_max = max(opt_max, opt)

    # --- memory per pipeline rank ---------------------------------------------------------
    mem_stages: list[dict[str, float]] = []
    for r in range(p):
        _, _, _, _, dparams, eparams, act, largest_full = rank_parts[r]
        ob = optimizer_bytes(L)        # fp32 master + Adam moments in L.optimizer_dtype
        sd = state_bytes(dparams, shard, L.zero, grad_bytes=gb, optimizer_bytes=ob)
        se = state_bytes(eparams, L.edp, L.zero, grad_bytes=gb, optimizer_bytes=ob)
        mem = {k: sd[k] + se[k] for k in sd}
        if L.zero >= 3 and shard > 1 and not L.reshard_after_forward:
            # weights gathered in forward stay until their backward: all of them at the peak
            mem["weights"] = K.PARAM_BYTES * (dparams + eparams)
        elif L.zero >= 3 and shard > 1 and rank_layers[r]:   # gathered layers exist only when sharded
            w, g = zero3_working_bytes(L, [blocks[i] for i in rank_layers[r]], gb)
            mem["weights"] += w
            mem["gradients"] += g
        activ = act * in_flight(L.schedule, m, p, v, r) + largest_full
        if r == 0:
            activ += K.BF16 * profile.hidden * T / sp_div * in_flight(L.schedule, m, p, v, r)
        if r == p - 1:
            activ += head_activation_bytes(profile, T, L.tp)
        mem["activations"] = activ
        mem["fp8_cache"] = K.FP8_WEIGHT_CACHE_BYTES * (dparams + eparams) if fp8 else 0.0
        mem_stages.append({k: val / GB for k, val in mem.items()})
    totals = [sum(s.values()) for s in mem_stages]
    peak_stage = max(range(p), key=lambda r: totals[r])
    peak = totals[peak_stage]
    capacity = cluster.usable_memory_gb

    # --- assemble -------------------------------------------------------------------------
    # FP8 weights are quantised once per step (first micro-batch), not per micro-batch
    step = busy + bubble + pp_exposed + dp_exposed_max + opt_max + max(rank_cast) + K.STEP_OVERHEAD_S
    time_s = {"compute": m * parts_slow["compute"],
              "tp": m * parts_slow["tp"], "cp": m * parts_slow["cp"], "ep": m * parts_slow["ep"],
              "pp": pp_exposed, "dp": dp_exposed_max, "bubble": bubble,
              "optimizer": opt_max, "overhead": K.STEP_OVERHEAD_S}
    # the busy time also includes layer overheads folded into compute; keep the split summing to the step
    time_s["compute"] += step - sum(time_s.values())
    comm_s = {"tp": m * comm_slow["tp"], "cp": m * comm_slow["cp"], "ep": m * comm_slow["ep"],
              "pp": pp_total, "dp": dp_total_max}
    n = cluster.num_gpus
    tokens = float(seq_len) * global_batch
    mflops = _model_flops(profile, seq_len, global_batch)
    hflops = mflops + recompute_flops_per_step(profile, seq_len, global_batch, L)
    peak_flops = cluster.gpu.bf16_tflops * 1e12
    model_tflops = mflops / step / n / 1e12
    hw_tflops = hflops / step / n / 1e12
    bottleneck = _bottleneck(time_s, step, peak, capacity)
    ep_cross = L.ep > 1 and group(cluster, L.ep, L.etp).domains > 1
    regime = regime_of(L.to_dict(), seq_len=seq_len, precision=precision, ep_cross_domain=ep_cross)
    band, band_s = step_uncertainty(time_s, regime)
    return Estimate(
        step_time_s=step, tokens_per_s_per_gpu=tokens / step / n,
        model_tflops_per_gpu=model_tflops, hardware_tflops_per_gpu=hw_tflops,
        mfu=model_tflops * 1e12 / peak_flops, hfu=hw_tflops * 1e12 / peak_flops,
        peak_memory_gb=peak, memory_gb=dict(mem_stages[peak_stage]), memory_by_stage=tuple(mem_stages),
        capacity_gb=capacity, fits=peak <= capacity, time_s=time_s, comm_s=comm_s,
        num_microbatches=m, peak_stage=peak_stage, layout=L.to_dict(), seq_len=seq_len,
        global_batch=global_batch, precision=precision, model=profile.name, cluster=cluster.name,
        num_gpus=n, bottleneck=bottleneck, uncertainty=band, uncertainty_s=band_s, regime=regime)


def _bottleneck(time_s: dict[str, float], step: float, peak: float, capacity: float) -> str:
    if peak > capacity:
        return f"memory: needs {peak:.1f} GB per GPU, {capacity:.1f} GB available"
    worst = max((k for k in time_s if k not in ("compute", "overhead")), key=lambda k: time_s[k])
    share = time_s[worst] / step
    if share < 0.05:
        return f"compute-bound ({time_s['compute'] / step * 100:.0f}% of the step is compute)"
    names = {"tp": "exposed tensor-parallel communication", "cp": "exposed context-parallel communication",
             "ep": "expert all-to-all", "pp": "pipeline p2p", "dp": "exposed data-parallel communication",
             "bubble": "pipeline bubble", "optimizer": "optimizer step"}
    return f"{names[worst]} ({share * 100:.0f}% of the step)"
