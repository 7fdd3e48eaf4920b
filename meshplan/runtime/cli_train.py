"""`meshplan train`: plan, then launch training on local processes (torchrun) with that plan.

Run by a user, it plans (or loads `--plan`), prints the plan's summary, writes it to the output
directory, and re-runs itself under torchrun with `--nproc` processes (`--max-restarts` restarts
the whole job from the last checkpoint if a process dies). Each torchrun worker (`--worker`)
builds the model with real weights (same seed on every rank), parallelises it with the plan and
runs the training loop (meshplan.runtime.train).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from meshplan.errors import ConfigError, MeshplanError

DEFAULT_MODEL = "tiny-llama"
# Start-up (rendezvous, rank 0 tokenising the data while the others wait, model set-up) may take
# longer than a step's collectives; --timeout bounds the collectives of the training loop.
SETUP_TIMEOUT_S = 300.0
_FAILURE = "failure-rank"                   # out/failure-rank<N>.txt: why a worker stopped the job


def register(sub) -> None:
    t = sub.add_parser("train", help="plan and train a model on local processes (default: a tiny Llama "
                                     "on the embedded corpus with 4 CPU processes)")
    t.add_argument("--model", default=DEFAULT_MODEL,
                   help="preset name, path/to/file.py:factory, or a transformers config.json")
    t.add_argument("--data", default=None, help="directory of text files or a uint16/uint32 token file "
                                                "(default: the corpus shipped with meshplan)")
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--global-batch", type=int, default=16, help="sequences per step")
    t.add_argument("--seq-len", type=int, default=128)
    t.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                   help="bf16: bf16 compute with fp32 master weights; fp32: everything in fp32")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup", type=int, default=10)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--plan", default=None, help="reuse a saved plan (meshplan plan --json)")
    t.add_argument("--fix", default="", help="constrain the plan, e.g. tp=2,pp=2")
    t.add_argument("--nproc", type=int, default=4, help="processes (GPUs) on this machine")
    t.add_argument("--cluster", default="local-cpu", help="cluster preset or JSON to plan for")
    t.add_argument("--out", default="meshplan-run", help="output directory: plan, metrics.jsonl, checkpoints")
    t.add_argument("--checkpoint-every", type=int, default=50)
    t.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep (0: all)")
    t.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints in the background while training goes on")
    t.add_argument("--no-resume", action="store_true", help="ignore checkpoints already in --out")
    t.add_argument("--max-restarts", type=int, default=0, help="restart the job this many times after a failure")
    t.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait while training before the job fails, naming the rank "
                        "that stopped responding")
    t.add_argument("--worker", metavar="ARGS_JSON", default=None, help=argparse.SUPPRESS)
    # testing aids: one rank crashes (--fail-at-step) or stops responding (--hang-at-step)
    t.add_argument("--fail-at-step", type=int, default=None, help=argparse.SUPPRESS)
    t.add_argument("--hang-at-step", type=int, default=None, help=argparse.SUPPRESS)
    t.add_argument("--hang-rank", type=int, default=1, help=argparse.SUPPRESS)
    t.set_defaults(fn=cmd_train)


def _cluster(name: str, nproc: int):
    from meshplan.cluster import Cluster
    if name.endswith(".json"):
        cl = Cluster.load(name)
    elif name == "local-cpu":
        cl = Cluster.preset("local-cpu")
        if nproc != cl.num_gpus:
            cl = cl.replace(gpus_per_node=nproc, scaleup_domain=nproc)
    else:
        cl = Cluster.preset(name)
    if cl.num_gpus != nproc:
        raise ConfigError(f"cluster {cl.name!r} has {cl.num_gpus} GPUs but --nproc is {nproc}; "
                          "pass --nproc matching the cluster, or a cluster JSON for this machine")
    return cl


def _plan(args):
    import meshplan as mp
    from meshplan.cli import _parse_layout
    from meshplan.planner.plan import Plan
    if args.plan:
        plan = Plan.load(args.plan)
        plan.check_matches(world_size=args.nproc)
        return plan
    cluster = _cluster(args.cluster, args.nproc)
    model = _load(args, "meta")
    fixed = {"cp": 1, "ep": 1, **(_parse_layout(args.fix) if args.fix else {})}
    return mp.plan(model, cluster, seq_len=args.seq_len, global_batch=args.global_batch, fixed=fixed)


def _load(args, device: str):
    """The model: a preset is built at --seq-len; files and configs carry their own lengths."""
    from meshplan.api import load_model
    preset = not args.model.endswith((".py", ".json")) and ".py:" not in args.model
    return load_model(args.model, device=device, **({"seq_len": args.seq_len} if preset else {}))


def cmd_train(args) -> int:
    if args.worker:
        from meshplan.runtime.spawn import exit_worker
        exit_worker(_worker(argparse.Namespace(**json.loads(Path(args.worker).read_text()))))
    from meshplan.runtime.launch import launch_local
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"planning {args.model} for {args.nproc} processes on {args.cluster} ...", file=sys.stderr, flush=True)
    plan = _plan(args)
    print(plan.explain())
    plan_path = out / "plan.json"
    plan.save(plan_path)
    # the workers read their options from a file: on torchrun's command line, options such as
    # --nproc or --max-restarts would be taken by torchrun's own parser (prefix matching)
    settings = {k: v for k, v in vars(args).items() if k != "fn"}
    settings.update(plan=str(plan_path), worker=None)
    args_path = out / "train-args.json"
    args_path.write_text(json.dumps(settings, indent=1))
    worker = ["meshplan.cli", "train", "--worker", str(args_path)]
    for stale in out.glob(f"{_FAILURE}*"):
        stale.unlink()
    print(f"launching {plan.world_size} processes (torchrun); metrics -> {out / 'metrics.jsonl'}",
          file=sys.stderr, flush=True)
    code = launch_local(plan.world_size, worker, module=True, max_restarts=args.max_restarts)
    if code != 0:
        # repeat the workers' diagnosis after torchrun's report, where the user looks first
        for reason in dict.fromkeys(f.read_text() for f in sorted(out.glob(f"{_FAILURE}*"))):
            print(f"meshplan: error: {reason}", file=sys.stderr, flush=True)
    return code


def _worker(args) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from meshplan.planner.plan import Plan
    from meshplan.runtime.parallel import parallelize
    from meshplan.runtime.train import RankHangError, TrainConfig, train
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=max(args.timeout, SETUP_TIMEOUT_S))
    # A private key space per restart attempt: after a restart, gloo must not find the previous
    # attempt's addresses in torchrun's store (seen as "connectFullMesh ... Connection refused").
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"meshplan/attempt_{attempt}", base),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    try:
        plan = Plan.load(args.plan)
        torch.manual_seed(args.seed)
        model = _load(args, "cpu")
        pm = parallelize(model, plan, compute_dtype=None if args.precision == "fp32" else "plan")
        cfg = TrainConfig(steps=args.steps, lr=args.lr, warmup=min(args.warmup, args.steps), seed=args.seed,
                          data=args.data, out_dir=args.out, checkpoint_every=args.checkpoint_every,
                          keep_checkpoints=getattr(args, "keep", 2),
                          async_checkpoint=getattr(args, "async_checkpoint", False),
                          resume=not args.no_resume, collective_timeout_s=args.timeout,
                          fail_at_step=args.fail_at_step, hang_at_step=getattr(args, "hang_at_step", None),
                          hang_rank=getattr(args, "hang_rank", 1))
        try:
            res = train(model, plan, cfg, pm=pm)
        except (RankHangError, MeshplanError) as e:
            # a clean reason (a hung rank, a full disk, a damaged checkpoint, ...); the non-zero
            # exit makes torchrun stop the remaining ranks; cmd_train repeats it after torchrun's report
            print(f"meshplan: error: {e}", file=sys.stderr, flush=True)
            try:
                (Path(args.out) / f"{_FAILURE}{dist.get_rank()}.txt").write_text(str(e))
            except OSError:
                pass                        # e.g. the full disk itself: the line above is still there
            return 1 if isinstance(e, RankHangError) else 2
        if dist.get_rank() == 0 and res.losses:
            first, last = res.losses[min(res.losses)], res.losses[max(res.losses)]
            print(f"\ntrained steps {res.start_step + 1}..{res.final_step}: loss {first:.3f} -> {last:.3f}; "
                  f"checkpoint {res.checkpoint}", flush=True)
    finally:
        dist.destroy_process_group()
    return 0
