"""CPU processes pay host work a GPU-oriented model does not charge
(meshplan.cost_models.host): DTensor dispatch and redistributions under TP, the runtime's gloo
collectives under EP / CP / PP, the ring's eager per-block ops, the grouped GEMMs' per-expert loop,
torch.distributed.pipelining's per-action schedule, and the per-parameter optimizer / norm loops in
place of the fixed STEP_OVERHEAD_S. Each is a measured constant times a count from the trace and the
layout; GPU clusters are unchanged."""

from __future__ import annotations

import dataclasses

import pytest

import meshplan as mp
from meshplan.cluster import Cluster
from meshplan.cost_models import constants as K
from meshplan.cost_models import host as H
from meshplan.cost_models.device import device_of
from meshplan.cost_models.gpu import GPU
from meshplan.cost_models.host import CPU_HOST
from meshplan.ir.layout import Layout
from meshplan.ir.stack import resolve_stack

SEQ, GBS = 128, 16


def _cpu(nproc=4):
    return Cluster.preset("local-cpu").replace(gpus_per_node=nproc, scaleup_domain=nproc)


def _h100():
    return Cluster(gpu="h100-sxm", num_gpus=8, gpus_per_node=8)


@pytest.fixture(scope="module")
def llama():
    return mp.profile(mp.models.build("tiny-llama", device="meta"), seq_len=SEQ)


@pytest.fixture(scope="module")
def moe():
    return mp.profile(mp.models.build("tiny-moe", device="meta"), seq_len=SEQ)


def _est(profile, cluster, **layout):
    base = {"dp": 4, "tp": 1, "pp": 1, "cp": 1, "mbs": 4, "recompute": "none"}
    base.update(layout)
    return mp.estimate(profile, cluster, base, seq_len=SEQ, global_batch=GBS)


def test_dtensor_ops_counted_from_the_trace(llama):
    b = llama.blocks[0]
    linears = sum(1 for o in b.ops if o.kind == "linear")
    norms = sum(1 for o in b.ops if o.kind == "norm")
    assert H.dtensor_op_counts(b, Layout(tp=1, dp=4)) == {"linear": 0, "norm": 0, "other": 0}
    sp = H.dtensor_op_counts(b, Layout(tp=2, dp=2, sp=True))
    # the sharded linears, and under SP the norms and the two residual adds of the block
    assert sp == {"linear": linears, "norm": norms, "other": 2}
    assert H.dtensor_op_counts(b, Layout(tp=2, dp=2, sp=False)) == {"linear": linears, "norm": 0, "other": 0}


def test_tp_host_time_scales_with_dtensor_ops_and_collectives(llama):
    b, cl = llama.blocks[0], _cpu()
    f, bw = H.tp_host_time(b, Layout(tp=2, dp=2, sp=True), cl)
    n = H.dtensor_op_counts(b, Layout(tp=2, dp=2, sp=True))
    coll = H.tp_collectives_per_layer(b, Layout(tp=2, dp=2, sp=True)) * K.CPU_COLLECTIVE_HOST_S
    want_f = (n["linear"] * K.CPU_DTENSOR_LINEAR_S[0] + n["norm"] * K.CPU_DTENSOR_NORM_S[0]
              + n["other"] * K.CPU_DTENSOR_OP_S[0] + coll) * H.host_slowdown(cl)
    assert f == pytest.approx(want_f) and bw > f
    assert "tp" not in device_of(_h100()).layer_host(b, Layout(tp=2, dp=2, sp=True), _h100(), "none")
    # without SP fewer ops run on DTensors and half the collectives are issued
    assert sum(H.tp_host_time(b, Layout(tp=2, dp=2, sp=False), cl)) < f + bw


def test_tp_estimate_on_cpu_charges_dtensor_overhead(llama):
    cl = _cpu()
    dp = _est(llama, cl)
    tp = _est(llama, cl, dp=2, tp=2, mbs=8, sp=True)
    layer_host = sum(H.tp_host_time(llama.blocks[0], Layout(tp=2, dp=2, sp=True), cl))
    edges = sum(H.tp_edge_host_time(llama, Layout(tp=2, dp=2, sp=True), cl, first=True, last=True))
    # the TP share of the step holds the host work of every layer and the edges
    assert tp.time_s["tp"] >= llama.num_layers * layer_host + edges
    assert tp.step_time_s - dp.step_time_s > 0.5 * llama.num_layers * layer_host


def test_gpu_estimates_unchanged_by_host_terms(llama):
    """On GPUs every host term is zero and the step overhead stays STEP_OVERHEAD_S."""
    h = _h100()
    est = _est(llama, h, dp=2, tp=2, cp=2, mbs=8)
    assert est.time_s["overhead"] == K.STEP_OVERHEAD_S
    L = Layout(tp=2, dp=1, cp=2, pp=2, ep=1)
    dev = device_of(h)
    assert dev is GPU and device_of(_cpu()) is CPU_HOST
    for pol in ("none", "full"):
        assert dev.layer_host(llama.blocks[0], L, h, pol) == {}
    assert dev.edge_host(llama, L, h, first=True, last=True) == (0.0, 0.0)
    assert dev.pp_host_time(L, h, m=8) == 0.0
    assert dev.step_overhead(llama, h, L, [], resolve_stack("reference")) == K.STEP_OVERHEAD_S
    # a stack that measured its own step overhead (meshplan's runtime on one H100 / H200) is priced with it
    meshplan_stack = resolve_stack("meshplan")
    assert dev.step_overhead(llama, h, L, [], meshplan_stack) == meshplan_stack.step_overhead_s < K.STEP_OVERHEAD_S
    assert dev.op_overhead(llama.blocks[0].ops, h, K.FITTED) == (K.FITTED.layer_overhead_s,) * 2
    # the same layout on CPU processes: every host term is charged
    c = _cpu()
    host = device_of(c).layer_host(llama.blocks[0], L, c, "none")
    assert host["tp"][0] > 0 and host["cp"][0] > 0 and device_of(c).pp_host_time(L, c, m=8) > 0


def test_step_overhead_on_cpu_is_the_measured_pieces(llama):
    cl = _cpu()
    est = _est(llama, cl)
    n = H.param_tensors(llama, range(llama.num_layers), first=True, last=True)
    assert n == 9 * llama.num_layers + 3          # 9 per block, embedding, final norm, output
    per = (K.CPU_ADAMW_DTENSOR_PARAM_S + K.CPU_GRAD_NORM_DTENSOR_PARAM_S) * H.host_slowdown(cl)
    assert est.time_s["overhead"] >= n * per
    assert est.time_s["overhead"] != K.STEP_OVERHEAD_S
    # plain (unsharded) parameters run AdamW's loop on plain tensors: cheaper
    assert H.step_host_time(n, Layout(dp=1), cl, sync_s=0) < H.step_host_time(n, Layout(dp=4), cl, sync_s=0)


def test_sp_norm_weights_pay_partial_gradient_all_reduces(llama):
    L = Layout(tp=2, dp=2, sp=True)
    layers = range(llama.num_layers)
    assert H.partial_grad_reduces(llama, layers, L, last=True) == 2 * llama.num_layers + 1
    assert H.partial_grad_reduces(llama, layers, Layout(tp=2, dp=2, sp=False), last=True) == 0


def test_ep_and_moe_loop_host_time(moe):
    cl = _cpu()
    dense, moe_block = moe.blocks
    assert H.ep_host_time(dense, Layout(ep=2, dp=4), cl) == (0.0, 0.0)
    f, b = H.ep_host_time(moe_block, Layout(ep=2, dp=4), cl)
    # counts + 2 row all-to-alls forward, 2 backward
    assert f == pytest.approx(3 * K.CPU_COLLECTIVE_HOST_S * H.host_slowdown(cl))
    assert b == pytest.approx(2 * K.CPU_COLLECTIVE_HOST_S * H.host_slowdown(cl))
    # the per-expert loop runs over the local experts only (EP halves it); the custom op's own
    # Python is paid once per grouped linear whatever the expert count
    full = sum(H.moe_loop_host_time(moe_block, Layout(dp=4), cl))
    half = sum(H.moe_loop_host_time(moe_block, Layout(ep=2, dp=4), cl))
    calls = sum(1 for li in moe_block.linears if li.role in ("expert_in", "expert_out"))
    per_call = calls * sum(K.CPU_PY_CUSTOM_OP_S) * H.host_slowdown(cl)
    assert half - per_call == pytest.approx((full - per_call) / 2) and full > per_call > 0
    ep = _est(moe, cl, ep=2)
    assert ep.time_s["ep"] >= 3 * (f + b)       # three MoE layers


def test_cp_ring_host_time(llama):
    cl = _cpu()
    assert H.ring_blocks(2, True) == 5 and H.ring_blocks(4, True) == 9 and H.ring_blocks(2, False) == 8
    f2, b2 = H.cp_host_time(llama.blocks[0], Layout(cp=2, dp=2), cl)
    f4, _ = H.cp_host_time(llama.blocks[0], Layout(cp=4, dp=1), cl)
    assert 0 < f2 < f4 and b2 > f2
    # backward sends cp-1 K/V shifts and cp dK/dV shifts (the last brings each block's gradient home)
    sends = lambda cp, i: H.cp_host_time(llama.blocks[0], Layout(cp=cp, dp=1), cl)[i]  # noqa: E731
    per_send = (sends(4, 0) - sends(2, 0)) / 2 - (H.ring_blocks(4, True) - H.ring_blocks(2, True)) / 2 * \
        (5 * K.CPU_OP_FWD_S + K.CPU_VIEW_FWD_S) * H.host_slowdown(cl)
    ops_b = lambda cp: H.ring_blocks(cp, True) * 4 * K.CPU_OP_FWD_S * H.host_slowdown(cl)  # noqa: E731
    assert sends(4, 1) - ops_b(4) == pytest.approx(7 * per_send) and sends(2, 1) - ops_b(2) == pytest.approx(3 * per_send)
    est = _est(llama, cl, dp=2, cp=2, mbs=8)
    assert est.time_s["cp"] >= llama.num_layers * (f2 + b2)


def test_pp_host_time_counts_actions_and_p2p():
    cl = _cpu()
    s = H.host_slowdown(cl)
    one = H.pp_host_time(Layout(pp=2, dp=2), cl, m=4)
    assert one == pytest.approx(4 * (2 * K.CPU_COLLECTIVE_HOST_S + 2 * K.CPU_PP_ACTION_HOST_S) * s)
    # interleaving (2 stages per rank) doubles the actions and adds the sends between them
    two = H.pp_host_time(Layout(pp=2, dp=2, vp=2), cl, m=4)
    assert two == pytest.approx(4 * (6 * K.CPU_COLLECTIVE_HOST_S + 4 * K.CPU_PP_ACTION_HOST_S) * s)
    assert H.pp_host_time(Layout(pp=1, dp=4), cl, m=4) == 0.0


def test_host_terms_follow_the_calibrated_speed(llama):
    cl = _cpu()
    slow = dataclasses.replace(cl, gpu=dataclasses.replace(cl.gpu, bf16_tflops=cl.gpu.bf16_tflops / 3))
    L = Layout(tp=2, dp=2, sp=True)
    assert sum(H.tp_host_time(llama.blocks[0], L, slow)) == pytest.approx(
        3 * sum(H.tp_host_time(llama.blocks[0], L, cl)))


def test_cpu_pipeline_bubble_gives_idle_cores_to_busy_ranks(llama):
    """4 processes on 2 cores: ranks idling in the fill / drain give their cores to ranks with work,
    so the step is the larger of the work at the shared rate and the critical path at full speed."""
    from meshplan.cost_models.host import cpu_thread_share
    cl = _cpu()

    def _cpu_bubble(cluster, layout, busy, bubble):
        return device_of(cluster).pipeline_bubble(cluster, layout, busy, bubble)
    share = cpu_thread_share(cl)
    assert share == pytest.approx(0.5)
    # 1F1B, pp2, m = 2: bubble half the busy time -> hidden; m = 1: bubble = busy -> nothing left either
    assert _cpu_bubble(cl, Layout(pp=2, dp=2), 1.0, 0.5) == 0.0
    assert _cpu_bubble(cl, Layout(pp=2, dp=2), 1.0, 1.0) == 0.0
    # a deep pipeline with few micro-batches: the critical path at full speed exceeds the work
    assert _cpu_bubble(cl, Layout(pp=4, dp=1), 1.0, 3.0) == pytest.approx(0.5 * 4.0 - 1.0)
    assert _cpu_bubble(cl, Layout(pp=1, dp=4), 1.0, 0.7) == 0.7
    assert _cpu_bubble(_h100(), Layout(pp=2, dp=4), 1.0, 0.5) == 0.5
    # one process per core: nothing to give
    assert _cpu_bubble(_cpu(nproc=2), Layout(pp=2, dp=1), 1.0, 0.5) == pytest.approx(0.5)

def test_fsdp_units_and_routing_statistics_follow_the_runtime():
    """ZeRO-1/2: one dense unit (+ one per MoE layer's experts under EP); ZeRO-3: every block and
    the root too, kept-gathered units one all-gather fewer; the routing statistics are all-reduced
    once per step over dp x cp ranks, all the stage's MoE layers together (moe.flush_windows)."""
    assert H.fsdp_units(Layout(dp=4, zero=1), 0, 4) == 1
    assert H.fsdp_units(Layout(dp=4, zero=3), 0, 4) == 5
    assert H.fsdp_units(Layout(dp=4, ep=2, zero=1), 3, 4) == 4
    assert H.fsdp_units(Layout(dp=1, tp=4, zero=1), 0, 4) == 0
    assert H.fsdp_collectives(Layout(dp=4, zero=3), 0, 4) == 15
    assert H.fsdp_collectives(Layout(dp=4, zero=3, reshard_after_forward=False), 0, 4) == 10
    assert H.routing_stat_reduces(Layout(dp=4, ep=2), 3) == 1
    assert H.routing_stat_reduces(Layout(dp=4, ep=2), 0) == 0
    assert H.routing_stat_reduces(Layout(dp=1, tp=4), 3) == 0
