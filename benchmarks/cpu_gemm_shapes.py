#!/usr/bin/env python
"""bf16 GEMM time against shape on one CPU thread: the fixed time per call that makes the small
GEMMs of MoE experts slow on CPU (constants.CPU_GEMM_CALL_S).

Times torch.mm on bf16 operands (no autograd, the operator a linear layer's forward, dgrad and
wgrad each run, and that meshplan::grouped_mm's CPU loop runs once per expert) at the default
jobs' shapes and a few larger ones, fits t = flops / rate + fixed by least squares, and reports
the fixed time per call beside a plain small op's (a chain of 8x8 multiplies: the dispatch cost
CPU_OP_FWD_S is defined by, which the cost model already charges per traced op), so that the
GEMM's own per-call work is fixed - op. Both are then scaled to the reference rate the CPU_*
constants use (CPU_MICRO_MATMUL_GFLOPS_1T): x fitted rate / reference rate.

    python benchmarks/cpu_gemm_shapes.py [--reps 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import median_cpu_s  # noqa: E402
from _report import emit  # noqa: E402

# (m, k, n): tiny-llama's linears at 512 tokens, tiny-moe's experts (256 rows each: 512 tokens x
# top-2 / 4 experts) in forward, dgrad and wgrad form, and larger ones that pin the rate
SHAPES = [(512, 128, 128), (512, 128, 256), (512, 128, 384), (512, 384, 128), (128, 512, 384),
          (256, 128, 96), (256, 96, 128), (96, 256, 128), (128, 256, 96), (512, 128, 96),
          (1024, 128, 96), (1024, 512, 512), (512, 512, 512), (2048, 512, 512)]


def small_op_s(reps: int) -> float:
    """Seconds per op of a chain of 60 multiplies of an 8x8 tensor, no autograd (dispatch only)."""
    x = torch.randn(8, 8)

    def chain():
        y = x
        for _ in range(60):
            y = y * 1.0001
    return median_cpu_s(chain, samples=5, calls=max(1, reps // 10), warmup=10) / 60


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from meshplan.cost_models import constants as K
    lines = [f"# bf16 torch.mm on one thread, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"{'m':>5s} {'k':>5s} {'n':>5s} {'us':>9s} {'GFLOP/s':>8s}"]
    rows = []
    with torch.no_grad():
        for m, k, n in SHAPES:
            a = torch.randn(m, k, dtype=torch.bfloat16)
            b = torch.randn(k, n, dtype=torch.bfloat16)
            t = median_cpu_s(lambda: torch.mm(a, b), samples=5, calls=args.reps, warmup=10)
            rows.append((2.0 * m * n * k, t))
            lines.append(f"{m:5d} {k:5d} {n:5d} {t * 1e6:9.1f} {2 * m * n * k / t / 1e9:8.1f}")
    # least squares of the RELATIVE error of t = flops / rate + fixed (each shape counts alike; plain
    # least squares lets the large shapes set the fixed term, which only the small ones show)
    xs, ys = [r[0] for r in rows], [r[1] for r in rows]
    w = [1.0 / y ** 2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    fixed = (sy - slope * sx) / sw
    rate = 1.0 / slope
    op = small_op_s(args.reps)
    worst = max(abs(fixed + x * slope - y) / y for x, y in rows)
    scale = rate / (K.CPU_MICRO_MATMUL_GFLOPS_1T * 1e9)
    lines += [f"# fit t = flops / rate + fixed: rate {rate / 1e9:.0f} GFLOP/s, fixed {fixed * 1e6:.1f} us a call "
              f"(worst shape off by {worst * 100:.0f}%)",
              f"# plain small op (dispatch, no autograd): {op * 1e6:.1f} us",
              f"# GEMM's own work per call: {(fixed - op) * 1e6:.1f} us; at the reference rate "
              f"({K.CPU_MICRO_MATMUL_GFLOPS_1T:.0f} GFLOP/s, x {scale:.2f}): {(fixed - op) * scale * 1e6:.1f} us "
              f"(constants.CPU_GEMM_CALL_S = {K.CPU_GEMM_CALL_S * 1e6:.0f} us)"]
    return emit(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
