"""`meshplan calibrate`: measure this machine and write a cluster profile (thin over
meshplan.cost_models.calibrate)."""

from __future__ import annotations

import sys

from meshplan.cost_models.calibrate import run_calibration, save_profile

__all__ = ["register", "cmd_calibrate"]


def cmd_calibrate(args) -> int:
    cluster, cal = run_calibration(args.base, args.nproc, args.quick)
    save_profile(cluster, cal, args.out)
    print(cluster.describe())
    print(f"measured in {cal.seconds:.1f} s; profile written to {args.out}", file=sys.stderr)
    print(f"use it with: meshplan plan --cluster {args.out}   (or estimate / whatif)", file=sys.stderr)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure this machine's matmul throughput and collective bandwidth; write a cluster profile",
        description="Measure matrix-multiply throughput (bf16/fp32 on CPU, bf16/fp8 on CUDA), memory bandwidth "
                    "and all_reduce/all_gather bus bandwidth over --nproc local processes, and write a cluster "
                    "JSON that `plan`, `estimate` and `whatif` accept as --cluster.")
    p.add_argument("--out", default="cluster-profile.json", help="profile to write (default: %(default)s)")
    p.add_argument("--base", default="local-cpu",
                   help="preset (or cluster JSON) whose unmeasured figures are kept: local-cpu measures the CPU; "
                        "a GPU preset (e.g. dgx-h100) measures the CUDA devices (default: %(default)s)")
    p.add_argument("--nproc", type=int, default=2, help="processes for the collective benchmark (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="fewer shapes, sizes and repetitions (seconds on a laptop)")
    p.set_defaults(fn=cmd_calibrate)
