"""Mechanisms that differ by software stack (meshplan.ir.stack), each from its source: attention
kernel rates, element-wise fusion, TP overlap, PyTorch context parallelism, recompute policies."""

from __future__ import annotations

import dataclasses
import math

import pytest

import meshplan as mp
from meshplan.cost_models import constants as K
from meshplan.cost_models.compute import attention_time
from meshplan.cost_models.context import Context
from meshplan.cost_models.cp import torch_cp_merge
from meshplan.cost_models.estimate import estimate_profile, layer_table
from meshplan.cost_models.flops import recompute_flops_per_step
from meshplan.ir.layout import Layout
from meshplan.errors import ConfigError
from meshplan.ir.stack import STACKS

H100 = mp.Cluster.preset("dgx-h100", nodes=1)
A100 = mp.Cluster.preset("dgx-a100", nodes=1)


@pytest.fixture(scope="module")
def llama():
    return mp.profile("llama3-8b", seq_len=8192)


@pytest.fixture(scope="module")
def moe():
    return mp.profile("mixtral-8x7b", seq_len=4096)


def test_attention_kernels_run_at_their_measured_rates():
    fa2 = attention_time(1e12, H100, backward=False, kernel="fa2")
    # cuDNN as measured beside FlashAttention-2 on an H200 (benchmarks/results/gpu_rates-2026-11-27-h200.md)
    assert math.isclose(fa2 / attention_time(1e12, H100, backward=False, kernel="cudnn"), 701.7 / 381.1, rel_tol=0.01)
    assert math.isclose(fa2 / attention_time(1e12, H100, backward=False, kernel="fa3"), 648 / 370, rel_tol=0.01)
    assert attention_time(1e12, H100, backward=False, kernel="flash") == fa2
    with pytest.raises(ValueError, match="unknown attention kernel"):
        attention_time(1e12, H100, backward=False, kernel="fa9")


def test_stack_attention_on_hopper_and_ampere(llama):
    lay = dict(dp=8, zero=1, mbs=1, recompute="none")
    kw = dict(seq_len=8192, global_batch=64)
    # megatron-core = reference but for its attention (and its other defaults, which this layout does not use)
    te = STACKS["reference"].replace(attention="te")
    h_ref = estimate_profile(llama, H100, lay, stack="reference", **kw)
    h_te = estimate_profile(llama, H100, lay, stack=te, **kw)
    a_ref = estimate_profile(llama, A100, lay, stack="reference", **kw)
    a_te = estimate_profile(llama, A100, lay, stack=te, **kw)
    assert h_te.step_time_s < h_ref.step_time_s
    assert a_te.step_time_s == a_ref.step_time_s          # FlashAttention-2 before Hopper either way


def test_eager_element_wise_costs_more_than_compile(llama):
    prof = dataclasses.replace(llama, fusions=())        # a config's profile: no fusion recorded
    lay = dict(dp=8, zero=3, mbs=2, recompute="none")
    kw = dict(seq_len=8192, global_batch=64)
    eager = estimate_profile(prof, H100, lay, stack=STACKS["torchtitan"].replace(compile=False), **kw)
    compiled = estimate_profile(prof, H100, lay, stack="torchtitan", **kw)
    assert eager.step_time_s > compiled.step_time_s
    assert eager.peak_memory_gb == compiled.peak_memory_gb


def test_async_tp_hides_all_but_one_forward_step(llama):
    """Async TP's micro-pipelining hides all but one of the tp chunks of the forward's transfers (and
    of a full recompute's forward); the backward's stay exposed (constants.ASYNC_TP_BWD_HIDDEN)."""
    lay = Layout(tp=8, dp=1, zero=1, mbs=1, tp_comm_overlap=True)
    tt = layer_table(llama, H100, lay, seq_len=8192, stack=STACKS["reference"].replace(tp_overlap="async_tp"))
    none = layer_table(llama, H100, lay, seq_len=8192, stack=STACKS["reference"].replace(tp_overlap="none"))
    c_async, c_none = tt.cost(0, "none"), none.cost(0, "none")
    one = c_none.exposed_s["tp"] / 2                  # one pass's transfers
    assert K.ASYNC_TP_BWD_HIDDEN == 0.0
    assert math.isclose(c_async.exposed_s["tp"], one / 8 + one, rel_tol=1e-9)
    assert math.isclose(c_none.bwd_s - c_async.bwd_s, 0.0, abs_tol=1e-12)
    assert math.isclose(c_none.fwd_s - c_async.fwd_s, one * 7 / 8, rel_tol=1e-9)
    full_a, full_n = tt.cost(0, "full"), none.cost(0, "full")
    assert math.isclose(full_n.recompute_s - full_a.recompute_s, one * 7 / 8, rel_tol=1e-9)
    # meshplan's runtime runs the same async TP for the plan's tp_comm_overlap (on CUDA)
    mp_ = layer_table(llama, H100, lay, seq_len=8192, stack="meshplan").cost(0, "none")
    mp_off = layer_table(llama, H100, dataclasses.replace(lay, tp_comm_overlap=False), seq_len=8192,
                         stack="meshplan").cost(0, "none")
    assert mp_.fwd_s < mp_off.fwd_s and math.isclose(mp_.bwd_s, mp_off.bwd_s, rel_tol=1e-12)
    ub = layer_table(llama, H100, lay, seq_len=8192, stack="reference").cost(0, "none")
    assert math.isclose(ub.exposed_s["tp"], c_none.exposed_s["tp"] * (1 - K.TP_OVERLAP_HIDDEN), rel_tol=1e-9)


def test_pytorch_context_parallelism_pays_a_merge_per_ring_step(llama):
    kw = dict(seq_len=65536)
    costs = {}
    for cp in (2, 8):
        lay = Layout(cp=cp, dp=8 // cp, zero=3, mbs=1, cp_comm_type="all_gather")
        torch_cp = layer_table(llama, H100, lay, stack=STACKS["reference"].replace(cp_impl="torch"), **kw)
        te_cp = layer_table(llama, H100, lay, stack="reference", **kw)
        costs[cp] = torch_cp.cost(0, "none").compute_s - te_cp.cost(0, "none").compute_s
    assert costs[2] > 0 and costs[8] > 0
    # each rank pays its per-layer copies and cp-1 merge / accumulation steps over its seq/cp tokens
    # (cost_models.cp.torch_ring_forward / torch_ring_backward; shape pinned in test_cp_merge.py)
    b = next(x for x in llama.blocks if x.heads)
    for cp in (2, 8):
        lay = Layout(cp=cp, dp=8 // cp, zero=3, mbs=1, cp_comm_type="all_gather")
        ctx = Context.build(H100, lay, kw["seq_len"], False, stack=STACKS["reference"].replace(cp_impl="torch"))
        assert costs[cp] == pytest.approx(sum(torch_cp_merge(b, ctx)), rel=1e-9)


def test_op_level_sac_sits_between_none_and_full(llama):
    lay = Layout(dp=8, zero=1, mbs=1)
    t = layer_table(llama, H100, lay, seq_len=8192, stack="torchtitan")
    acts = {p: t.act(0, p) for p in ("none", "op_sac", "full")}
    assert acts["full"] < acts["op_sac"] < acts["none"]
    rc = {p: t.cost(0, p).recompute_s for p in ("none", "op_sac", "full")}
    assert rc["none"] == 0 < rc["op_sac"] < rc["full"]
    # hardware FLOPs: every second matmul runs again
    half = recompute_flops_per_step(llama, 8192, 64, Layout(dp=8, recompute="op_sac"))
    full = recompute_flops_per_step(llama, 8192, 64, Layout(dp=8, recompute="full"))
    assert 0 < half < full


def test_recomputing_the_moe_layer_keeps_only_its_input(moe):
    lay = Layout(ep=8, dp=8, zero=1, mbs=1)
    t = layer_table(moe, H100, lay, seq_len=4096, stack="megatron-core")
    acts = {p: t.act(0, p) for p in ("none", "norm_act", "norm_moe", "full")}
    assert acts["full"] < acts["norm_moe"] < acts["norm_act"] < acts["none"]
    c = t.cost(0, "norm_moe")
    # the MoE forward runs again, dispatch and combine all-to-alls included
    assert c.recompute_s > t.cost(0, "norm_act").recompute_s
    assert c.comm_s["ep"] > t.cost(0, "norm_act").comm_s["ep"]


def test_fsdp_under_torch_pipelining_reduces_once_a_step(llama):
    """torch.distributed.pipelining runs each micro-batch's backward without FSDP's gradient sync
    and reduce-scatters once after the last one (PipelineStage.perform_reduce_grad); kept gathered,
    the weights are gathered once a step. The stage then holds its whole unsharded gradients."""
    kw = dict(seq_len=8192, global_batch=64)
    lay = dict(tp=1, pp=2, dp=4, zero=3, mbs=1, recompute="full", reshard_after_forward=False)
    ours = estimate_profile(llama, H100, lay, stack=STACKS["reference"].replace(pp_fsdp_deferred=True), **kw)
    megatron = estimate_profile(llama, H100, lay, stack="reference", **kw)
    m = ours.num_microbatches
    assert m == 16
    assert ours.comm_s["dp"] < megatron.comm_s["dp"] / 4           # once a step instead of every micro-batch
    assert ours.memory_gb["gradients"] > megatron.memory_gb["gradients"]
    resharded = estimate_profile(llama, H100, dict(lay, reshard_after_forward=True),
                                 stack=STACKS["reference"].replace(pp_fsdp_deferred=True), **kw)
    assert resharded.comm_s["dp"] > ours.comm_s["dp"]             # gathers for every forward and backward
    assert STACKS["meshplan"].pp_fsdp_deferred and STACKS["torchtitan"].pp_fsdp_deferred


def test_fsdp2_copies_around_its_collectives_on_the_compute_stream(llama):
    """FSDP2 copies each all-gather's output into the parameters (read + write the gathered bytes) and
    the gradients into the reduce-scatter buffer (bf16 read, reduce dtype written) on the compute
    stream: exposed time the overlap cannot hide. On CPU processes the measured per-unit host cost
    holds them already."""
    from meshplan.cost_models.roofline import hbm_rate
    lay = dict(dp=8, zero=3, mbs=1, recompute="full", reshard_after_forward=True)
    kw = dict(seq_len=8192, global_batch=16)
    tt = STACKS["torchtitan"]
    with_, without = (estimate_profile(llama, H100, lay, stack=tt.replace(fsdp_passes=c), **kw) for c in ("fsdp2", "none"))
    per_mb = (2 * 2 * 2 + (2 + 4)) * llama.total_params / hbm_rate(H100)   # two gathers (reshard), one reduce-scatter
    m = 16 // 8
    extra = with_.time_s["dp"] - without.time_s["dp"]
    assert extra == pytest.approx(m * per_mb, rel=0.02)
    assert with_.comm_s["dp"] == pytest.approx(without.comm_s["dp"])
    assert STACKS["meshplan"].fsdp_passes == "fsdp2"
    cpu = mp.Cluster.preset("local-cpu")
    tiny = mp.profile("tiny-llama", seq_len=128)
    a, b = (estimate_profile(tiny, cpu, dict(dp=4, zero=3), seq_len=128, global_batch=16,
                             stack=STACKS["meshplan"].replace(fsdp_passes=c)) for c in ("fsdp2", "none"))
    assert a.step_time_s == pytest.approx(b.step_time_s)


def test_fsdp1_builds_each_units_unsharded_gradient_before_reducing_it(llama):
    """FSDP1 (llm-foundry's Composer) gathers into its flat parameters, so its all-gathers copy
    nothing, but every micro-batch's backward concatenates the views' bf16 gradients into the flat
    gradient, casts it to the fp32 reduce dtype and pre-divides it in place: 2 + 2, 2 + 4 and 4 + 4
    bytes per parameter (torch/distributed/fsdp/_runtime_utils.py). Reduced in bf16 the cast goes
    and the divide reads and writes bf16."""
    from meshplan.cost_models.estimate import fsdp_predivide_factor
    from meshplan.cost_models.roofline import hbm_rate
    assert [fsdp_predivide_factor(n) for n in (1, 2, 3, 8, 16, 64, 512)] == [1, 2, 2, 4, 4, 8, 32]
    kw = dict(seq_len=8192, global_batch=16)
    lf = STACKS["llm-foundry"]
    assert lf.fsdp_passes == "fsdp1"
    m = 16 // 8

    def extra(lay):
        a, b = (estimate_profile(llama, H100, lay, stack=lf.replace(fsdp_passes=c), **kw) for c in ("fsdp1", "none"))
        assert a.comm_s["dp"] == pytest.approx(b.comm_s["dp"])
        return a.time_s["dp"] - b.time_s["dp"]

    lay = dict(dp=8, zero=3, mbs=1, recompute="full", reshard_after_forward=True)
    assert extra(lay) == pytest.approx(m * (4 + 6 + 8) * llama.total_params / hbm_rate(H100), rel=0.02)
    assert extra({**lay, "grad_dtype": "bf16"}) == pytest.approx(m * (4 + 4) * llama.total_params / hbm_rate(H100),
                                                                 rel=0.02)
    with pytest.raises(ConfigError, match="fsdp_passes"):
        lf.replace(fsdp_passes="fsdp3")
    # a stack saved with the boolean field this one replaced still loads
    old = {k: v for k, v in STACKS["torchtitan"].to_dict().items() if k != "fsdp_passes"}
    assert type(lf).from_dict({**old, "fsdp_copies": True}) == STACKS["torchtitan"]


def test_tp_overlap_needs_the_tp_group_inside_one_nvlink_domain():
    """Transformer Engine's userbuffers and PyTorch's async TP reach the TP peers' memory directly, so a
    TP group across nodes runs neither: its transfers are priced exposed, the estimate's layout (and so
    the plan and its exports) carries the flag off, and inside a node nothing changes."""
    gpt = mp.profile("gpt3-6.7b", seq_len=2048)
    two_nodes = mp.Cluster.preset("dgx-h100", nodes=2)
    kw = dict(seq_len=2048, global_batch=16, stack="megatron-core")
    on = dict(tp=16, dp=1, pp=1, sp=True, mbs=1, recompute="full", tp_comm_overlap=True)
    across = estimate_profile(gpt, two_nodes, on, **kw)
    off = estimate_profile(gpt, two_nodes, {**on, "tp_comm_overlap": False}, **kw)
    assert not across.layout.tp_comm_overlap
    assert math.isclose(across.step_time_s, off.step_time_s, rel_tol=1e-12)
    table = layer_table(gpt, two_nodes, Layout(**on), seq_len=2048, stack="megatron-core")
    assert table.cost(0, "none").exposed_s["tp"] == pytest.approx(table.cost(0, "none").comm_s["tp"])
    inside = dict(on, tp=8, dp=2)
    within = estimate_profile(gpt, two_nodes, inside, **kw)
    assert within.layout.tp_comm_overlap
    assert within.time_s["tp"] < estimate_profile(gpt, two_nodes, {**inside, "tp_comm_overlap": False}, **kw).time_s["tp"]
    # a fixed TP across nodes is planned as asked (the free search keeps TP inside a node)
    model = mp.models.build("gpt3-6.7b", device="meta")
    plan = mp.plan(model, two_nodes, seq_len=2048, global_batch=16, stack="megatron-core", fixed=on)
    assert plan.layout.tp == 16 and "--tp-comm-overlap" not in plan.to_megatron_args()
    free = mp.plan(model, two_nodes, seq_len=2048, global_batch=16, stack="megatron-core",
                   fixed={"tp_comm_overlap": True})
    assert free.layout.tp <= 8
