"""Layout knobs the cost model prices and meshplan's runtime does not run are refused by
`runtime_limits`, naming the knob and what would work; the planner then never returns them for
the meshplan stack (it costs them as excluded layouts), and other stacks still plan them."""

from __future__ import annotations

import pytest

import meshplan as mp
from meshplan.errors import LayoutError
from meshplan.ir.layout import Layout
from meshplan.ir.support import runtime_limits


@pytest.mark.parametrize("knob, value, names", [
    ("moe_dispatcher", "deepep", ("moe_dispatcher='deepep'", "use moe_dispatcher='alltoall'")),
    ("attn_kernel", "fa3", ("attn_kernel='fa3'", "use attn_kernel='flash'")),
    ("attn_kernel", "cudnn", ("attn_kernel='cudnn'", "use attn_kernel='flash'")),
    ("attn_kernel", "triton", ("attn_kernel='triton'", "use attn_kernel='flash'")),
    ("moe_capacity_factor", 1.25, ("moe_capacity_factor=1.25", "dropless", "leave moe_capacity_factor unset")),
])
def test_unrun_knob_is_refused(knob, value, names):
    layout = dict(dp=4, ep=2, zero=3, **{knob: value})
    (why,) = runtime_limits(layout)
    for part in names:
        assert part in why
    # the Layout object is read the same way as its dict
    assert runtime_limits(Layout(**layout)) == [why]


@pytest.mark.parametrize("impl", ["megatron", "deepspeed"])
def test_other_zero3_implementation_is_refused(impl):
    (why,) = runtime_limits(Layout(dp=4, zero=3, fsdp_impl=impl))
    assert f"fsdp_impl={impl!r}" in why and "FSDP2" in why and "use fsdp_impl='fsdp2'" in why


def test_what_the_runtime_runs_passes():
    for layout in (dict(dp=4, zero=3), dict(dp=4, zero=3, attn_kernel="fa2"), dict(dp=4, ep=2, zero=1),
                   dict(dp=2, zero=3, grad_dtype="bf16"), dict(dp=2, zero=0, grad_dtype="bf16"),
                   dict(dp=2, zero=1, tp=2, grad_dtype="bf16"), dict(dp=1, cp=2, grad_dtype="bf16"),
                   dict(dp=4, ep=2, zero=1, grad_dtype="bf16")):
        assert runtime_limits(Layout(**layout)) == [], layout


def test_bf16_gradients_need_a_reduction_that_runs_in_bf16():
    # one data-parallel rank: no FSDP2 / DDP reduction, the runtime keeps fp32 gradients
    for layout in (dict(tp=2, grad_dtype="bf16"), dict(pp=2, grad_dtype="bf16")):
        (why,) = runtime_limits(Layout(**layout))
        assert "grad_dtype='bf16'" in why and "one data-parallel rank" in why and "use grad_dtype='fp32'" in why
    # DDP with expert parallelism: the experts' gradients are reduced apart from DDP, in fp32
    (why,) = runtime_limits(Layout(dp=4, ep=2, zero=0, grad_dtype="bf16"))
    assert "DDP (zero=0)" in why and "use zero>=1" in why and "grad_dtype='fp32'" in why
    assert runtime_limits(Layout(dp=4, ep=2, zero=0)) == []


def test_planner_excludes_the_knob_for_meshplan_only():
    model = mp.models.build("tiny-moe", seq_len=64, device="meta")
    cluster = mp.Cluster(gpu="h100-sxm", num_gpus=8, gpus_per_node=8)
    with pytest.raises(LayoutError, match="moe_dispatcher='deepep'"):
        mp.plan(model, cluster, seq_len=64, global_batch=16, fixed=dict(dp=8, ep=2, moe_dispatcher="deepep"))
    plan = mp.plan(model, cluster, seq_len=64, global_batch=16, stack="reference",
                   fixed=dict(dp=8, ep=2, moe_dispatcher="deepep"))
    assert plan.layout.moe_dispatcher == "deepep"
