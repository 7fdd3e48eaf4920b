"""Multi-head latent attention in the planner's view: the tracer's roles and geometry, the analytic
profile from a config (agreeing with the trace), the TP placements and traits, and the attention
FLOPs with query/key heads of 192 and values of 128 (DeepSeek-V3)."""

from __future__ import annotations

import pytest

import meshplan as mp
from meshplan.cost_models.flops import attention_fwd_flops_per_token
from meshplan.export.shape import ModelShape
from meshplan.ir.support import runtime_limits
from meshplan.profiling.analytic import profile_from_config
from meshplan.profiling.fusions import find_fusions
from meshplan.profiling.tp_roles import role_placements
from meshplan.profiling.traits import model_traits

TINY_MLA = dict(kv_heads=None, attention="mla", q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16)


def _roles(block) -> dict[str, str]:
    return {li.name: li.role for li in block.linears if li.name.startswith("attention.")}


def test_trace_and_config_agree_on_mla():
    cfg = mp.models.config("tiny-llama", **TINY_MLA)
    model = mp.models.build(cfg, device="meta")
    traced = mp.profile(model, seq_len=64)
    analytic = profile_from_config(cfg, seq_len=64)
    want = {"attention.wq_a": "attn_down", "attention.wq_b": "attn_qkv", "attention.wkv_a": "attn_down",
            "attention.wkv_b": "attn_qkv", "attention.wo": "attn_out"}
    for p in (traced, analytic):
        b = p.blocks[0]
        assert _roles(b) == want
        assert (b.heads, b.kv_heads, b.head_dim, b.v_head_dim) == (4, 4, 24, 16)
        assert (b.q_dim, b.o_dim, b.latent_dim) == (96, 64, 48 + 40)
        assert p.total_params == cfg.num_params()
    shapes = lambda p: {li.name: (li.in_features, li.out_features) for li in p.blocks[0].linears}  # noqa: E731
    assert shapes(traced) == shapes(analytic)
    # the traced SDPA FLOPs (torch's own count from the q, k, v shapes) are the analytic ones
    assert traced.blocks[0].fwd_flops == pytest.approx(analytic.blocks[0].fwd_flops, rel=1e-6)
    # tensor parallelism: up-projections by heads, down-projections and latent norms whole, even
    # under sequence parallelism; the model's own forward runs on the local shapes
    placed = role_placements(traced.blocks[0], tp=2, sp=True)
    assert {k: placed[k] for k in ("attention.wq_a", "attention.wkv_a", "attention.q_norm", "attention.kv_norm",
                                   "attention.wq_b", "attention.wkv_b", "attention.wo", "attention",
                                   "attention_norm")} == {
        "attention.wq_a": "replicate", "attention.wkv_a": "replicate", "attention.q_norm": "replicate",
        "attention.kv_norm": "replicate", "attention.wq_b": "colwise", "attention.wkv_b": "colwise",
        "attention.wo": "rowwise", "attention": "heads", "attention_norm": "sequence"}
    traits = model_traits(traced, model)
    assert not traits.partly_fused_qkv and traits.tp_forward == ""
    assert not runtime_limits(dict(tp=2, sp=True), traits)
    # an export from the profile alone reads MLA's sizes back from the linears
    s = ModelShape.from_profile(traced)
    assert (s.q_lora_rank, s.kv_lora_rank, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim) == (48, 32, 16, 8, 16)


def test_deepseek_v3_profile_counts_mla():
    cfg = mp.models.config("deepseek-v3")
    p = profile_from_config(cfg, seq_len=4096)
    dense, moe = p.blocks
    # 671B of the main model (arXiv 2412.19437), plus the preset's MTP depth
    assert p.total_params - cfg.num_mtp_params() == pytest.approx(671.03e9, rel=1e-4)
    # wq_a 11.0 M, wq_b 37.7 M, wkv_a 4.1 M, wkv_b 16.8 M, wo 117.4 M
    assert sum(li.params for li in moe.linears if li.name.startswith("attention.")) == 187_105_280
    # attention core per token: QK^T over 128 heads x 192, PV over 128 x 128, causal half
    assert attention_fwd_flops_per_token(moe, 4096) == pytest.approx(2.0 * 4096 * (128 * 192 + 128 * 128) / 2)
    assert (moe.head_dim, moe.v_head_dim, moe.kv_heads) == (192, 128, 128)
    # reading MLA's keys leaves the fingerprints of other configs as they were; MLA changes it
    small = dict(layers=2, hidden=256, heads=4, vocab=1000)
    mla = dict(small, attention="mla", kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    fp = lambda c: profile_from_config(c).fingerprint  # noqa: E731
    assert fp(small) == fp(dict(small, attention="gqa")) != fp(mla) != fp(dict(mla, q_lora_rank=64))
    assert ModelShape.from_profile(p).kv_lora_rank == 512


def test_group_limited_routers_are_not_fused_and_undeclared_latent_attention_refuses_tp():
    plain = mp.models.config("tiny-moe", seq_len=64)
    grouped = plain.replace(moe_router_num_groups=2, moe_router_group_topk=1)
    routers = lambda cfg: {e.module for e in find_fusions(mp.profile(mp.models.build(cfg, device="meta"),  # noqa: E731
                                                                       seq_len=64)).modules if e.kernel == "moe_router"}
    assert routers(plain) == {f"layers.{i}.feed_forward" for i in (1, 2, 3)}
    assert routers(grouped) == set()
    # a latent attention that does not name its shared rotary key: TP refused (its gradient sum)
    model = mp.models.build("tiny-llama", device="meta", seq_len=64, **TINY_MLA)
    del model.layers[0].attention.shared_rope_key
    traits = model_traits(mp.profile(model, seq_len=64), model)
    assert "shared_rope_key" in traits.tp_forward
    assert any("shared_rope_key" in why for why in runtime_limits(dict(tp=2), traits))
