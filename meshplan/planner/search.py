"""Layout search: enumerate mesh factorisations and execution choices, prune, cost, rank.

The space (issue "planner search"): every factorisation of the GPU count into tp x cp x pp x dp,
experts folded over the dense dp x cp x tp ranks as ep (x etp), virtual stages vp, micro-batch
size, recompute (none / norm_act / selective / full), ZeRO stage (distributed optimizer or FSDP), schedule
(1F1B, interleaved, zero-bubble) and precision. Pruning, cheapest first:
1. divisibility (heads, KV heads, FFN, vocab, experts, sequence, batch) and the scale-up domain
   (TP and EP stay inside it unless `allow_cross_domain` or the degree is fixed);
2. a memory lower bound per mesh (weights + gradients + optimizer state, no activations);
3. per mesh, recompute is tried from none to full and the micro-batch grows while it fits, so
   a mesh costs a handful of estimates, not the full cross product (under ZeRO-3, where memory caps
   the micro-batch, full recompute is tried for a larger one: _cost_mesh);
4. meshes in the order of a lower bound on their step (planner/bound.py), skipped once it cannot
   enter the planner's window.
Only the parallel dimensions the stack runs are enumerated (Stack.parallel_dims).
Every surviving candidate is scored with the same `estimate_profile` users call.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.memory import grad_bytes, optimizer_bytes, state_bytes
from meshplan.cost_models.offload import frees_device_memory
from meshplan.cost_models.uncertainty import PREFER_SIMPLER_WINDOW, memory_pressed
from meshplan.errors import ConfigError, LayoutError, MeshplanError
from meshplan.ir.estimate import Estimate
from meshplan.ir.layout import Layout, divisors, split_layers
from meshplan.ir.precision import Precision
from meshplan.ir.profile import ModelProfile
from meshplan.ir.stack import PARALLEL_DIMS, Stack, resolve_stack
from meshplan.ir.support import runs_as_ddp, runtime_limits
from meshplan.planner.bound import MeshBound, policies_of
from meshplan.planner.fixed import (FIXABLE, PASSED_THROUGH, SINGLE_CHUNK_SCHEDULES, check_fixed,
                                    check_fixed_against_model, check_fixed_dims, check_fixed_values, no_blocks,
                                    tp_indivisible)
from meshplan.profiling.traits import model_traits

__all__ = ["SearchResult", "search", "FIXABLE"]

RECOMPUTE_ORDER = ("none", "norm_act", "norm_moe", "mla_up", "selective", "op_sac", "full")
# "norm_act" (re-run the norms and the routed experts' activation: element-wise work only) is offered
# where its memory saving is large or selective's recompute is dear: on MoE models (it drops the
# experts' activation outputs, topk x moe_ffn_hidden per token, usually the largest MoE activation) and
# from this sequence length on, where selective re-runs an attention that grows with the sequence.
# On short dense models it saves only the two norm outputs (4h bytes per token) for about what
# selective's recompute costs, so it is not tried there (fewer estimates). (judgement, not fitted)
NORM_ACT_MIN_SEQ = 8192
MAX_MBS = 8
MAX_MBS_ZERO3 = 16
# The search skips CP below this many tokens per CP rank unless cp is fixed: the ring's cp-1
# latency-bound steps then cost more than the attention they split (judgement, not fitted).
CP_MIN_TOKENS_PER_RANK = 1024
# Virtual stages: every vp that splits each pipeline rank's layers into equal chunks, up to one layer
# per chunk, as Megatron-LM accepts (--num-layers-per-virtual-pipeline-stage). A cap of 8 left out
# published layouts (NeMo 24.07: Nemotron-4 340B pp8 vp12, Nemotron 22B pp4 vp10)
# and costs ~20% more estimates on the largest cases (benchmarks/planning_speed.py).
# 12 covers every published vp the validation data expresses (NeMo: Nemotron-4 340B pp8 vp12); no cap
# costs 20-34% more estimates on the largest cases and picks splits such as pp2 vp47 (judgement)
MAX_VP: int | None = 12        # None: no cap beyond one layer per chunk
# Where the layers split evenly for no vp above 1 (Llama 3 405B's 126 layers over pp4, pp8 or pp16),
# the search tries each vp whose chunks, split as evenly as possible (split_layers; Megatron-LM's
# --pipeline-model-parallel-layout, a torchtitan module list per stage), leave the busiest rank no
# more layers than the plain pipeline does: interleaving then adds no imbalance the schedule does not
# already have. Meta's 405B layout is such a split (tp8 pp16 vp4: 64 chunks of 2 or 1 layers, Llama 3
# paper Table 4); trying every vp up to MAX_VP there instead doubled the estimates where the layer
# count has few divisors (DeepSeek-V3's 61 layers at 2,048 GPUs: 16,467 against 7,945), so these go
# up to MAX_UNEVEN_VP chunks per rank. (judgement)
MAX_UNEVEN_VP = 4
# The planner chooses among (uncertainty.prefer_simpler) and explains with (runner-ups) at most
# this many of the fastest fitting estimates; the search's bound keeps every estimate that can
# enter them
PLANNER_WINDOW = PREFER_SIMPLER_WINDOW


@dataclass
class SearchResult:
    ranked: list[Estimate]                 # fitting candidates, best first
    rejected: list[Estimate]               # evaluated but over memory: the leanest few, for messages
    rejected_fast: list[Estimate] = field(default_factory=list)   # over memory: the fastest few
    # layouts the runtime cannot run (meshplan.ir.support), fastest first, with the first reason
    unsupported: list[tuple[Estimate, str]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


def vp_options(layers: int, pp: int, max_vp: int | None = None) -> list[int]:
    """The virtual stages per pipeline rank the search tries: every vp up to one layer per chunk
    (and MAX_VP) that splits the layers evenly; where none above 1 does, every vp whose nearly even
    chunks leave a rank at most the layers the plain pipeline's busiest rank holds (ceil(L / pp))."""
    cap = min(layers // pp, (max_vp if max_vp is not None else MAX_VP) or layers)
    even = [v for v in range(1, cap + 1) if layers % (pp * v) == 0]
    if any(v > 1 for v in even):
        return even
    plain = -(-layers // pp)
    return [v for v in range(1, min(cap, MAX_UNEVEN_VP) + 1) if v * -(-layers // (pp * v)) <= plain]


# Exposed ZeRO-3 traffic, as a share of the step, above which a mesh whose micro-batch memory caps
# also tries heavier recompute for a larger micro-batch (judgement: below it the saving cannot pay
# for the recomputed forward, and the search would cost twice the estimates for nothing)
ZERO3_EXPOSED_SHARE = 0.05

def _opts(key: str, fixed: Mapping[str, Any], values: Iterable) -> list:
    if key in fixed:
        return [fixed[key]]
    return list(values)


def _state_lower_bound_gb(profile: ModelProfile, tp: int, pp: int, ep: int, dp_shard: int, edp: int,
                          zero: int, dtypes: Layout, stack: Stack | None = None) -> float:
    """Weights + grads + optimizer of the most loaded pipeline rank, no activations (the
    bytes per parameter of cost_models.memory, for the gradient and optimizer dtypes of `dtypes` and
    the stack's main copy of the weights)."""
    dense = sum((b.params - b.expert_params) * b.count for b in profile.blocks)
    expert = sum(b.expert_params * b.count for b in profile.blocks)
    dense_gpu = (dense / pp + profile.embedding_params) / tp
    expert_gpu = expert / pp / ep

    def per_param(d: int) -> float:
        return sum(state_bytes(1.0, d, zero, grad_bytes=grad_bytes(dtypes),
                               optimizer_bytes=optimizer_bytes(dtypes, stack)).values())

    return (dense_gpu * per_param(dp_shard) + expert_gpu * per_param(edp)) / 2 ** 30


def search(profile: ModelProfile, cluster, *, seq_len: int, global_batch: int, precisions: tuple[Precision, ...],
           fixed: Mapping[str, Any] | None = None, allow_cross_domain: bool = False,
           keep: int = 256, stack: Stack | str | None = None, traits=None,
           fp8_modules: frozenset | None = None, bound: bool = True) -> SearchResult:
    """Rank every candidate layout (see the module docstring) that `stack` runs (meshplan.ir.stack;
    default meshplan's runtime, whose limits meshplan.ir.support declares), priced as it runs them.
    fp8_modules: the module set Precision.FP8 candidates are priced with (planner.ilp.fp8.
    fp8_layer_modules: what the plan's FP8 placement will run); None prices every linear in FP8.
    bound: cost candidates cheapest lower bound first and skip those that cannot reach the
    planner's window (planner.bound; `_cost_in_bound_order`); False costs every candidate."""
    t0 = time.perf_counter()
    stack = resolve_stack(stack)
    runtime = stack.runtime_checks
    n = cluster.num_gpus
    f = check_fixed(fixed or {}, n)
    check_fixed_values(f)
    if Precision.FP8 in precisions:
        recipe = f.get("fp8_recipe", Layout().fp8_recipe)
        if recipe not in stack.fp8_recipes and "fp8_recipe" not in f and len(precisions) > 1:
            precisions = tuple(p for p in precisions if p != Precision.FP8)    # "auto": BF16 on a stack without FP8
        else:
            try:
                stack.check_fp8_recipe(recipe)
            except ConfigError as e:
                raise ConfigError(f"precision fp8: {e}") from None
    check_fixed_dims(f, stack)
    runs = {d: d in stack.parallel_dims for d in PARALLEL_DIMS}
    if f.get("offload_activations") and not stack.activation_offload:
        raise ConfigError(f"fixed offload_activations=True: the {stack.name} stack does not offload activations "
                          "to host memory; plan for stack 'meshplan' or 'megatron-core', or leave it unset")
    if f.get("offload_activations") and runtime and "recompute" in f and \
            not _offload_recompute([f["recompute"]], stack):
        raise ConfigError(runtime_limits(Layout(offload_activations=True, recompute=f["recompute"]))[0])
    blocks = profile.layer_blocks()
    L = profile.num_layers
    if not L:
        raise LayoutError(no_blocks(profile))
    attn = [b for b in blocks if b.heads]
    heads = min((b.heads for b in attn), default=1)
    kv = min((b.kv_heads for b in attn), default=1)
    ffns = [w for b in blocks for w in (b.ffn_hidden, b.shared_ffn_hidden) if w]
    moe = [b for b in blocks if b.is_moe]
    experts = min((b.experts for b in moe), default=0)
    domain = cluster.scaleup_domain

    def tp_ok(t: int) -> bool:
        # a fixed degree is the user's leave to span domains, as a fixed ep is
        return not tp_indivisible(t, profile.vocab, heads=heads, kv=kv, ffns=ffns) and (
            allow_cross_domain or t <= domain or "tp" in f)

    check_fixed_against_model(f, profile, experts, heads=heads, kv=kv, ffns=ffns, n=n)

    stats = {"meshes": 0, "pruned_divisibility": 0, "pruned_memory": 0, "pruned_bound": 0, "estimates": 0,
             "runtime_excluded": 0}
    ranked: list[Estimate] = []
    rejected: list[Estimate] = []
    traits = traits or model_traits(profile)
    # costed like the others (so explain() can say what the runtime's limits cost), never returned
    unsupported: list[Estimate] = []
    unsupported_why: list[str] = []
    ustats = dict.fromkeys(stats, 0)
    todo: list[tuple[Layout, str | None]] = []     # (candidate, why the runtime cannot run it)
    # the gradient and optimizer dtypes every candidate has (the memory bound prices them)
    dtypes = Layout(**{k: f[k] for k in ("grad_dtype", "optimizer_dtype", "optimizer") if k in f})
    for tp in _opts("tp", f, (t for t in divisors(n) if t <= 64 and (t == 1 or runs["tp"]))):
        if not tp_ok(tp):
            stats["pruned_divisibility"] += 1
            continue
        for cp in _opts("cp", f, (c for c in divisors(n // tp) if c <= 32 and (c == 1 or runs["cp"]))):
            # CP needs 2*cp equal chunks (load-balanced causal split); below 1k tokens per rank the
            # search does not try it (the ring's per-step latency outweighs the saving), unless asked
            short = seq_len // cp < CP_MIN_TOKENS_PER_RANK and "cp" not in f
            if (n // tp) % cp or (cp > 1 and (seq_len % (2 * cp) or short)):
                stats["pruned_divisibility"] += 1
                continue
            for pp in _opts("pp", f, (p for p in divisors(n // (tp * cp)) if p <= L and (p == 1 or runs["pp"]))):
                if (n // (tp * cp)) % pp:
                    continue
                dp = n // (tp * cp * pp)
                if "dp" in f and f["dp"] != dp:
                    continue
                if global_batch % dp:
                    stats["pruned_divisibility"] += 1
                    continue
                vps = [1] if pp == 1 or f.get("schedule") in SINGLE_CHUNK_SCHEDULES else \
                    [2] if f.get("schedule") == "zbv" else vp_options(L, pp)
                if "schedule" not in f and "interleaved" not in stack.schedules:
                    vps = [1]           # the stack runs one model chunk per pipeline rank
                for vp in _opts("vp", f, vps):
                    scheds = ["1f1b"] if pp == 1 else (["interleaved"] if vp > 1 else ["1f1b", "zb"])
                    if pp > 1:
                        scheds = [x for x in scheds if x in stack.schedules] or scheds[:1]
                    eps = [1]
                    if experts and runs["ep"]:
                        fold = dp * cp * tp
                        eps = [e for e in divisors(experts) if fold % e == 0 and (allow_cross_domain or e <= domain)]
                    for ep, schedule, zero in itertools.product(
                            _opts("ep", f, eps), _opts("schedule", f, scheds),
                            _opts("zero", f, tuple(z for z in ((0, 1, 3) if dp * cp > 1 else (1,))
                                                    if pp == 1 or z <= stack.max_zero_with_pp))):
                        if pp > 1 and zero > stack.max_zero_with_pp:
                            continue    # a fixed ZeRO stage the stack does not run beside a pipeline
                        etp = f.get("etp", 1)
                        if runtime and zero == 0 and "zero" not in f and \
                                not runs_as_ddp(zero=0, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp):
                            continue    # the runtime runs zero=0 as DDP only without tp/cp/pp/etp
                        stats["meshes"] += 1
                        edp = max(1, dp * cp * tp // (ep * etp))
                        if _state_lower_bound_gb(profile, tp, pp, ep * etp, dp * cp, edp, zero, dtypes, stack) > \
                                cluster.usable_memory_gb:
                            stats["pruned_memory"] += 1
                            continue
                        stage_layers = f.get("stage_layers")
                        if stage_layers is None and L % (pp * vp):
                            stage_layers = split_layers(L, pp * vp)
                        choices: dict[str, Any] = {}
                        if not stack.grad_accum_fusion:
                            # the layout says what runs: PyTorch accumulates each micro-batch's weight
                            # gradients by a separate add (AccumulateGrad), not in the wgrad GEMM
                            choices["grad_accum_fusion"] = False
                        if ep > 1 and stack.runs_ep_overlap(Layout(pp=pp, vp=vp, ep=ep, ep_comm_overlap=True)):
                            # the stack overlaps the expert all-to-all where the schedule pairs
                            # micro-batches (the cost model also drops it under full recompute)
                            choices["ep_comm_overlap"] = True
                        choices.update({k: f[k] for k in PASSED_THROUGH if k in f})
                        for variant in _fsdp_variants(zero, dp * cp, cluster.gpus_per_node // (tp * cp), f,
                                                      stack.fsdp_impls):
                            try:
                                cand = Layout(tp=tp, cp=cp, pp=pp, vp=vp, dp=dp, ep=ep, etp=etp, zero=zero,
                                              schedule=schedule, stage_layers=stage_layers, **{**choices, **variant})
                            except ConfigError:
                                # a fixed choice this mesh cannot take (fsdp_impl on a zero < 3 mesh,
                                # stage_layers of another pp * vp)
                                stats["pruned_divisibility"] += 1
                                continue
                            limits = runtime_limits(cand, traits) if runtime else []
                            if limits and tp > 1 and "sp" not in f:
                                # sequence parallelism is the default with TP, not a requirement:
                                # where only SP stands in the runtime's way, run TP without it
                                no_sp = cand.replace(sp=False)
                                if not runtime_limits(no_sp, traits):
                                    cand, limits = no_sp, []
                            if limits:
                                stats["runtime_excluded"] += 1
                            todo.append((cand, limits[0] if limits else None))
    _cost_in_bound_order(todo, profile, cluster, f, seq_len, global_batch, precisions, fp8_modules, stack,
                         stats, ustats, ranked, rejected, unsupported, unsupported_why,
                         bound=bound and not _unbalanced_experts(profile))
    ranked.sort(key=lambda e: e.step_time_s)
    # keep the leanest rejections (for "does not fit" messages) and the fastest ones (layouts that
    # would have won with more memory, shown as runner-ups)
    leanest = sorted(rejected, key=lambda e: e.peak_memory_gb)[:8]
    fastest = sorted(rejected, key=lambda e: e.step_time_s)[:8]
    stats["seconds"] = time.perf_counter() - t0
    excluded = sorted(zip(unsupported, unsupported_why), key=lambda t: t[0].step_time_s)[:3]
    # past the `keep` fastest, the fastest fitting layout of each expert-parallel degree the head
    # lacks: a router nothing balances widens the upper band of EP layouts (Estimate.uncertainty_high),
    # and the planner may then prefer less expert parallelism ranked far down (uncertainty.prefer_simpler)
    head = ranked[:keep]
    seen = {(e.layout.ep, e.precision) for e in head}
    tail: dict[tuple[int, str], Estimate] = {}
    for e in ranked[keep:]:
        key = (e.layout.ep, e.precision)
        if key not in seen:
            tail.setdefault(key, e)
    return SearchResult(ranked=head + sorted(tail.values(), key=lambda e: e.step_time_s), rejected=leanest,
                        rejected_fast=fastest, stats=stats, unsupported=excluded)


def _fsdp_variants(zero: int, dpcp: int, node_ranks: int, f: Mapping[str, Any],
                   impls: tuple[str, ...] = ("fsdp2",)) -> list[dict[str, Any]]:
    """ZeRO-3 flavours: FSDP (shard over all of dp*cp, reshard after forward), keep the gathered
    weights until backward (ZeRO-2-like), and HSDP (shard inside a node, replicate across), in the
    stack's ZeRO-3 (Stack.fsdp_impls: PyTorch FSDP where it has it). DeepSpeed's (Megatron-LM 2021,
    Megatron-DeepSpeed) shards over all of dp*cp and regathers for backward: the other two are not its."""
    if zero != 3:
        return [{}]
    impl = f.get("fsdp_impl") or ("fsdp2" if "fsdp2" in impls else impls[0])
    fixed = {k: f[k] for k in ("fsdp_shard", "reshard_after_forward") if k in f}
    if impl == "deepspeed":
        return [{"fsdp_impl": impl, **fixed}]
    named = {} if impl == "fsdp2" or "fsdp_impl" in f else {"fsdp_impl": impl}   # a fixed one is passed through
    out = [dict(fsdp_shard=0, reshard_after_forward=True), dict(fsdp_shard=0, reshard_after_forward=False)]
    if 1 < node_ranks < dpcp and dpcp % node_ranks == 0:
        out.append(dict(fsdp_shard=node_ranks, reshard_after_forward=True))
    keep = [v for v in out if all(v[k] == x for k, x in fixed.items())]
    return [{**v, **named} for v in keep or [fixed]]


def _recompute_options(profile: ModelProfile, pp: int, seq_len: int = 0, stack: Stack | None = None) -> list:
    """none, norm_act (MoE or long sequences: NORM_ACT_MIN_SEQ), norm_moe (MoE), selective (or the
    stack's op-level selective checkpointing), then full recomputation of a growing number of layers
    per pipeline rank (Megatron's --recompute-num-layers), then all of them: those `stack` runs."""
    stack = stack or resolve_stack(None)
    per_rank = max(1, profile.num_layers // pp)
    partial = sorted({max(1, round(per_rank * q)) for q in (0.25, 0.5, 0.75)} - {per_rank})
    moe = any(b.is_moe for b in profile.layer_blocks())
    norm_act = ["norm_act"] if moe or seq_len >= NORM_ACT_MIN_SEQ else []
    norm_moe = ["norm_moe"] if moe else []
    # mla_up (Megatron's mla_up_proj + mlp modules) exists for latent attention only
    mla_up = ["mla_up"] if any(b.latent_dim for b in profile.layer_blocks()) else []
    out = ["none", *norm_act, *norm_moe, *mla_up, "selective", "op_sac", *partial, "full"]
    return [r for r in out if stack.offers_recompute(r)]


def _unbalanced_experts(profile: ModelProfile) -> bool:
    """Routers nothing balances: an expert-parallel layout then carries an upper-side risk, and the
    planner may prefer a layout with less of it from anywhere down the ranking (uncertainty.
    prefer_simpler), so the search costs every candidate."""
    return profile.moe_balance == "none" and any(b.is_moe for b in profile.blocks)


def _cost_in_bound_order(todo, profile, cluster, f, seq_len, global_batch, precisions, fp8_modules, stack,
                         stats, ustats, ranked, rejected, unsupported, unsupported_why, *, bound: bool) -> None:
    """Cost the candidates of `todo`, appending to ranked / rejected / unsupported in `todo`'s order.

    With `bound`, candidates are costed in the order of their lower bound (planner.bound) and the
    rest are skipped once the bound exceeds the step of the PLANNER_WINDOW-th fastest fitting
    estimate found: none of them could enter the window the planner chooses and explains from
    (uncertainty.prefer_simpler's candidates, the runner-ups), nor be faster than the chosen
    layout. The estimates kept are exactly those a full search ranks in that window, but for one
    judgement: a ZeRO-3 mesh capped by memory tries full recompute for a larger micro-batch only where
    its exposed traffic, the most that could save, would bring it into the window (_cost_mesh)."""
    results: list[tuple[list, list, list] | None] = [None] * len(todo)
    order = range(len(todo))
    if bound and todo:
        # the per-layer policies of every recompute option a candidate tries (they differ by pp only
        # in the partial counts, all "full" + "none")
        pps = dict.fromkeys(cand.pp for cand, _ in todo)
        policies = policies_of(rc for pp in pps for rc in _opts("recompute", f, _recompute_options(
            profile, pp, seq_len, stack)))
        lower = MeshBound(profile, cluster, seq_len=seq_len, global_batch=global_batch, precisions=precisions,
                          policies=policies, fp8_modules=fp8_modules, stack=stack)
        lbs = [lower(cand, _mbs_options(cand, global_batch // cand.dp, f, stack)) for cand, _ in todo]
        order = sorted(order, key=lambda i: (lbs[i], i))
    window: list[float] = []        # the fastest fitting steps found (a max-heap, negated)
    for n, i in enumerate(order):
        if bound and len(window) >= PLANNER_WINDOW and lbs[i] > -window[0]:
            stats["pruned_bound"] = len(todo) - n
            break
        cand, why = todo[i]
        fit: list = []
        over: list = []
        excluded: list = []
        if why is not None:
            _cost_mesh(profile, cluster, cand, f, seq_len, global_batch, precisions, excluded, [], ustats,
                       fp8_modules, stack)
        else:
            cutoff = -window[0] if bound and len(window) >= PLANNER_WINDOW else math.inf
            _cost_mesh(profile, cluster, cand, f, seq_len, global_batch, precisions, fit, over, stats,
                       fp8_modules, stack, cutoff)
            for e in fit:
                if len(window) < PLANNER_WINDOW:
                    heapq.heappush(window, -e.step_time_s)
                elif e.step_time_s < -window[0]:
                    heapq.heapreplace(window, -e.step_time_s)
        results[i] = (fit, over, excluded)
    for i, res in enumerate(results):
        if res is not None:
            ranked.extend(res[0])
            rejected.extend(res[1])
            unsupported.extend(res[2])
            unsupported_why.extend([todo[i][1]] * len(res[2]))


def _mbs_options(base: Layout, per_dp: int, f: Mapping[str, Any], stack: Stack) -> list[int]:
    """The micro-batch sizes a mesh tries: divisors of its per-rank batch up to MAX_MBS (or the
    fixed one). torch.distributed.pipelining (meshplan's runtime, torchtitan) needs at least pp
    micro-batches per step; the cost model itself prices fewer (Megatron's 1F1B allows it), so a
    user may still fix mbs, and a plan for a stack without that limit may choose it. Sharded data
    parallelism alone (ZeRO-3, no pipeline) goes to MAX_MBS_ZERO3: each micro-batch gathers and
    reduce-scatters every weight, and large micro-batches amortise that (MosaicML's MPT runs: 10-16)."""
    cap = MAX_MBS_ZERO3 if base.zero >= 3 and base.pp == 1 else MAX_MBS
    mbss = [m for m in divisors(per_dp) if m <= cap and
            (base.pp == 1 or per_dp // m >= base.pp or not stack.pp_min_microbatches)]
    return _opts("mbs", f, mbss)


def _cost_mesh(profile, cluster, base: Layout, f, seq_len, global_batch, precisions, ranked, rejected, stats,
               fp8_modules: frozenset | None = None, stack: Stack | None = None, cutoff: float = math.inf) -> None:
    """Per mesh: recompute from cheapest, micro-batch grown while it fits and helps; where nothing
    fits and the stack offloads activations, the same with the saved activations in host memory.
    cutoff: the step a layout must beat to enter the planner's window (the bound-ordered search's)."""
    stack = stack or resolve_stack(None)
    mbss = _mbs_options(base, global_batch // base.dp, f, stack)
    rcs = _recompute_options(profile, base.pp, seq_len, stack)
    if base.offload_activations:
        rcs = _offload_recompute(rcs, stack, base.pp)
    for precision in precisions:
        fitting = len(ranked)
        from_mbs = 0                 # where memory capped the micro-batch under ZeRO-3 (below)
        options = _opts("recompute", f, rcs)
        for rc in options:
            if from_mbs and rc != options[-1]:
                continue             # capped: straight to the policy that frees the most memory
            start, refused = len(ranked), len(rejected)
            best_here = _grow_mbs(profile, cluster, base, dict(recompute=rc), [m for m in mbss if m >= from_mbs],
                                  seq_len, global_batch, precision, ranked, rejected, stats, fp8_modules, stack)
            # ZeRO-3 gathers and reduce-scatters the weights for every micro-batch. Where memory stopped
            # the micro-batch growing, those collectives show in the step, and saving them (at most their
            # exposed time) could bring the mesh into the planner's window (`cutoff`), the heaviest
            # policy is tried next, from the micro-batch that did not fit: below it, it only adds work.
            capped = base.zero >= 3 and len(rejected) > refused and best_here is not None and any(
                e.time_s["dp"] >= ZERO3_EXPOSED_SHARE * e.step_time_s and e.step_time_s - e.time_s["dp"] < cutoff
                for e in ranked[start:])
            if capped:
                from_mbs = rejected[refused].layout.mbs
            if best_here is not None and "recompute" not in f and rc not in ("norm_act", "norm_moe", "mla_up") \
                    and not all(memory_pressed(e) for e in ranked[start:]) and not capped:
                break                          # cheapest recompute that fits found; more recompute only adds work
            # (not after the module policies ("norm_act", ...): selective saves more and re-runs attention
            # instead, which at short sequences can be the cheaper recompute; both are ranked; nor where
            # every fitting estimate of it runs within MEMORY_PRESSURE_FRAC of a GPU's usable memory: the
            # next policy's headroom is then ranked too, for prefer_simpler to weigh)
        if len(ranked) > fitting or "offload_activations" in f or not stack.activation_offload or \
                not frees_device_memory(cluster):
            continue
        # nothing fits on this mesh: offload the saved activations to host memory (cost_models/
        # offload.py), with the least recompute that then fits. Only here: a mesh that fits without it is
        # costed as before, and one too small for its activations gains a candidate
        ladder = _opts("recompute", f, _offload_recompute(rcs, stack, base.pp))
        # the leanest first, at the smallest micro-batch: where even it does not fit (most such meshes:
        # their weights, the embedding and the head do not shrink), one estimate settles the mesh
        if not ladder or not mbss or _grow_mbs(profile, cluster, base,
                                               dict(recompute=ladder[-1], offload_activations=True),
                                               mbss[:1], seq_len, global_batch, precision, [], rejected, stats,
                                               fp8_modules, stack) is None:
            continue
        for rc in ladder:
            best_here = _grow_mbs(profile, cluster, base, dict(recompute=rc, offload_activations=True), mbss,
                                  seq_len, global_batch, precision, ranked, rejected, stats, fp8_modules, stack)
            if best_here is not None and "recompute" not in f:
                break


def _offload_recompute(rcs: list, stack: Stack, pp: int = 1) -> list:
    """The recompute options that run with activation offloading on `stack` at pipeline degree `pp`
    (meshplan's runtime offloads what autograd's saved-tensor hooks see: meshplan.ir.support;
    Megatron's --cpu-offloading runs at pp=1 without recompute: Stack.offload_composes)."""
    if not stack.offload_composes:
        return [rc for rc in rcs if rc == "none"] if pp == 1 else []
    if not stack.runtime_checks:
        return list(rcs)
    return [rc for rc in rcs if _offloads_with(rc)]


@functools.lru_cache(maxsize=None)
def _offloads_with(recompute: str | int) -> bool:
    """Whether the runtime offloads activations under `recompute` (meshplan.ir.support); asked for
    every recompute option of every mesh where nothing fits, so answered once per option."""
    return not runtime_limits(Layout(offload_activations=True, recompute=recompute))


def _grow_mbs(profile, cluster, base: Layout, changes: dict[str, Any], mbss: list[int], seq_len: int,
              global_batch: int, precision: Precision, ranked: list, rejected: list, stats: dict,
              fp8_modules: frozenset | None, stack: Stack) -> float | None:
    """Estimate `base` with `changes` (its recompute, offloading) for each micro-batch size while it
    fits and the step keeps falling; returns the fastest fitting step (None: none fits). Each
    estimate's layout is one `base.replace` (the search's most frequent Layout construction)."""
    best_here = None
    for mbs in mbss:
        try:
            est = estimate_profile(profile, cluster, base.replace(mbs=mbs, **changes), seq_len=seq_len,
                                   global_batch=global_batch, precision=precision,
                                   fp8_modules=fp8_modules if precision == Precision.FP8 else None, stack=stack)
        except MeshplanError:
            stats["pruned_divisibility"] += 1
            continue
        stats["estimates"] += 1
        if not est.fits:
            rejected.append(est)
            break                      # a larger micro-batch only needs more memory
        ranked.append(est)
        if best_here is not None and est.step_time_s > best_here:
            break                      # growing mbs stopped paying off
        best_here = est.step_time_s
    return best_here
