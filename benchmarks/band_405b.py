#!/usr/bin/env python
"""Does the planner's llama3-405b layout on 16,384 H100 survive its own uncertainty band?

At seq 8192, global batch 2048 the model's fastest layout uses CP at 8k and a
deep pipeline, far from what Meta trained with (tp8 pp16, no CP at 8k; Llama 3 paper, Table 4).
This prints the model's fastest layout, the plan the planner returns (which prefers a simpler
layout when the gain is inside the band), and the experts' layouts, each with its gain over the
experts, the band of that gain, and the components the edge rests on.

    python benchmarks/band_405b.py [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit  # noqa: E402

import meshplan as mp  # noqa: E402
from meshplan.api import profile  # noqa: E402
from meshplan.cost_models.estimate import estimate_profile  # noqa: E402
from meshplan.ir.layout import split_layers  # noqa: E402
from meshplan.cost_models.uncertainty import gain_band  # noqa: E402

SEQ, GBS = 8192, 2048
# Llama 3 paper (arXiv 2407.21783) Table 4, 16,384 GPUs at 8k context: TP 8, CP 1, PP 16, DP 128;
# 126 layers do not divide into 16 (or 64) stages, so they are split as evenly as possible
EXPERTS = {"tp8 pp16 vp4 (interleaved)": dict(tp=8, pp=16, vp=4, dp=128, cp=1, zero=1, mbs=1, recompute="none",
                                              schedule="interleaved", stage_layers=split_layers(126, 64)),
           "tp8 pp16": dict(tp=8, pp=16, vp=1, dp=128, cp=1, zero=1, mbs=1, recompute="none",
                            stage_layers=split_layers(126, 16))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    t0 = time.time()
    model = mp.models.build("llama3-405b", device="meta")
    cl = mp.Cluster.preset("dgx-h100", nodes=2048)
    prof = profile(model, seq_len=SEQ)
    pl = mp.plan(model, cl, seq_len=SEQ, global_batch=GBS)
    lines = []
    p = lines.append
    chosen = pl.estimate
    fastest = min([chosen] + [r for r in pl.runner_ups if r.fits], key=lambda r: r.step_time_s)
    fastest_est = chosen if fastest is chosen else estimate_profile(prof, cl, fastest.layout, seq_len=SEQ,
                                                                   global_batch=GBS, stack=pl.stack)
    p(f"llama3-405b, {cl.num_gpus} x H100, seq {SEQ}, global batch {GBS} sequences, bf16")
    p(f"model's fastest layout: {fastest_est.layout.short():55s} {fastest_est.step_time_s:7.3f} s "
      f"+/-{fastest_est.uncertainty * 100:.0f}%")
    p(f"planner's choice:       {chosen.layout.short():55s} {chosen.step_time_s:7.3f} s "
      f"+/-{chosen.uncertainty * 100:.0f}%")
    if pl.notes.band_choice:
        p(f"  {pl.notes.band_choice}")
    p("")
    p(f"{'against the experts':28s} {'expert step':>11s} {'layout':>8s} {'gain':>7s} {'band':>7s}  verdict; edge rests on")
    for name, lay in EXPERTS.items():
        # the cheapest recompute that fits, as the experts would have run it
        e = mp.plan(model, cl, seq_len=SEQ, global_batch=GBS, fixed={k: v for k, v in lay.items()
                                                                     if k != "recompute"}).estimate
        for who, cand in (("fastest", fastest_est), ("chosen", chosen)):
            gain, band, diff = gain_band(cand, e)
            edge = ", ".join(f"{k} {d * 1e3:+.0f} ms" for k, d in sorted(diff.items(), key=lambda kv: -kv[1])
                             if abs(d) > 1e-3 * cand.step_time_s)
            verdict = "survives (gain > band)" if gain > band else \
                "loses (beyond the band)" if -gain > band else "inside the band"
            p(f"{name:28s} {e.step_time_s:10.3f}s {who:>8s} {gain * 100:+6.1f}% {band * 100:6.1f}%  {verdict}; {edge}")
        p(f"  {name}: recompute {e.layout.recompute}, {e.peak_memory_gb:.1f} GB, band of its own step "
          f"+/-{e.uncertainty * 100:.0f}%")
    p(f"\n({time.time() - t0:.1f} s)")
    return emit(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
