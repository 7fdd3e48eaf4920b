"""The `meshplan train` job as its ranks receive it: JobConfig (meshplan.train.job) is filled from the
command line once, written as JSON, and read back by each worker unchanged."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshplan.cli import build_parser
from meshplan.errors import ConfigError
from meshplan.train.job import JobConfig

_NOT_JOB = {"cmd", "fn", "worker"}      # the subcommand, its function, and the worker's own flag


def _parse(*argv):
    return build_parser().parse_args(["train", *argv])


def test_every_train_option_is_a_job_field():
    dests = set(vars(_parse())) - _NOT_JOB
    assert dests == set(JobConfig.fields()), (dests ^ set(JobConfig.fields()))
    # the defaults are the command's
    assert JobConfig.from_options(_parse()) == JobConfig()


def test_job_round_trips_through_its_json_file(tmp_path):
    args = _parse("--model", "tiny-moe", "--steps", "7", "--lr", "0.01", "--rampup-batch-size", "4", "4", "64",
                  "--moe-expert-bias", "--no-document-mask", "--fp32-grads", "router,norm", "--compile", "off",
                  "--profile", "2:3", "--log", "tensorboard", "--fail-at-step", "3")
    job = dataclasses.replace(JobConfig.from_options(args), plan=str(tmp_path / "plan.json"), seq_len=32)
    assert job.rampup_batch_size == (4, 4, 64) and job.moe_overrides == {"moe_expert_bias": True}
    job.save(tmp_path / "job.json")
    back = JobConfig.load(tmp_path / "job.json")
    assert back == job and back.to_dict() == json.loads(job.to_json())
    assert not list(tmp_path.glob(".job.json.*"))          # written atomically: no temporary left
    cfg = back.train_config()
    assert (cfg.steps, cfg.lr, cfg.profile_steps, cfg.log, cfg.document_mask, cfg.rampup_batch_size) == (
        7, 0.01, (2, 3), ("tensorboard",), False, (4, 4, 64))


def test_an_older_file_takes_defaults_and_a_foreign_one_is_refused(tmp_path):
    assert JobConfig.from_dict({"steps": 5}) == JobConfig(steps=5)
    with pytest.raises(ConfigError, match="unknown option.*flux_capacitor.*rerun `meshplan train`"):
        JobConfig.from_dict({"steps": 5, "flux_capacitor": 1})
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a JSON object of options"):
        JobConfig.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="cannot read the job config"):
        JobConfig.load(tmp_path / "missing.json")


@pytest.mark.parametrize("change, message", [
    (dict(steps=0), "--steps must be >= 1, got 0"),
    (dict(keep=-1), "--keep must be >= 0, got -1"),
    (dict(rdzv_timeout=0.0), "--rdzv-timeout must be > 0"),
    (dict(profile="8:6"), "--profile '8:6'"),
    (dict(init_from="/nonexistent/ckpt"), "--init-from '/nonexistent/ckpt' does not exist"),
])
def test_a_bad_value_is_named_by_its_flag(change, message):
    with pytest.raises(ConfigError) as e:
        JobConfig(**change).train_config()
    assert message in str(e.value), str(e.value)


def test_worker_options_follow_the_flags():
    import torch

    from meshplan.train.worker import parallel_options

    class Plan:
        precision = "bf16"
    opts = parallel_options(JobConfig(precision="fp16", compile="off", fp32_grads="router", fp8_recipe="rowwise"),
                            Plan())
    assert (opts.compute_dtype, opts.fp8, opts.compile, opts.fp32_grads, opts.fp8_recipe) == (
        torch.float16, False, False, ("router",), "rowwise")
    assert parallel_options(JobConfig(), Plan()).compute_dtype == "plan"
