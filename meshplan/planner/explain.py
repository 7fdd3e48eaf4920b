"""Human-readable explanations of a Plan: the layout, where the step time goes, memory per
stage against capacity, the runner-ups and why each lost, and the bottleneck."""

from __future__ import annotations

from meshplan.cost_models.uncertainty import gain_band, upper_risk, worst_case_words
from meshplan.ir.estimate import Estimate

__all__ = ["explain", "why_lost", "balance_note"]

_NAMES = {"compute": "compute", "tp": "exposed TP comm", "cp": "exposed CP comm", "ep": "expert all-to-all",
          "pp": "pipeline p2p", "dp": "exposed DP comm", "bubble": "pipeline bubble", "optimizer": "optimizer step",
          "overhead": "fixed overhead", "offload": "offload copies"}
# the band's parts: a collective's error covers what shows and what it hides (uncertainty.hidden)
_RISK_NAMES = dict(_NAMES, tp="TP comm", cp="CP comm", dp="DP comm")


def why_lost(loser: Estimate, best: Estimate) -> str:
    """The component of the step that grew most against the winner."""
    if not loser.fits:
        faster = (1 - loser.step_time_s / best.step_time_s) * 100
        return (f"would be {faster:.1f}% faster but does not fit: needs {loser.peak_memory_gb:.1f} GB per GPU, "
                f"{loser.capacity_gb:.1f} GB usable")
    diffs = {k: loser.time_s.get(k, 0.0) - best.time_s.get(k, 0.0) for k in {**best.time_s, **loser.time_s}}
    k = max(diffs, key=diffs.get)
    slower = loser.step_time_s / best.step_time_s - 1
    if slower < 0:
        # faster by the model, yet not chosen: its edge is inside the uncertainty band, or does not
        # survive its own upper-side risk (prefer_simpler)
        gain, band, d = gain_band(loser, best)
        rests = ", ".join(f"{_NAMES.get(c, c)} {v * 1e3:.0f} ms" for c, v in sorted(d.items(), key=lambda kv: -kv[1])
                          if v > 1e-3 * loser.step_time_s)
        if gain > band and upper_risk(loser) > 0:
            return (f"predicted {-slower * 100:.1f}% faster, but not at its worst case: "
                    f"{worst_case_words(loser, best, band)}; the chosen layout is simpler or carries less of "
                    f"that risk; its edge rests on: {rests or 'nothing'}")
        return (f"predicted {-slower * 100:.1f}% faster, but the gain is inside the band ({band * 100:.1f}%) and "
                f"the layout is less simple or less validated; its edge rests on: {rests or 'nothing'}")
    if loser.precision != best.precision and k == "compute":
        return f"{slower * 100:.1f}% slower: {loser.precision} GEMMs are slower than {best.precision}"
    if k == "compute":
        order = {"none": 0, "norm_act": 0.5, "selective": 1, "full": 2}
        lr, br = loser.layout.recompute, best.layout.recompute
        if order.get(lr, 1) > order.get(br, 1) or (isinstance(lr, int) and br == "none"):
            return (f"{slower * 100:.1f}% slower: recomputation ({lr}) redoes forward work "
                    f"(+{diffs[k] * 1e3:.1f} ms per step of compute)")
        if loser.layout.mbs != best.layout.mbs:
            return (f"{slower * 100:.1f}% slower: micro-batch {loser.layout.mbs} runs less efficient "
                    f"kernels than {best.layout.mbs} (+{diffs[k] * 1e3:.1f} ms of compute)")
    return f"{slower * 100:.1f}% slower: more {_NAMES.get(k, k)} (+{diffs[k] * 1e3:.1f} ms per step)"


def balance_note(model: str, est: Estimate) -> str:
    """One line when a MoE model trains with nothing balancing its routers (Estimate.moe_balance
    "none"): the step is priced balanced, and the worst case sits in the band's upper side."""
    if est.moe_balance != "none":
        return ""
    if est.moe_worst_load > 1.0:
        risk = (f"up to {est.moe_worst_load:.1f}x the balanced load on the busiest EP rank: step up to "
                f"+{est.uncertainty_high * 100:.0f}%, the band's upper side")
    else:       # ep = 1: every rank runs every expert, the rows per rank do not change
        risk = "priced balanced; at ep=1 the step barely changes, an expert-parallel layout would"
    return (f"{model} trains without load balancing: an untrained router can send most tokens to a few experts "
            f"({risk}); train with moe_aux_loss_coeff=1e-2 (--moe-aux-loss-coeff 1e-2) or moe_expert_bias=True "
            "(--moe-expert-bias) (a transformers model: output_router_logits=True, router_aux_loss_coef > 0), "
            "or force balance for benchmarking (moe_force_balance=True, --moe-force-balance)")


def _bar(frac: float, width: int = 30) -> str:
    n = max(0, min(width, round(frac * width)))
    return "#" * n + "." * (width - n)


def explain(plan) -> str:
    est = plan.estimate
    lay = plan.layout
    out = []
    p = out.append
    p(f"Plan for {plan.model} on {est.num_gpus} x {plan.cluster.get('gpu', {}).get('id', '?')} "
      f"({plan.cluster.get('name')}), seq {plan.seq_len}, global batch {plan.global_batch}, {plan.precision}, "
      f"for the {getattr(plan, 'stack', 'meshplan')} stack")
    p(f"  layout: {lay.short()}  (mesh {' x '.join(f'{k}={v}' for k, v in plan.mesh.items())})")
    p(f"  {plan.num_microbatches} micro-batches of {plan.micro_batch_size} per data-parallel rank per step"
      + (f"; FP8 on {len(plan.fp8_modules)} linears" if plan.fp8_modules else ""))
    if plan.fused_kernels:
        # a module repeated in every block is named once, by its path inside the block
        by_kernel: dict[str, list[str]] = {}
        for f in plan.fused_kernels:
            block = plan.block_of(f.module)
            name = f"blocks' {f.module[len(block) + 1:]}" if block else f.module
            if name not in by_kernel.setdefault(f.kernel, []):
                by_kernel[f.kernel].append(name)
        p("  fused kernels: " + "; ".join(f"{k} on {', '.join(v)}" for k, v in by_kernel.items()))
    p("")
    p(f"Predicted step {est.step_time_s:.3f} s: {est.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
      f"{est.model_tflops_per_gpu:.0f} model TFLOP/s/GPU, MFU {est.mfu * 100:.1f}%")
    if est.uncertainty:
        lo, hi = est.step_time_range_s
        worst = sorted(((v, k) for k, v in est.uncertainty_s.items() if v > 0), reverse=True)[:3]
        flags = [k for k, on in est.regime.items() if on and k != "fsdp"]
        pm = (f"+{(est.uncertainty + est.uncertainty_high) * 100:.1f}%/-{est.uncertainty * 100:.1f}%"
              if est.uncertainty_high else f"+/-{est.uncertainty * 100:.1f}%")
        p(f"  uncertainty band {pm} ({lo:.3f}-{hi:.3f} s), from the validation error "
          f"of: " + ", ".join(f"{_RISK_NAMES.get(k, k)} {v * 1e3:.1f} ms" for v, k in worst)
          + (f"; less-validated regimes: {', '.join(flags)}" if flags else ""))
    for line in est.extrapolation:
        p(f"  extrapolates: {line}")
    note = balance_note(plan.model, est)
    if note:
        p(f"  {note}")
    for note in (plan.notes.optimizer_note, plan.notes.band_choice, plan.notes.runtime_excluded_note):
        if note:
            p(f"  {note}")
    for k, v in est.time_s.items():
        if v > 0:
            frac = v / est.step_time_s
            p(f"  {_NAMES.get(k, k):18s} {v * 1e3:10.1f} ms  {frac * 100:5.1f}%  {_bar(frac)}")
    p("")
    p(f"Memory per GPU (GB) against {est.capacity_gb:.1f} GB usable:")
    cats = sorted({c for s in est.memory_by_stage for c in s})
    p("  stage " + "".join(f"{c[:11]:>12s}" for c in cats) + f"{'total':>10s}")
    for i, s in enumerate(est.memory_by_stage):
        tot = sum(v for c, v in s.items() if c != "host_offload")   # host memory apart
        p(f"  {i:5d} " + "".join(f"{s.get(c, 0.0):12.1f}" for c in cats) + f"{tot:10.1f}"
          + ("  <- peak" if i == est.peak_stage else ""))
    p("")
    p(f"Bottleneck: {est.bottleneck}")
    if plan.runner_ups:
        p("")
        p("Runner-ups:")
        for r in plan.runner_ups:
            p(f"  {r.layout.short():60s} {r.step_time_s:8.3f} s  {r.reason}")
    s = plan.notes
    if s.meshes or s.estimates:
        p("")
        bound = f", {s.pruned_bound} skipped by the step-time bound" if s.pruned_bound else ""
        p(f"Searched {s.meshes} meshes, {s.estimates} estimates "
          f"({s.pruned_memory} meshes pruned by memory{bound}) in {s.seconds:.2f} s")
    if s.placement_note:
        p(f"Note: {s.placement_note}")
    return "\n".join(out)
