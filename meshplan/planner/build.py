"""Turn a search result into a `Plan` (or a DoesNotFitError that says what would fit)."""

from __future__ import annotations

from typing import Any, Mapping

from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.memory import grad_bytes, optimizer_bytes, state_bytes
from meshplan.cost_models.uncertainty import prefer_simpler
from meshplan.errors import DoesNotFitError, LayoutError, MeshplanError
from meshplan.ir.estimate import GB, Estimate
from meshplan.ir.layout import Layout, check_layout, divisors
from meshplan.ir.plan import FusedKernel, Plan, PlanNotes, RunnerUp
from meshplan.ir.precision import Precision
from meshplan.ir.profile import ModelProfile
from meshplan.ir.support import block_placement_limits
from meshplan.planner.explain import why_lost
from meshplan.profiling.fusions import find_fusions
from meshplan.planner.ilp.fp8 import choose_fp8, forced_sets, fp8_candidates, fp8_layer_modules
from meshplan.planner.ilp.sharding import shard_profile
from meshplan.profiling.tp_roles import role_placements
from meshplan.profiling.traits import packing
from meshplan.ir.stack import resolve_stack
from meshplan.planner.ilp.stage_refine import refine_stages

__all__ = ["build_plan", "placements_for", "stage_modules", "block_instances"]

def placements_for(profile: ModelProfile, layout: Layout, cluster=None, *, seq_len: int = 0,
                   notes: list[str] | None = None) -> dict[str, str]:
    """Module FQN -> placement (meshplan.ir.plan.PLACEMENTS) for every instance of every block,
    plus the embedding and output layer. tp == 1 means everything is replicated within the TP
    group (only routed experts are labelled, for expert parallelism).

    For traced profiles (blocks carry their op graph) the intra-block sharding ILP chooses the
    placements; analytic profiles (no graph), and ILP results the runtime cannot run, fall back to
    the data-flow roles of the linears (Megatron's pattern), with a note saying so."""
    per_block = _ilp_placements(profile, layout, cluster, seq_len, notes) if layout.tp > 1 else None
    if per_block is None:
        per_block = {b.signature: role_placements(b, tp=layout.tp, ep=layout.ep, sp=bool(layout.sp))
                     for b in profile.blocks}
    out: dict[str, str] = {}
    for b in profile.blocks:
        for inst in b.instances:
            out.update({f"{inst}.{rel}": label for rel, label in per_block[b.signature].items()})
    if layout.tp > 1:
        _outer_placements(profile, out, sequence=bool(layout.sp))
    return out


def _ilp_placements(profile: ModelProfile, layout: Layout, cluster, seq_len: int,
                    notes: list[str] | None) -> dict[str, dict[str, str]] | None:
    """Block signature -> {path in block: placement} from the sharding ILP, or None (with a note)
    where it cannot be used."""
    def fallback(why: str) -> None:
        if notes is not None:
            notes.append(f"placements follow the runtime's Megatron pattern, not the sharding ILP: {why}")

    if cluster is None or not profile.blocks or not all(b.ops for b in profile.blocks):
        return None            # analytic profile: nothing to solve over
    try:
        tokens = int(layout.mbs * seq_len / layout.cp)
        # the cost model priced the layout's sp choice, so the placements must carry it out
        solved = shard_profile(profile, cluster, tp=layout.tp, tokens=tokens, sp_allowed=bool(layout.sp),
                               io_layout="sequence" if layout.sp else "replicate")
    except MeshplanError as e:
        fallback(f"the ILP failed ({e})")
        return None
    out: dict[str, dict[str, str]] = {}
    for b in profile.blocks:
        bs = solved.get(b.signature)
        if bs is None:
            fallback(f"the ILP returned nothing for block {b.instances[0] if b.instances else b.signature}")
            return None
        attention = tuple(k for k in bs.placements if k not in {li.name for li in b.linears}
                          and any(o.kind == "attention" and o.module.endswith("." + k) for o in b.ops))
        why = block_placement_limits(bs.placements, {li.name: li.role for li in b.linears}, attention,
                                     packed={li.name: lab for li in b.linears if (lab := packing(b, li))})
        if why:
            # the ILP found a dataflow the runtime does not run: keep the runtime's pattern (the
            # estimate priced the layout, not the ILP's placements, so it still holds)
            fallback(f"for block {b.instances[0] if b.instances else b.signature}: {why[0]}")
            return None
        out[b.signature] = dict(bs.placements)
    return out


def _outer_placements(profile: ModelProfile, out: dict[str, str], *, sequence: bool) -> None:
    """Modules outside the blocks: the token embedding is vocabulary-parallel and the head
    column-parallel; with sequence parallelism the other modules before the blocks (learned
    positions) hand on the sequence shard ("seq_split") and those after (final norm) work on it."""
    for m in profile.pre_modules:
        out[m] = "seq_split" if sequence else "replicate"
    for m in profile.post_modules:
        out[m] = "sequence" if sequence else "replicate"
    if profile.embedding_fqn:
        out[profile.embedding_fqn] = "vocab_parallel"
    if profile.head_fqn:
        out[profile.head_fqn] = "colwise"


def block_instances(profile: ModelProfile) -> tuple[str, ...]:
    """Every repeated block's FQN in execution order (the k-th use of a block is its k-th instance)."""
    order: list[str] = []
    counters = {i: 0 for i in range(len(profile.blocks))}
    for bi in profile.layers:
        order.append(profile.blocks[bi].instances[counters[bi]])
        counters[bi] += 1
    return tuple(order)


def stage_modules(profile: ModelProfile, stage_layers: tuple[int, ...]) -> tuple[tuple[str, ...], ...]:
    order = block_instances(profile)
    stages, start = [], 0
    for s, n in enumerate(stage_layers):
        mods = list(order[start:start + n])
        start += n
        if s == 0:
            pre = profile.pre_modules or ((profile.embedding_fqn,) if profile.embedding_fqn else ())
            mods[:0] = [m for m in pre if m]
        if s == len(stage_layers) - 1:
            post = profile.post_modules or ((profile.head_fqn,) if profile.head_fqn else ())
            mods.extend(m for m in post if m and m not in mods)
        stages.append(tuple(mods))
    return tuple(stages)


def _no_fit_message(profile: ModelProfile, cluster, rejected: list[Estimate], seq_len: int) -> str:
    n = cluster.num_gpus
    total = profile.total_params
    lay = Layout()      # bf16 weights, fp32 gradients and Adam state, nothing sharded
    state_gb = sum(state_bytes(total, 1, 0, grad_bytes=grad_bytes(lay), optimizer_bytes=optimizer_bytes(lay)).values()) / GB
    cap = cluster.usable_memory_gb
    min_gpus = max(1, int(state_gb / cap) + 1)
    msg = [f"no layout of {profile.name} ({total / 1e9:.1f}B parameters) fits on {n} x {cluster.gpu.id} "
           f"at seq {seq_len}"]
    if rejected:
        best = min(rejected, key=lambda e: e.peak_memory_gb)
        msg.append(f": the leanest layout found ({best.layout.short()}) needs {best.peak_memory_gb:.1f} GB per GPU, "
                   f"{cap:.1f} GB are usable")
    msg.append(f"; weights + gradients + Adam state alone are {state_gb:.0f} GB at dp=1, so at least "
               f"~{min_gpus} GPUs are needed even fully sharded. What would fit: more GPUs "
               f"(try {max(min_gpus, 2 * n)}), a shorter sequence, or a GPU with more memory")
    return "".join(msg)


def _mesh_dps(n: int, profile: ModelProfile, seq_len: int, domain: int) -> list[int]:
    """Data-parallel degrees some tp x cp x pp leaves on n GPUs: tp dividing the attention heads
    (and the NVLink domain, <= 8), cp with seq_len in 2*cp chunks (<= 32), pp <= the layers."""
    heads = [g for b in profile.blocks if b.heads for g in (b.heads, b.kv_heads or b.heads)]
    tps = [t for t in divisors(n) if t <= min(8, domain) and all(h % t == 0 for h in heads)
           and profile.vocab % t == 0]
    out = []
    for dp in divisors(n):
        rest = n // dp
        if any(rest % tp == 0 and any(rest // tp % cp == 0 and rest // tp // cp <= profile.num_layers
                                      for cp in divisors(rest // tp) if cp <= 32 and (cp == 1 or seq_len % (2 * cp) == 0))
               for tp in tps):
            out.append(dp)
    return out


def _no_mesh_message(profile: ModelProfile, cluster, seq_len: int, global_batch: int) -> str:
    """Why the search found no layout to price at all, and GPU counts / batch sizes that have one."""
    n, node, domain = cluster.num_gpus, max(1, cluster.gpus_per_node), cluster.scaleup_domain
    if domain > node and domain % node == 0:
        node = domain       # whole scale-up domains (NVL72 racks)
    counts = []
    for k in range(1, 257):
        counts += [c for c in (n - k * node, n + k * node)
                   if c > 0 and any(global_batch % d == 0 for d in _mesh_dps(c, profile, seq_len, domain))]
        if counts:
            break
    dps = _mesh_dps(n, profile, seq_len, domain)
    batches = sorted({max(d, round(global_batch / d) * d) for d in dps}, key=lambda b: (abs(b - global_batch), b))[:2]
    hint = []
    if counts:
        hint.append(f"{' or '.join(map(str, sorted(counts)))} GPUs")
    if batches:
        hint.append(f"a global batch of {' or '.join(map(str, batches))} sequences")
    return (f"no layout of {profile.name} can be formed on {n} x {cluster.gpu.id} with global batch {global_batch} "
            f"at seq {seq_len}: every split of {n} GPUs into tensor (<= {min(8, domain)}), context (<= 32) and "
            f"pipeline (<= {profile.num_layers} layers) degrees the model can take leaves a data-parallel degree "
            f"that does not divide {global_batch} sequences. What would work: "
            f"{', or '.join(hint) if hint else 'a GPU count and a global batch with common factors'}")


def _fp8_modules(profile, cluster, lay: Layout, best: Estimate, seq_len: int, global_batch: int,
                 force_in=(), force_out=(), stack=None) -> tuple[str, ...]:
    """FP8 placement ILP: which linears gain from FP8 within the memory left on each stage.

    The budget is the room left by the layout with no linear in FP8 (BF16 activations, no FP8
    weight cache): the ILP itself charges each FP8 module's cache and credits its FP8-stored inputs.
    (`best` priced precision "fp8" already holds the cache of every weight and FP8 inputs; a budget
    taken from it counted the cache twice, and the ILP then dropped most linears for want of room:
    GPT-3 20B at tp2 dp32 kept 13 of 264 linears in FP8, 26% slower than estimate() of the layout.)"""
    base = best
    if best.precision == Precision.FP8:
        base = estimate_profile(profile, cluster, lay, seq_len=seq_len, global_batch=global_batch,
                                precision=Precision.FP8, fp8_modules=frozenset(), stack=stack)
    cands = fp8_candidates(profile, cluster, lay, seq_len=seq_len, global_batch=global_batch, stack=stack)
    # (offloaded activations are in host memory: no GPU budget taken)
    budget = [base.capacity_gb - sum(v for k, v in s.items() if k not in ("fp8_cache", "host_offload"))
              for s in base.memory_by_stage]
    try:
        choice = choose_fp8(cands, memory_budget_gb=budget, force_in=force_in, force_out=force_out)
    except DoesNotFitError:
        # The ILP charges each module's weight cache and credits its FP8-stored saved inputs, one
        # module at a time; under recompute the peak is the recomputed layer's working set, whose FP8
        # inputs it does not credit (a MoE layer's routed expert inputs at micro-batch 8: ~1.9 GB). Where
        # the estimate of exactly the forced set fits, that set is the placement.
        forced = tuple(sorted(forced_sets([c.module for c in cands], force_in, force_out)[0]))
        if not forced:
            raise
        exact = estimate_profile(profile, cluster, lay, seq_len=seq_len, global_batch=global_batch,
                                 precision=Precision.FP8, fp8_modules=frozenset(forced), stack=stack)
        if not exact.fits:
            raise
        return forced
    return tuple(sorted(choice.modules))


def _fused_kernels(profile: ModelProfile, lay: Layout) -> tuple[FusedKernel, ...]:
    on = {name for name, fused in profile.fusions if fused}
    return tuple(m for m in find_fusions(profile, tp=lay.tp).modules if m.kernel in on)


def build_plan(profile: ModelProfile, cluster, result, *, seq_len: int, global_batch: int, top_k: int = 5,
               fixed: Mapping[str, Any] | None = None, prefer_simpler_layouts: bool = True,
               fp8_force_in=(), fp8_force_out=(), stack=None) -> Plan:
    """The Plan of the search's best layout. Fused kernels are listed where the profile says the
    runtime swaps them in (ModelProfile.fusions True), matched again for the chosen TP degree.
    fp8_force_in / fp8_force_out: modules (names or glob patterns) the FP8 placement ILP must put
    in / keep out of FP8; the search priced FP8 with the same forces (fp8_layer_modules)."""
    stack = resolve_stack(stack)
    fp8_layers = fp8_layer_modules(profile, fp8_force_in, fp8_force_out)
    unsupported = getattr(result, "unsupported", [])
    if not result.ranked and unsupported:
        est, why = unsupported[0]
        raise LayoutError(f"no layout the runtime can run was found: {est.layout.short()} and "
                          f"the others searched cannot run: {why}. Fix fewer degrees (e.g. leave tp/ep free) "
                          "so the planner can choose a layout the runtime supports")
    if not result.ranked and not result.rejected and not result.stats.get("meshes"):
        raise LayoutError(_no_mesh_message(profile, cluster, seq_len, global_batch))
    if not result.ranked:
        raise DoesNotFitError(_no_fit_message(profile, cluster, result.rejected, seq_len))
    # the pipeline-stage ILP may move layers off the embedding / output stages; try it on the
    # leading candidates (unless the user fixed the split) and keep the fastest
    if not (fixed and "stage_layers" in fixed):
        head = [refine_stages(profile, cluster, e, seq_len=seq_len, global_batch=global_batch,
                              fp8_modules=fp8_layers, stack=stack) for e in result.ranked[:3]]
        result.ranked = sorted(head + result.ranked[3:], key=lambda e: e.step_time_s)
    # a faster layout whose edge over a simpler, better-validated one is inside the model's
    # uncertainty band does not win (meshplan.cost_models.uncertainty); unless the user fixed enough
    # of the layout that the choice is theirs
    band_note = ""
    if prefer_simpler_layouts:
        chosen, band_note = prefer_simpler(result.ranked)
        if chosen is not result.ranked[0]:
            result.ranked = [chosen] + [e for e in result.ranked if e is not chosen]
    best = result.ranked[0]
    excluded_note = ""
    if unsupported and unsupported[0][0].step_time_s < best.step_time_s:
        fast, why = unsupported[0]
        gain = best.step_time_s / fast.step_time_s - 1
        excluded_note = (f"the fastest layout found, {fast.layout.short()} "
                         f"({fast.step_time_s:.3f} s, {gain * 100:.0f}% faster), was excluded: the runtime "
                         f"cannot run it ({why})")
    lay = best.layout
    stage_layers = check_layout(lay, profile, cluster, seq_len=seq_len, global_batch=global_batch)
    seen = {(best.layout, best.precision)}
    runner_ups = []
    for e in result.ranked[1:]:
        key = (e.layout, e.precision)
        if key in seen:
            continue
        seen.add(key)
        runner_ups.append(RunnerUp(layout=e.layout, step_time_s=e.step_time_s,
                                   peak_memory_gb=e.peak_memory_gb, fits=e.fits, reason=why_lost(e, best)))
        if len(runner_ups) >= top_k - 1:
            break
    for e in [e for e in result.rejected_fast if e.step_time_s < best.step_time_s][:2]:
        runner_ups.append(RunnerUp(layout=e.layout, step_time_s=e.step_time_s,
                                   peak_memory_gb=e.peak_memory_gb, fits=False, reason=why_lost(e, best)))
    placement_notes: list[str] = []
    placements = placements_for(profile, lay, cluster, seq_len=seq_len, notes=placement_notes)
    fp8_modules: tuple[str, ...] = ()
    if best.precision == Precision.FP8:
        fp8_modules = _fp8_modules(profile, cluster, lay, best, seq_len, global_batch, fp8_force_in, fp8_force_out,
                                   stack)
        # the plan's prediction costs exactly the FP8 set it will run
        best = estimate_profile(profile, cluster, lay, seq_len=seq_len, global_batch=global_batch,
                                precision=Precision.FP8, fp8_modules=frozenset(fp8_modules), stack=stack)
    return Plan(model=profile.name, model_fingerprint=profile.fingerprint, stack=stack.name, cluster=cluster.to_dict(),
                cluster_fingerprint=cluster.fingerprint(), seq_len=seq_len, global_batch=global_batch,
                precision=best.precision, layout=lay, blocks=block_instances(profile),
                placements=placements, stages=stage_modules(profile, stage_layers),
                num_microbatches=best.num_microbatches, fp8_modules=fp8_modules,
                fused_kernels=_fused_kernels(profile, lay), estimate=best, runner_ups=tuple(runner_ups),
                notes=PlanNotes(**result.stats, fixed=dict(fixed or {}), band_choice=band_note or "",
                                runtime_excluded_note=excluded_note or "",
                                placement_note=placement_notes[0] if placement_notes else ""))
