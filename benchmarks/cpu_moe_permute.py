#!/usr/bin/env python
"""The MoE token permutation on one CPU thread, against the rate the cost model charges it
(constants.CPU_PERMUTE_GB_S_1T).

MoE.routed (meshplan/models/moe.py) gathers each token's k copies into expert order
(index_select), scales the experts' output rows by the routing weights (mul) and scatter-adds
them back to their tokens (index_add); backward runs the transposes (index_add into zeros, the
mul's two products, index_select). The cost model counts this as 4 k h T bf16 bytes forward
(layer._elementwise_bytes: permute + unpermute, read + write) and twice that backward. This times
exactly those ops, forward + backward, at the default job's shape (tiny-moe: 512 tokens, h 128,
top-2 of 4 experts) and a larger one, and reports bytes / time in the model's units: 3 x forward
bytes over the measured seconds, scaled to the reference matmul rate (x this thread's 512^3 bf16
GFLOP/s / CPU_MICRO_MATMUL_GFLOPS_1T), next to a plain bf16 multiply's rate measured the same way.

    python benchmarks/cpu_moe_permute.py [--reps 100] [--out FILE]
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

SHAPES = [(512, 128, 2, 4), (2048, 512, 2, 8)]      # tokens, hidden, top-k, experts


def permute_step(n: int, h: int, k: int, e: int):
    """One forward + backward of MoE.routed's permutation (no expert compute in between)."""
    tokens = torch.randn(n, h, dtype=torch.bfloat16, requires_grad=True)
    weights = torch.rand(n, k, requires_grad=True)
    expert_of_copy = torch.arange(n * k) % e                      # balanced, as forced balance routes
    order = torch.argsort(expert_of_copy, stable=True)
    token_of_copy = order // k

    def step():
        rows = tokens.index_select(0, token_of_copy)               # gather, (n k, h)
        routed = rows * weights.flatten()[order].unsqueeze(-1).to(rows.dtype)
        out = torch.zeros_like(tokens, dtype=routed.dtype).index_add(0, token_of_copy, routed)   # scatter-add
        out.float().sum().backward()
    return step


def mul_step(n: int, h: int):
    a = torch.randn(n, h, dtype=torch.bfloat16)
    b = torch.randn(n, h, dtype=torch.bfloat16)
    return lambda: a * b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from meshplan.cost_models import constants as K
    a = torch.randn(512, 512, dtype=torch.bfloat16)
    gflops = 2 * 512 ** 3 / median_cpu_s(lambda: a @ a, samples=args.reps) / 1e9
    scale = gflops / K.CPU_MICRO_MATMUL_GFLOPS_1T        # reference seconds = seconds x scale
    lines = [f"# MoE permutation on one thread, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"512^3 bf16 matmul {gflops:.0f} GFLOP/s (x {scale:.2f} to the reference rate)",
             f"{'tokens':>6s} {'h':>5s} {'k':>2s} {'E':>3s} {'fwd MB':>7s} {'fwd+bwd us':>10s} {'GB/s ref':>9s} "
             f"{'mul GB/s ref':>12s}"]
    for n, h, k, e in SHAPES:
        fwd_bytes = 4 * k * 2 * h * n                      # layer._elementwise_bytes' permute term
        t = median_cpu_s(permute_step(n, h, k, e), samples=args.reps)
        rate = 3 * fwd_bytes / (t * scale) / 1e9
        tm = median_cpu_s(mul_step(n * k, h), samples=args.reps)
        mul_rate = 3 * 2 * n * k * h / (tm * scale) / 1e9
        lines.append(f"{n:6d} {h:5d} {k:2d} {e:3d} {fwd_bytes / 1e6:7.2f} {t * 1e6:10.0f} {rate:9.2f} {mul_rate:12.2f}")
    lines.append(f"# constants: CPU_PERMUTE_GB_S_1T {K.CPU_PERMUTE_GB_S_1T}, CPU_ELEMENTWISE_GB_S_1T "
                 f"{K.CPU_ELEMENTWISE_GB_S_1T} (a mix of fast muls and slow transcendental ops)")
    return emit(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
