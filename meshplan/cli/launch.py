"""`meshplan launch`: start a training command on N local processes (torchrun) or submit it to Slurm.

    meshplan launch --nproc 4 -- train.py --lr 3e-4
    meshplan launch --plan plan.json -- meshplan train --plan plan.json
    meshplan launch --plan plan.json --slurm --partition gpu --time 04:00:00 -- meshplan train --plan plan.json
    meshplan launch --nproc 8 --nnodes 2 --slurm --dry-run -- -m mypkg.train   # print the script only
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from meshplan.api import Plan
from meshplan.errors import ConfigError
from meshplan.train.launch import layout_from_plan

__all__ = ["register", "cmd_launch"]

_DEFAULT_SCRIPT = "meshplan-job.sbatch"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "launch", help="run a training command on N processes (torchrun) or as a Slurm job",
        description="Start `command` on every process: a script (train.py ...), a module (-m pkg.mod ...) or "
                    "`meshplan train ...`. Put it after --.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--plan", metavar="PLAN.json", help="take the process count (and nodes, GPUs per node) from a plan")
    size.add_argument("--nproc", type=int, metavar="N", help="processes per node (GPUs per node with --slurm)")
    p.add_argument("--nnodes", type=int, default=None, metavar="N",
                   help="nodes (default: 1, or the plan's cluster); locally, run the same command on each node")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="rendezvous of a multi-node run without Slurm (the first node's address)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart all processes up to K times when one fails (torchrun's elastic agent)")
    p.add_argument("--slurm", action="store_true", help="write a Slurm batch script (srun + torchrun) and sbatch it")
    p.add_argument("--dry-run", action="store_true",
                   help="print the torchrun command / Slurm script instead of running or submitting it")
    p.add_argument("--out", metavar="SCRIPT.sh",
                   help=f"where to write the Slurm script (default: ./{_DEFAULT_SCRIPT}; with --dry-run: stdout)")
    p.add_argument("--time", default="01:00:00", help="Slurm time limit (default 01:00:00)")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--job-name", default="meshplan", help="Slurm job name")
    p.add_argument("--cpus-per-task", type=int, default=None,
                   help="Slurm CPUs per node-task (default: 8 per GPU)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="what each process runs, after --: script.py args | -m module args | meshplan train args")
    p.set_defaults(fn=cmd_launch)


def _sizes(args) -> tuple[int, int, str]:
    """(nodes, processes per node, a note saying where the numbers came from)."""
    if args.plan:
        if not Path(args.plan).is_file():
            raise ConfigError(f"plan file {args.plan!r} does not exist; write one with "
                              "`meshplan plan ... --json plan.json`")
        plan = Plan.load(args.plan)
        nodes, per_node = layout_from_plan(plan, nnodes=args.nnodes)
        return nodes, per_node, f"plan {args.plan}: world size {plan.world_size}"
    if args.nproc is None:
        raise ConfigError("say how many processes: --nproc N (per node) or --plan plan.json")
    return args.nnodes or 1, args.nproc, f"--nproc {args.nproc}"


def cmd_launch(args) -> int:
    from meshplan.train.launch import (
        SlurmJob,
        launch_local,
        slurm_script,
        submit_slurm,
        target_spec,
        torchrun_command,
    )
    target = target_spec(args.command)
    nodes, per_node, source = _sizes(args)
    if not args.slurm:
        if args.dry_run:
            print(shlex.join(torchrun_command(per_node, target, nnodes=nodes, max_restarts=args.max_restarts,
                                              rdzv_endpoint=args.rdzv_endpoint)))
            return 0
        where = f"on this node, one of {nodes}" if nodes > 1 else "on this machine"
        print(f"launching {per_node} process(es) {where} ({source})", file=sys.stderr, flush=True)
        return launch_local(per_node, target, nnodes=nodes, max_restarts=args.max_restarts,
                            rdzv_endpoint=args.rdzv_endpoint)
    if args.rdzv_endpoint:
        raise ConfigError("--rdzv-endpoint is for runs without Slurm; a Slurm job meets on its first node")
    job = SlurmJob(target=target, nodes=nodes, gpus_per_node=per_node, cpus_per_task=args.cpus_per_task,
                   time=args.time, partition=args.partition, account=args.account, job_name=args.job_name,
                   max_restarts=args.max_restarts, comment=source)
    text = slurm_script(job)
    if args.dry_run and not args.out:
        sys.stdout.write(text)
        return 0
    path = Path(args.out or _DEFAULT_SCRIPT)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    print(f"Slurm script written to {path} ({nodes} node(s) x {per_node} GPU(s))", file=sys.stderr)
    if args.dry_run:
        return 0
    code, output = submit_slurm(str(path))
    print(output)
    return code
