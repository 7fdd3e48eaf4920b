"""`meshplan estimate`, `plan`, `models`, `clusters`: the planning subcommands (thin over
meshplan.estimate / meshplan.plan)."""

from __future__ import annotations

import sys
import time

import meshplan as mp
from meshplan.cli.common import cluster_from_args, parse_layout
from meshplan.ir.precision import PLAN_CHOICES, PRICED, Precision
from meshplan.cluster import GPUS, Cluster
from meshplan.errors import MeshplanError
from meshplan.export import EXPORT_STACKS, FORMATS as EXPORT_FORMATS, export_constraints, export_text
from meshplan.ir.stack import STACKS
from meshplan.reports.html import write_plan_report

__all__ = ["register"]


def cmd_estimate(args) -> int:
    cluster = cluster_from_args(args)
    layout = parse_layout(args.layout)
    est = mp.estimate(args.model, cluster, layout, seq_len=args.seq_len, global_batch=args.global_batch,
                      precision=args.precision, stack=args.stack)
    if args.json:
        print(est.to_json())
    else:
        print(est.summary())
    return 0


def cmd_plan(args) -> int:
    cluster = cluster_from_args(args)
    fixed = parse_layout(args.fix) if args.fix else None
    # an exported plan runs on the target framework: plan for its stack unless --stack says otherwise
    stack = args.stack or (EXPORT_STACKS[args.export] if args.export else "meshplan")
    if args.export and args.stack and args.stack != EXPORT_STACKS[args.export]:
        raise MeshplanError(f"--export {args.export} runs on the {EXPORT_STACKS[args.export]} stack, not {args.stack}; "
                            f"leave --stack out (or pass --stack {EXPORT_STACKS[args.export]})")
    if args.export:
        # what the target cannot run for this model (beyond its stack's offer): planned around, so the
        # top plan exports; a key the user fixed is left as given (the export then names the problem)
        must, why = export_constraints(args.export, args.model, args.precision)
        fixed = dict(fixed or {})
        for (key, value), reason in zip(must.items(), why, strict=True):
            if key not in fixed:
                fixed[key] = value
                print(f"--export {args.export}: planning with {reason}", file=sys.stderr)
        fixed = fixed or None
    t0 = time.perf_counter()
    print(f"planning {args.model} on {cluster.num_gpus} x {cluster.gpu.id} for the {stack} stack ...",
          file=sys.stderr, flush=True)
    pl = mp.plan(args.model, cluster, seq_len=args.seq_len, global_batch=args.global_batch,
                 precision=args.precision, fixed=fixed, top_k=args.top_k,
                 allow_cross_domain=args.allow_cross_domain, fused_kernels=not args.no_fused_kernels,
                 stack=stack)
    print(pl.explain())
    print(f"(planned in {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.json:
        pl.save(args.json)
        print(f"plan written to {args.json}", file=sys.stderr)
    if args.report:
        write_plan_report(pl, args.report)
        print(f"report written to {args.report}", file=sys.stderr)
    if args.export:
        print(export_text(pl, args.export))
    return 0


def cmd_models(args) -> int:
    from meshplan import models
    for name in models.presets():
        c = models.config(name)
        moe = f", {c.experts} experts top-{c.topk}" if c.experts else ""
        print(f"{name:18s} {c.family:5s} {c.layers:4d} layers, hidden {c.hidden}, heads {c.heads}/{c.kv_heads}{moe}")
    return 0


def cmd_clusters(args) -> int:
    print("presets:")
    for name in Cluster.presets():
        c = Cluster.preset(name)
        print(f"  {name:14s} {c.gpus_per_node} x {c.gpu.id} per node, scale-up domain {c.scaleup_domain}")
    print("GPUs:", ", ".join(sorted(GPUS)))
    return 0


def register(sub) -> None:
    e = sub.add_parser("estimate", help="predict step time, throughput, MFU and memory of one layout")
    e.add_argument("--model", default="llama3-8b",
                   help="preset name (see `meshplan models`), path/to/file.py:factory, or a transformers config.json")
    e.add_argument("--cluster", default="dgx-h100", help="cluster preset or a cluster JSON file")
    e.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the preset's)")
    e.add_argument("--layout", default="", help="e.g. tp=2,pp=1,dp=4,mbs=1,recompute=selective,zero=1")
    e.add_argument("--seq-len", type=int, default=8192)
    e.add_argument("--global-batch", type=int, default=128, help="sequences per step")
    e.add_argument("--precision", default=Precision.BF16, choices=[p.value for p in PRICED])
    e.add_argument("--json", action="store_true", help="print the Estimate as JSON")
    e.add_argument("--stack", default=None, choices=list(STACKS),
                   help="the software that runs the layout (default: the stack-neutral reference)")
    e.set_defaults(fn=cmd_estimate)
    p = sub.add_parser("plan", help="find the fastest layout that fits and explain it")
    p.add_argument("--model", default="llama3-8b",
                   help="preset name (see `meshplan models`), path/to/file.py:factory, or a transformers config.json")
    p.add_argument("--cluster", default="dgx-h100", help="cluster preset or a cluster JSON file")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the preset's)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--global-batch", type=int, default=128, help="sequences per step")
    p.add_argument("--precision", default=Precision.BF16, choices=PLAN_CHOICES,
                   help="the names plan() and train --precision take")
    p.add_argument("--fix", default="", help="constrain layout keys, e.g. tp=4,pp=8")
    p.add_argument("--top-k", type=int, default=5, help="runner-ups to keep")
    p.add_argument("--allow-cross-domain", action="store_true", help="let TP/EP span scale-up domains")
    p.add_argument("--no-fused-kernels", action="store_true",
                   help="keep every module eager (no fused RMSNorm/SwiGLU/linear+CE) and cost it so")
    p.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    p.add_argument("--report", metavar="PATH", help="write a self-contained HTML report of the plan")
    p.add_argument("--stack", default=None, choices=list(STACKS),
                   help="the software that will run the plan (default: meshplan's runtime; with --export, the "
                        "target's stack)")
    p.add_argument("--export", choices=list(EXPORT_FORMATS),
                   help="print the plan as Megatron-LM flags, a torchtitan config, NeMo 2 or Megatron-Bridge "
                        "overrides")
    p.set_defaults(fn=cmd_plan)
    m = sub.add_parser("models", help="list model presets")
    m.set_defaults(fn=cmd_models)
    c = sub.add_parser("clusters", help="list cluster presets and GPU ids")
    c.set_defaults(fn=cmd_clusters)
