"""The cost model against formulas computed independently here: Megatron model FLOPs,
ZeRO state bytes, per-GPU weights under TP/PP, activation orderings, pipeline bubbles and the
step-time breakdown (cost_models.md §3-§6)."""

from __future__ import annotations

import math

import pytest

import meshplan
from meshplan.cluster import Cluster
from meshplan.errors import ConfigError
from meshplan.cost_models import constants as K
from meshplan.cost_models.estimate import estimate_profile
from meshplan.ir.estimate import GB
from meshplan.cost_models.flops import model_flops_per_step
from meshplan.cost_models.memory import state_bytes
from meshplan.cost_models.pipeline import in_flight, pipeline_time
from meshplan.profiling.analytic import profile_from_config

# GPT-style: LayerNorm-free defaults are fine, what matters is GELU 4h + MHA
GPT = dict(layers=24, hidden=2048, heads=16, vocab=51200, gated=False)
LLAMA8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, vocab=128256, ffn_hidden=14336)
LLAMA70B = dict(layers=80, hidden=8192, heads=64, kv_heads=8, vocab=128256, ffn_hidden=28672)
MOE = dict(layers=8, hidden=2048, heads=16, kv_heads=4, vocab=32768, experts=8, topk=2, moe_ffn_hidden=1024,
           shared_experts=1)



def est(cfg, cluster, seq_len=2048, global_batch=64, precision="bf16", **layout):
    return meshplan.estimate(cfg, cluster, layout, seq_len=seq_len, global_batch=global_batch, precision=precision)


# ---- FLOPs ----------------------------------------------------------------------------------------
def test_gpt_flops_match_narayanan_formula():
    p = profile_from_config(GPT)
    L, h, V = GPT["layers"], GPT["hidden"], GPT["vocab"]
    for s, B in ((2048, 8), (4096, 3), (128, 1)):
        want = 72 * B * s * L * h ** 2 * (1 + s / (6 * h) + V / (12 * L * h))
        assert model_flops_per_step(p, s, B, causal_half=False) == pytest.approx(want, rel=1e-9)


def test_causal_halves_only_attention_term():
    p = profile_from_config(GPT)
    L, h = GPT["layers"], GPT["hidden"]
    s, B = 4096, 2
    full = model_flops_per_step(p, s, B, causal_half=False)
    half = model_flops_per_step(p, s, B, causal_half=True)
    attn = 3 * B * s * L * 4 * s * h           # fwd 4*s*h per token per layer, x3
    assert full - half == pytest.approx(attn / 2, rel=1e-9)


def test_swiglu_gqa_hand_count():
    cfg = dict(layers=4, hidden=1024, heads=16, kv_heads=4, ffn_hidden=2816, vocab=32000)
    p = profile_from_config(cfg)
    h, f, V, L = 1024, 2816, 32000, 4
    hq, hkv = 1024, 4 * 64
    s, B = 1024, 4
    per_tok_layer = 2 * (h * hq + 2 * h * hkv + hq * h) + 2 * 3 * h * f + 4 * s * hq / 2
    want = 3 * B * s * (L * per_tok_layer + 2 * h * V)
    assert model_flops_per_step(p, s, B) == pytest.approx(want, rel=1e-9)


def test_moe_counts_topk_experts_excludes_router():
    p = profile_from_config(MOE)
    h, E, k, fm, L, V = 2048, 8, 2, 1024, 8, 32768
    hq, hkv = 2048, 4 * 128
    s, B = 2048, 2
    attn = 2 * (h * hq + 2 * h * hkv + hq * h) + 4 * s * hq / 2
    experts = k * 2 * 3 * h * fm            # topk routed experts, SwiGLU
    shared = 2 * 3 * h * fm                 # one shared expert of width fm
    want = 3 * B * s * (L * (attn + experts + shared) + 2 * h * V)
    got = model_flops_per_step(p, s, B)
    assert got == pytest.approx(want, rel=1e-9)
    # the router (2*h*E per token per layer) must not be in it
    assert abs(got - want) < 3 * B * s * L * 2 * h * E / 100


def test_estimate_tflops_and_mfu_consistent(h100x8):
    p = profile_from_config(LLAMA8B)
    e = estimate_profile(p, h100x8, dict(tp=2, pp=2, dp=2), seq_len=4096, global_batch=32)
    flops = model_flops_per_step(p, 4096, 32)
    assert e.model_tflops_per_gpu * e.step_time_s * e.num_gpus * 1e12 == pytest.approx(flops, rel=1e-9)
    assert e.mfu == pytest.approx(e.model_tflops_per_gpu / h100x8.gpu.bf16_tflops, rel=1e-9)
    assert e.hfu == pytest.approx(e.mfu, rel=1e-12)          # no recompute
    assert e.tokens_per_s_per_gpu == pytest.approx(4096 * 32 / e.step_time_s / 8, rel=1e-9)
    assert 0.05 < e.mfu < 0.8
    full = estimate_profile(p, h100x8, dict(tp=2, pp=2, dp=2, recompute="full"), seq_len=4096, global_batch=32)
    assert full.hfu > full.mfu
    assert full.step_time_s > e.step_time_s


# ---- memory ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_state_bytes_per_zero_stage(d):
    P = 1e9
    per_param = {0: 18, 1: 6 + 12 / d, 2: 2 + 16 / d, 3: 18 / d}
    for zero, want in per_param.items():
        got = state_bytes(P, d, zero)
        assert sum(got.values()) == pytest.approx(want * P, rel=1e-12)
        assert set(got) == {"weights", "gradients", "optimizer"}


def _llama_block_params(c):
    h, f, hd = c["hidden"], c["ffn_hidden"], c["hidden"] // c["heads"]
    hq, hkv = c["heads"] * hd, c["kv_heads"] * hd
    return h * hq + 2 * h * hkv + hq * h + 3 * h * f + 2 * h


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (8, 1), (1, 4), (2, 4), (4, 2)])
def test_weights_gradients_optimizer_scale_with_tp_pp(h100x8, tp, pp):
    c = LLAMA8B
    dp = 8 // (tp * pp)
    e = est(c, h100x8, seq_len=1024, global_batch=16, tp=tp, pp=pp, dp=dp, zero=1)
    params0 = (c["layers"] // pp * _llama_block_params(c) + c["vocab"] * c["hidden"]
               + (c["vocab"] * c["hidden"] + c["hidden"] if pp == 1 else 0)) / tp
    m0 = e.memory_by_stage[0]
    assert m0["weights"] * GB == pytest.approx(2 * params0, rel=1e-9)
    assert m0["gradients"] * GB == pytest.approx(4 * params0, rel=1e-9)
    assert m0["optimizer"] * GB == pytest.approx(12 * params0 / dp, rel=1e-9)
    if pp > 1:
        last = (c["layers"] // pp * _llama_block_params(c) + c["vocab"] * c["hidden"] + c["hidden"]) / tp
        assert e.memory_by_stage[-1]["weights"] * GB == pytest.approx(2 * last, rel=1e-9)
        mid = c["layers"] // pp * _llama_block_params(c) / tp
        if pp > 2:
            assert e.memory_by_stage[1]["weights"] * GB == pytest.approx(2 * mid, rel=1e-9)


def test_recompute_orders_activations(h100x8):
    acts = {rc: est(LLAMA8B, h100x8, seq_len=4096, global_batch=16, tp=2, pp=2, dp=2, recompute=rc)
            .memory_by_stage[0]["activations"] for rc in ("none", "selective", "full")}
    assert acts["full"] < acts["selective"] <= acts["none"]
    assert acts["full"] < acts["none"] / 5


def test_selective_strictly_less_without_flash_attention(h100x8):
    a = {rc: est(GPT, h100x8, seq_len=2048, global_batch=16, tp=2, dp=4, recompute=rc,
                 flash_attention=False).memory_gb["activations"] for rc in ("none", "selective")}
    assert a["selective"] < a["none"]


def test_sequence_parallel_reduces_activations(h100x8):
    on = est(LLAMA8B, h100x8, seq_len=4096, global_batch=16, tp=4, dp=2, sp=True)
    off = est(LLAMA8B, h100x8, seq_len=4096, global_batch=16, tp=4, dp=2, sp=False)
    assert on.memory_gb["activations"] < off.memory_gb["activations"]
    assert on.memory_gb["weights"] == pytest.approx(off.memory_gb["weights"], rel=1e-12)


def test_1f1b_first_stage_holds_more_microbatches(h100x8):
    cfg = dict(LLAMA8B, vocab=32768)
    e = est(cfg, h100x8, seq_len=2048, global_batch=16, pp=4, dp=2)
    acts = [s["activations"] for s in e.memory_by_stage]
    assert acts[0] > acts[1] > acts[2]
    assert [in_flight("1f1b", 8, 4, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 2, 4, 1, r) for r in range(4)] == [2, 2, 2, 1]
    assert in_flight("gpipe", 8, 4, 1, 0) == 8 and in_flight("gpipe", 8, 4, 1, 3) == 8


def test_interleaved_stage0_activation_factor(h100x8):
    p, v, m = 4, 2, 8
    base = est(LLAMA8B, h100x8, seq_len=2048, global_batch=16, pp=p, dp=2)
    inter = est(LLAMA8B, h100x8, seq_len=2048, global_batch=16, pp=p, vp=v, dp=2)
    assert base.num_microbatches == m
    ratio = inter.memory_by_stage[0]["activations"] / base.memory_by_stage[0]["activations"]
    assert ratio == pytest.approx(1 + (p - 1) / (p * v), rel=0.02)


def test_fp8_stores_smaller_activations_and_weight_cache(h100x8):
    bf = est(LLAMA8B, h100x8, seq_len=4096, global_batch=16, tp=2, dp=4)
    f8 = est(LLAMA8B, h100x8, seq_len=4096, global_batch=16, tp=2, dp=4, precision="fp8")
    assert f8.memory_gb["activations"] < bf.memory_gb["activations"]
    assert bf.memory_gb["fp8_cache"] == 0.0
    assert f8.memory_gb["fp8_cache"] > 0.0
    # TE's FP8 weight copy: FP8_WEIGHT_CACHE_BYTES per local parameter of the layers (weights are 2
    # bytes each); the embedding, output layer and final norm run in BF16 and have none
    p = profile_from_config(LLAMA8B, seq_len=4096)
    edges = (p.embedding_params + p.head_params + p.other_params) / 2 * K.PARAM_BYTES / GB     # tp=2, one stage
    want = (f8.memory_gb["weights"] - edges) * K.FP8_WEIGHT_CACHE_BYTES / K.PARAM_BYTES
    assert f8.memory_gb["fp8_cache"] == pytest.approx(want, rel=1e-9)
    assert f8.step_time_s < bf.step_time_s


def test_fits_flips_with_capacity():
    c64 = Cluster.preset("dgx-h100", nodes=8)
    ddp = est(LLAMA70B, c64, seq_len=4096, global_batch=64, dp=64, zero=0)
    assert not ddp.fits
    assert ddp.peak_memory_gb > 70e9 * 18 / GB * 0.99           # 18 bytes per parameter, unsharded
    assert ddp.bottleneck.startswith("memory")
    fsdp = est(LLAMA70B, c64, seq_len=4096, global_batch=64, dp=64, zero=3, recompute="full")
    assert fsdp.fits
    assert fsdp.peak_memory_gb < fsdp.capacity_gb == pytest.approx(c64.usable_memory_gb)
    assert fsdp.fits == (fsdp.peak_memory_gb <= fsdp.capacity_gb)


def test_peak_is_max_stage(h100x8):
    e = est(LLAMA8B, h100x8, seq_len=2048, global_batch=16, pp=4, dp=2)
    totals = [sum(s.values()) for s in e.memory_by_stage]
    assert e.peak_memory_gb == pytest.approx(max(totals), rel=1e-12)
    assert e.peak_stage == totals.index(max(totals))
    assert e.memory_gb == e.memory_by_stage[e.peak_stage]


def test_zero3_without_data_parallel_costs_no_extra_memory(h100x8):
    z0 = est(LLAMA8B, h100x8, seq_len=1024, global_batch=1, tp=8, dp=1, zero=0)
    z3 = est(LLAMA8B, h100x8, seq_len=1024, global_batch=1, tp=8, dp=1, zero=3)
    assert z3.peak_memory_gb <= z0.peak_memory_gb * (1 + 1e-9)


# ---- pipeline -------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 4, 8])
def test_pipeline_bubbles_uniform(p):
    t, w, m = 0.3, 0.1, 4 * p
    busy, b1 = pipeline_time("1f1b", m, 1, [t] * p, [w] * p)
    assert busy == pytest.approx(m * t)
    assert b1 == pytest.approx((p - 1) * t)
    assert pipeline_time("gpipe", m, 1, [t] * p, [w] * p)[1] == pytest.approx((p - 1) * t)
    for v in (2, 4):
        assert pipeline_time("interleaved", m, v, [t] * p, [w] * p)[1] == pytest.approx((p - 1) * t / v)
    zb = pipeline_time("zb", m, 1, [t] * p, [w] * p)[1]
    assert zb == pytest.approx((p - 1) * (t - 2 * w))
    assert 0 < zb < b1
    assert pipeline_time("zbv", 2 * p, 2, [t] * p, [w] * p)[1] == 0.0
    assert pipeline_time("zbv", 2 * p - 1, 2, [t] * p, [w] * p)[1] > 0.0


def test_pipeline_single_stage_and_uneven():
    assert pipeline_time("1f1b", 8, 1, [0.5], [0.1]) == (4.0, 0.0)
    busy, bubble = pipeline_time("1f1b", 8, 1, [0.1, 0.3, 0.2], [0.0] * 3)
    assert busy == pytest.approx(8 * 0.3)
    assert bubble == pytest.approx(0.3)    # fill + drain walk the other ranks


def test_estimate_bubble_grows_with_pp():
    bubbles = []
    for nodes, pp in ((1, 2), (2, 4), (4, 8)):
        e = est(LLAMA8B, Cluster.preset("dgx-h100", nodes=nodes), seq_len=2048, global_batch=32, pp=pp, dp=4)
        assert e.num_microbatches == 8
        bubbles.append(e.time_s["bubble"])
    assert bubbles[0] < bubbles[1] < bubbles[2]


def test_more_microbatches_shrink_bubble_fraction(h100x8):
    fr = []
    for B in (8, 32, 128):
        e = est(LLAMA8B, h100x8, seq_len=2048, global_batch=B, pp=4, dp=2)
        fr.append(e.time_s["bubble"] / e.step_time_s)
    assert fr[0] > fr[1] > fr[2] > 0


def test_interleaving_shrinks_estimate_bubble(h100x8):
    a = est(LLAMA8B, h100x8, seq_len=2048, global_batch=16, pp=4, dp=2)
    b = est(LLAMA8B, h100x8, seq_len=2048, global_batch=16, pp=4, vp=2, dp=2)
    assert b.time_s["bubble"] < a.time_s["bubble"]
    assert b.comm_s["pp"] > a.comm_s["pp"]            # v x more p2p


# ---- step-time breakdown --------------------------------------------------------------------------
BREAKDOWN_CASES = [
    (LLAMA8B, 1, dict(tp=1, dp=8)),
    (LLAMA8B, 1, dict(tp=2, pp=2, dp=2, recompute="selective")),
    (LLAMA8B, 2, dict(tp=4, cp=2, pp=2, dp=1, recompute="full")),
    (LLAMA8B, 2, dict(tp=2, pp=4, vp=2, dp=2, zero=3)),
    (MOE, 1, dict(tp=2, dp=4, ep=4)),
    (MOE, 2, dict(tp=2, cp=2, dp=4, ep=8, etp=2, zero=2)),
    (MOE, 1, dict(dp=8, ep=1, zero=0, recompute=1)),
]


@pytest.mark.parametrize("cfg,nodes,layout", BREAKDOWN_CASES)
def test_time_breakdown_sums_and_signs(cfg, nodes, layout):
    e = est(cfg, Cluster.preset("dgx-h100", nodes=nodes), seq_len=4096, global_batch=32, **layout)
    assert sum(e.time_s.values()) == pytest.approx(e.step_time_s, rel=1e-9)
    assert all(v >= 0 for v in e.time_s.values()), e.time_s
    assert all(math.isfinite(v) for v in e.time_s.values())
    is_moe = "experts" in cfg
    tp, cp, dp, ep = layout.get("tp", 1), layout.get("cp", 1), layout.get("dp", 1), layout.get("ep", 1)
    assert (e.time_s["tp"] > 0) == (tp > 1) and (e.comm_s["tp"] > 0) == (tp > 1)
    assert (e.comm_s["ep"] > 0) == (is_moe and ep > 1)
    assert (e.comm_s["cp"] > 0) == (cp > 1)
    if dp * cp == 1:
        assert e.time_s["dp"] == 0.0 and e.comm_s["dp"] == 0.0
    else:
        assert e.comm_s["dp"] > 0
    if layout.get("pp", 1) == 1:
        assert e.time_s["bubble"] == 0.0 and e.comm_s["pp"] == 0.0
    for k in ("tp", "cp", "ep", "pp", "dp"):
        assert e.comm_s[k] >= e.time_s[k] * (1 - 1e-9), k


def test_tp_comm_overlap_hides_tp(h100x8):
    a = est(LLAMA8B, h100x8, seq_len=4096, global_batch=16, tp=8, dp=1)
    b = est(LLAMA8B, h100x8, seq_len=4096, global_batch=16, tp=8, dp=1, tp_comm_overlap=True)
    assert b.time_s["tp"] < a.time_s["tp"]
    assert b.comm_s["tp"] == pytest.approx(a.comm_s["tp"], rel=1e-12)


def test_pp_exposed_not_above_total_with_few_microbatches(h100x8):
    e = est(dict(layers=8, hidden=1024, heads=16, vocab=32768), h100x8, seq_len=1024, global_batch=2, pp=4, dp=2)
    assert e.num_microbatches == 1
    assert e.comm_s["pp"] >= e.time_s["pp"]


def test_fsdp_exposed_not_above_total():
    c = Cluster.preset("dgx-h100", nodes=4)
    e = est(dict(layers=2, hidden=8192, heads=64, vocab=32768), c, seq_len=128, global_batch=32, dp=32, zero=3)
    assert e.comm_s["dp"] >= e.time_s["dp"]


def test_estimate_json_round_trip(h100x8):
    e = est(MOE, h100x8, seq_len=2048, global_batch=16, tp=2, dp=4, ep=4)
    back = meshplan.Estimate.from_dict(__import__("json").loads(e.to_json()))
    assert back == e
    assert "tokens/s/GPU" in e.summary()


# ---- stack mechanisms: gradient dtype, MoE dispatch, ZeRO-3 flavours, FP8 weight caching ---------
def test_bf16_gradients_halve_gradient_memory_and_reduce_scatter(h100x16):
    fp32 = est(LLAMA8B, h100x16, seq_len=2048, global_batch=32, dp=16)
    bf16 = est(LLAMA8B, h100x16, seq_len=2048, global_batch=32, dp=16, grad_dtype="bf16")
    assert bf16.memory_gb["gradients"] == pytest.approx(fp32.memory_gb["gradients"] / 2, rel=1e-9)
    assert bf16.comm_s["dp"] < fp32.comm_s["dp"]
    assert bf16.layout.grad_dtype == "bf16" and "grads-bf16" in bf16.layout.short()


@pytest.mark.parametrize("stack, kept", [("meshplan", 1.0), ("torchtitan", 1.0), ("megatron-core", 0.5)])
def test_bf16_gradients_are_held_in_the_dtype_the_stack_keeps(h100x16, stack, kept):
    """FSDP2 / DDP over fp32 parameters reduce in bf16 but hold fp32 gradients (the reduced shard is
    cast back to the parameter's dtype); Megatron-Core's --grad-reduce-in-bf16 buffer is bf16."""
    kw = dict(seq_len=2048, global_batch=32, stack=stack)
    for layout in (dict(dp=16, zero=1), dict(dp=16, zero=3)):
        fp32 = meshplan.estimate(LLAMA8B, h100x16, layout, **kw)
        bf16 = meshplan.estimate(LLAMA8B, h100x16, dict(layout, grad_dtype="bf16"), **kw)
        assert bf16.comm_s["dp"] < fp32.comm_s["dp"]                          # the reduction is bf16
        if layout["zero"] == 1:
            assert bf16.memory_gb["gradients"] == pytest.approx(kept * fp32.memory_gb["gradients"], rel=1e-9)


def test_deepep_dispatch_cuts_cross_node_expert_traffic(h100x16):
    moe = dict(MOE, experts=64, topk=8)
    a2a = est(moe, h100x16, seq_len=4096, global_batch=16, dp=16, ep=16)
    dee = est(moe, h100x16, seq_len=4096, global_batch=16, dp=16, ep=16, moe_dispatcher="deepep")
    assert 0 < dee.comm_s["ep"] < 0.7 * a2a.comm_s["ep"]
    assert dee.step_time_s < a2a.step_time_s
    # without expert parallelism the dispatcher changes nothing
    assert est(moe, h100x16, dp=16, moe_dispatcher="deepep").step_time_s == pytest.approx(
        est(moe, h100x16, dp=16).step_time_s)


def test_megatron_fsdp_hides_more_than_torch_fsdp():
    c = Cluster.preset("dgx-h100", nodes=4)
    torch_fsdp = est(LLAMA8B, c, seq_len=4096, global_batch=64, dp=32, zero=3, recompute="full")
    mfsdp = est(LLAMA8B, c, seq_len=4096, global_batch=64, dp=32, zero=3, recompute="full", fsdp_impl="megatron")
    assert mfsdp.time_s["dp"] < torch_fsdp.time_s["dp"]
    assert mfsdp.comm_s["dp"] == pytest.approx(torch_fsdp.comm_s["dp"])      # same traffic, better hidden
    with pytest.raises(ConfigError, match="needs zero=3"):
        est(LLAMA8B, c, dp=32, zero=1, fsdp_impl="megatron")
    with pytest.raises(ConfigError, match="grad_dtype"):
        est(LLAMA8B, c, dp=32, grad_dtype="fp16")


def test_deepspeed_zero3_gathers_modules_not_blocks():
    """A 20480-wide GPT block holds 5B parameters; DeepSpeed gathers one sub-module (<= the 1.7B
    FC1) under its live-parameter cap, FSDP two whole blocks."""
    big = dict(layers=4, hidden=20480, heads=128, vocab=51200, gated=False)
    c = Cluster.preset("dgx-a100", nodes=8)
    fsdp = est(big, c, seq_len=2048, global_batch=64, dp=64, zero=3, recompute="full")
    ds = est(big, c, seq_len=2048, global_batch=64, dp=64, zero=3, recompute="full", fsdp_impl="deepspeed")
    fc1 = 20480 * 4 * 20480
    live = max(fc1, min(K.DS_MAX_LIVE_PARAMS, fc1 + K.DS_PREFETCH_BUCKET))
    sharded = fsdp.memory_gb["weights"] - 2 * K.PARAM_BYTES * 12 * 20480 ** 2 / GB   # minus two ~12h^2 blocks
    assert ds.memory_gb["weights"] == pytest.approx(sharded + K.PARAM_BYTES * live / GB, rel=0.01)
    assert ds.peak_memory_gb < fsdp.peak_memory_gb


def test_fp8_weights_cast_once_per_step(h100x8):
    from meshplan.cost_models.compute import fp8_weight_cast_time, gemm_time
    m, n, k = 4096, 4096, 4096
    per_use = gemm_time(m, n, k, h100x8, fp8=True, weight_cast=True)
    cached = gemm_time(m, n, k, h100x8, fp8=True)
    assert cached < per_use
    assert gemm_time(m, n, k, h100x8, weight_cast=True) == gemm_time(m, n, k, h100x8)   # BF16: no cast
    hbm = h100x8.gpu.hbm_tb_s * 1e12 * K.HBM_EFF
    # an uncached weight is quantised every micro-batch, a third of it charged to each of the three GEMMs
    assert per_use - cached == pytest.approx(n * k * K.FP8_QUANT_BYTES["tensorwise"] / hbm / 3)
    assert fp8_weight_cast_time(n * k, h100x8) == pytest.approx(n * k * K.FP8_QUANT_BYTES["tensorwise"] / hbm)
    # more micro-batches amortise the cast: FP8's per-micro-batch time gain grows with m
    f1 = est(LLAMA8B, h100x8, seq_len=4096, global_batch=8, dp=8, precision="fp8")
    f4 = est(LLAMA8B, h100x8, seq_len=4096, global_batch=32, dp=8, precision="fp8")
    assert f4.step_time_s < 4 * f1.step_time_s
