"""Turn a search result into a `Plan` (or a DoesNotFitError that says what would fit)."""

from __future__ import annotations

from typing import Any, Mapping

from meshplan.cost_models.estimate import estimate_profile
from meshplan.ir.estimate import Estimate
from meshplan.ir.layout import Layout, check_layout
from meshplan.errors import DoesNotFitError, LayoutError
from meshplan.ir.support import TP_ROLE_PLACEMENT, block_placement_limits
from meshplan.planner.explain import why_lost
from meshplan.ir.plan import MESH_AXES, Plan, RunnerUp
from meshplan.ir.profile import ModelProfile

__all__ = ["build_plan", "placements_for", "stage_modules"]

# Placement of a linear by its data-flow role (roles come from the traced graph, not class names).


def placements_for(profile: ModelProfile, layout: Layout, cluster=None, *, seq_len: int = 0,
                   notes: list[str] | None = None) -> dict[str, str]:
    """Per-module placements relative to each block signature (`<signature>:<module>`), plus the
    embedding and output layer. tp == 1 means everything is replicated within the TP group.

    For traced profiles (blocks carry their op graph) the intra-block sharding ILP chooses the
    placements; analytic profiles (no graph) fall back to the data-flow roles of their linears."""
    out: dict[str, str] = {}
    if layout.tp > 1 and cluster is not None and profile.blocks and all(b.ops for b in profile.blocks):
        from meshplan.errors import MeshplanError
        from meshplan.planner.ilp_sharding import shard_profile
        try:
            tokens = int(layout.mbs * seq_len / layout.cp)
            # the cost model priced the layout's sp choice, so the placements must carry it out
            solved = shard_profile(profile, cluster, tp=layout.tp, tokens=tokens, sp_allowed=bool(layout.sp),
                                   io_layout="sequence" if layout.sp else "replicate")
        except MeshplanError:
            solved = {}
        by_sig = {b.signature: b for b in profile.blocks}
        for sig, bs in list(solved.items()):
            b = by_sig.get(sig)
            attention = tuple(k for k, v in bs.placements.items() if k not in {li.name for li in b.linears}
                              and any(o.kind == "attention" and o.module.endswith("." + k) for o in b.ops)) if b else ()
            why = block_placement_limits(bs.placements, {li.name: li.role for li in b.linears}, attention) if b else []
            if why:
                # the ILP found a dataflow the runtime does not run: keep the runtime's pattern
                # (the estimate priced the layout, not the ILP's placements, so it still holds)
                if notes is not None:
                    notes.append(f"sharding ILP's placements for block {sig} replaced by the runtime's "
                                 f"Megatron pattern: {why[0]}")
                solved = {}
                break
        if solved:
            for sig, bs in solved.items():
                for mod, placement in bs.placements.items():
                    out[f"{sig}:{mod}"] = placement
                out[f"{sig}:<io>"] = bs.io_layout
            _outer_placements(profile, out, sequence=any(bs.io_layout == "sequence" for bs in solved.values()))
            return out
    for b in profile.blocks:
        for li in b.linears:
            out[f"{b.signature}:{li.name}"] = TP_ROLE_PLACEMENT.get(li.role, "replicate") if layout.tp > 1 \
                else ("expert" if li.role.startswith("expert") and layout.ep > 1 else "replicate")
        if layout.tp > 1 and b.ops and b.instances:
            # traced blocks: the attention between column- and row-parallel linears runs on the
            # local heads (the runtime adjusts the module's head counts)
            inst = b.instances[0]
            for o in b.ops:
                if o.kind == "attention" and o.module.startswith(inst + "."):
                    out[f"{b.signature}:{o.module[len(inst) + 1:]}"] = "heads"
    if layout.tp > 1:
        out["*norm*"] = "sequence" if layout.sp else "replicate"
        _outer_placements(profile, out, sequence=bool(layout.sp))
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


def stage_modules(profile: ModelProfile, stage_layers: tuple[int, ...]) -> tuple[tuple[str, ...], ...]:
    # instances are in execution order: the k-th use of a block is its k-th instance
    order: list[str] = []
    counters = {i: 0 for i in range(len(profile.blocks))}
    for bi in profile.layers:
        b = profile.blocks[bi]
        order.append(b.instances[counters[bi]])
        counters[bi] += 1
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
    state_gb = total * 18 / 2 ** 30
    cap = cluster.usable_memory_gb
    min_gpus = max(1, int(state_gb / cap) + 1)
    msg = [f"no layout of {profile.name} ({total / 1e9:.1f}B parameters) fits on {n} x {cluster.gpu.id} "
           f"at seq {seq_len}"]
    if rejected:
        best = min(rejected, key=lambda e: e.peak_memory_gb)
        lay = Layout.from_dict(best.layout)
        msg.append(f": the leanest layout found ({lay.short()}) needs {best.peak_memory_gb:.1f} GB per GPU, "
                   f"{cap:.1f} GB are usable")
    msg.append(f"; weights + gradients + Adam state alone are {state_gb:.0f} GB at dp=1, so at least "
               f"~{min_gpus} GPUs are needed even fully sharded. What would fit: more GPUs "
               f"(try {max(min_gpus, 2 * n)}), a shorter sequence, or a GPU with more memory")
    return "".join(msg)


def _fp8_modules(profile, cluster, lay: Layout, best: Estimate, seq_len: int, global_batch: int) -> tuple[str, ...]:
    """FP8 placement ILP: which linears gain from FP8 within the memory left on each stage."""
    from meshplan.planner.ilp_fp8 import choose_fp8, fp8_candidates
    cands = fp8_candidates(profile, cluster, lay, seq_len=seq_len, global_batch=global_batch)
    budget = [best.capacity_gb - sum(s.values()) for s in best.memory_by_stage]
    choice = choose_fp8(cands, memory_budget_gb=budget)
    return tuple(sorted(choice.modules))


def _fused_kernels(profile: ModelProfile, lay: Layout) -> tuple[str, ...]:
    from meshplan.planner.fusions import find_fusions
    on = {name for name, fused in profile.fusions if fused}
    return tuple(m.entry() for m in find_fusions(profile, tp=lay.tp).modules if m.kernel in on)


def build_plan(profile: ModelProfile, cluster, result, *, seq_len: int, global_batch: int, top_k: int = 5,
               fixed: Mapping[str, Any] | None = None, prefer_simpler_layouts: bool = True) -> Plan:
    """The Plan of the search's best layout. Fused kernels are listed where the profile says the
    runtime swaps them in (ModelProfile.fusions True), matched again for the chosen TP degree."""
    unsupported = getattr(result, "unsupported", [])
    if not result.ranked and unsupported:
        est, why = unsupported[0]
        raise LayoutError(f"no layout the runtime can run was found: {Layout.from_dict(est.layout).short()} and "
                          f"the others searched cannot run: {why}. Fix fewer degrees (e.g. leave tp/ep free) "
                          "so the planner can choose a layout the runtime supports")
    if not result.ranked:
        raise DoesNotFitError(_no_fit_message(profile, cluster, result.rejected, seq_len))
    # the pipeline-stage ILP may move layers off the embedding / output stages; try it on the
    # leading candidates (unless the user fixed the split) and keep the fastest
    if not (fixed and "stage_layers" in fixed):
        from meshplan.planner.stages import refine_stages
        head = [refine_stages(profile, cluster, e, seq_len=seq_len, global_batch=global_batch)
                for e in result.ranked[:3]]
        result.ranked = sorted(head + result.ranked[3:], key=lambda e: e.step_time_s)
    # a faster layout whose edge over a simpler, better-validated one is inside the model's
    # uncertainty band does not win (meshplan.cost_models.uncertainty); unless the user fixed enough
    # of the layout that the choice is theirs
    band_note = ""
    if prefer_simpler_layouts:
        from meshplan.cost_models.uncertainty import prefer_simpler
        chosen, band_note = prefer_simpler(result.ranked)
        if chosen is not result.ranked[0]:
            result.ranked = [chosen] + [e for e in result.ranked if e is not chosen]
    best = result.ranked[0]
    excluded_note = ""
    if unsupported and unsupported[0][0].step_time_s < best.step_time_s:
        fast, why = unsupported[0]
        gain = best.step_time_s / fast.step_time_s - 1
        excluded_note = (f"the fastest layout found, {Layout.from_dict(fast.layout).short()} "
                         f"({fast.step_time_s:.3f} s, {gain * 100:.0f}% faster), was excluded: the runtime "
                         f"cannot run it ({why})")
    lay = Layout.from_dict(best.layout)
    stage_layers = check_layout(lay, profile, cluster, seq_len=seq_len, global_batch=global_batch)
    seen = {repr(sorted(best.layout.items())) + best.precision}
    runner_ups = []
    for e in result.ranked[1:]:
        key = repr(sorted(e.layout.items())) + e.precision
        if key in seen:
            continue
        seen.add(key)
        runner_ups.append(RunnerUp(layout=e.layout, step_time_s=e.step_time_s, peak_memory_gb=e.peak_memory_gb,
                                   fits=e.fits, reason=why_lost(e, best)))
        if len(runner_ups) >= top_k - 1:
            break
    for e in [e for e in result.rejected_fast if e.step_time_s < best.step_time_s][:2]:
        runner_ups.append(RunnerUp(layout=e.layout, step_time_s=e.step_time_s, peak_memory_gb=e.peak_memory_gb,
                                   fits=False, reason=why_lost(e, best)))
    placement_notes: list[str] = []
    placements = placements_for(profile, lay, cluster, seq_len=seq_len, notes=placement_notes)
    mesh = {"pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "tp": lay.tp}
    assert tuple(mesh) == MESH_AXES
    fp8_modules: tuple[str, ...] = ()
    if best.precision == "fp8":
        fp8_modules = _fp8_modules(profile, cluster, lay, best, seq_len, global_batch)
        # the plan's prediction costs exactly the FP8 set it will run
        best = estimate_profile(profile, cluster, lay, seq_len=seq_len, global_batch=global_batch,
                                precision="fp8", fp8_modules=frozenset(fp8_modules))
    return Plan(model=profile.name, model_fingerprint=profile.fingerprint, cluster=cluster.to_dict(),
                cluster_fingerprint=cluster.fingerprint(), seq_len=seq_len, global_batch=global_batch,
                precision=best.precision, layout=best.layout, mesh=mesh, placements=placements,
                stages=stage_modules(profile, stage_layers), schedule=lay.schedule, micro_batch_size=lay.mbs,
                num_microbatches=best.num_microbatches, recompute=lay.recompute, fp8_modules=fp8_modules,
                fused_kernels=_fused_kernels(profile, lay),
                estimate=best.to_dict(), runner_ups=tuple(runner_ups),
                search={**result.stats, "fixed": dict(fixed or {}),
                        **({"band_choice": band_note} if band_note else {}),
                        **({"runtime_excluded_note": excluded_note} if excluded_note else {}),
                        **({"placement_note": placement_notes[0]} if placement_notes else {})})
