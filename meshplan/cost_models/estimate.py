"""Compose per-layer costs into a training step: `estimate_profile(profile, cluster, layout, ...)`.

T_step = m * t_slowest_rank + bubble(schedule) + exposed PP p2p + exposed DP/FSDP
         + optimizer step + fixed step overhead                       (cost_models.md §9)
where t_rank is one micro-batch's forward + backward (+ recompute) over the rank's chunks,
including the exposed TP/CP/EP communication inside each layer (meshplan.cost_models.ranks).
"""

from __future__ import annotations


from meshplan.cost_models import constants as K
from meshplan.cost_models.comm import collective_time, group
from meshplan.cost_models.compute import fp8_recipe_factor
from meshplan.cost_models.device import device_of
from meshplan.cost_models.flops import model_flops_per_step, recompute_flops_per_step
from meshplan.cost_models.layer import Context
from meshplan.cost_models.memory import (
    adam_bytes,
    autocast_runs,
    fp8_cache_bytes,
    fp8_copies_held,
    deepep_buffer_bytes,
    grad_bytes,
    grad_store_bytes,
    optimizer_bytes,
    peak_gradient_bytes,
    state_bytes,
    weight_copy_bytes,
    zero3_working_bytes,
)
from meshplan.cost_models.muon import muon_rank_memory, muon_rank_time
from meshplan.cost_models.offload import (
    HOST_CATEGORY,
    frees_device_memory,
    host_capacity_gb,
    offload_memory,
    offload_ranks,
)
from meshplan.cost_models.pipeline import ep_unpaired_steps, in_flight, pipeline_time
from meshplan.cost_models.ranks import (
    RankWork,
    clear_layer_cache,
    embedding_time,
    fused_loss,
    head_activation_bytes,
    head_times,
    rank_layers,
    rank_work,
)
from meshplan.cost_models.roofline import matmul_rate
from meshplan.cost_models.tables import layer_table, pipeline_p2p_s, stack_unfused
from meshplan.cost_models.uncertainty import (extrapolation, imbalance_risk, memory_pressure, moe_host_risk,
                                              plan_regimes, regime_of, step_uncertainty)
from meshplan.errors import ConfigError
from meshplan.ir.estimate import GB, PRECISIONS, TIME_KEYS, Estimate
from meshplan.ir.layout import Layout, check_layout
from meshplan.ir.precision import Precision
from meshplan.ir.profile import ModelProfile
from meshplan.ir.stack import Stack, resolve_stack

# layer_table and stack_unfused are the planner's tables (cost_models/tables.py), named here too
__all__ = ["estimate_profile", "layer_table", "stack_unfused", "clear_caches"]
# re-exported for callers that imported them from here before they moved to ranks.py
_REEXPORTED = (embedding_time, fused_loss, head_times, head_activation_bytes, TIME_KEYS)

_FLOPS_CACHE: dict = {}


def clear_caches() -> None:
    """Forget memoised layer costs: needed after changing a constant in `constants` (the fit does)."""
    clear_layer_cache()
    _FLOPS_CACHE.clear()


def _model_flops(profile: ModelProfile, seq_len: int, global_batch: int) -> float:
    key = (profile.fingerprint, profile.name, seq_len, global_batch)
    if key not in _FLOPS_CACHE:
        if len(_FLOPS_CACHE) > 10_000:
            _FLOPS_CACHE.clear()
        _FLOPS_CACHE[key] = model_flops_per_step(profile, seq_len, global_batch)
    return _FLOPS_CACHE[key]


def _zero3_units(layout: Layout, blocks) -> int:
    """Collectives per pass over a rank's parameters under ZeRO-3: one per block (FSDP, Megatron-FSDP)
    plus the root unit (embedding, head), or one per linear sub-module for DeepSpeed."""
    if layout.fsdp_impl == "deepspeed":
        return max(1, sum(li.count for b in blocks for li in b.linears) + 1)
    return len(blocks) + 1


def _fsdp_overlap(layout: Layout, cluster, fitted: K.Fitted = K.FITTED) -> float:
    """Overlap efficiency of ZeRO-3's per-micro-batch gathers and reduce-scatters. Megatron-FSDP
    issues them through the same bucketed asynchronous machinery as Megatron's distributed optimizer
    (--overlap-param-gather / --overlap-grad-reduce, double-buffered, zero-copy), so it shares that
    constant; PyTorch FSDP and DeepSpeed ZeRO-3 use the separately fitted FSDP constant."""
    if not cluster.gpu.comm_overlap:
        return 0.0
    return fitted.dp_overlap_eff if layout.fsdp_impl == "megatron" else fitted.fsdp_overlap_eff


class _DPGroups:
    """The process groups DP / ZeRO collectives run over."""

    def __init__(self, cluster, L: Layout):
        self.shard = L.shard
        self.dp = group(cluster, max(1, self.shard), L.tp)                     # parameters sharded over
        self.rep = group(cluster, L.dp * L.cp // max(1, self.shard), L.tp * max(1, self.shard))   # HSDP
        self.edp = group(cluster, L.edp, L.ep * L.etp)
        self.full = group(cluster, L.dp * L.cp, L.tp)                          # plain DDP all-reduce


def _collective_pair(kind: str, nbytes_d: float, nbytes_e: float, g: _DPGroups, cluster, dense_group=None) -> float:
    return collective_time(kind, nbytes_d, dense_group or g.dp, cluster) + collective_time(kind, nbytes_e, g.edp, cluster)


def _gather_bytes(w: RankWork) -> float:
    """Bytes of the dense weights one ZeRO-3 all-gather of the rank's layers brings: BF16, but 1 byte
    per element for those torchao hands FSDP2 in FP8 (w.fp8_gathered: fsdp_utils.py
    fsdp_pre_all_gather returns the shard's FP8 data, its scale travels as metadata)."""
    return K.PARAM_BYTES * (w.dparams - w.fp8_gathered) + K.FP8 * w.fp8_gathered


def fsdp_predivide_factor(world: int) -> int:
    """The factor FSDP1 divides each unsharded gradient by before its reduce-scatter (by the rest of
    the world size after it), grown as torch/distributed/fsdp/_init_utils.py
    `_get_gradient_predivide_factor` grows it: doubled while the world size divides by it and the
    quotient exceeds it (8 -> 4, 64 -> 8, 3 -> 2): above 1, a pass, for every group of two or more."""
    f = 1
    while world % f == 0 and world / f > f:
        f *= 2
    return f


def fsdp_passes(w: RankWork, L: Layout, cluster, gb: float, passes: str, shard: int) -> tuple[float, float]:
    """(per all-gather, per reduce-scatter) seconds of the element-wise passes PyTorch FSDP runs
    around its collectives on the GPU (Stack.fsdp_passes), HBM-bound; counted as exposed, as the
    passes hold the GPU whichever stream issues them. Megatron-FSDP's buffers are the parameters
    themselves and DeepSpeed's ZeRO-3 is not modelled in this detail: none for "none".
      - "fsdp2" (torch/distributed/fsdp/_fully_shard): FSDPParamGroup.wait_for_unshard runs
        foreach_all_gather_copy_out, split_with_sizes_copy from the gathered buffer into the
        unsharded parameters, on the compute stream; foreach_reduce runs
        foreach_reduce_scatter_copy_in, chunk_cat of the unsharded gradients into the
        reduce-scatter buffer in the reduce dtype: the gathered bytes read and written once, the
        gradients read in the parameters' compute dtype and written in the reduce dtype. It divides
        by the world size inside the collective (ReduceOp.AVG / premul-sum).
      - "fsdp1" (torch/distributed/fsdp/_runtime_utils.py): the all-gather lands in the flat
        parameter, whose views the forward uses (no copy). Backward: autograd builds the flat
        parameter's gradient from its views' gradients (split_with_sizes' backward concatenates
        them: bf16 read and written), `_post_backward_hook` casts it to the reduce dtype
        (`flat_param.grad.to(handle._reduce_dtype)`) and `_reduce_grad` divides it in place by the
        pre-divide factor (`_div_if_needed`) before reduce-scattering it. The post-divide and the
        accumulation run on the 1/shard gradient shard and are left out."""
    if passes == "none" or L.fsdp_impl != "fsdp2":
        return 0.0, 0.0
    dev = device_of(cluster)
    n = w.dparams + w.eparams
    if passes == "fsdp1":
        grads = 2 * K.PARAM_BYTES * n                                     # the views' gradients concatenated
        if gb != K.PARAM_BYTES:
            grads += (K.PARAM_BYTES + gb) * n                             # cast to the reduce dtype
        if fsdp_predivide_factor(shard) > 1:
            grads += 2 * gb * n                                           # divided in place
        return 0.0, dev.fsdp_copy_time(grads, cluster)
    gathered = _gather_bytes(w) + K.PARAM_BYTES * w.eparams
    return (dev.fsdp_copy_time(2 * gathered, cluster),
            dev.fsdp_copy_time((K.PARAM_BYTES + gb) * n, cluster))


def _zero3_pp_deferred(w: RankWork, blocks, L: Layout, g: _DPGroups, cluster, m: int, gb: float,
                       fitted: K.Fitted = K.FITTED, passes: str = "none") -> tuple[float, float]:
    """FSDP2 under torch.distributed.pipelining (Stack.pp_fsdp_deferred): a micro-batch's backward
    neither reshards nor reduces, and one reduce-scatter follows the stage's last micro-batch.
    Weights kept gathered after forward (reshard_after_forward=False, torchtitan's default with PP)
    are gathered once a step; resharded after each forward they are gathered for each micro-batch's
    forward and again for its backward. The step-end reduce-scatter has no backward left to hide
    behind; the gathers are prefetched ahead of each forward / backward as without PP."""
    units = _zero3_units(L, [blocks[i] for i in w.layers])
    ag = units * _collective_pair("all_gather", _gather_bytes(w) / units, K.PARAM_BYTES * w.eparams / units,
                                  g, cluster)
    rs = units * _collective_pair("reduce_scatter", gb * w.dparams / units, gb * w.eparams / units, g, cluster)
    eta = _fsdp_overlap(L, cluster, fitted)
    gathers = 2 * m if L.reshard_after_forward else 1
    n_layers = max(1, len(w.layers))
    exposed = gathers * (max(0.0, ag - eta * min(w.t_f, w.t_b)) + ag / n_layers) + rs
    rep = collective_time("all_reduce", gb * w.dparams / max(1, g.shard), g.rep, cluster)
    copy_ag, copy_rs = fsdp_passes(w, L, cluster, gb, passes, g.shard)
    return gathers * ag + rs + rep, min(exposed, gathers * ag + rs) + rep + gathers * copy_ag + copy_rs


def _zero3_comm(w: RankWork, blocks, L: Layout, g: _DPGroups, cluster, m: int, gb: float,
                fitted: K.Fitted = K.FITTED, passes: str = "none") -> tuple[float, float]:
    """FSDP: gather for forward (and again for backward when resharded), reduce-scatter, every
    micro-batch; HSDP adds one all-reduce of the gradient shards across replicas. ZeRO-3 issues one
    collective per gathering unit (a block, or a sub-module for DeepSpeed), so each pays its own
    latency: ring all-gather / reduce-scatter take n-1 steps, which dominates at thousands of ranks
    (SC'21 Table 2's ZeRO-3 throughput falling with N)."""
    units = _zero3_units(L, [blocks[i] for i in w.layers])
    ag = units * _collective_pair("all_gather", _gather_bytes(w) / units, K.PARAM_BYTES * w.eparams / units,
                                  g, cluster)
    rs = units * _collective_pair("reduce_scatter", gb * w.dparams / units, gb * w.eparams / units, g, cluster)
    eta = _fsdp_overlap(L, cluster, fitted)
    n_ag = 2 if L.reshard_after_forward else 1
    n_layers = max(1, len(w.layers))
    per_mb = max(0.0, ag - eta * w.t_f) + max(0.0, (n_ag - 1) * ag + rs - eta * w.t_b) + 2 * ag / n_layers
    per_mb = min(per_mb, n_ag * ag + rs)       # never more than all of it exposed
    rep = collective_time("all_reduce", gb * w.dparams / max(1, g.shard), g.rep, cluster)
    copy_ag, copy_rs = fsdp_passes(w, L, cluster, gb, passes, g.shard)
    return m * (n_ag * ag + rs) + rep, m * (per_mb + n_ag * copy_ag + copy_rs) + max(0.0, rep - eta * w.t_b)


def _dp_comm(w: RankWork, blocks, L: Layout, g: _DPGroups, cluster, m: int,
             pp_deferred: bool = False, fitted: K.Fitted = K.FITTED, passes: str = "none",
             overlap: bool = True) -> tuple[float, float]:
    """(total, exposed) seconds of data-parallel communication per step on one pipeline rank; with
    `overlap` False (Stack.dp_overlap) the gradient reduction and ZeRO-1/2's gathers wait for the
    pipeline to drain and hide behind nothing."""
    gb = grad_bytes(L)
    eta = fitted.dp_overlap_eff if cluster.gpu.comm_overlap and overlap else 0.0
    if L.zero == 0:
        ar = _collective_pair("all_reduce", gb * w.dparams, gb * w.eparams, g, cluster, dense_group=g.full)
        return ar, max(0.0, ar - eta * w.t_b)
    if L.zero in (1, 2):
        # the units whose experts are gathered and reduce-scattered apart, each paying its latency
        units_e = device_of(cluster).expert_fsdp_units(sum(1 for i in w.layers if blocks[i].is_moe), L)
        ag = collective_time("all_gather", K.PARAM_BYTES * w.dparams, g.dp, cluster) + \
            units_e * collective_time("all_gather", K.PARAM_BYTES * w.eparams / max(1, units_e), g.edp, cluster)
        rs = collective_time("reduce_scatter", gb * w.dparams, g.dp, cluster) + \
            units_e * collective_time("reduce_scatter", gb * w.eparams / max(1, units_e), g.edp, cluster)
        return ag + rs, max(0.0, rs - eta * w.t_b) + max(0.0, ag - eta * w.t_f)
    if pp_deferred and L.pp > 1:
        return _zero3_pp_deferred(w, blocks, L, g, cluster, m, gb, fitted, passes)
    return _zero3_comm(w, blocks, L, g, cluster, m, gb, fitted, passes)


def _optimizer_time(w: RankWork, L: Layout, cluster) -> float:
    """Adam step over the rank's optimizer shard: OPTIMIZER_STEP_BYTES of HBM traffic per parameter."""
    shard_e = L.edp if L.zero >= 1 else 1
    return K.OPTIMIZER_STEP_BYTES * (w.dparams / L.shard + w.eparams / shard_e) / \
        (cluster.gpu.hbm_tb_s * 1e12 * K.HBM_EFF)


def _with_muon(dp: list[tuple[float, float]], ranks: list[RankWork], profile: ModelProfile, L: Layout, cluster,
               g: _DPGroups, opt_max: float) -> tuple[list[tuple[float, float]], float]:
    """Each rank's (total, exposed) DP seconds plus Muon's exchanges (the update's partly hidden
    by the next forward); the optimizer time plus the slowest rank's Newton-Schulz (cost_models/muon.py)."""
    dense = group(cluster, L.tp * max(1, L.shard), 1)       # tp fastest, then the optimizer's dp shard
    ns_max = 0.0
    out = []
    for r, (w, (total, exposed)) in enumerate(zip(ranks, dp)):
        comm, shown, ns = muon_rank_time(w, r, profile, L, cluster, dense_group=dense, expert_group=g.edp,
                                         matmul_flops_s=matmul_rate(cluster, False))
        out.append((total + comm, exposed + shown))
        ns_max = max(ns_max, ns)
    return out, opt_max + ns_max


def _activation_bytes(w: RankWork, r: int, profile: ModelProfile, L: Layout, m: int, tokens: float) -> float:
    """Activation bytes pipeline rank r holds at its peak: its micro-batches in flight."""
    p = L.pp
    held = in_flight(L.schedule, m, p, L.vp, r)
    activ = w.act * held + w.largest_full
    if r == 0:
        activ += K.BF16 * profile.hidden * tokens / (L.tp if L.sp else 1) * held
    if r == p - 1:
        activ += head_activation_bytes(profile, tokens, L.tp)
    return activ


def _state_memory(w: RankWork, blocks, L: Layout, pp_deferred: bool = False, grad_store: float | None = None,
                  stack: Stack | None = None) -> dict[str, float]:
    """Bytes by category of what a pipeline rank holds whatever its place in the schedule: weights,
    gradients and optimizer state, ZeRO-3's gathered layers (the same on twin ranks: `_ranks`)."""
    shard = L.shard
    gb, ob = grad_bytes(L), optimizer_bytes(L, stack)    # main weights + Adam moments in L.optimizer_dtype
    gs = gb if grad_store is None else grad_store
    sd = state_bytes(w.dparams, shard, L.zero, grad_bytes=gs, optimizer_bytes=ob)
    se = state_bytes(w.eparams, L.edp, L.zero, grad_bytes=gs, optimizer_bytes=ob)
    mem = {k: sd[k] + se[k] for k in sd}
    if L.zero >= 3 and shard > 1 and not L.reshard_after_forward:
        # weights gathered in forward stay until their backward: all of them at the peak
        mem["weights"] = K.PARAM_BYTES * (w.dparams + w.eparams)
    elif L.zero >= 3 and shard > 1 and w.layers:   # gathered layers exist only when sharded
        wb, g = zero3_working_bytes(L, [blocks[i] for i in w.layers], gb)
        mem["weights"] += wb
        mem["gradients"] += g
    if pp_deferred and L.zero >= 3 and shard > 1:
        # the unsharded gradients of every layer of the stage, held from the first backward to the
        # step's reduce-scatter (in the parameters' bf16; FSDP2 casts to the reduce dtype per bucket)
        mem["gradients"] += K.PARAM_BYTES * (w.dparams + w.eparams) - sd["gradients"] - se["gradients"]
    return mem


def _rank_memory(w: RankWork, r: int, profile: ModelProfile, blocks, L: Layout, m: int, tokens: float,
                 fp8: bool, pp_deferred: bool = False, grad_store: float | None = None,
                 fp8_primary: bool = False, stack: Stack | None = None,
                 state: dict[str, float] | None = None) -> dict[str, float]:
    """GiB by category on pipeline rank r. pp_deferred: FSDP2 under torch.distributed.pipelining
    keeps the stage's unsharded gradients (and, without resharding, weights) until the step's
    reduce-scatter. grad_store: bytes per held gradient (memory.grad_store_bytes; None: the
    reduction's dtype). fp8_primary: the stack keeps the parameters themselves in FP8
    (Stack.fp8_param_gather), so the FP8 copies replace the BF16 working weights. stack: the
    optimizer's main copy of the weights (memory.master_bytes; None: fp32). state: the rank's
    `_state_memory` where already known (a twin's)."""
    shard = L.shard
    gs = grad_bytes(L) if grad_store is None else grad_store
    mem = dict(state) if state is not None else _state_memory(w, blocks, L, pp_deferred, grad_store, stack)
    mem["activations"] = _activation_bytes(w, r, profile, L, m, tokens)
    if L.optimizer == "muon":       # AdamW's part, and the step's buffers (cost_models/muon.py)
        for k, extra in muon_rank_memory(w, r, profile, blocks, L, adam_bytes=adam_bytes(L, stack),
                                         activations=mem["activations"]).items():
            mem[k] = mem.get(k, 0.0) + extra
    # the FP8 weight copies kept between micro-batches: the layers' (the embedding and output layer run BF16)
    fp8_held = fp8_copies_held(w.dparams - w.edge_params, w.eparams, L)
    mem["fp8_cache"] = fp8_cache_bytes(stack) * fp8_held if fp8 else 0.0
    if fp8 and fp8_primary and not (L.zero >= 3 and shard > 1):
        # FP8 primary weights (Megatron-Core --fp8-param-gather): no BF16 working copy beside them
        mem["weights"] = max(0.0, mem["weights"] - K.PARAM_BYTES * fp8_held)
    if getattr(stack, "master_weights", "fp32") == "params" and autocast_runs(L):
        # fp32 parameters (the optimizer's main copy, in "optimizer") under autocast: the weights are
        # the bf16 copies the layers keep for backward, and the gradients exist only from the
        # backward on (memory.weight_copy_bytes, memory.peak_gradient_bytes)
        head = profile.head_params or (profile.embedding_params if profile.tied_embeddings else 0)
        eager_head = head / L.tp if r == L.pp - 1 and not fused_loss(profile, L.tp) else 0.0
        mem["weights"] = weight_copy_bytes([blocks[i] for i in w.layers], L, stack,
                                           fp8_weights=w.fp8_weights if fp8 else 0.0, head_weights=eager_head,
                                           in_flight=in_flight(L.schedule, m, L.pp, L.vp, r))
        # the output layer's and final norm's gradients come first (a tied embedding's with them)
        emb = profile.embedding_params / L.tp if r == 0 and not profile.tied_embeddings else 0.0
        first = gs * (w.edge_params - emb) if r == L.pp - 1 else 0.0
        mem["gradients"] = peak_gradient_bytes(mem["gradients"], first, mem["activations"] + mem["weights"], m)
    if L.moe_dispatcher == "deepep" and L.ep > 1 and any(blocks[i].is_moe for i in w.layers):
        # DeepEP's registered NVLink/RDMA buffers, one per process (memory.deepep_buffer_bytes); only
        # present where DeepEP runs, so other layouts keep their categories
        mem["comm_buffers"] = deepep_buffer_bytes(profile.hidden, L.ep)
    return {k: val / GB for k, val in mem.items()}


def _check_precision(precision: str, cluster) -> bool:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r}: use one of {PRECISIONS}")
    fp8 = precision == Precision.FP8
    if fp8 and not cluster.gpu.fp8_tflops:
        raise ConfigError(f"{cluster.gpu.name} has no FP8 matrix units; use precision='bf16'")
    return fp8


def _ranks(profile: ModelProfile, cluster, L: Layout, stage_layers, seq_len: int, fp8: bool,
           fp8_modules: frozenset | None, grad_accum_fusion: bool, recipe: str,
           stack: Stack, fitted: K.Fitted) -> tuple[list[RankWork], Context]:
    """Every pipeline rank's work for one micro-batch."""
    table = layer_table(profile, cluster, L, seq_len=seq_len, precision=Precision.FP8 if fp8 else Precision.BF16,
                        fp8_modules=fp8_modules, fp8_recipe=recipe, stack=stack, fitted=fitted)
    ctx = table.ctx
    layers = rank_layers(stage_layers, L.pp)
    # pipeline ranks that hold the same sequence of blocks (policies, FP8 flags) in the same place
    # (first, middle, last) do the same work: priced once, copied with their own layer indices
    seen: dict[tuple, int] = {}
    out: list[RankWork] = []
    for r in range(L.pp):
        key = (r == 0, r == L.pp - 1, table.keys_of(layers[r]))
        first = seen.get(key)
        if first is None:
            seen[key] = r
            out.append(rank_work(profile, table, ctx, layers[r], r, L.pp, grad_accum_fusion=grad_accum_fusion,
                                 grad_buffer_bytes=grad_store_bytes(L, stack)))
        else:
            out.append(out[first].twin_at(first, layers[r]))     # the same work at other layer indices
    return out, ctx


def estimate_profile(profile: ModelProfile, cluster, layout: Layout | dict, *, seq_len: int, global_batch: int,
                     precision: str = Precision.BF16, fp8_modules: frozenset | None = None,
                     grad_accum_fusion: bool | None = None, fp8_recipe: str | None = None,
                     stack: Stack | str | None = None, fitted: K.Fitted | None = None) -> Estimate:
    """Score one layout. Pure: (profile, cluster, layout, stack, shapes) -> Estimate.

    stack: the software that runs it (meshplan.ir.stack: a preset name or a Stack); None is the
    "reference" stack, the baseline the fitted constants describe (FlashAttention-2-class attention,
    fused element-wise kernels, the layout's own flags for everything else).
    grad_accum_fusion: whether gradient accumulation is folded into the weight-gradient GEMMs
    (Megatron-LM since 2022, Megatron-Core, Transformer Engine: True); False charges a separate pass
    per micro-batch (compute.grad_accumulation_time), as 2021 Megatron-LM, Megatron-DeepSpeed and
    PyTorch's AccumulateGrad run. None: the layout's field, and False where the stack does not fuse.
    fp8_recipe: the FP8 scaling recipe (constants.FP8_RECIPES) of precision="fp8"; None: the layout's.
    fitted: the fitted constants (constants.Fitted); None: the shipped fit, constants.FITTED."""
    L = Layout.coerce(layout)
    if L.tp_comm_overlap and L.tp > 1 and group(cluster, L.tp, 1).domains > 1:
        # Both TP overlaps reach the peers' memory directly: Transformer Engine's userbuffers build the
        # TP group from the ranks of one NVLink domain (CUDA IPC or multicast handles, MNNVL fabric
        # handles on NVL72: userbuffers-host.cpp, create_communicator_grouped2), PyTorch's async TP
        # runs on symmetric memory, which "does not work across network interfaces" (torch
        # _symmetric_memory). A TP group across scale-up domains runs neither: the layout runs, and
        # is priced, without it (exports then leave the flag off).
        L = L.replace(tp_comm_overlap=False)
    stack = resolve_stack(stack, default="reference")
    if L.offload_activations and stack.compile and not stack.compile_offloaded:
        stack = stack.replace(compile=False)       # offloaded blocks run eagerly (Stack.compile_offloaded)
    if grad_accum_fusion is None:
        grad_accum_fusion = L.grad_accum_fusion and stack.grad_accum_fusion
    recipe = fp8_recipe or L.fp8_recipe
    fp8 = _check_precision(precision, cluster)
    if fp8:
        fp8_recipe_factor(recipe, cluster)         # unknown recipe, or MXFP8 without MX tensor cores
        stack.check_fp8_recipe(recipe)
    stage_layers = check_layout(L, profile, cluster, seq_len=seq_len, global_batch=global_batch)
    m = global_batch // (L.dp * L.mbs)
    # forced balance prices the MoE layers at exactly their mean load (layer.routing_layout)
    ranks, ctx = _ranks(profile, cluster, L, stage_layers, seq_len, fp8, fp8_modules, grad_accum_fusion, recipe,
                        stack, fitted or K.FITTED)
    # activation offloading (cost_models/offload.py) adds its exposed copies to each rank's passes
    off = offload_ranks(ranks, layer_table(profile, cluster, L, seq_len=seq_len, precision=Precision.FP8 if fp8 else Precision.BF16,
                                           fp8_modules=fp8_modules, fp8_recipe=recipe, stack=stack,
                                           fitted=fitted or K.FITTED), L, cluster, m) \
        if L.offload_activations else None
    busy, bubble = pipeline_time(L.schedule, m, L.vp, [w.fb for w in ranks], [w.wgrad for w in ranks])
    dev = device_of(cluster)
    bubble = dev.pipeline_bubble(cluster, L, busy, bubble)
    slow = max(range(L.pp), key=lambda r: ranks[r].fb)
    pp_exposed, pp_total = pipeline_p2p_s(profile, cluster, L, m, ctx.tokens, stack)   # host work included
    groups, blocks = _DPGroups(cluster, L), profile.layer_blocks()
    deferred = stack.pp_fsdp_deferred and L.pp > 1
    dp: list[tuple[float, float]] = []
    for w in ranks:     # a rank's data-parallel traffic follows its work: a twin's is the same
        dp.append(dp[w.twin] if w.twin is not None else _dp_comm(w, blocks, L, groups, cluster, m, deferred,
                                                                  ctx.fitted, stack.fsdp_passes, stack.dp_overlap))
    opt_max = max(_optimizer_time(w, L, cluster) for w in ranks)
    if L.optimizer == "muon":       # the owner exchange (exposed DP traffic) and Newton-Schulz
        dp, opt_max = _with_muon(dp, ranks, profile, L, cluster, groups, opt_max)
    mem_stages: list[dict[str, float]] = []
    states: dict[int, dict[str, float]] = {}
    for r, w in enumerate(ranks):
        # a twin holds what its twin holds but for the micro-batches in flight, and so, where the
        # runtime's bf16 weight copies are per micro-batch (Stack.master_weights "params"), its own
        if w.twin is None or stack.master_weights == "params":
            gs = grad_store_bytes(L, stack)
            if w.twin is None:
                states[r] = _state_memory(w, blocks, L, deferred, gs, stack)
            mem_stages.append(_rank_memory(w, r, profile, blocks, L, m, ctx.tokens, fp8, deferred, gs,
                                           fp8_primary=L.fp8_recipe in stack.fp8_param_gather, stack=stack,
                                           state=states[r if w.twin is None else w.twin]))
        else:
            mem_stages.append(dict(mem_stages[w.twin],
                                   activations=_activation_bytes(w, r, profile, L, m, ctx.tokens) / GB))
    if off is not None:     # the offloaded activations move to the host (a category apart)
        offload_memory(mem_stages, off, GB, frees_device_memory(cluster))
    # the FP8 weight casts a stack runs once a step (Transformer Engine's cache fill; per micro-batch
    # ones are in the ranks' forward and backward: compute.fp8_weight_casts)
    dp_exposed, dp_total = max(e for _, e in dp), max(t for t, _ in dp)
    overhead = dev.step_overhead(profile, cluster, L, ranks, stack)
    # the expert overlap pairs chunk-steps; its warm-up and cool-down steps run alone and show the
    # all-to-alls it hides elsewhere (a rank's hidden share per micro-batch, 1/vp of it per step)
    unpaired = max(ep_unpaired_steps(L.pp, L.vp, m, r) / L.vp * max(0.0, w.comm["ep"] - w.parts["ep"])
                   for r, w in enumerate(ranks)) if stack.runs_ep_overlap(L) else 0.0
    step = busy + bubble + pp_exposed + dp_exposed + opt_max + max(w.cast for w in ranks) + overhead + unpaired
    w = ranks[slow]
    time_s = {"compute": m * w.parts["compute"], "tp": m * w.parts["tp"], "cp": m * w.parts["cp"],
              "ep": m * w.parts["ep"] + unpaired, "pp": pp_exposed, "dp": dp_exposed, "bubble": bubble,
              "optimizer": opt_max, "overhead": overhead}
    if off is not None:
        time_s["offload"] = m * (off[slow].fwd_s + off[slow].bwd_s)
    # the busy time also includes layer overheads folded into compute; keep the split summing to the step
    time_s["compute"] += step - sum(time_s.values())
    comm_s = {"tp": m * w.comm["tp"], "cp": m * w.comm["cp"], "ep": m * w.comm["ep"], "pp": pp_total, "dp": dp_total}
    return _assemble(profile, cluster, L, step=step, time_s=time_s, comm_s=comm_s, mem_stages=mem_stages, m=m,
                     seq_len=seq_len, global_batch=global_batch, precision=precision, stack=stack, recipe=recipe,
                     moe_host_s=m * w.moe_host)


def _assemble(profile: ModelProfile, cluster, L: Layout, *, step: float, time_s: dict, comm_s: dict,
              mem_stages: list[dict], m: int, seq_len: int, global_batch: int, precision: str,
              stack: Stack, recipe: str, moe_host_s: float = 0.0) -> Estimate:
    """Throughput, FLOP rates, memory peak, bottleneck and uncertainty band around a step time."""
    # offloaded activations (HOST_CATEGORY) live in host memory: checked against the host's, not the GPU's
    totals = [sum(v for k, v in s.items() if k != HOST_CATEGORY) for s in mem_stages]
    peak_stage = max(range(len(totals)), key=lambda r: totals[r])
    peak, capacity = totals[peak_stage], cluster.usable_memory_gb
    host_peak = max(s.get(HOST_CATEGORY, 0.0) for s in mem_stages)
    host_over = host_peak > 0 and host_peak > host_capacity_gb(cluster)
    n = cluster.num_gpus
    tokens = float(seq_len) * global_batch
    mflops = _model_flops(profile, seq_len, global_batch)
    hflops = mflops + recompute_flops_per_step(profile, seq_len, global_batch, L)
    peak_flops = cluster.gpu.bf16_tflops * 1e12
    model_tflops = mflops / step / n / 1e12
    hw_tflops = hflops / step / n / 1e12
    ep_cross = L.ep > 1 and group(cluster, L.ep, L.etp).domains > 1
    regime = regime_of(L, seq_len=seq_len, precision=precision, ep_cross_domain=ep_cross)
    band, band_s = step_uncertainty(time_s, regime, comm_s)
    # a router nothing balances: priced balanced, its worst case widens the band's upper side
    high, worst = imbalance_risk(profile, cluster, L, seq_len=seq_len, fp8=precision == Precision.FP8, microbatches=m,
                                 ep_s=time_s["ep"], step=step)
    if high:
        regime["moe_unbalanced"] = True
    moe = any(b.is_moe for b in profile.blocks)
    notes: tuple[str, ...] = ()
    if device_of(cluster).validated_by_published_runs:
        fabric = cluster.gpu.scaleup if cluster.scaleup_domain > 1 and n > 1 else ""
        floor, notes = extrapolation(plan_regimes(stack=stack.name, gpu_id=cluster.gpu.id, precision=precision,
                                                  fp8_recipe=recipe, ep_cross=ep_cross, seq_len=seq_len, moe=moe,
                                                  fabric=fabric))
        band = max(band, floor)
        notes += memory_pressure(peak, capacity)
        host_x, host_notes = moe_host_risk(moe_host_s, step)
        band, notes = (band ** 2 + host_x ** 2) ** 0.5, notes + host_notes
    return Estimate(
        step_time_s=step, tokens_per_s_per_gpu=tokens / step / n,
        model_tflops_per_gpu=model_tflops, hardware_tflops_per_gpu=hw_tflops,
        mfu=model_tflops * 1e12 / peak_flops, hfu=hw_tflops * 1e12 / peak_flops,
        peak_memory_gb=peak, memory_gb=dict(mem_stages[peak_stage]), memory_by_stage=tuple(mem_stages),
        capacity_gb=capacity, fits=peak <= capacity and not host_over, time_s=time_s, comm_s=comm_s,
        num_microbatches=m, peak_stage=peak_stage, layout=L, seq_len=seq_len,
        global_batch=global_batch, precision=precision, model=profile.name, cluster=cluster.name,
        num_gpus=n, bottleneck=_bottleneck(time_s, step, peak, capacity) if not host_over or peak > capacity else
        (f"host memory: offloaded activations need {host_peak:.1f} GB of host memory per GPU, "
         f"{host_capacity_gb(cluster):.1f} GB available (the server's DRAM shared by its GPUs)"),
        uncertainty=band, uncertainty_s=band_s,
        regime=regime, uncertainty_high=high, moe_balance=profile.moe_balance if moe else "", moe_worst_load=worst,
        stack=stack.name, extrapolation=notes)


def _bottleneck(time_s: dict[str, float], step: float, peak: float, capacity: float) -> str:
    if peak > capacity:
        return f"memory: needs {peak:.1f} GB per GPU, {capacity:.1f} GB available"
    worst = max((k for k in time_s if k not in ("compute", "overhead")), key=lambda k: time_s[k])
    share = time_s[worst] / step
    if share < 0.05:
        return f"compute-bound ({time_s['compute'] / step * 100:.0f}% of the step is compute)"
    names = {"tp": "exposed tensor-parallel communication", "cp": "exposed context-parallel communication",
             "ep": "expert all-to-all", "pp": "pipeline p2p", "dp": "exposed data-parallel communication",
             "bubble": "pipeline bubble", "optimizer": "optimizer step",
             "offload": "exposed activation-offload copies"}
    return f"{names[worst]} ({share * 100:.0f}% of the step)"
