"""DeepSpeed's pipeline engine (the `megatron-deepspeed` stack: BLOOM, MT-NLG) as its source runs it:
blocking p2p at every micro-batch, activations sliced over TP, the gradient all-reduce after the drain."""

from __future__ import annotations

import math

import pytest

import meshplan as mp
from meshplan.cost_models.comm import group, p2p_time
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.tables import pipeline_p2p_s
from meshplan.cost_models.validation import load_rows, stack_of
from meshplan.errors import ConfigError
from meshplan.ir.layout import Layout
from meshplan.ir.stack import STACKS

A100 = mp.Cluster.preset("dgx-a100", nodes=8)
DS, M21 = STACKS["megatron-deepspeed"], STACKS["megatron-2021"]


@pytest.fixture(scope="module")
def gpt():
    return mp.profile("gpt3-1.3b", seq_len=2048)


def test_blocking_p2p_puts_every_micro_batch_on_the_critical_path(gpt):
    lay = Layout(tp=4, pp=4, dp=4, mbs=2, sp=False)
    m, tokens = 16, 2 * 2048.0
    plain, plain_total = pipeline_p2p_s(gpt, A100, lay, m, tokens, M21)
    blocking, total = pipeline_p2p_s(gpt, A100, lay, m, tokens, DS)
    size = 2 * tokens * gpt.hidden / lay.tp                   # bf16, the 1/tp slice each TP rank sends
    cross = group(A100, lay.pp, lay.tp * lay.dp).domains > 1
    hop = p2p_time(size, A100, cross_domain=cross)
    # fill and drain as before, plus a middle stage's four transfers of each micro-batch
    assert math.isclose(blocking - plain, 4 * m * hop, rel_tol=1e-9)
    assert plain_total == 2 * m * hop
    assert total == pytest.approx(blocking)      # a blocking stage's sends and receives are all exposed


def test_scatter_gather_sends_one_tp_slice(gpt):
    lay = Layout(tp=4, pp=4, dp=4, mbs=2, sp=False)          # without SP each TP rank holds the whole activation
    whole = pipeline_p2p_s(gpt, A100, lay, 16, 4096.0, STACKS["reference"])[1]
    sliced = pipeline_p2p_s(gpt, A100, lay, 16, 4096.0, M21)[1]
    assert sliced < whole / 3                    # a quarter of the bytes, the same per-hop latency


def test_gradient_all_reduce_waits_for_the_drain(gpt):
    lay = dict(tp=2, pp=2, dp=16, zero=1, mbs=2, recompute="full", flash_attention=False, sp=False)
    kw = dict(seq_len=2048, global_batch=256)
    overlapped = estimate_profile(gpt, A100, lay, stack=M21.replace(pp_blocking_p2p=True), **kw)
    drained = estimate_profile(gpt, A100, lay, stack=DS, **kw)
    assert drained.time_s["dp"] > overlapped.time_s["dp"]
    assert drained.comm_s["dp"] == pytest.approx(overlapped.comm_s["dp"])    # same traffic, less hidden
    assert drained.step_time_s > overlapped.step_time_s


def test_published_megatron_deepspeed_runs_use_the_stack():
    rows = {r.id: r for r in load_rows()}
    for rid in ("bloom-176b-prod", "mtnlg-530b-2240gpu"):
        st = stack_of(rows[rid])
        assert st.name == "megatron-deepspeed" and st.pp_blocking_p2p and not st.dp_overlap
    assert stack_of(rows["megatron-sc21-t1-1.7B"]).name == "megatron-2021"


def test_plans_for_the_stack_run_plain_1f1b(gpt):
    assert DS.schedules == ("1f1b",)
    plan = mp.plan(gpt, A100, seq_len=2048, global_batch=256, stack="megatron-deepspeed", fixed=dict(pp=4))
    assert plan.layout.pp == 4 and plan.layout.vp == 1 and plan.layout.schedule == "1f1b"
    assert plan.stack == "megatron-deepspeed"
    # "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" (DeepSpeed's PipelineEngine)
    assert all(e.layout.zero <= 1 for e in [plan.estimate, *plan.runner_ups])
    with pytest.raises(ConfigError, match="ZeRO up to stage 1 with pipeline parallelism"):
        mp.plan(gpt, A100, seq_len=2048, global_batch=256, stack="megatron-deepspeed", fixed=dict(pp=4, zero=3))


def test_plans_use_the_stacks_own_zero3(gpt):
    """Megatron-LM 2021 and Megatron-DeepSpeed ran DeepSpeed's ZeRO-3, not PyTorch FSDP's: their ZeRO-3
    plans say so and take none of FSDP's options (keep-gathered, HSDP); a fixed ZeRO-3 on
    Megatron-DeepSpeed keeps the pipeline at 1 stage (its engine refuses ZeRO-3 beside a pipeline)."""
    for stack in (DS, M21):
        assert "fsdp2" not in stack.fsdp_impls
        plan = mp.plan(gpt, A100, seq_len=2048, global_batch=256, stack=stack.name, fixed=dict(zero=3))
        lays = [plan.layout, *(r.layout for r in plan.runner_ups)]
        assert all(x.fsdp_impl == "deepspeed" and x.fsdp_shard == 0 and x.reshard_after_forward
                   for x in lays if x.zero == 3), stack.name
        if stack is DS:
            assert all(x.pp == 1 for x in lays if x.zero == 3)
    # PyTorch-native stacks keep FSDP's flavours
    tt = mp.plan(gpt, A100, seq_len=2048, global_batch=256, stack="torchtitan", fixed=dict(zero=3))
    assert tt.layout.fsdp_impl == "fsdp2"
