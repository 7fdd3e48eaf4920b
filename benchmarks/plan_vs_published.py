#!/usr/bin/env python
"""Quality check against experts: for each expressible row of published_runs.csv, plan freely
(same model, GPU count, sequence length, global batch, precision) and compare the planner's
layout with the published one, both scored by meshplan's own cost model.

Checks, per row:
- the published layout is inside the search space: plan(..., fixed=<published layout>) returns
  exactly estimate() of that layout;
- the free plan is at least as fast by the planner's own model; where the planner chose a simpler
  layout whose loss is inside the model's band (meshplan.cost_models.uncertainty.prefer_simpler),
  the fastest layout its search found must be (that row is counted as "simpler inside band");
- both plans price FP8 as the published stack ran it: Transformer Engine / Megatron quantise every
  linear of every transformer layer (plan(fp8_force_in=...)), as estimate(precision="fp8") prices
  it, where meshplan's own plans keep the first and last block in BF16 by default;
- the free plan's predicted gain over the published layout against the band of that gain
  (meshplan.cost_models.uncertainty.gain_band): a gain inside the band is not a claim the model can
  make against the experts.
Prints both layouts, their predicted throughput, gain, band, and why the planner's differs.

    python benchmarks/plan_vs_published.py [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from meshplan.api import plan  # noqa: E402
from meshplan.ir.layout import Layout  # noqa: E402
from meshplan.cost_models.validation import DEFAULT_CSV, _gpu, load_rows, row_cluster, stack_of  # noqa: E402
from validate_published import model_config, run_row  # noqa: E402
from meshplan.errors import MeshplanError  # noqa: E402
from meshplan.cost_models.uncertainty import gain_band  # noqa: E402
from meshplan.planner.explain import why_lost  # noqa: E402

FIX_KEYS = ("tp", "cp", "pp", "vp", "dp", "ep", "etp", "zero", "mbs", "recompute", "schedule", "sp",
            "tp_comm_overlap", "ep_comm_overlap", "flash_attention", "stage_layers", "fsdp_shard", "reshard_after_forward")
# the run's software stack: kept in both the fixed and the free plan (not the planner's choice)
STACK_KEYS = ("flash_attention", "tp_comm_overlap", "attn_kernel", "grad_dtype", "fsdp_impl", "moe_dispatcher",
              "grad_accum_fusion", "fp8_recipe", "cp_comm_type", "moe_capacity_factor", "optimizer_dtype")


def stack_fp8_modules(prof) -> list[str]:
    """Every transformer layer's linears but routers: what Transformer Engine / Megatron-Core run in
    FP8 under --fp8-format (routers and the output layer stay in higher precision)."""
    return [f"{inst}.{li.name}" for b in prof.blocks for inst in b.instances for li in b.linears
            if li.role != "router"]


@dataclass
class Comparison:
    pub: Any          # estimate() of the published layout (with its stack's conventions)
    same: Any         # plan(fixed=<published layout>)
    free: Any         # plan(fixed=<the published stack only>)
    layout: dict      # the published layout
    fastest_s: float  # the fastest fitting layout the free search found (the plan may be a simpler one)


def compare_row(r, profiles: dict, keep: tuple[str, ...] = ()) -> Comparison | None:
    """Plan row `r`'s problem with the published layout fixed and freely, under its software stack
    (None when the row is not expressible or its published layout does not fit by meshplan's model).
    keep: layout keys the free plan also takes from the published layout (a narrower, faster search)."""
    cfg = model_config(r)
    gpu, n, s, B = _gpu(r), r.num("num_gpus"), r.num("seq"), r.num("gbs")
    if cfg is None or not (gpu and n and s and B):
        return None
    res = run_row(r, traced=False, profiles=profiles)
    if res.predicted is None or not res.fits:
        return None
    lay = res.layout
    prof = profiles[repr(sorted(cfg.items()))]
    cluster = row_cluster(r)
    precision = res.estimate.precision
    full = Layout.from_dict(lay).to_dict()
    # what the software stack could do is not the planner's choice: keep it as published
    env = {k: full[k] for k in STACK_KEYS if k in full}
    fixed = {**{k: v for k, v in full.items() if k in FIX_KEYS}, **env}
    fp8_in = stack_fp8_modules(prof) if precision == "fp8" else ()
    # the published runs ran on their own frameworks: each plan is made for the row's stack (its
    # recompute policies, kernels, overlap), without meshplan's runtime limits (meshplan.ir.support)
    stack = stack_of(res.row)
    same = plan(prof, cluster, seq_len=s, global_batch=B, precision=precision, fixed=fixed,
                allow_cross_domain=True, stack=stack, fp8_force_in=fp8_in)
    free = plan(prof, cluster, seq_len=s, global_batch=B, precision=precision,
                fixed={**env, **{k: full[k] for k in keep}},
                allow_cross_domain=True, stack=stack, fp8_force_in=fp8_in)
    # prefer_simpler may have chosen a simpler layout inside the band: the fastest is then a runner-up
    fastest = min([free.estimate.step_time_s] + [ru.step_time_s for ru in free.runner_ups if ru.fits])
    return Comparison(pub=res.estimate, same=same, free=free, layout=lay, fastest_s=fastest)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", default=str(DEFAULT_CSV))
    ap.add_argument("--quick", action="store_true", help="one row per source")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = load_rows(args.csv)
    lines: list[str] = []
    p = lines.append
    p(f"{'row':42s} {'published layout':44s} {'pub tok/s':>9s} {'planned layout':52s} {'plan tok/s':>10s} {'gain':>6s} {'band':>6s}  verdict")
    profiles: dict = {}
    seen_src: set = set()
    n_ok = n_worse = n_mismatch = n_simpler = 0
    n_inside = n_outside = 0
    diffs = []
    t0 = time.time()
    for r in rows:
        if args.quick and r.family in seen_src:
            continue
        try:
            c = compare_row(r, profiles)
        except MeshplanError as e:
            p(f"{r.id[:42]:42s} planning failed: {e}")
            continue
        if c is None:
            continue
        seen_src.add(r.family)
        pub, same, free, lay, fastest = c.pub, c.same, c.free, c.layout, c.fastest_s
        n, s, B = pub.num_gpus, pub.seq_len, pub.global_batch
        if abs(same.estimate.step_time_s - pub.step_time_s) > 1e-9 * pub.step_time_s:
            n_mismatch += 1
        fe = free.estimate
        gain, band, _ = gain_band(fe, pub)
        inside = gain <= band
        n_inside += inside
        n_outside += not inside
        note = ""
        if fe.step_time_s <= pub.step_time_s * (1 + 1e-9):
            n_ok += 1
        elif free.notes.band_choice and fastest <= pub.step_time_s * (1 + 1e-9):
            n_simpler += 1
            note = f"; simpler inside band (search's fastest {B * s / fastest / n:.0f} tok/s)"
        else:
            n_worse += 1
            note = "; SLOWER"
        p(f"{r.id[:42]:42s} {Layout.from_dict(lay).short()[:44]:44s} {pub.tokens_per_s_per_gpu:9.0f} "
          f"{free.layout.short()[:52]:52s} {fe.tokens_per_s_per_gpu:10.0f} {gain * 100:+5.1f}% {band * 100:5.1f}%  "
          f"{'inside band' if inside else 'beyond band'}{note}")
        if gain > 0.005:
            diffs.append(f"  {r.id}: published loses by {gain * 100:.1f}% (band {band * 100:.1f}%): "
                         f"{why_lost(pub, fe)}")
    p("")
    p(f"free plan at least as fast as the published layout: {n_ok} rows; a simpler layout inside the band "
      f"chosen, the search's fastest at least as fast: {n_simpler}; slower: {n_worse}; "
      f"fixed-layout plan != estimate: {n_mismatch}")
    p(f"free plan's gain over the published layout inside the band of that gain: {n_inside} rows; "
      f"beyond the band (a claim against the experts): {n_outside}")
    p("Where the planner differs from the experts (main reason, by meshplan's model):")
    lines.extend(diffs)
    p(f"\n({time.time() - t0:.1f} s)")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if (n_worse == 0 and n_mismatch == 0) else 1


if __name__ == "__main__":
    raise SystemExit(main())
