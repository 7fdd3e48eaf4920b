"""The `meshplan` command: thin over the Python API (parse, call, print)."""

from __future__ import annotations

import argparse
import sys

from meshplan.errors import MeshplanError

# modules that add subcommands (train, launch, whatif, calibrate) with register(subparsers)
_SUBCOMMAND_MODULES: tuple[str, ...] = ("meshplan.runtime.cli_train", "meshplan.runtime.cli_launch", "meshplan.reports.cli_whatif", "meshplan.reports.cli_calibrate")

_LAYOUT_INT = ("tp", "cp", "ep", "etp", "pp", "vp", "dp", "zero", "mbs")


def _parse_layout(text: str) -> dict:
    """'tp=8,pp=4,recompute=full' -> dict (ints where the key is a degree)."""
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise MeshplanError(f"layout item {part!r} is not key=value (e.g. --layout tp=8,pp=4,dp=2)")
        k, v = (s.strip() for s in part.split("=", 1))
        if k in _LAYOUT_INT:
            try:
                out[k] = int(v)
            except ValueError:
                raise MeshplanError(f"layout {k}={v!r}: must be an integer") from None
        elif k in ("sp", "tp_comm_overlap", "flash_attention"):
            out[k] = v.lower() in ("1", "true", "yes", "on")
        elif k == "recompute" and v.isdigit():
            out[k] = int(v)
        else:
            out[k] = v
    return out


def _cluster(args):
    from meshplan.cluster import Cluster
    if args.cluster.endswith(".json"):
        return Cluster.load(args.cluster)
    opts = {}
    if args.nodes:
        opts["nodes"] = args.nodes
    return Cluster.preset(args.cluster, **opts)


def cmd_estimate(args) -> int:
    import meshplan as mp
    cluster = _cluster(args)
    layout = _parse_layout(args.layout)
    est = mp.estimate(args.model, cluster, layout, seq_len=args.seq_len, global_batch=args.global_batch,
                      precision=args.precision)
    if args.json:
        print(est.to_json())
    else:
        print(est.summary())
    return 0


def cmd_plan(args) -> int:
    import meshplan as mp
    cluster = _cluster(args)
    fixed = _parse_layout(args.fix) if args.fix else None
    t0 = __import__("time").perf_counter()
    print(f"planning {args.model} on {cluster.num_gpus} x {cluster.gpu.id} ...", file=sys.stderr, flush=True)
    pl = mp.plan(args.model, cluster, seq_len=args.seq_len, global_batch=args.global_batch,
                 precision=args.precision, fixed=fixed, top_k=args.top_k,
                 allow_cross_domain=args.allow_cross_domain, fused_kernels=not args.no_fused_kernels,
                 for_runtime=not args.export)     # an exported plan runs on the target framework
    print(pl.explain())
    print(f"(planned in {__import__('time').perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.json:
        pl.save(args.json)
        print(f"plan written to {args.json}", file=sys.stderr)
    if args.report:
        from meshplan.reports.html import write_plan_report
        write_plan_report(pl, args.report)
        print(f"report written to {args.report}", file=sys.stderr)
    if args.export:
        from meshplan.reports.export import export_text
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
    from meshplan.cluster import GPUS, Cluster
    print("presets:")
    for name in Cluster.presets():
        c = Cluster.preset(name)
        print(f"  {name:14s} {c.gpus_per_node} x {c.gpu.id} per node, scale-up domain {c.scaleup_domain}")
    print("GPUs:", ", ".join(sorted(GPUS)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="meshplan", description="Auto-parallel planner for PyTorch training.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("estimate", help="predict step time, throughput, MFU and memory of one layout")
    e.add_argument("--model", default="llama3-8b",
                   help="preset name (see `meshplan models`), path/to/file.py:factory, or a transformers config.json")
    e.add_argument("--cluster", default="dgx-h100", help="cluster preset or a cluster JSON file")
    e.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the preset's)")
    e.add_argument("--layout", default="", help="e.g. tp=2,pp=1,dp=4,mbs=1,recompute=selective,zero=1")
    e.add_argument("--seq-len", type=int, default=8192)
    e.add_argument("--global-batch", type=int, default=128, help="sequences per step")
    e.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp8"])
    e.add_argument("--json", action="store_true", help="print the Estimate as JSON")
    e.set_defaults(fn=cmd_estimate)
    p = sub.add_parser("plan", help="find the fastest layout that fits and explain it")
    p.add_argument("--model", default="llama3-8b",
                   help="preset name (see `meshplan models`), path/to/file.py:factory, or a transformers config.json")
    p.add_argument("--cluster", default="dgx-h100", help="cluster preset or a cluster JSON file")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the preset's)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--global-batch", type=int, default=128, help="sequences per step")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16", "fp8", "auto"],
                   help="the names plan() and train --precision take")
    p.add_argument("--fix", default="", help="constrain layout keys, e.g. tp=4,pp=8")
    p.add_argument("--top-k", type=int, default=5, help="runner-ups to keep")
    p.add_argument("--allow-cross-domain", action="store_true", help="let TP/EP span scale-up domains")
    p.add_argument("--no-fused-kernels", action="store_true",
                   help="keep every module eager (no fused RMSNorm/SwiGLU/linear+CE) and cost it so")
    p.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    p.add_argument("--report", metavar="PATH", help="write a self-contained HTML report of the plan")
    p.add_argument("--export", choices=["megatron", "torchtitan", "nemo"],
                   help="print the plan as Megatron-LM flags, a torchtitan config or NeMo overrides")
    p.set_defaults(fn=cmd_plan)
    m = sub.add_parser("models", help="list model presets")
    m.set_defaults(fn=cmd_models)
    c = sub.add_parser("clusters", help="list cluster presets and GPU ids")
    c.set_defaults(fn=cmd_clusters)
    # Other subcommands live next to the code they drive; each module has register(subparsers).
    import importlib
    for mod in _SUBCOMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--"]:
        # torchrun received `meshplan.cli -- train ...`: the `--` keeps its own parser away from
        # our options (meshplan.runtime.launch.torchrun_command); it is not ours to parse
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except MeshplanError as e:
        print(f"meshplan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
