"""`meshplan whatif`: capacity-planning sweeps from the command line.

    meshplan whatif --model llama3-405b --tokens 15T --seq-len 8192 --global-batch 2048 \\
        --gpu h100-sxm,h200,b200 --gpus 1024,2048,4096,8192,16384 --deadline 90d --budget 20M \\
        --price h100-sxm=2.5 --json w.json --markdown w.md --html w.html

Prints the table (stdout); a progress line goes to stderr when it is a terminal (--progress /
--no-progress override). Bad values raise meshplan errors, which `meshplan.cli.main()` prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshplan.errors import ConfigError
from meshplan.ir.precision import AUTO, PRICED, Precision
from meshplan.reports.html import write_whatif_report
from meshplan.reports.whatif import DEFAULT_COUNTS, DEFAULT_GPUS, whatif

__all__ = ["register", "cmd_whatif"]


def register(subparsers) -> None:
    w = subparsers.add_parser(
        "whatif", help="compare time to train and cost over GPU types and counts",
        description="Plan the model on every (GPU type, GPU count) and report throughput, MFU, time to train, "
                    "GPU-hours, cost, memory headroom and what limits scaling; mark the cheapest option within "
                    "the deadline, the fastest within the budget and the time-cost Pareto front.")
    w.add_argument("--model", default="llama3-8b",
                   help="preset name (see `meshplan models`), path/to/file.py:factory, or a transformers config.json")
    w.add_argument("--tokens", required=True, help="training tokens: 15T, 300B, 2.5e12")
    w.add_argument("--seq-len", type=int, default=8192)
    w.add_argument("--global-batch", type=int, default=1024, help="sequences per step")
    w.add_argument("--gpu", default=",".join(DEFAULT_GPUS),
                   help="comma-separated GPU ids (see `meshplan clusters`) or cluster JSON files (a calibrated "
                        "profile, used as the node type)")
    w.add_argument("--gpus", default=",".join(map(str, DEFAULT_COUNTS)),
                   help="comma-separated GPU counts, multiples of the node size")
    w.add_argument("--deadline", help="time limit: 90d, 36h, 2w")
    w.add_argument("--budget", help="cost limit in USD: 20M, 1.5k, $300000")
    w.add_argument("--price", action="append", metavar="GPU=USD",
                   help="override the on-demand price per GPU-hour, e.g. h100-sxm=2.5 (repeat or comma-separate)")
    w.add_argument("--precision", default=Precision.BF16, choices=[*(p.value for p in PRICED), AUTO])
    w.add_argument("--rampup-batch-size", type=int, nargs=3, metavar=("START", "INCREMENT", "SAMPLES"), default=None,
                   help="batch-size ramp-up (as meshplan train): time to train includes its smaller steps")
    w.add_argument("--json", metavar="PATH", help="write the full sweep as JSON")
    w.add_argument("--markdown", metavar="PATH", help="write a Markdown report")
    w.add_argument("--html", metavar="PATH", help="write a self-contained HTML report with plots")
    w.add_argument("--jobs", type=int, default=None,
                   help="processes planning the points in parallel (default: one per core from 8 points on; 1: none)")
    w.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress line on stderr (default: when stderr is a terminal)")
    w.set_defaults(fn=cmd_whatif)


def _check_writable(path: str | None, flag: str) -> None:
    if path and not Path(path).resolve().parent.is_dir():
        raise ConfigError(f"{flag} {path}: directory {Path(path).resolve().parent} does not exist")


def cmd_whatif(args) -> int:
    for path, flag in ((args.json, "--json"), (args.markdown, "--markdown"), (args.html, "--html")):
        _check_writable(path, flag)   # before a sweep that may take minutes
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    w = whatif(args.model, tokens=args.tokens, seq_len=args.seq_len, global_batch=args.global_batch,
               gpus=args.gpu, counts=args.gpus, deadline_days=args.deadline, budget_usd=args.budget,
               prices=args.price, precision=args.precision, progress=progress,
               rampup=tuple(args.rampup_batch_size) if getattr(args, "rampup_batch_size", None) else None,
               jobs=args.jobs)
    print(w.to_table())
    if args.json:
        Path(args.json).write_text(w.to_json() + "\n", encoding="utf-8")
        print(f"JSON written to {args.json}", file=sys.stderr)
    if args.markdown:
        Path(args.markdown).write_text(w.to_markdown(), encoding="utf-8")
        print(f"Markdown written to {args.markdown}", file=sys.stderr)
    if args.html:
        write_whatif_report(w, args.html)
        print(f"HTML report written to {args.html}", file=sys.stderr)
    return 0
