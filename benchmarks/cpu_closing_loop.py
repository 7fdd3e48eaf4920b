#!/usr/bin/env python
"""Closing the loop on the one machine CI can measure: the local-cpu cost
model's predicted step against the measured step of `meshplan train`, per layout.

For each layout of the default job (tiny-llama, 4 processes, global batch 16 x 128 tokens; EP on
tiny-moe, the same shapes with 4 experts, routed with forced balance as Megatron benchmarks MoE
throughput: the untrained router of a model without a balancing loss sends nearly every token to
one expert, max/mean 1.96 of a possible 2.0, a state real training does not stay in) this runs `meshplan train --fix <layout> --steps N` with
gloo on local CPU processes, reads metrics.jsonl, and compares the median measured step (after
the first `--skip` warm-up steps) with the plan's predicted step. With `--cluster profile.json`
(written by `meshplan calibrate --nproc 4`) the plan and its prediction use the calibrated machine.

    python benchmarks/cpu_closing_loop.py [--steps 20] [--only dp4,tp2dp2] [--cluster profile.json] [--out FILE]
    python benchmarks/cpu_closing_loop.py --calibrate-each [--steps 20] [--repeat 3]   # re-calibrate before each run
    python benchmarks/cpu_closing_loop.py --predict-only     # predictions alone, no processes (seconds)

--calibrate-each runs `meshplan calibrate --nproc 4 --quick` right before each layout and plans and
predicts that layout with it: on a host shared with other work the load drifts over the minutes a
full run takes, and one calibration at the start describes only its own moment.

Runs one layout at a time (each ~20 steps: tens of seconds on 2 cores). Measured CPU step times
move with what else runs on the host; the report says when it was measured and, per layout, the
1-minute load average before > after the run (4 of it are the run's own processes). Calibrate
right before (`meshplan calibrate --nproc 4 --quick`) so the profile sees the same host.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit  # noqa: E402

# the default job's layouts; world size 4
LAYOUTS = {
    "dp4": ("tiny-llama", "dp=4,tp=1,pp=1,cp=1"),
    "tp2dp2": ("tiny-llama", "tp=2,dp=2,pp=1,cp=1"),
    "pp2dp2": ("tiny-llama", "pp=2,dp=2,tp=1,cp=1"),
    "cp2dp2": ("tiny-llama", "cp=2,dp=2,tp=1,pp=1"),
    "ep2dp2": ("tiny-moe", "ep=2,dp=4,tp=1,pp=1,cp=1"),
}
# model options per layout (meshplan train flags and the matching models.build keywords)
OPTIONS = {"ep2dp2": (["--moe-force-balance"], {"moe_force_balance": True})}
TARGET = 0.15          # the cost model's target: within 15% of the measured step
SEQ, GBS, NPROC = 128, 16, 4
CORES = os.cpu_count() or 1


def _load() -> str:
    """The host's 1-minute load average (other work may share the host: measured CPU steps
    move with it, so every row says what it was)."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def _gflops(cluster: str) -> float:
    """A profile's bf16 matmul rate per process (GFLOP/s)."""
    from meshplan.cluster import Cluster
    return Cluster.load(cluster).gpu.bf16_tflops * 1e3


def _fix_dict(fix: str) -> dict:
    return {k: int(v) for k, v in (kv.split("=") for kv in fix.split(","))}


def predict(model: str, fix: str, cluster: str = "local-cpu", **options):
    """The plan's Estimate for the layout, as `meshplan train` would plan it."""
    import meshplan as mp
    from meshplan.cli.train import _cluster
    cl = _cluster(cluster, NPROC)
    m = mp.models.build(model, device="meta", **options)
    return mp.plan(m, cl, seq_len=SEQ, global_batch=GBS, fixed=_fix_dict(fix)).estimate


def measure(model: str, fix: str, steps: int, skip: int, cluster: str, timeout: int,
            flags: list[str] = ()) -> tuple[float, float, list, float, float, float]:
    """(median measured step s, predicted step s, all measured steps, median MoE imbalance or nan,
    median CPU seconds of rank 0's process per step, and of them after forward and backward) of one
    `meshplan train` run. The imbalance (busiest expert's rows over the mean, the runtime's
    moe_imbalance metric) matters under EP: every EP rank waits for the one holding the busiest
    expert, which the cost model prices only at its statistical floor (layer.moe_load_factor)."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "meshplan.cli", "train", "--model", model, "--fix", fix, "--steps", str(steps),
               "--global-batch", str(GBS), "--seq-len", str(SEQ), "--nproc", str(NPROC), "--out", d,
               "--checkpoint-every", str(10 * steps), "--no-resume", "--cluster", cluster, *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        path = Path(d) / "metrics.jsonl"
        if proc.returncode != 0 or not path.exists():
            raise RuntimeError(f"meshplan train failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    recs = [r for r in recs if "step_time_s" in r]
    times = [r["step_time_s"] for r in recs][skip:]
    pred = next((r["predicted_step_time_s"] for r in recs if r.get("predicted_step_time_s")), float("nan"))
    imb = [r["moe_imbalance"] for r in recs[skip:] if r.get("moe_imbalance")]
    cpu = [r["cpu_time_s"] for r in recs[skip:] if r.get("cpu_time_s")]
    upd = [r["cpu_update_s"] for r in recs[skip:] if r.get("cpu_update_s")]
    return (statistics.median(times), pred, times, (statistics.median(imb) if imb else float("nan")),
            statistics.median(cpu) if cpu else float("nan"), statistics.median(upd) if upd else float("nan"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    ap.add_argument("--only", help="comma-separated layout names: " + ",".join(LAYOUTS))
    ap.add_argument("--cluster", default="local-cpu", help="local-cpu or a `meshplan calibrate` profile")
    ap.add_argument("--predict-only", action="store_true")
    ap.add_argument("--calibrate-each", action="store_true",
                    help="calibrate (meshplan calibrate --nproc 4 --quick) right before each layout and use that profile")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds over the layouts (interleaved); the verdict takes each layout's median")
    ap.add_argument("--keep-profiles", help="with --calibrate-each: keep each layout's profile in this folder")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(LAYOUTS)
    lines = []
    p = lines.append
    p(f"# local-cpu closing the loop, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
      f"{NPROC} processes, global batch {GBS} x {SEQ} tokens, cluster "
      f"{'calibrated before each layout' if args.calibrate_each else args.cluster}")
    p(f"{'layout':8s} {'model':10s} {'predicted':>9s} {'measured':>9s} {'error':>7s}  within {TARGET * 100:.0f}%  "
      f"{'load':>9s} {'cpu':>6s} {'update':>6s} {'packed':>6s}  predicted split")
    ok = True
    tmp = tempfile.TemporaryDirectory(prefix="closing-loop-")
    keep = Path(args.keep_profiles or tmp.name)
    keep.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[tuple[float, float]]] = {n: [] for n in names}    # (predicted, measured) per round
    for rnd in range(1 if args.predict_only else args.repeat):
        for name in names:
            model, fix = LAYOUTS[name]
            cluster = args.cluster
            if args.calibrate_each and not args.predict_only:
                cluster = str(keep / f"{name}-{rnd}.json")
                subprocess.run([sys.executable, "-m", "meshplan.cli", "calibrate", "--nproc", str(NPROC), "--quick",
                                "--out", cluster], capture_output=True, text=True, check=True, timeout=args.timeout)
            flags, options = OPTIONS.get(name, ([], {}))
            est = predict(model, fix, cluster, **options)
            split = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in est.time_s.items() if v > 5e-4)
            if args.predict_only:
                p(f"{name:8s} {model:10s} {est.step_time_s:9.3f} {'-':>9s} {'-':>7s}  {'-':9s}  {split} ms")
                continue
            load0 = _load()
            try:
                med, pred, _, imb, cpu, upd = measure(model, fix, args.steps, args.skip, cluster, args.timeout, flags)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                p(f"{name:8s} {model:10s} {est.step_time_s:9.3f} {'failed':>9s}  {str(e).splitlines()[0][:80]}")
                ok = False
                continue
            runs[name].append((pred, med))
            err = pred / med - 1
            load = f"{load0}>{_load()}"
            if args.calibrate_each:
                split = f"calibrated {_gflops(cluster):.0f} GFLOP/s/process; " + split
            # cpu: rank 0's process CPU per step (update: of it, what follows forward and backward);
            # packed: the step if the 4 processes' CPU work filled the host's cores with no idle time
            # (wall above it: waits for a peer to be scheduled, or other jobs)
            packed = cpu * NPROC / CORES
            tag = f"{name}" + (f"/{rnd + 1}" if args.repeat > 1 else "")
            p(f"{tag:8s} {model:10s} {pred:9.3f} {med:9.3f} {err * 100:+6.1f}%  {'yes' if abs(err) <= TARGET else 'NO':9s}  "
              f"{load:>9s} {cpu:6.3f} {upd:6.3f} {packed:6.3f}  {split} ms" + ("" if math.isnan(imb) else f"; measured MoE imbalance {imb:.2f}"))
            print(lines[-1], flush=True)
    if args.predict_only:
        return emit(lines, args.out)
    # the verdict: per layout, the median over rounds of predicted and of measured (a round that met
    # a burst of other work on the shared host moves the median less than the mean)
    p(f"# median over {args.repeat} round(s)")
    for name in names:
        if not runs[name]:
            continue
        pred = statistics.median(r[0] for r in runs[name])
        med = statistics.median(r[1] for r in runs[name])
        err = pred / med - 1
        ok &= abs(err) <= TARGET
        # the rounds' own errors: how far one round on the shared host can stray from the median
        errs = sorted(pr / me - 1 for pr, me in runs[name])
        spread = f"  rounds {errs[0] * 100:+.0f}..{errs[-1] * 100:+.0f}%" if len(errs) > 1 else ""
        p(f"{name:8s} {LAYOUTS[name][0]:10s} {pred:9.3f} {med:9.3f} {err * 100:+6.1f}%  "
          f"{'yes' if abs(err) <= TARGET else 'NO'}{spread}")
        print(lines[-1], flush=True)
    return emit(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
