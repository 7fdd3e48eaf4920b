"""Sliding-window attention through the profile, the cost model, the runtime's limits, the planner and
the exports: windows recorded per block (tracer and analytic profile agree), windowed FLOPs
(w - w^2/2s keys per query), the banded flash-attention shape, the refusals, GPT-OSS planned and
exported."""

from __future__ import annotations

import dataclasses

import pytest

import meshplan as mp
from meshplan import models
from meshplan.cost_models import compute
from meshplan.cost_models.attention import AttnCall, AttnShape, _call_cost, _masked_pairs, layer_calls
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.flops import attention_fwd_flops_per_token, model_flops_per_step
from meshplan.errors import ConfigError, MeshplanError
from meshplan.export.shape import ModelShape
from meshplan.ir.support import ModelTraits, runtime_limits
from meshplan.profiling.analytic import profile_from_config


def test_profiles_record_the_window_per_block():
    cfg = models.config("tiny-llama", sliding_window=16, attention_sinks=True, bias=True)
    traced = mp.profile(models.build("tiny-llama", device="meta", sliding_window=16, attention_sinks=True,
                                     bias=True), seq_len=64)
    built = profile_from_config(cfg, seq_len=64)
    for p in (traced, built):
        assert [b.attn_window for b in p.layer_blocks()] == [16, 0, 16, 0]
        assert len(p.blocks) == 2 and p.blocks[0].signature != p.blocks[1].signature
        assert all(b.attn_sinks and b.causal for b in p.blocks)
        assert p.total_params == cfg.num_params()
    # the window is part of the model's identity (plans and cached layer costs are tied to it)
    assert traced.fingerprint != mp.profile(models.build("tiny-llama", device="meta", attention_sinks=True,
                                                         bias=True), seq_len=64).fingerprint
    assert traced.layers == built.layers == (0, 1, 0, 1)


def test_windowed_attention_flops():
    p = profile_from_config(models.config("gpt-oss-20b"), seq_len=4096)
    swa, full = p.blocks[p.layers[0]], p.blocks[p.layers[1]]
    s, w, width = 4096, 128, swa.q_dim + swa.o_dim
    assert (swa.attn_window, full.attn_window) == (128, 0)
    # each query attends min(i + 1, w) keys: s w - w^2 / 2 pairs over the sequence
    assert attention_fwd_flops_per_token(swa, s) == pytest.approx(2 * (w - w * w / (2 * s)) * width)
    assert attention_fwd_flops_per_token(full, s) == pytest.approx(2 * (s / 2) * width)
    assert attention_fwd_flops_per_token(swa, s, causal_half=False) == pytest.approx(2 * w * width)
    # a window as long as the sequence is plain causal attention
    assert attention_fwd_flops_per_token(swa, w) == pytest.approx(attention_fwd_flops_per_token(full, w))
    unwindowed = dataclasses.replace(p, blocks=tuple(dataclasses.replace(b, attn_window=0) for b in p.blocks))
    saved = model_flops_per_step(unwindowed, s, 8) - model_flops_per_step(p, s, 8)
    assert saved == pytest.approx(3 * 8 * s * 12 * 2 * (s / 2 - (w - w * w / (2 * s))) * width)


def test_banded_kernel_shape():
    """FlashAttention's local mode computes the tiles the band touches: two per query tile row
    for a 128-token window on 128-wide tiles (one on the first row)."""
    s, n = 4096, 4096 // 128
    call = AttnCall(s, s, True, window=128)
    assert _masked_pairs(call) == 128 * 129 / 2 + (s - 128) * 128
    per_bh = _call_cost(call, 1, 1, backward=False, kernel="fa3")      # one SM: SM-seconds in tile units
    causal = _call_cost(AttnCall(s, s, True), 1, 1, backward=False, kernel="fa3")
    fixed = per_bh - (2 * n - 1)
    assert fixed > 0 and causal - fixed == pytest.approx(n * (n + 1) / 2)
    assert layer_calls(s, 64, causal=True, window=128).calls == (call,)


def test_attention_time_falls_with_the_window():
    h100 = mp.Cluster.preset("dgx-h100", nodes=1)
    p = profile_from_config(models.config("gpt-oss-20b"), seq_len=8192)
    b = dataclasses.replace(p.blocks[0], attn_window=0)
    times = []
    for w in (0, 4096, 1024, 128):
        shape = layer_calls(8192, 64, causal=True, window=w)
        flops = attention_fwd_flops_per_token(dataclasses.replace(b, attn_window=w), 8192) * 8192
        times.append(compute.attention_time(flops, h100, backward=True, shape=shape))
    # 32x fewer FLOPs at w = 128, s = 8192; the two-tile rows pay the per-CTA fixed work, so less in time
    assert times == sorted(times, reverse=True) and times[-1] < times[0] / 5
    # a whole step, priced as Megatron-Core runs it (FlashAttention's window mode)
    unwindowed = dataclasses.replace(p, fingerprint=p.fingerprint + "-full",     # (estimates cache by it)
                                     blocks=tuple(dataclasses.replace(x, attn_window=0) for x in p.blocks))
    kw = dict(seq_len=8192, global_batch=16, stack="megatron-core")
    layout = dict(dp=8, ep=8, zero=1, recompute="full")
    fast, slow = estimate_profile(p, h100, layout, **kw), estimate_profile(unwindowed, h100, layout, **kw)
    assert fast.step_time_s < slow.step_time_s
    assert fast.peak_memory_gb == pytest.approx(slow.peak_memory_gb)    # flash keeps O(s) per head either way


def test_runtime_refuses_context_parallel_windows_and_tp_sinks():
    lay = dict(tp=1, cp=2, dp=1, pp=1, ep=1, etp=1, vp=1, zero=1)
    reasons = runtime_limits(lay, ModelTraits(attn_window=128, layers=4))
    assert any("context parallelism (cp=2) with sliding-window attention (window 128)" in r and "use cp=1" in r
               for r in reasons)
    assert not runtime_limits(dict(lay, cp=1), ModelTraits(attn_window=128, layers=4))
    reasons = runtime_limits(dict(lay, cp=1, tp=2), ModelTraits(attn_sinks=True, layers=4))
    assert any("tensor parallelism (tp=2) with attention sinks" in r for r in reasons)
    model = models.build("tiny-llama", device="meta", sliding_window=8, seq_len=64)
    with pytest.raises(MeshplanError, match="sliding-window attention"):
        mp.plan(model, mp.Cluster.preset("local-cpu", nproc=2), seq_len=64, global_batch=4,
                fixed={"cp": 2, "tp": 1, "pp": 1, "dp": 1})


@pytest.fixture(scope="module")
def gpt_oss_plan():
    # the layout of Megatron-Bridge's GPT-OSS 120B H100 benchmark (tp 1, pp 4, ep 8): the search
    # over the rest (vp, ZeRO, recompute, micro-batch) stays within a test's time
    return mp.plan("gpt-oss-120b", mp.Cluster.preset("dgx-h100", nodes=8), seq_len=4096, global_batch=512,
                   fixed={"tp": 1, "cp": 1, "pp": 4, "ep": 8}, top_k=1)


def test_gpt_oss_120b_plans_on_the_meta_device(gpt_oss_plan):
    est = gpt_oss_plan.estimate
    assert est.fits and est.num_gpus == 64 and 0.05 < est.mfu < 0.7


def test_exports_carry_the_window_and_sinks(gpt_oss_plan):
    args = gpt_oss_plan.to_megatron_args()
    flag = lambda name: args[args.index(name) + 1]    # noqa: E731
    assert flag("--window-size") == "127,0" and flag("--window-attn-skip-freq") == "2"
    assert flag("--softmax-type") == "learnable"
    bridge = gpt_oss_plan.to_nemo(flavor="megatron-bridge")
    model = {k.rsplit(".", 1)[-1]: v for k, v in bridge.items()}
    assert model["window_size"] == (127, 0) and model["window_attn_skip_freq"] == 2
    assert model["softmax_type"] == "learnable"
    with pytest.raises(ConfigError, match="sliding-window attention and attention sinks"):
        gpt_oss_plan.to_torchtitan()


def test_megatron_window_patterns():
    base = dict(layers=4, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn_hidden=128, vocab=100)
    assert ModelShape(**base, layer_windows=(8, 8, 8, 8)).megatron_window() == ((7, 0), None)
    assert ModelShape(**base, layer_windows=(8, 8, 8, 0)).megatron_window() == ((7, 0), 4)
    assert ModelShape(**base, layer_windows=(0, 8, 8, 0)).megatron_window() == ((7, 0), [0, 1, 1, 0])
    assert ModelShape(**base).megatron_window() is None
    with pytest.raises(ConfigError, match="one window_size"):
        ModelShape(**base, layer_windows=(8, 16, 8, 0)).megatron_window()
