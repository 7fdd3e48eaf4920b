"""Cost-model mechanisms, each checked against the formula it comes from, so that
removing the mechanism fails a test: unfused gradient accumulation, context-parallel attention
variants (ring, all-gather KV, all-to-all)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from meshplan.cluster import Cluster
from meshplan.cost_models import constants as K
from meshplan.cost_models.comm import collective_time, p2p_time
from meshplan.cost_models.compute import attention_time, grad_accumulation_time
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.flops import attention_fwd_flops_per_token
from meshplan.cost_models.layer import (
    Context,
    activation_bytes,
    cp_comm,
    cp_comm_type,
    layer_cost,
)
from meshplan.errors import ConfigError
from meshplan.ir.layout import Layout
from meshplan.profiling.analytic import profile_from_config

LLAMA8B = dict(family="llama", layers=8, hidden=4096, heads=32, kv_heads=8, vocab=128256, ffn_hidden=14336)


@pytest.fixture(scope="module")
def prof():
    return profile_from_config(LLAMA8B)


def _with(layout: Layout, **fields) -> Layout:
    return dataclasses.replace(layout, **fields)


# ---- gradient accumulation (Megatron-LM before 2022-02, Megatron-DeepSpeed) -----------------------
def test_unfused_grad_accumulation_costs_one_buffer_pass_per_microbatch(prof, h100x16):
    """Each micro-batch adds its bf16 weight gradients into the fp32 buffer: 2 + 4 + 4 bytes per weight
    the rank holds, at HBM speed, on the critical path of every micro-batch (so also in the bubble)."""
    lay = dict(tp=2, pp=2, dp=4, zero=1)
    kw = dict(seq_len=4096, global_batch=64)
    fused = estimate_profile(prof, h100x16, lay, **kw)
    assert fused == estimate_profile(prof, h100x16, lay, grad_accum_fusion=True, **kw)   # the default
    unfused = estimate_profile(prof, h100x16, lay, grad_accum_fusion=False, **kw)
    m = fused.num_microbatches
    # the slowest rank's weights: its state bytes / (2 weight + 4 grad + 12/d optimizer) per parameter
    params = max(s["weights"] for s in fused.memory_by_stage) * 2 ** 30 / K.PARAM_BYTES
    per_mb = grad_accumulation_time(params, K.FP32, h100x16)
    assert math.isclose(per_mb, params * 10 / (h100x16.gpu.hbm_tb_s * 1e12 * K.HBM_EFF))
    # m passes in the busy time, and the fill/drain (bubble) grows by the other rank's passes
    extra = unfused.step_time_s - fused.step_time_s
    assert m * per_mb * 0.99 < extra < (m + 1) * per_mb * 1.01
    assert unfused.time_s["compute"] > fused.time_s["compute"]


def test_grad_accumulation_buffer_dtype_and_zero3(prof, h100x16):
    """A bf16 gradient buffer moves 2 + 2 + 2 bytes; ZeRO-3 accumulates only its shard (no full pass)."""
    assert math.isclose(grad_accumulation_time(1e9, K.BF16, h100x16) / grad_accumulation_time(1e9, K.FP32, h100x16),
                        6 / 10)
    kw = dict(seq_len=4096, global_batch=64)
    lay = dict(dp=16, zero=3)
    assert estimate_profile(prof, h100x16, lay, grad_accum_fusion=False, **kw).step_time_s == \
        estimate_profile(prof, h100x16, lay, **kw).step_time_s


def test_validation_marks_only_pre_2022_megatron_stacks_unfused():
    from meshplan.cost_models.validation import Row, stack_of
    fam = {"megatron-sc21-t1-1.7B": False, "mtnlg-530b-2240gpu": False, "bloom-176b-prod": False,
           "korthikanti-22B-full": True, "nemo2407-gpt3-5b-64gpu": True, "modelzoo-x": True, "mosaic-x": True}
    for rid, fused in fam.items():
        assert stack_of(Row(id=rid, source="", raw={})).grad_accum_fusion is fused, rid


# ---- context parallelism ---------------------------------------------------------------------------
def _ctx(cluster, layout, seq_len):
    return Context.build(cluster, layout, seq_len, False)


def test_ring_cp_hides_each_step_behind_that_steps_attention(prof, h100x16):
    """Ring attention: cp-1 K/V transfers forward, each exposed only by what it outlasts 1/cp of the
    rank's attention; backward moves K/V and dK/dV (twice the bytes)."""
    b = prof.layer_blocks()[0]
    for seq in (8192, 131072):
        c = _ctx(h100x16, Layout(tp=1, cp=8, dp=2), seq)
        a_f = attention_time(attention_fwd_flops_per_token(b, seq) * c.tokens, h100x16, backward=False)
        a_b = attention_time(attention_fwd_flops_per_token(b, seq) * c.tokens, h100x16, backward=True)
        f, fx, bw, bx = cp_comm(b, c, a_f, a_b)
        step = p2p_time(2 * K.BF16 * c.tokens * b.kv_dim, h100x16, cross_domain=False)
        assert math.isclose(f, 7 * step) and math.isclose(bw, 14 * step)
        assert math.isclose(fx, 7 * max(0.0, step - a_f / 8))
        assert math.isclose(bx, 7 * max(0.0, 2 * step - a_b / 8))
        if seq == 131072:    # attention grows with s^2, the chunk's K/V with s: fully hidden at long context
            assert fx == 0.0 and bx == 0.0
    assert cp_comm_type(Layout(cp=2)) == "p2p"


def test_all_gather_cp_is_exposed_and_small_with_gqa(prof, h100x16):
    """Llama 3 (arXiv 2407.21783 §3.3.2): all-gather K/V (exposed), reduce-scatter dK/dV in backward;
    with GQA (8 of 32 heads) the gathered K/V is a quarter of Q, and it is kept for backward."""
    b = prof.layer_blocks()[0]
    seq = 131072
    lay = _with(Layout(tp=1, cp=8, dp=2), cp_comm_type="all_gather")
    assert cp_comm_type(lay) == "all_gather"
    c = _ctx(h100x16, lay, seq)
    f, fx, bw, bx = cp_comm(b, c, 1.0, 1.0)      # attention time does not hide any of it
    full = 2 * K.BF16 * seq * b.kv_dim
    assert math.isclose(f, collective_time("all_gather", full, c.cp, h100x16)) and f == fx
    assert math.isclose(bw, collective_time("reduce_scatter", full, c.cp, h100x16)) and bw == bx
    ring = cp_comm(b, _ctx(h100x16, Layout(tp=1, cp=8, dp=2), seq), 1.0, 1.0)
    assert math.isclose(f, ring[0], rel_tol=0.2)     # the same bytes reach each rank either way
    assert b.kv_dim * 4 == b.q_dim
    # memory: the other ranks' K and V stay until backward
    kept = activation_bytes(b, c, policy="none") - activation_bytes(b, _ctx(h100x16, Layout(tp=1, cp=8, dp=2), seq),
                                                                     policy="none")
    assert math.isclose(kept, 2 * K.BF16 * (seq / 8) * 7 * b.kv_dim)
    # and the layer pays it fully, where the ring hid it
    assert layer_cost(b, c, policy="none").exposed_s["cp"] > \
        layer_cost(b, _ctx(h100x16, Layout(tp=1, cp=8, dp=2), seq), policy="none").exposed_s["cp"]


def test_a2a_cp_moves_qkv_and_output(prof, h100x16):
    """Ulysses (arXiv 2309.14509): all-to-all of q, k, v and the output, forward and backward."""
    b = prof.layer_blocks()[0]
    c = _ctx(h100x16, _with(Layout(tp=1, cp=8, dp=2), cp_comm_type="a2a"), 32768)
    f, fx, bw, bx = cp_comm(b, c, 1.0, 1.0)
    size = K.BF16 * c.tokens * (2 * b.q_dim + 2 * b.kv_dim)
    assert math.isclose(f, collective_time("all_to_all", size, c.cp, h100x16)) and f == fx == bw == bx
    with pytest.raises(ConfigError, match="cp_comm_type"):
        Layout(cp=2, cp_comm_type="ulysses")


# ---- FP8 recipes -----------------------------------------------------------------------------------
def test_fp8_recipes_differ_by_their_quantisation_traffic(prof, h100x8):
    """Each recipe moves its own bytes per element of a linear's input and output gradient
    (rowwise: each tensor quantised along both axes, measured at 16.5 against tensorwise's 5; blockwise
    tiles need no amax pass) and its scaled-matmul kernels run at the measured share of the
    tensorwise rate."""
    from meshplan.cost_models.compute import (
        fp8_recipe_factor,
        fp8_weight_cast_time,
        gemm_time,
        matmul_rate,
    )
    m, n, k = 8192, 4096, 4096
    base = gemm_time(m, n, k, h100x8, fp8=True)
    hbm = h100x8.gpu.hbm_tb_s * 1e12 * K.HBM_EFF
    cast_tw = (m * k + m * n) * K.FP8_QUANT_BYTES["tensorwise"] / hbm / 3     # a third per GEMM
    for recipe in ("rowwise", "blockwise", "tensorwise"):
        assert math.isclose(fp8_recipe_factor(recipe), K.FP8_QUANT_BYTES[recipe] / K.FP8_QUANT_BYTES["tensorwise"])
        t = gemm_time(m, n, k, h100x8, fp8=True, recipe=recipe)
        slower_math = 2 * m * n * k / matmul_rate(h100x8, True) * (1 / K.FP8_RECIPE_GEMM_RATE[recipe] - 1)
        assert math.isclose(t - base, cast_tw * (fp8_recipe_factor(recipe) - 1) + slower_math,
                            rel_tol=1e-9, abs_tol=1e-15)
        assert math.isclose(fp8_weight_cast_time(1e9, h100x8, recipe),
                            fp8_weight_cast_time(1e9, h100x8) * fp8_recipe_factor(recipe))
    assert fp8_recipe_factor("rowwise") == 3.3
    assert 0.8 < fp8_recipe_factor("blockwise") < 0.82 and 0.8 < fp8_recipe_factor("mxfp8") < 0.82
    kw = dict(seq_len=4096, global_batch=32, precision="fp8")
    tw = estimate_profile(prof, h100x8, dict(tp=2, dp=4), **kw)
    rw = estimate_profile(prof, h100x8, dict(tp=2, dp=4), fp8_recipe="rowwise", **kw)
    assert tw == estimate_profile(prof, h100x8, dict(tp=2, dp=4), fp8_recipe="tensorwise", **kw)
    assert rw.step_time_s > tw.step_time_s and rw.comm_s == tw.comm_s


def test_mxfp8_needs_blackwell(prof, h100x8):
    from meshplan.errors import ConfigError
    kw = dict(seq_len=4096, global_batch=32, precision="fp8", fp8_recipe="mxfp8")
    with pytest.raises(ConfigError, match="mxfp8"):
        estimate_profile(prof, h100x8, dict(tp=2, dp=4), **kw)
    b200 = Cluster.preset("dgx-b200", nodes=1)
    assert estimate_profile(prof, b200, dict(tp=2, dp=4), **kw).step_time_s > 0
    with pytest.raises(ValueError, match="recipe"):
        estimate_profile(prof, b200, dict(tp=2, dp=4), **dict(kw, fp8_recipe="nvfp4"))


def test_validation_reads_the_recipe_from_the_precision_column():
    from meshplan.cost_models.validation import Row, stack_options
    assert stack_options(Row(id="modelzoo-x", source="", raw={"precision": "fp8 (blockwise)"}))["fp8_recipe"] == \
        "blockwise"
    # NeMo 1.x ran Transformer Engine 1.x, whose one recipe is delayed scaling; Bridge's H100 "FP8" is
    # current scaling, the Layout's default
    assert stack_options(Row(id="nemo2407-x", source="", raw={"precision": "fp8"}))["fp8_recipe"] == "delayed"
    assert stack_options(Row(id="nemo-longseq-x", source="", raw={"precision": "fp8"}))["fp8_recipe"] == "delayed"
    assert "fp8_recipe" not in stack_options(Row(id="mb-2604.01-x", source="", raw={"precision": "fp8"}))
    assert "fp8_recipe" not in stack_options(Row(id="nemo2407-x", source="", raw={"precision": "bf16"}))


def test_delayed_scaling_skips_the_amax_pass(prof, h100x8):
    """Delayed scaling takes its scale from earlier steps' amax history: the same per-tensor-scaled
    GEMMs as current (tensorwise) scaling, one read of each quantised tensor fewer (3 bytes per element
    against 5), so an FP8 step is faster by exactly the casts' difference."""
    from meshplan.cost_models import constants as K
    from meshplan.cost_models.roofline import fp8_cast_time
    assert K.FP8_RECIPE_GEMM_RATE["delayed"] == K.FP8_RECIPE_GEMM_RATE["tensorwise"]
    t, d = (fp8_cast_time(8192, 4096, 4096, h100x8, r) for r in ("tensorwise", "delayed"))
    assert d == pytest.approx(t * 3 / 5)
    kw = dict(seq_len=4096, global_batch=32, precision="fp8", stack="megatron-core")
    cur = estimate_profile(prof, h100x8, dict(tp=2, dp=4), fp8_recipe="tensorwise", **kw)
    old = estimate_profile(prof, h100x8, dict(tp=2, dp=4), fp8_recipe="delayed", **kw)
    assert old.step_time_s < cur.step_time_s
    assert old.peak_memory_gb == pytest.approx(cur.peak_memory_gb)
    # torchao has no delayed scaling: the torchtitan stack refuses it by name
    with pytest.raises(Exception, match="delayed"):
        estimate_profile(prof, h100x8, dict(tp=2, dp=4), fp8_recipe="delayed", **dict(kw, stack="torchtitan"))


# ---- MoE memory: DeepEP buffers ---------------------------------------------------------------------
def test_deepep_buffers_follow_deepeps_size_hints(h100x16):
    """DeepEP (csrc/legacy/config.hpp): 10 channels (20 SMs / 2) x NVLink peers x recv-token slots x
    per-token bytes (hidden*2 data + 8 meta + 128 int64 top-k indices + 128 fp32 weights + 128 fp32
    scales); an RDMA buffer only beyond one node."""
    from meshplan.cost_models.memory import deepep_buffer_bytes
    h = 4096
    per_token = 2 * h + 8 + 128 * 8 + 128 * 4 + 128 * 4
    nvl8 = 10 * 8 * (2 * 1 + 3) * 4 + 10 * 8 * 256 * per_token     # head/tail ints + token slots
    assert deepep_buffer_bytes(h, 8) == -(-nvl8 // 128) * 128
    assert deepep_buffer_bytes(h, 1) == 0.0
    assert deepep_buffer_bytes(h, 32) > deepep_buffer_bytes(h, 8) * 1.4          # + RDMA buffers across nodes
    moe = profile_from_config(dict(family="moe", layers=4, hidden=h, heads=32, kv_heads=8, vocab=32000,
                                   ffn_hidden=8192, experts=16, topk=2, moe_ffn_hidden=1024))
    kw = dict(seq_len=4096, global_batch=32)
    a2a = estimate_profile(moe, h100x16, dict(ep=16, dp=16), **kw)
    dee = estimate_profile(moe, h100x16, dict(ep=16, dp=16, moe_dispatcher="deepep"), **kw)
    assert "comm_buffers" not in a2a.memory_gb
    assert math.isclose(dee.memory_gb["comm_buffers"], deepep_buffer_bytes(h, 16) / 2 ** 30)
    assert math.isclose(dee.peak_memory_gb - a2a.peak_memory_gb, dee.memory_gb["comm_buffers"], rel_tol=1e-9)


# ---- MoE experts: one grouped GEMM ------------------------------------------------------------------
def test_grouped_gemm_pays_the_kernel_cost_once_and_pads_rows_to_tiles(h100x8):
    """torch._grouped_mm / Megatron-Core --moe-grouped-gemm: all local experts in one kernel (one fixed
    cost, not one per expert); each expert's rows fill whole 128-row tiles of math."""
    from meshplan.cost_models.compute import gemm_time, grouped_gemm_time
    n, k = 4096, 4096
    body = gemm_time(4096, n, k, h100x8) - K.GEMM_FIXED_S
    g = grouped_gemm_time(4096, n, k, h100x8, groups=16)
    assert math.isclose(g, 16 * body + K.GEMM_FIXED_S)
    assert math.isclose(gemm_time(4096, n, k, h100x8, count=16) - g, 15 * K.GEMM_FIXED_S)
    # 300 rows per expert take 3 row tiles, the math of 384 rows (compute-bound: above ~243 rows an
    # H100 GEMM with bf16 weights does more math than weight traffic); separate GEMMs would not pad
    assert K.GEMM_TILE_M == 128
    assert grouped_gemm_time(300, n, k, h100x8, groups=8) == grouped_gemm_time(384, n, k, h100x8, groups=8)
    assert gemm_time(300, n, k, h100x8, count=8) < gemm_time(384, n, k, h100x8, count=8)
    # below the ridge the weights' HBM traffic sets the time, padded or not
    assert math.isclose(grouped_gemm_time(64, n, k, h100x8, groups=8),
                        gemm_time(64, n, k, h100x8, count=8) - 7 * K.GEMM_FIXED_S)


def test_layer_charges_experts_as_one_grouped_gemm(h100x8):
    from meshplan.cost_models.compute import gemm_time, grouped_gemm_time
    from meshplan.cost_models.layer import _gemms, moe_load_factor
    moe = profile_from_config(dict(family="moe", layers=2, hidden=2048, heads=16, kv_heads=4, vocab=32000,
                                   ffn_hidden=4096, experts=64, topk=4, moe_ffn_hidden=768))
    b = next(bl for bl in moe.layer_blocks() if bl.is_moe)
    c = Context.build(h100x8, Layout(ep=8, dp=8), 4096, False)
    fwd, _ = _gemms(b, c)
    want = 0.0
    for li in b.linears:
        if li.role in ("expert_in", "expert_out"):
            # the busiest EP rank's rows (routing imbalance: tests/cost_models/test_moe_imbalance.py)
            rows = c.tokens * 8 * li.tokens_per_token * moe_load_factor(b, c)
            want += grouped_gemm_time(rows, li.out_features, li.in_features, h100x8, groups=li.count / 8)
        elif li.role == "router":
            want += gemm_time(c.tokens, li.out_features, li.in_features, h100x8)
        else:
            want += gemm_time(c.tokens * li.tokens_per_token, li.out_features, li.in_features, h100x8, count=li.count)
    assert math.isclose(fwd, want, rel_tol=1e-12)


def test_rowwise_fp8_reproduces_the_measured_h100_step_difference():
    """This project's H100 measurement (benchmarks/results/gpu_suite-2026-11-24-...-fp8-runtime.md):
    torchao rowwise took 0.1681 s a step against tensorwise's 0.1379 s on one H100 (16 layers, hidden
    2048, ffn 8192, 4 x 2048 tokens). The model's difference between the two recipes is that 30 ms
    within 10%: almost all of it the rowwise casts (constants.FP8_QUANT_BYTES, measured on an H200),
    the rowwise GEMMs running at 0.98 of the tensorwise rate as the H200's kernels do."""
    import meshplan as mp
    meta = mp.models.build("llama3-8b", device="meta", layers=16, hidden=2048, heads=16, kv_heads=8,
                           ffn_hidden=8192)
    one = Cluster(gpu=Cluster.preset("dgx-h100", nodes=1).gpu, gpus_per_node=1, nodes=1)
    step = {r: mp.estimate(meta, one, {"dp": 1, "mbs": 4, "zero": 0, "fp8_recipe": r}, seq_len=2048,
                           global_batch=4, precision="fp8", stack="torchtitan").step_time_s
            for r in ("tensorwise", "rowwise")}
    assert step["rowwise"] - step["tensorwise"] == pytest.approx(0.1681 - 0.1379, rel=0.10)



def test_latent_attention_keeps_value_wide_outputs():
    """MLA's queries and keys are 192 wide per head, its values and the attention output 128: the
    activation charge and the a2a CP volume count each tensor at its own width, so the same block
    with value-wide outputs as wide as its queries is charged exactly the difference."""
    import dataclasses

    import meshplan as mp
    from meshplan.cost_models.context import Context
    from meshplan.cost_models.cp import _cp_a2a
    from meshplan.cost_models.layer import activation_bytes
    from meshplan.profiling.analytic import profile_from_config
    mla = profile_from_config(mp.models.config("deepseek-v3"), seq_len=4096)
    b = next(x for x in mla.blocks if x.heads)
    wide = dataclasses.replace(b, v_head_dim=b.head_dim)     # values (and so the output) as wide as q
    assert b.o_dim < wide.o_dim == b.q_dim
    cl = Cluster.preset("dgx-h100", nodes=2)
    tp = 8
    ctx = Context.build(cl, Layout(tp=tp, dp=2, mbs=1), seq_len=4096, fp8=False)
    extra = activation_bytes(wide, ctx, policy="none") - activation_bytes(b, ctx, policy="none")
    # per token: the flash output and the out-projection input (o_dim each), the values (v_dim), / tp
    per_token = K.BF16 * (2 * (wide.o_dim - b.o_dim) + (wide.v_dim - b.v_dim)) / tp
    assert extra == pytest.approx(per_token * ctx.tokens, rel=1e-9)
    cp_ctx = Context.build(cl, Layout(tp=1, cp=8, dp=2, mbs=1, cp_comm_type="a2a"), seq_len=4096, fp8=False)
    assert _cp_a2a(b, cp_ctx)[0] < _cp_a2a(wide, cp_ctx)[0]
