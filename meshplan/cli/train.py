"""`meshplan train`: plan, then launch training on local processes (torchrun) with that plan.

Run by a user, it checks every option, plans (or loads `--plan`), prints the plan's summary,
writes it and the job's `JobConfig` (meshplan.train.job) to the output directory, and re-runs
itself under torchrun with `--nproc` processes (`--max-restarts` restarts the whole job from the
last checkpoint if a process dies). Each torchrun worker (`--worker JOB_JSON`) reads the JobConfig
back and runs meshplan.train.worker: process group, model, parallelize, the training loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import meshplan as mp
from meshplan.api import Plan, load_model
from meshplan.cli import data as data_cli
from meshplan.cli.common import parse_layout
from meshplan.cluster import Cluster
from meshplan.errors import ConfigError
from meshplan.ir.layout import OPTIMIZER_DTYPES
from meshplan.ir.precision import PLAN_CHOICES, Precision
from meshplan.train.job import MOE_FIELDS, JobConfig
from meshplan.train.launch import (
    launch_local,
    layout_from_plan,
    under_torchrun,
    wait_for_endpoint,
)
from meshplan.train.spawn import exit_worker
from meshplan.train.worker import FAILURE_PREFIX, run_precision, run_worker

DEFAULT_MODEL = "tiny-llama"
DEFAULT_SEQ, DEFAULT_BATCH = 128, 16
__all__ = ["register", "cmd_train", "train_config", "run_precision", "check_fp8_backend"]


def register(sub) -> None:
    t = sub.add_parser("train", help="plan and train a model on local processes (default: a tiny Llama "
                                     "on the embedded corpus with 4 CPU processes)")
    t.add_argument("--model", default=None,
                   help="preset name, path/to/file.py:factory, or a transformers config.json (default: the "
                        f"model --plan was made for, else {DEFAULT_MODEL})")
    t.add_argument("--data", default=None, help="a directory from `meshplan data prepare`, text files (a file or "
                                                "directory), JSONL/Parquet files, a uint16/uint32 token file, or a "
                                                "blend A:0.7,B:0.3 (default: the corpus shipped with meshplan)")
    t.add_argument("--steps", type=int, default=100)
    t.add_argument("--global-batch", type=int, default=None,
                   help=f"sequences per step (default: the plan's with --plan, else {DEFAULT_BATCH})")
    t.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per sequence (default: the plan's with --plan, else {DEFAULT_SEQ})")
    t.add_argument("--precision", default=None, choices=PLAN_CHOICES,
                   help="planning: the precision to plan for (default bf16; plan() takes the same names). "
                        "With --plan: the plan's precision by default; another value is an explicit override "
                        "(e.g. --precision bf16 trains an FP8 plan in BF16). bf16/fp16: that compute with fp32 "
                        "master weights; fp8: the plan's FP8 modules run FP8 linears (torchao on CPU, emulated; "
                        "Transformer Engine or torchao on GPUs), the rest bf16; fp32: everything in fp32")
    t.add_argument("--fp8-backend", default="auto", choices=["auto", "torchao", "te"],
                   help="FP8 linears: auto = Transformer Engine on CUDA when installed, else torchao")
    t.add_argument("--fp8-recipe", default=None, choices=["tensorwise", "rowwise", "delayed"],
                   help="FP8 scaling: tensorwise (per-tensor current scaling), rowwise (torchao), delayed (TE's "
                        "per-tensor scaling from an amax history); default: the plan's (tensorwise)")
    t.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile each transformer block: auto = on CUDA GPUs only (default: %(default)s)")
    t.add_argument("--optimizer-dtype", default=None, choices=list(OPTIMIZER_DTYPES),
                   help="Adam moments' dtype (master weights stay fp32); default: the plan's layout (fp32)")
    t.add_argument("--optimizer", default=None, choices=["adamw", "muon"],
                   help="muon: Muon (Newton-Schulz orthogonalised momentum) for the hidden matrices, AdamW for "
                        "embeddings, head, norms, routers; planned and priced as such; default: the plan's (adamw)")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup", type=int, default=10)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--plan", default=None, help="reuse a saved plan (meshplan plan --json)")
    t.add_argument("--fix", default="", help="constrain the plan, e.g. tp=2,pp=2")
    t.add_argument("--nproc", type=int, default=None,
                   help="processes (GPUs) on this machine (default: 4, or what --plan needs)")
    t.add_argument("--nnodes", type=int, default=1, help="machines in the job; each runs this same command")
    t.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 .. nnodes-1")
    t.add_argument("--rdzv-endpoint", metavar="HOST:PORT", default=None,
                   help="where the machines meet (node 0's address and a free port); needed with --nnodes > 1")
    t.add_argument("--rdzv-timeout", type=float, default=300.0,
                   help="seconds to wait for the other machines at the rendezvous")
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
    _register_training_options(t)
    data_cli.register_train_options(t)
    t.add_argument("--worker", metavar="JOB_JSON", default=None, help=argparse.SUPPRESS)
    # testing aids: one rank crashes (--fail-at-step) or stops responding (--hang-at-step)
    t.add_argument("--fail-at-step", type=int, default=None, help=argparse.SUPPRESS)
    t.add_argument("--hang-at-step", type=int, default=None, help=argparse.SUPPRESS)
    t.add_argument("--hang-rank", type=int, default=1, help=argparse.SUPPRESS)
    t.set_defaults(fn=cmd_train)


def _register_training_options(t) -> None:
    g = t.add_argument_group("MoE load balancing (model config options; see docs/training.md)")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=None,
                   help="coefficient of the load-balancing loss added to the training loss (e.g. 1e-2)")
    g.add_argument("--moe-aux-loss-scope", choices=["global", "local"], default=None,
                   help="global (default): counts over dp x cp ranks and micro-batches; local: per micro-batch")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="router z-loss coefficient (e.g. 1e-3)")
    g.add_argument("--moe-expert-bias", action="store_const", const=True, default=None,
                   help="aux-loss-free balancing (DeepSeek-V3): fp32 per-expert bias updated every step")
    g.add_argument("--moe-bias-update-rate", type=float, default=None, help="expert-bias step (default 1e-3)")
    g.add_argument("--moe-capacity-factor", type=float, default=None,
                   help="drop token copies past capacity_factor x N k / E per expert (default: dropless)")
    g.add_argument("--moe-force-balance", action="store_const", const=True, default=None,
                   help="benchmarking: route round-robin, every expert equally loaded")
    g = t.add_argument_group("schedule, checkpoints, batch ramp-up, fine-tuning")
    g.add_argument("--lr-schedule", choices=["cosine", "wsd"], default="cosine",
                   help="cosine decay after warm-up, or WSD (warm-up, stable, decay)")
    g.add_argument("--wsd-decay-steps", type=int, default=None, help="WSD: steps of the final decay (default 10%%)")
    g.add_argument("--wsd-decay-style", choices=["linear", "cosine", "minus_sqrt"], default="linear")
    g.add_argument("--profile", metavar="FIRST:LAST", default=None,
                   help="run torch.profiler over these steps (e.g. 6:8) on every rank; writes a Chrome trace "
                        "and an operator table per rank to OUT/profile/")
    g.add_argument("--keep-every", type=int, default=0,
                   help="also keep every checkpoint whose step is a multiple of this (milestones)")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"),
                   default=None, help="grow the global batch from START by INCREMENT over SAMPLES samples")
    g.add_argument("--batch-schedule", metavar="STEP:BATCH,...", default=None,
                   help='global batch by step, e.g. "0:64,100:128,500:256" (64 from step 0, 128 from step 100, '
                        "...); the plan is made for the last, largest batch (--global-batch defaults to it)")
    g.add_argument("--init-from", default=None,
                   help="fine-tune: load only the weights from a checkpoint or a safetensors directory")
    g = t.add_argument_group("observability and fp16")
    g.add_argument("--log", metavar="tensorboard,wandb", default="",
                   help="also log metrics to TensorBoard (<out>/tb) and/or Weights & Biases (WANDB_MODE=offline "
                        "is honoured); each needs its package installed")
    g.add_argument("--loss-scaling", choices=["auto", "dynamic", "off"], default="auto",
                   help="fp16 dynamic loss scaling: auto = when the model computes in fp16")
    g.add_argument("--fp32-grads", metavar="PATTERNS", default=None,
                   help="parameters whose gradients reduce in fp32 when the plan reduces in bf16 (grad_dtype "
                        "bf16), e.g. router,expert_bias,norm (substrings or globs of parameter names)")


def _moe_overrides(args) -> dict:
    return {k: getattr(args, k) for k in MOE_FIELDS if getattr(args, k, None) is not None}


def _cluster(name: str, nproc: int, nnodes: int = 1):
    if name.endswith(".json"):
        cl = Cluster.load(name)
    elif name == "local-cpu":
        cl = Cluster.preset("local-cpu")
        if (nproc, nnodes) != (cl.gpus_per_node, cl.nodes):
            cl = cl.replace(gpus_per_node=nproc, nodes=nnodes, scaleup_domain=nproc)
    else:
        cl = Cluster.preset(name, nodes=nnodes)
    if cl.num_gpus != nproc * nnodes:
        raise ConfigError(f"cluster {cl.name!r} has {cl.num_gpus} GPUs but the job has {nnodes} node(s) x "
                          f"{nproc} processes; pass --nproc / --nnodes matching the cluster, or a cluster "
                          "JSON for these machines")
    return cl


def _plan(args, world_size: int | None = None):
    """The job's plan: --plan's (checked against the job's size), else a fresh plan for
    --nnodes x --nproc processes. Planning is deterministic, so every node (and, under torchrun,
    every rank) that plans gets the same plan."""
    if args.plan:
        if not Path(args.plan).is_file():
            raise ConfigError(f"plan file {args.plan!r} does not exist; write one with "
                              "`meshplan plan ... --json plan.json`")
        plan = Plan.load(args.plan)
        if world_size is None and args.nproc is not None:
            world_size = args.nproc * args.nnodes
        if world_size is not None:
            plan.check_matches(world_size=world_size)
        return _with_options(plan, args)
    nproc, nnodes = args.nproc or 4, args.nnodes
    if world_size is not None:
        nproc = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        nnodes = max(1, world_size // nproc)
    cluster = _cluster(args.cluster, nproc, nnodes)
    model = _load(args, "meta")
    fixed = parse_layout(args.fix) if args.fix else {}
    if getattr(args, "optimizer_dtype", None):
        fixed["optimizer_dtype"] = args.optimizer_dtype
    if getattr(args, "optimizer", None):
        fixed["optimizer"] = args.optimizer
    if getattr(args, "fp8_recipe", None) in ("tensorwise", "rowwise"):
        fixed["fp8_recipe"] = args.fp8_recipe       # priced as run
    # "delayed" runs on Transformer Engine; the meshplan stack prices torchao's tensorwise casts for it,
    # which cost more than delayed scaling's (constants.FP8_QUANT_BYTES): the plan errs slow
    plan = mp.plan(model, cluster, seq_len=args.seq_len, global_batch=args.global_batch, fixed=fixed,
                   precision=getattr(args, "precision", None) or Precision.BF16)
    return _with_options(dataclasses.replace(plan, model_source=args.model), args)


def _with_options(plan, args):
    """--optimizer-dtype and --optimizer applied to the plan's layout; an FP8 plan whose backend package is
    missing fails here, before any process is launched, naming the package to install."""
    check_fp8_backend(plan, args)
    want = getattr(args, "optimizer_dtype", None)
    if want and plan.layout.optimizer_dtype != want:
        plan = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, optimizer_dtype=want))
    algo = getattr(args, "optimizer", None)         # --optimizer on a reused plan (--plan)
    if algo and plan.layout.optimizer != algo:
        plan = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, optimizer=algo))
    return plan


def check_fp8_backend(plan, args) -> None:
    """Raise ConfigError naming the package when an FP8 plan's backend is not installed (unless
    an explicit --precision override runs the plan without FP8)."""
    import torch

    from meshplan.runtime.fp8 import resolve_backend
    if plan.precision != Precision.FP8 or not plan.fp8_modules or \
            not run_precision(plan, getattr(args, "precision", None))["fp8"]:
        return
    # the layout's tp and recipe: "auto" resolves as the ranks will (TE only where it runs the layout)
    resolve_backend(getattr(args, "fp8_backend", "auto"), torch.device("cuda" if torch.cuda.is_available() else "cpu"),
                    tp=plan.layout.tp, recipe=getattr(args, "fp8_recipe", None) or plan.layout.fp8_recipe)


def _save_atomic(path: Path, text: str) -> None:
    # nodes sharing a file system write the same file: a reader must never see half of it
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _load(args, device: str):
    """The model: a preset is built at --seq-len; files and configs carry their own lengths."""
    preset = not args.model.endswith((".py", ".json")) and ".py:" not in args.model
    moe = _moe_overrides(args)
    if moe and not preset:
        flag = "--" + next(iter(moe)).replace("_", "-")
        raise ConfigError(f"{flag} sets an option of meshplan's MoE models; {args.model} is not a preset "
                          "(set the option in your model, or use a preset such as --model tiny-moe)")
    return load_model(args.model, device=device, **({"seq_len": args.seq_len, **moe} if preset else {}))


def cmd_train(args) -> int:
    if args.worker:
        job = JobConfig.load(args.worker)
        exit_worker(run_worker(job, lambda device: _load(job, device)))
    if under_torchrun():
        # started by `meshplan launch`, a Slurm script or torchrun itself: this process is one rank
        exit_worker(_in_launcher(args))
    _check_nodes(args)
    saved = _model_from_plan(args)
    train_config(args)                  # every training option is checked before planning
    _check_data(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if saved is not None and args.nproc is None:
        _, args.nproc = layout_from_plan(saved, nnodes=args.nnodes)
    where = f" x {args.nnodes} nodes" if args.nnodes > 1 else ""
    if saved is None:
        print(f"planning {args.model} for {args.nproc or 4} processes{where} on {args.cluster} ...",
              file=sys.stderr, flush=True)
    else:
        print(f"training the plan in {args.plan}: {saved.model} on {saved.world_size} processes{where}",
              file=sys.stderr, flush=True)
    plan = _plan(args)
    args.nproc = plan.world_size // args.nnodes
    _check_host_memory(plan, args.nproc)
    if saved is not None:
        _check_model_matches(plan, args)
    if args.node_rank == 0:
        print(plan.explain())
    plan_path = out / "plan.json"
    _save_atomic(plan_path, plan.to_json())
    # the workers read the job from a file (meshplan.train.job says why not from their command line)
    job = dataclasses.replace(JobConfig.from_options(args), plan=str(plan_path))
    job_path = out / ("train-args.json" if args.nnodes == 1 else f"train-args-node{args.node_rank}.json")
    job.save(job_path)
    worker = ["meshplan.cli", "train", "--worker", str(job_path)]
    for stale in out.glob(f"{FAILURE_PREFIX}*"):
        stale.unlink()
    if args.nnodes > 1 and args.node_rank > 0:
        print(f"node {args.node_rank}: waiting for the rendezvous at {args.rdzv_endpoint} ...",
              file=sys.stderr, flush=True)
        wait_for_endpoint(args.rdzv_endpoint, args.rdzv_timeout)
    print(f"launching {args.nproc} processes (torchrun)"
          + (f" on node {args.node_rank} of {args.nnodes}" if args.nnodes > 1 else "")
          + f"; metrics -> {out / 'metrics.jsonl'}", file=sys.stderr, flush=True)
    multi = dict(nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint,
                 rdzv_timeout_s=args.rdzv_timeout) if args.nnodes > 1 else {}
    code = launch_local(args.nproc, worker, module=True, max_restarts=args.max_restarts, **multi)
    if code != 0:
        # repeat the workers' diagnosis after torchrun's report, where the user looks first
        for reason in dict.fromkeys(f.read_text() for f in sorted(out.glob(f"{FAILURE_PREFIX}*"))):
            print(f"meshplan: error: {reason}", file=sys.stderr, flush=True)
    return code


# ---- checks made before any process starts ------------------------------------------------------
def train_config(args):
    """The training loop's config from the command line, every option checked (ConfigError names
    the flag and a value that works): JobConfig.train_config, which each worker runs again."""
    return JobConfig.from_options(args).train_config()


def _check_data(args) -> None:
    """Open --data as rank 0 will (a text folder is tokenised into the cache the ranks then read)
    and check it holds one global batch of sequences."""
    from meshplan.train.data import TokenDataset
    if getattr(args, "tokenizer", None) or getattr(args, "eval_data", None) or (
            args.data is not None and ("," in args.data or not Path(args.data).exists())):
        from meshplan.train.loop import _vocab
        # blends, tokenizers, validation data (cli/data.py)
        return data_cli.check_train_data(args, _vocab(_load(args, "meta")))
    if args.data is None:
        return
    ds = TokenDataset.open(args.data)
    need = args.seq_len + 1
    if len(ds) < need:
        raise ConfigError(f"--data {args.data!r} holds {len(ds)} tokens, fewer than one sequence of "
                          f"--seq-len {args.seq_len} (+1 target); give more data or a shorter --seq-len")


def _model_from_plan(args) -> Plan | None:
    """With --plan: the saved plan (checked readable here), and --model taken from it when not given.
    Without: --model defaults to the tiny Llama."""
    _batch_from_schedule(args)
    if not args.plan:
        args.model = args.model or DEFAULT_MODEL
        args.seq_len = DEFAULT_SEQ if args.seq_len is None else args.seq_len
        args.global_batch = DEFAULT_BATCH if args.global_batch is None else args.global_batch
        return None
    if not Path(args.plan).is_file():
        raise ConfigError(f"plan file {args.plan!r} does not exist; write one with "
                          "`meshplan plan ... --json plan.json`")
    plan = Plan.load(args.plan)
    for name in ("seq_len", "global_batch"):
        given, planned = getattr(args, name), getattr(plan, name)
        if given is not None and given != planned:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {given} differs from the plan's {planned} ({args.plan}); leave {flag} out "
                              f"to train the plan as made, or re-plan with {flag} {given}")
        setattr(args, name, planned)
    if args.model is None:
        source = plan.model_source or plan.model
        from meshplan import models
        if not (plan.model_source or source in models.presets()):
            raise ConfigError(f"the plan {args.plan!r} was made for model {plan.model!r}, which names no preset "
                              "and no file; pass the model with --model (path/to/file.py:factory or a config JSON)")
        args.model = source
    return plan


def _batch_from_schedule(args) -> None:
    """--batch-schedule: plan for its last (largest) batch; --global-batch, when given, must be it."""
    from meshplan.train.batch_schedule import parse_batch_schedule
    if not getattr(args, "batch_schedule", None):
        return
    last = parse_batch_schedule(args.batch_schedule)[-1][1]
    if args.global_batch is None:
        args.global_batch = last
    elif args.global_batch != last:
        raise ConfigError(f"--global-batch {args.global_batch} differs from the last batch of --batch-schedule "
                          f"({last}); the plan is made for the schedule's final batch: leave --global-batch out "
                          f"or end the schedule at {args.global_batch}")


def _check_model_matches(plan, args) -> None:
    """The model this job builds is the one the plan was made for (structure fingerprint), checked
    on the meta device before launching rather than on every rank after."""
    from meshplan.ir.fingerprint import fingerprint
    fp = fingerprint(_load(args, "meta"))
    if fp != plan.model_fingerprint:
        raise ConfigError(f"--plan {args.plan!r} was made for model {plan.model!r} "
                          f"(seq_len {plan.seq_len}), but --model {args.model} builds another structure; "
                          "pass the plan's model (or leave --model out), or re-plan for this model")


def _check_host_memory(plan, nproc: int) -> None:
    """Where the ranks run on this machine's CPU, the plan's memory per rank (its estimate) times the
    processes started here must fit the memory the machine has free: a plan made for the GPUs of a
    large model would otherwise start, swap and be killed minutes later."""
    import torch
    free = available_host_gb()
    if torch.cuda.is_available() or free is None:
        return
    per_rank = plan.estimate.peak_memory_gb
    if per_rank * nproc > free:
        raise ConfigError(f"the plan for {plan.model} needs ~{per_rank:.1f} GB per process (its estimate on "
                          f"{plan.estimate.cluster}) x {nproc} processes = {per_rank * nproc:.0f} GB, but this "
                          f"machine has {free:.0f} GB free and no GPU; run the plan on the GPUs it was made for, "
                          "or train a model this machine holds (e.g. `meshplan train --model tiny-llama`)")


def available_host_gb() -> float | None:
    """GiB of memory the machine can give new processes (/proc/meminfo MemAvailable); None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_nodes(args) -> None:
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1} (--nnodes {args.nnodes})")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise ConfigError(f"{args.nnodes} nodes need --rdzv-endpoint HOST:PORT: node 0's address (reachable "
                          "from every node) and a free port, the same on every node")
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")


def _in_launcher(args) -> int:
    """`meshplan train` run by torchrun on every rank: plan (or load --plan) for the job's world
    size, rank 0 writes plan.json, then train as a worker."""
    world = int(os.environ["WORLD_SIZE"])
    _model_from_plan(args)
    plan = _plan(args, world_size=world)
    out = Path(args.out)
    if int(os.environ["RANK"]) == 0:
        out.mkdir(parents=True, exist_ok=True)
        print(plan.explain(), flush=True)
        _save_atomic(out / "plan.json", plan.to_json())
    job = JobConfig.from_options(args)
    return run_worker(job, lambda device: _load(job, device), plan=plan)
