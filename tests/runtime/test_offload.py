"""Activation offloading (meshplan.runtime.offload), as a plan's `offload_activations` says.

In this process (one-rank gloo group): tiny Llama's step with offloading equals the step without,
bit for bit (the copies move values, they change none), under recompute "none", "full" and a
layer count; the bytes the pack hooks moved are the tensors the policy keeps (with "full": exactly
each block's input, per micro-batch) and all of them come back in backward; the policies whose
tensors the hooks cannot see are refused. In one spawned 2-rank world (offload_workers.py): data
parallelism (FSDP2) with full recompute and a 2-stage pipeline (1F1B, four micro-batches in
flight) match the single-device model. The exports: Megatron-LM / NeMo name --cpu-offloading
(and refuse it with recompute), torchtitan refuses it.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import numerics
import offload_workers as workers
import pytest
import torch

import meshplan as mp
from meshplan.errors import LayoutError
from meshplan.ir.layout import Layout
from worlds import ok, spawn_cases

SEQ, BATCH, HIDDEN, LAYERS = 16, 4, 128, 4     # tiny-llama: 4 blocks of width 128


@functools.lru_cache(maxsize=None)
def _base_plan():
    model = mp.models.build("tiny-llama", seq_len=SEQ, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return mp.plan(model, mp.Cluster.preset("local-cpu", nproc=1), seq_len=SEQ, global_batch=BATCH,
                       fixed={"tp": 1, "pp": 1, "dp": 1, "mbs": 2, "recompute": "none"})


def _with(plan, **layout):
    return dataclasses.replace(plan, layout=Layout.from_dict(dict(plan.layout.to_dict(), **layout)))


def _step(recompute, offload: bool):
    from meshplan.runtime import parallelize
    torch.manual_seed(0)
    model = numerics.build_model("tiny-llama", seq_len=SEQ)
    pm = parallelize(model, _with(_base_plan(), recompute=recompute, offload_activations=offload), compute_dtype=None)
    x, y = numerics.batch(BATCH, SEQ)
    loss = pm.forward_backward(x, y)
    return loss, pm.full_grads(), pm


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("recompute", ["none", "full", 2])
def test_offloaded_step_equals_step_without(recompute):
    loss, grads, pm = _step(recompute, True)
    ref_loss, ref_grads, _ = _step(recompute, False)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert set(grads) == set(ref_grads)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=0, atol=0, msg=lambda m, n=n: f"grad {n}: {m}")
    (off,) = pm.offload
    microbatches = BATCH // 2
    block_input = microbatches * 2 * SEQ * HIDDEN * 4      # (mbs, seq, hidden) fp32 per micro-batch
    if recompute == "full":
        # non-reentrant checkpointing keeps only each block's input, through the offload hooks
        assert off.bytes_offloaded == LAYERS * block_input
    elif recompute == 2:
        # two blocks keep their inputs, two keep everything they save: several inputs' worth each
        assert off.bytes_offloaded > 2 * block_input + 2 * 4 * block_input
    else:
        # every block keeps its norms' inputs, projections, attention and MLP activations
        assert off.bytes_offloaded > LAYERS * 4 * block_input
    assert off.bytes_reloaded == off.bytes_offloaded      # all of it came back for backward


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("recompute", ["selective", "norm_act"])
def test_policies_kept_outside_the_hooks_are_refused(recompute):
    from meshplan.runtime import parallelize
    model = numerics.build_model("tiny-llama", seq_len=SEQ)
    with pytest.raises(LayoutError, match="offload_activations with recompute"):
        parallelize(model, _with(_base_plan(), recompute=recompute, offload_activations=True), compute_dtype=None)


CASES_2 = {
    "dp2_full": dict(tp=1, pp=1, dp=2, zero=1, mbs=1, recompute="full", offload_activations=True),   # FSDP2
    "pp2_1f1b": dict(tp=1, pp=2, dp=1, vp=1, mbs=1, schedule="1f1b", recompute="none", offload_activations=True),
}


@pytest.fixture(scope="module")
def world2():
    items = {name: tuple(sorted(fixed.items())) for name, fixed in CASES_2.items()}
    numerics.plan_for.prefetch([("tiny-llama", 2, it, SEQ, BATCH) for it in items.values()])
    cases = {name: dict(model="tiny-llama", plan=numerics.plan_for("tiny-llama", 2, it, SEQ, BATCH), seq_len=SEQ,
                        global_batch=BATCH) for name, it in items.items()}
    return spawn_cases(2, workers.run_cases, cases, timeout_s=240)


def test_two_rank_data_parallel_full_recompute_matches_single_device(world2):
    runs = world2["dp2_full"]
    ok(runs)
    assert [r["data_parallel"] for r in runs] == ["fsdp"] * 2
    per_rank = LAYERS * (BATCH // 2) * SEQ * HIDDEN * 4    # two micro-batches of one sequence each
    assert [r["offloaded"] for r in runs] == [per_rank] * 2
    assert [r["reloaded"] for r in runs] == [per_rank] * 2


def test_two_stage_pipeline_matches_single_device(world2):
    runs = world2["pp2_1f1b"]
    ok(runs)
    first, last = runs
    # every micro-batch's tensors went to the host and came back; the first stage also offloaded
    # the forward torch.distributed.pipelining runs once on real inputs to infer the stages'
    # metadata (PipelineStage._forward_metadata_inference), whose graph no backward reads:
    # one more micro-batch's worth of its blocks
    assert first["stages"] == last["stages"] == 1 and last["reloaded"] == last["offloaded"] > 0
    microbatches = BATCH
    assert first["offloaded"] * microbatches == first["reloaded"] * (microbatches + 1)


def test_exports_name_offloading_or_refuse_it():
    from meshplan.errors import ConfigError
    from meshplan.export.megatron import to_megatron_args
    from meshplan.export.nemo import to_nemo
    from meshplan.export.torchtitan import to_torchtitan
    plan = _with(_base_plan(), offload_activations=True)
    args = to_megatron_args(plan)
    i = args.index("--cpu-offloading-num-layers")
    assert "--cpu-offloading" in args and args[i + 1] == str(LAYERS - 1)      # Megatron keeps the last layer
    assert "cpu_offloading" in str(to_nemo(plan))
    with pytest.raises(ConfigError, match="without activation recomputation"):
        to_megatron_args(_with(plan, recompute="full"))
    with pytest.raises(ConfigError, match="does not offload activations"):
        to_torchtitan(plan)
