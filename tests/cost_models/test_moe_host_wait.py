"""The host wait of dropless MoE dispatch on stacks that read the token counts on the CPU once per MoE
layer (Stack.moe_host_sync), with Transformer Engine's per-expert GEMM launches (Stack.expert_gemm):
what it charges, where it does not apply, and that it does not grow with the tokens of a micro-batch."""

from __future__ import annotations

import pytest

import meshplan as mp
from meshplan.cost_models import constants as K
from meshplan.cost_models.device import device_of
from meshplan.cost_models.estimate import estimate_profile
from meshplan.errors import ConfigError
from meshplan.ir.layout import Layout
from meshplan.ir.stack import STACKS, Stack
from meshplan.models.presets import config as preset_config
from meshplan.profiling.analytic import profile_from_config

H100 = mp.Cluster.preset("dgx-h100", nodes=2)
MCORE = STACKS["megatron-core"]


@pytest.fixture(scope="module")
def qwen30():
    return profile_from_config(preset_config("qwen3-30b-a3b"), seq_len=4096)


def _moe_block(profile):
    return next(b for b in profile.blocks if b.is_moe)


def _est(profile, stack, mbs=1, **lay):
    layout = dict(tp=1, pp=1, dp=16, ep=16, zero=1, mbs=mbs, recompute="none", **lay)
    return estimate_profile(profile, H100, layout, seq_len=4096, global_batch=16 * mbs * 8, stack=stack)


def test_wait_counts_one_gemm_launch_per_local_expert(qwen30):
    """Megatron-Core's experts: fc1 (gate and up as one GEMM) and fc2, each launched once per local
    expert at TE's per-expert host cost; the backward issues twice the forward's launches."""
    b = _moe_block(qwen30)
    gpu = device_of(H100)
    f16, b16 = gpu.moe_host_wait(b, Layout(dp=16, ep=16), MCORE)
    f8, _ = gpu.moe_host_wait(b, Layout(dp=16, ep=8), MCORE)
    local16, local8 = b.experts / 16, b.experts / 8
    assert b16 == pytest.approx(2 * f16)
    # halving EP doubles the local experts: two more GEMM launches per added expert
    assert f8 - f16 == pytest.approx(2 * (local8 - local16) * K.TE_EXPERT_GEMM_HOST_S)
    # one grouped launch per expert linear where the stack runs grouped kernels
    grouped = MCORE.replace(expert_gemm="grouped")
    fg, _ = gpu.moe_host_wait(b, Layout(dp=16, ep=16), grouped)
    assert fg < f16 and fg == pytest.approx(f16 - 2 * local16 * K.TE_EXPERT_GEMM_HOST_S
                                            + sum(li.role.startswith("expert") for li in b.linears) * K.HOST_LAUNCH_S)


def test_no_wait_without_the_sync_for_padded_dispatch_dense_layers_and_cpu(qwen30):
    b = _moe_block(qwen30)
    gpu = device_of(H100)
    assert gpu.moe_host_wait(b, Layout(dp=16, ep=16, moe_capacity_factor=1.0), MCORE) == (0.0, 0.0)
    assert gpu.moe_host_wait(b, Layout(dp=16, ep=16), STACKS["torchtitan"]) == (0.0, 0.0)
    dense = profile_from_config(preset_config("llama3-8b"), seq_len=4096).blocks[0]
    assert gpu.moe_host_wait(dense, Layout(dp=8), MCORE) == (0.0, 0.0)
    # CPU processes charge every op's host time already
    assert device_of(mp.Cluster.preset("local-cpu")).moe_host_wait(b, Layout(dp=16, ep=16), MCORE) == (0.0, 0.0)


def test_the_wait_is_a_fixed_cost_per_layer_and_micro_batch(qwen30):
    """The seconds added per micro-batch do not grow with its tokens: relative to the step, the wait
    shrinks as the micro-batch grows (why dropless MoE runs lose most at micro-batch 1)."""
    synced, free = MCORE, MCORE.replace(moe_host_sync=False)
    added = {}
    for mbs in (1, 4):
        on, off = _est(qwen30, synced, mbs), _est(qwen30, free, mbs)
        m = on.num_microbatches
        added[mbs] = ((on.step_time_s - off.step_time_s) / m, (on.step_time_s - off.step_time_s) / on.step_time_s)
    assert added[1][0] == pytest.approx(added[4][0], rel=0.02)
    assert added[4][1] < 0.5 * added[1][1]


def test_the_bridge_overlap_ab_on_qwen3_30b():
    """Megatron-Bridge PR #5094 timed the same run (16 H100, BF16, EP16, HybridEP, micro-batch 1,
    global batch 1024) with and without the expert all-to-all overlap: 24.714 s -> 20.992 s a step
    (240.1 -> 287.3 model TFLOP/s). The host wait is what makes the first as slow as it was, and the
    overlap does not hide it (the host issues both paired micro-batches): with the wait the model
    lands within 5% of both; without it, it is 14% fast before the overlap."""
    prof = profile_from_config(preset_config("qwen3-30b-a3b"), seq_len=4096)

    def step(stack, overlap):
        return estimate_profile(prof, H100, dict(tp=1, pp=1, dp=16, ep=16, zero=1, mbs=1, recompute="none",
                                                 moe_dispatcher="deepep", ep_comm_overlap=overlap),
                                seq_len=4096, global_batch=1024, stack=stack, precision="bf16").step_time_s
    off, on = step(MCORE, False), step(MCORE, True)
    assert off == pytest.approx(24.714, rel=0.05) and on == pytest.approx(20.992, rel=0.05)
    assert step(MCORE.replace(moe_host_sync=False), False) < 0.9 * 24.714


def test_fp8_current_scaling_casts_each_experts_slice():
    """Three launches per local expert for each quantised expert input (forward) and output gradient
    (backward) under current scaling; none extra under BF16."""
    b = _moe_block(profile_from_config(preset_config("qwen3-30b-a3b"), seq_len=4096))
    gpu, lay = device_of(H100), Layout(dp=16, ep=16)
    (f0, b0), (f1, b1) = gpu.moe_host_wait(b, lay, MCORE), gpu.moe_host_wait(b, lay, MCORE, "tensorwise")
    cast = 2 * 3 * (b.experts / 16) * K.HOST_LAUNCH_S
    assert (f1 - f0, b1 - b0) == pytest.approx((cast, cast))
    assert gpu.moe_host_wait(b, lay, MCORE, "mxfp8") == (f0, b0)


def test_expert_gemm_values_are_checked():
    with pytest.raises(ConfigError, match="expert_gemm"):
        Stack(name="x", expert_gemm="batched")


def test_a_plan_whose_moe_layers_wait_on_the_host_says_so_and_widens_its_band(qwen30):
    """Where the dropless dispatch's host wait is a large share of the step, the estimate says so and
    its band grows by that share (uncertainty.moe_host_risk): the model's least validated MoE part.
    Padded dispatch and stacks that do not sync carry neither."""
    from meshplan.cost_models.uncertainty import MOE_HOST_NOTE_FRAC, X_MOE_HOST
    dropless = _est(qwen30, MCORE, ep_comm_overlap=False)
    padded = _est(qwen30, MCORE, moe_capacity_factor=1.0)
    notes = [n for n in dropless.extrapolation if n.startswith("MoE host wait")]
    assert len(notes) == 1 and "% of the step" in notes[0]
    share = float(notes[0].split("ms, ")[1].split("%")[0]) / 100
    assert share >= MOE_HOST_NOTE_FRAC
    assert dropless.uncertainty >= X_MOE_HOST * share - 0.01
    assert not any(n.startswith("MoE host wait") for n in padded.extrapolation)
    torch_native = _est(qwen30, "torchtitan")
    assert not any(n.startswith("MoE host wait") for n in torch_native.extrapolation)


def test_moe_host_risk_is_the_waits_share_and_notes_it_from_the_threshold():
    from meshplan.cost_models.uncertainty import MOE_HOST_NOTE_FRAC, X_MOE_HOST, moe_host_risk
    assert moe_host_risk(0.0, 10.0) == (0.0, ())
    small, notes = moe_host_risk(0.5 * MOE_HOST_NOTE_FRAC * 10.0, 10.0)
    assert small == pytest.approx(X_MOE_HOST * 0.5 * MOE_HOST_NOTE_FRAC) and notes == ()
    big, notes = moe_host_risk(3.0, 10.0)
    assert big == pytest.approx(X_MOE_HOST * 0.3) and len(notes) == 1 and "3000 ms, 30% of the step" in notes[0]
