#!/usr/bin/env python
"""Per-parameter host costs of a training step on CPU processes, measured in the regime the
local-cpu cost model prices (4 one-thread processes on the host's cores, gloo): the optimizer's
per-parameter loop and the gradient norm's per-parameter ops, on plain tensors (DDP) and on
DTensors (FSDP2 shards), for constants.CPU_ADAMW_PARAM_S, CPU_ADAMW_DTENSOR_PARAM_S,
CPU_GRAD_NORM_PARAM_S and CPU_GRAD_NORM_DTENSOR_PARAM_S.

Each of 4 torchrun processes builds tiny-llama with `meshplan.parallelize` under the plan for
dp4 ZeRO-0 (DDP: plain tensors) or dp4 ZeRO-1 (FSDP2: DTensors), runs forward and backward, and
times `ParallelModel.clip_grad_norm` and the optimizer step (meshplan.train.optim, as `meshplan
train` builds it) in main-thread CPU seconds (time.thread_time: the process's own work, not the
time-sharing, nor gloo's threads, whose collectives the cost model prices apart). Per parameter
tensor = median over steps / parameter tensors. The cost model's constants are CPU seconds at the
reference rate that run at `cpu_rate_scale` of a core's worth: a process that measured c CPU
seconds needed c x nproc / cores wall seconds, which the model writes as constant / scale, so
constant = c x nproc / cores x cpu_rate_scale(local-cpu).

    python benchmarks/cpu_host_costs.py [--steps 25] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import torchrun_json  # noqa: E402
from _report import emit  # noqa: E402

NPROC = 4
LAYOUTS = {"plain (DDP, zero 0)": "dp=4,tp=1,pp=1,cp=1,zero=0", "DTensor (FSDP2, zero 1)": "dp=4,tp=1,pp=1,cp=1,zero=1"}


def worker(fix: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    import meshplan as mp
    from meshplan.runtime import parallelize
    from meshplan.train.optim import build_optimizer
    cluster = mp.Cluster.preset("local-cpu").replace(gpus_per_node=NPROC, scaleup_domain=NPROC)
    fixed = {k: int(v) for k, v in (kv.split("=") for kv in fix.split(","))}
    plan = mp.plan(mp.models.build("tiny-llama", device="meta"), cluster, seq_len=128, global_batch=16,
                   fixed=fixed)
    torch.manual_seed(0)
    pm = parallelize(mp.models.build("tiny-llama", device="cpu"), plan)
    opt = build_optimizer(pm.parameters(), lr=1e-4, device=pm.device)
    ids = torch.randint(0, 256, (16, 128))
    clip, step = [], []
    for _ in range(steps):
        dist.barrier()
        pm.forward_backward(ids, ids)
        t = time.thread_time()
        pm.clip_grad_norm(1.0)
        clip.append(time.thread_time() - t)
        t = time.thread_time()
        opt.step()
        step.append(time.thread_time() - t)
        pm.zero_grad()
    n = sum(1 for _ in pm.parameters())
    skip = min(5, steps // 2)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"params": n, "mode": pm.data_parallel,
                                         "clip": statistics.median(clip[skip:]) / n,
                                         "adamw": statistics.median(step[skip:]) / n}))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--out")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.worker[2])
        return 0
    from meshplan.cluster import Cluster
    from meshplan.cost_models import constants as K
    from meshplan.cost_models.host import cpu_rate_scale
    scale = cpu_rate_scale(Cluster.preset("local-cpu").replace(gpus_per_node=NPROC, scaleup_domain=NPROC))
    to_ref = NPROC / K.CPU_HOST_CORES * scale
    lines = [f"# per-parameter host costs, {NPROC} gloo processes on {os.cpu_count()} cores, tiny-llama, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"# main-thread CPU us per parameter tensor; reference units = x {NPROC}/{K.CPU_HOST_CORES} "
             f"x cpu_rate_scale {scale:.2f} = x {to_ref:.2f}",
             f"{'parameters':26s} {'mode':5s} {'n':>3s} {'clip us':>8s} {'ref':>6s} {'AdamW us':>9s} {'ref':>6s}"]
    for label, fix in LAYOUTS.items():
        r = torchrun_json(__file__, [fix, str(args.steps)], NPROC, label)
        lines.append(f"{label:26s} {r['mode']:5s} {r['params']:3d} {r['clip'] * 1e6:8.0f} {r['clip'] * 1e6 * to_ref:6.0f} "
                     f"{r['adamw'] * 1e6:9.0f} {r['adamw'] * 1e6 * to_ref:6.0f}")
    lines.append(f"# constants: CPU_GRAD_NORM_PARAM_S {K.CPU_GRAD_NORM_PARAM_S * 1e6:.0f}, CPU_GRAD_NORM_DTENSOR_PARAM_S "
                 f"{K.CPU_GRAD_NORM_DTENSOR_PARAM_S * 1e6:.0f}, CPU_ADAMW_PARAM_S {K.CPU_ADAMW_PARAM_S * 1e6:.0f}, "
                 f"CPU_ADAMW_DTENSOR_PARAM_S {K.CPU_ADAMW_DTENSOR_PARAM_S * 1e6:.0f} us")
    return emit(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
