"""Step-based batch-size schedules (`--batch-schedule "0:4,2:8"`) and the run's observability.

One spawned world of 2 ranks runs, in turn: a PP2 (1F1B) run whose schedule doubles the
micro-batch count at step 3 (a pipeline schedule per count), the same run stopped after step 1
and resumed (crossing the change after the resume), the same under interleaved 1F1B (pp=2, vp=2:
a multi-stage schedule), a DP2 run with the same schedule,
and a DP2 run with dynamic loss scaling and an inf gradient injected on rank 1 at step 3. The
reference is the single-process run of the same scheduled batches in this process, which also
writes TensorBoard events and summary.json. The same world also compares bf16 gradient
reductions with and without `fp32_grads`.

Tolerances: PP and DP sum in another order than one process (micro-batches, shards), so losses
and norms agree to fp32 rounding (rtol 1e-4, as tests/train/test_train.py's cross-plan resume);
a resume under the same plan replays the same kernels (1e-6). A wrong batch (a sample read twice
or skipped, a micro-batch count not applied) moves the loss by far more.
"""

from __future__ import annotations

import functools
import json

import pytest
import schedule_workers
import torch

from meshplan.errors import ConfigError
from meshplan.train.batch_schedule import StepBatchSchedule, parse_batch_schedule

SEQ, BATCH, STEPS = 32, 8, 4
SCHEDULE = "0:4,2:8"        # 4 sequences for steps 1-2, then 8: the micro-batch count doubles


# ---- parsing and validation -------------------------------------------------------------
def test_schedule_parses_and_counts_samples():
    assert parse_batch_schedule(" 0:64, 100:128,500:256 ") == ((0, 64), (100, 128), (500, 256))
    s = StepBatchSchedule("0:4,2:8,5:16", final=16, multiple=4)
    assert [s.batch_size(k) for k in range(7)] == [4, 4, 8, 8, 8, 16, 16]
    assert [s.consumed(k) for k in range(7)] == [0, 4, 8, 16, 24, 32, 48]
    assert s.sizes() == [4, 8, 16] and s.state() == ["steps", [[0, 4], [2, 8], [5, 16]]]


@pytest.mark.parametrize("text, match", [
    ("0:4,2", r"'2' is not STEP:GLOBAL_BATCH"),
    ("1:4,2:8", r"must start at step 0"),
    ("0:4,0:8", r"steps must rise: 0:8 comes after 0:4"),
    ("0:8,2:4", r"must not shrink: 2:4 after 0:8"),
    ("0:x", r"not STEP:GLOBAL_BATCH"),
])
def test_malformed_schedules_are_refused(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_batch_schedule(text)


def test_a_batch_that_does_not_split_names_the_pair_and_the_nearest_valid_ones():
    with pytest.raises(ConfigError, match=r"pair 100:6: global batch 6 is not a multiple of dp x micro-batch "
                                          r"size = 4 \(dp=2, mbs=2\).*nearest valid: 100:4 or 100:8"):
        StepBatchSchedule("0:4,100:6,200:8", final=8, multiple=4, multiple_note=" (dp=2, mbs=2)")
    with pytest.raises(ConfigError, match=r"ends at a global batch of 8, but the plan was made for 16"):
        StepBatchSchedule("0:4,100:8", final=16, multiple=4)


def test_config_takes_one_kind_of_schedule_and_known_loggers():
    from meshplan.train.loop import TrainConfig
    assert TrainConfig(batch_schedule="0:4,2:8").batch_schedule == ((0, 4), (2, 8))
    with pytest.raises(ConfigError, match="either a batch schedule or a batch-size ramp-up"):
        TrainConfig(batch_schedule="0:4,2:8", rampup_batch_size=(4, 4, 8))
    with pytest.raises(ConfigError, match="unknown logger 'csv'"):
        TrainConfig(log="csv")
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="needs the 'wandb' package.*pip install wandb"):
            TrainConfig(log="tensorboard,wandb")


def test_cli_plans_for_the_schedules_last_batch():
    import argparse

    from meshplan.cli.train import _batch_from_schedule
    args = argparse.Namespace(batch_schedule="0:4,10:16", global_batch=None)
    _batch_from_schedule(args)
    assert args.global_batch == 16
    with pytest.raises(ConfigError, match="--global-batch 8 differs from the last batch of --batch-schedule"):
        _batch_from_schedule(argparse.Namespace(batch_schedule="0:4,10:16", global_batch=8))


def test_cpu_peak_memory_resets():
    from meshplan.train.metrics import peak_memory_gb, reset_peak_memory
    if not reset_peak_memory("cpu"):
        pytest.skip("this platform cannot reset a process's peak RSS")
    big = torch.ones(50 * 2 ** 20)             # 200 MiB, written
    del big
    before = peak_memory_gb("cpu")
    reset_peak_memory("cpu")
    assert before - peak_memory_gb("cpu") > 0.15


# ---- training runs ------------------------------------------------------------------------
@functools.cache
def _plan(world: int, fixed: tuple):
    import meshplan as mp
    from meshplan.cluster import Cluster
    model = mp.models.build("tiny-llama", seq_len=SEQ, device="meta")
    return mp.plan(model, Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world), seq_len=SEQ,
                   global_batch=BATCH, fixed=dict(fixed))


PP2 = (("pp", 2), ("mbs", 1), ("schedule", "1f1b"))
PP2_VP2 = (("pp", 2), ("vp", 2), ("mbs", 1), ("schedule", "interleaved"))
DP2 = (("dp", 2), ("mbs", 1), ("zero", 3))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    from worlds import spawn_cases
    base = tmp_path_factory.mktemp("sched")
    common = dict(seq_len=SEQ, steps=STEPS, schedule=SCHEDULE)
    pp2, dp2 = _plan(2, PP2), _plan(2, DP2)
    cases = {"pp2": dict(plan=pp2, out=str(base / "pp2"), **common),
             "pp2_stop1": dict(plan=pp2, out=str(base / "pp2_cut"), stop_at=1, **common),
             "pp2_resume": dict(plan=pp2, out=str(base / "pp2_cut"), **common),
             "pp2_vp2": dict(plan=_plan(2, PP2_VP2), out=str(base / "pp2_vp2"), **common),
             "dp2": dict(plan=dp2, out=str(base / "dp2"), **common),
             "dp2_inf3": dict(plan=dp2, out=str(base / "dp2_inf"), loss_scaling="dynamic", inf_at=3, **common),
             "dp2_inf3_stop3": dict(plan=dp2, out=str(base / "dp2_inf_cut"), loss_scaling="dynamic", inf_at=3,
                                    stop_at=3, **common),
             "dp2_inf3_resume": dict(plan=dp2, out=str(base / "dp2_inf_cut"), loss_scaling="dynamic", **common),
             "fp32_grads": dict(kind="fp32_grads", seq_len=SEQ, batch=BATCH, runs={
                 "fp32": (_plan(2, DP2 + (("grad_dtype", "fp32"),)), ()),
                 "bf16": (_plan(2, DP2 + (("grad_dtype", "bf16"),)), ()),
                 "bf16_norms_fp32": (_plan(2, DP2 + (("grad_dtype", "bf16"),)), "norm")})}
    return spawn_cases(2, schedule_workers.runs, cases, timeout_s=240)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run of the same scheduled batches, logging to TensorBoard when installed."""
    import numerics

    from meshplan.runtime.parallel import parallelize
    from meshplan.train.loop import TrainConfig, train
    from meshplan.train.metrics import read_metrics
    from meshplan.train.spawn import init_single_process_group
    if not init_single_process_group(60):
        pytest.skip("a process group is already initialised in this process")
    out = tmp_path_factory.mktemp("ref")
    try:
        torch.manual_seed(0)
        model = numerics.build_model("tiny-llama", seq_len=SEQ)
        plan = _plan(1, (("mbs", 1),))
        pm = parallelize(model, plan, compute_dtype=None)
        tb = ("tensorboard",) if _has_tensorboard() else ()
        cfg = TrainConfig(steps=STEPS, lr=3e-3, warmup=1, out_dir=str(out), checkpoint_every=0, progress=False,
                          batch_schedule=SCHEDULE, log=tb)
        res = train(model, plan, cfg, pm=pm)
        direct = float(torch.cat([p.detach().flatten() for p in model.parameters()]).double().norm())
        yield dict(res=res, records=read_metrics(out / "metrics.jsonl"), out=out, pm=pm, direct_norm=direct)
    finally:
        import torch.distributed as dist
        dist.destroy_process_group()


def _has_tensorboard() -> bool:
    import importlib.util
    return importlib.util.find_spec("tensorboard") is not None


def _ok(world2, name):
    from worlds import ok
    ok(world2[name])
    return world2[name]


def test_single_process_run_follows_the_schedule_and_reports(reference):
    recs = reference["records"]
    assert [r["global_batch"] for r in recs] == [4, 4, 8, 8]
    # the last step's parameter norm is the norm of the weights the run ended with
    assert recs[-1]["param_norm"] == pytest.approx(reference["direct_norm"], rel=1e-6)
    assert all(r["peak_memory_rank"] == 0 and r["peak_memory_gb"] > 0 for r in recs)
    summary = json.loads((reference["out"] / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["tokens"] == (4 + 4 + 8 + 8) * SEQ
    assert summary["final_loss"] == pytest.approx(recs[-1]["loss"])
    assert summary["best_loss"] == pytest.approx(min(r["loss"] for r in recs))
    assert summary["checkpoint"].endswith("step_000004") and summary["tokens_per_s"] > 0
    assert summary == reference["res"].summary


def test_tensorboard_events_hold_the_scalars(reference):
    if not _has_tensorboard():
        pytest.skip("tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(reference["out"] / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/grad_norm", "train/param_norm", "train/peak_memory_gb"} <= set(tags)
    losses = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in reference["records"]]


@pytest.mark.parametrize("name", ["pp2", "pp2_vp2", "dp2"])
def test_sharded_runs_match_the_single_process_run_through_the_schedule(world2, reference, name):
    runs = _ok(world2, name)
    ref = reference["records"]
    for rank_result in runs:
        got = rank_result["losses"]
        assert sorted(got) == [1, 2, 3, 4]
        torch.testing.assert_close([got[s] for s in range(1, 5)], [r["loss"] for r in ref], rtol=1e-4, atol=1e-5)
    recs = runs[0]["records"]
    assert [r["global_batch"] for r in recs] == [4, 4, 8, 8]
    # the parameter norm over every shard (PP stages, FSDP shards) is the single-device one
    torch.testing.assert_close([r["param_norm"] for r in recs], [r["param_norm"] for r in ref], rtol=1e-5, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in recs], [r["grad_norm"] for r in ref], rtol=1e-4, atol=1e-6)
    assert {r["peak_memory_rank"] for r in recs} <= {0, 1}


def test_pp_resume_mid_schedule_is_exact(world2):
    full, first, second = (_ok(world2, n)[0] for n in ("pp2", "pp2_stop1", "pp2_resume"))
    assert sorted(first["losses"]) == [1] and second["start"] == 1 and sorted(second["losses"]) == [2, 3, 4]
    for step in range(1, STEPS + 1):
        got = (first if step == 1 else second)["losses"][step]
        torch.testing.assert_close(got, full["losses"][step], rtol=1e-6, atol=1e-6)


def test_loss_scaler_skips_an_inf_step_on_every_rank_and_halves_the_scale(world2):
    runs, plain = _ok(world2, "dp2_inf3"), _ok(world2, "dp2")[0]
    assert [r["skipped"] for r in runs] == [[3], [3]]
    recs = {r["step"]: r for r in runs[0]["records"]}
    assert [recs[s]["loss_scale"] for s in range(1, 5)] == [1024.0, 1024.0, 1024.0, 512.0]
    assert [recs[s]["skipped"] for s in range(1, 5)] == [False, False, True, False]
    assert recs[3]["param_norm"] == recs[2]["param_norm"]          # no update in the skipped step
    # scaled backward, unscaled before clipping: the same training as without scaling until the skip
    for s in (1, 2, 3):
        torch.testing.assert_close(runs[0]["losses"][s], plain["losses"][s], rtol=1e-6, atol=1e-6)
    assert torch.isfinite(torch.tensor(runs[0]["losses"][4]))
    assert runs[0]["summary"]["skipped_steps"] == [3] and runs[0]["summary"]["loss_scale"] == 512.0


def test_fp32_grads_reduce_the_chosen_parameters_in_fp32(world2):
    """bf16 compute on 2 data-parallel ranks: with --fp32-grads norm, the norm gains' gradients
    are summed in fp32 - equal to an all-fp32 reduction's - while every other gradient is the
    bf16 reduction's; without it the norm gradients carry bf16 rounding."""
    runs = _ok(world2, "fp32_grads")[0]
    fp32, bf16, mixed = (runs[k]["grads"] for k in ("fp32", "bf16", "bf16_norms_fp32"))
    assert runs["bf16_norms_fp32"]["modules"] and all("norm" in m for m in runs["bf16_norms_fp32"]["modules"])
    norms = [n for n in fp32 if "norm" in n]
    assert norms and len(norms) < len(fp32)
    for n in fp32:
        want = fp32[n] if n in norms else bf16[n]
        torch.testing.assert_close(mixed[n], want, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
    # the bf16 reduction does round the norm gradients (else the test could not tell them apart)
    assert any(not torch.equal(bf16[n], fp32[n]) for n in norms)


def test_loss_scaler_state_resumes(world2):
    full, second = _ok(world2, "dp2_inf3")[0], _ok(world2, "dp2_inf3_resume")[0]
    assert second["start"] == 3
    rec = {r["step"]: r for r in second["records"]}
    assert rec[4]["loss_scale"] == 512.0 and second["summary"]["loss_scale"] == 512.0
    torch.testing.assert_close(second["losses"][4], full["losses"][4], rtol=1e-6, atol=1e-6)


def test_a_micro_batch_count_the_pipeline_cannot_run_is_refused_before_training():
    from types import SimpleNamespace

    from meshplan.train.batch_schedule import check_pipeline

    class Schedules:                    # torch's 1F1B refuses fewer micro-batches than stages
        def get(self, n):
            if n < 2:
                raise ValueError(f"Number of microbatches ({n}) must be greater than or equal to the number of stages (2)")
    plan = SimpleNamespace(mesh={"dp": 2, "pp": 2}, layout=SimpleNamespace(mbs=1), schedule="1f1b")
    pm = SimpleNamespace(plan=plan, schedules=Schedules())
    check_pipeline(pm, StepBatchSchedule("0:4,5:8", final=8, multiple=2))
    with pytest.raises(ConfigError, match=r"global batch 2 gives 1 micro-batches .*'1f1b' pipeline schedule with "
                                          r"pp=2 cannot run.*at least 4"):
        check_pipeline(pm, StepBatchSchedule("0:2,5:8", final=8, multiple=2))
