"""Precision names are declared once (meshplan/ir/precision.py): the cost model, the planner, the what-if
sweeps and the command line accept exactly the sets derived there, and a Precision behaves as its name."""

from __future__ import annotations

import json

import pytest

from meshplan.errors import ConfigError
from meshplan.ir.estimate import PRECISIONS as PRICED_NAMES
from meshplan.ir.precision import AUTO, PLAN_CHOICES, PRICED, Precision, parse_precision


def test_a_precision_is_its_name():
    assert Precision.FP8 == "fp8" and f"{Precision.BF16}" == "bf16" and str(Precision.FP16) == "fp16"
    assert json.dumps({"p": Precision.FP8}) == '{"p": "fp8"}'
    assert Precision("fp8").is_fp8 and not Precision.BF16.is_fp8


def test_the_sets_derive_from_one_declaration():
    from meshplan.planner.policy import PRECISIONS as PLAN_NAMES
    assert PRICED_NAMES == tuple(p.value for p in PRICED) == ("bf16", "fp16", "fp8")
    assert PLAN_NAMES == PLAN_CHOICES == ("fp32", "bf16", "fp16", "fp8", AUTO)


def test_bad_names_list_the_good_ones():
    with pytest.raises(ConfigError, match="fp4.*fp32, bf16, fp16, fp8, auto"):
        parse_precision("fp4")
    assert parse_precision("auto") == AUTO and parse_precision("bf16") is Precision.BF16


def test_command_line_choices_are_the_declared_ones():
    import argparse

    from meshplan.cli import plan as plan_cli
    from meshplan.cli import whatif as whatif_cli
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    for mod in (plan_cli, whatif_cli):
        mod.register(sub)
    choices = {name: next(a.choices for a in p._actions if a.dest == "precision")
               for name, p in sub.choices.items() if any(a.dest == "precision" for a in p._actions)}
    assert tuple(choices["plan"]) == PLAN_CHOICES
    assert tuple(choices["estimate"]) == PRICED_NAMES
    assert tuple(choices["whatif"]) == (*PRICED_NAMES, AUTO)


def test_whatif_refuses_fp32_by_name():
    from meshplan.reports.whatif import whatif
    with pytest.raises(ConfigError, match="'fp32'.*bf16, fp16, fp8, auto"):
        whatif("llama3-8b", tokens="1T", seq_len=4096, global_batch=64, gpus=("h100-sxm",), counts=(8,),
               precision="fp32", progress=False)
