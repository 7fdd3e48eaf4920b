"""The `meshplan` command: thin over the public API (parse, call, print).

One module per group of subcommands, each with `register(subparsers)`:
plan.py (estimate, plan, models, clusters), train.py (train), launch.py (launch),
whatif.py (whatif), calibrate.py (calibrate), data.py (data prepare); common.py holds the shared argument helpers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from meshplan.errors import MeshplanError

__all__ = ["main", "build_parser"]

# modules that add subcommands with register(subparsers), in `meshplan --help` order
_SUBCOMMAND_MODULES: tuple[str, ...] = ("meshplan.cli.plan", "meshplan.cli.train", "meshplan.cli.launch",
                                        "meshplan.cli.whatif", "meshplan.cli.calibrate", "meshplan.cli.data")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="meshplan", description="Auto-parallel planner for PyTorch training.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for mod in _SUBCOMMAND_MODULES:
        importlib.import_module(mod).register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--"]:
        # torchrun received `meshplan.cli -- train ...`: the `--` keeps its own parser away from
        # our options (meshplan.train.launch.torchrun_command); it is not ours to parse
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except MeshplanError as e:
        print(f"meshplan: error: {e}", file=sys.stderr)
        return 2

