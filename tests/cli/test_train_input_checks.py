"""`meshplan train` checks its input before any process starts: one line naming the problem and
what works, exit code 2, within seconds (no torchrun, no tracebacks)."""

from __future__ import annotations

import argparse
import json

import pytest

from meshplan.cli import main
from meshplan.cli import train as cli_train
from meshplan.errors import ConfigError


def _run(capsys, *argv) -> str:
    rc = main(["train", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert not any("launching" in line for line in err), err          # nothing was started
    return err[-1]


@pytest.mark.parametrize("argv, message", [
    (("--data", "/nonexistent/texts"), "data path '/nonexistent/texts' does not exist"),
    (("--steps", "0"), "--steps must be >= 1, got 0"),
    (("--seq-len", "0"), "--seq-len must be >= 1, got 0"),
    (("--global-batch", "-4"), "--global-batch must be >= 1, got -4"),
    (("--lr", "0"), "--lr must be > 0"),
    (("--timeout", "-1"), "--timeout must be > 0"),
    (("--keep", "-1"), "--keep must be >= 0"),
    (("--nnodes", "0"), "--nnodes must be >= 1, got 0"),
    (("--nproc", "0"), "--nproc must be >= 1, got 0"),
    (("--profile", "8:6"), "--profile '8:6'"),
    (("--init-from", "/nonexistent/ckpt"), "--init-from '/nonexistent/ckpt' does not exist"),
    (("--fix", "tp=3"), "fixed tp=3 does not divide the 4 GPUs; tp must divide the GPU count: use one of [1, 2, 4]"),
])
def test_bad_option_is_named_before_launch(capsys, tmp_path, argv, message):
    line = _run(capsys, *argv, "--out", str(tmp_path / "o"))
    assert line.startswith("meshplan: error: ") and message in line, line


def test_too_little_data_is_named(capsys, tmp_path):
    (tmp_path / "t.txt").write_text("tiny")
    line = _run(capsys, "--data", str(tmp_path / "t.txt"), "--out", str(tmp_path / "o"))
    assert "fewer than one sequence of --seq-len 128" in line, line


def test_malformed_plan_files_are_named(capsys, tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text("{")
    assert f"plan '{bad}': plan is not valid JSON" in _run(capsys, "--plan", str(bad))
    bad.write_text(json.dumps({"version": 2, "layout": {}}))
    line = _run(capsys, "--plan", str(bad))
    assert f"plan '{bad}': malformed plan JSON: missing field(s) model, model_fingerprint" in line, line
    assert "missing.json' does not exist" in _run(capsys, "--plan", str(tmp_path / "missing.json"))


@pytest.fixture(scope="module")
def moe_plan(tmp_path_factory):
    """A saved plan for a model other than the default, made from its preset name."""
    import meshplan as mp
    path = tmp_path_factory.mktemp("plan") / "moe.json"
    mp.plan("tiny-moe", mp.Cluster.preset("local-cpu", nproc=2), seq_len=32, global_batch=8).save(path)
    return path


def _args(**kw):
    base = dict(model=None, plan=None, seq_len=None, global_batch=None)
    return argparse.Namespace(**{**base, **kw})


def test_a_saved_plan_names_its_model_and_train_builds_it(moe_plan):
    from meshplan.ir.plan import Plan
    assert Plan.load(moe_plan).model_source == "tiny-moe"
    args = _args(plan=str(moe_plan))
    cli_train._model_from_plan(args)
    assert (args.model, args.seq_len, args.global_batch) == ("tiny-moe", 32, 8)
    # without --plan: the default job
    args = _args()
    cli_train._model_from_plan(args)
    assert (args.model, args.seq_len, args.global_batch) == (cli_train.DEFAULT_MODEL, 128, 16)


def test_a_plan_trained_with_another_shape_or_model_is_refused_before_launch(capsys, moe_plan):
    with pytest.raises(ConfigError, match="--seq-len 64 differs from the plan's 32"):
        cli_train._model_from_plan(_args(plan=str(moe_plan), seq_len=64))
    line = _run(capsys, "--plan", str(moe_plan), "--model", "tiny-llama")
    assert "was made for model 'tiny-moe'" in line and "--model tiny-llama builds another structure" in line, line


def test_a_plan_too_big_for_this_machines_memory_is_refused_before_launch(capsys, tmp_path, moe_plan, monkeypatch):
    """A plan made for GPUs, trained where the ranks run on CPU: its memory per rank (the plan's
    estimate) times the processes must fit the memory the machine has free."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cli_train, "available_host_gb", lambda: 1e-3)
    line = _run(capsys, "--plan", str(moe_plan), "--out", str(tmp_path / "o"))
    assert "x 2 processes" in line and "this machine has 0 GB free and no GPU" in line, line
    monkeypatch.setattr(cli_train, "available_host_gb", lambda: None)     # unknown: not refused here
    from meshplan.ir.plan import Plan
    cli_train._check_host_memory(Plan.load(moe_plan), 2)
