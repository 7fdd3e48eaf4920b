"""DeepSeek-V3 as published: multi-head latent attention against an einsum reference, group-limited
routing against a per-token reference, the config's refusals, and the preset's parameter counts."""

from __future__ import annotations

import math

import pytest
import torch

from meshplan.errors import ConfigError
from meshplan.models import ModelConfig, Transformer, config
from meshplan.models.mla import MLAttention
from meshplan.models.moe import MoE

MLA = dict(attention="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6)
TINY = dict(family="llama", layers=2, hidden=32, heads=4, vocab=64, seq_len=16, **MLA)


def _init(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))


def _rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary positions written out: channel pairs (2i, 2i+1) of x (B, T, n, d) turned by
    pos * theta^(-2i/d)."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)             # (d/2,)
    ang = pos.double()[:, None] * freq[None]                                       # (T, d/2)
    c, s = ang.cos()[None, :, None], ang.sin()[None, :, None]
    a, b = x[..., 0::2].double(), x[..., 1::2].double()
    out = torch.empty(x.shape, dtype=torch.float64)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out.to(x.dtype)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_mla(m: MLAttention, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """DeepSeek-V3's attention (arXiv 2412.19437 eqs. 1-11) in einsums, from the module's weights."""
    B, T, _ = x.shape
    n, nope, rope, vd = cfg.heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    pos = torch.arange(T)
    c_q = _rms(torch.einsum("bth,rh->btr", x, m.wq_a.weight), m.q_norm.weight, cfg.norm_eps)
    q = torch.einsum("btr,or->bto", c_q, m.wq_b.weight).view(B, T, n, nope + rope)
    kv_a = torch.einsum("bth,oh->bto", x, m.wkv_a.weight)
    c_kv, k_rope = kv_a[..., :cfg.kv_lora_rank], kv_a[..., cfg.kv_lora_rank:]
    kv = torch.einsum("btr,or->bto", _rms(c_kv, m.kv_norm.weight, cfg.norm_eps), m.wkv_b.weight)
    kv = kv.view(B, T, n, nope + vd)
    q_rope = _rotate(q[..., nope:], pos, cfg.rope_theta)                          # (B, T, n, rope)
    k_rope = _rotate(k_rope[:, :, None, :], pos, cfg.rope_theta)                  # (B, T, 1, rope): one head
    scores = (torch.einsum("bsnd,btnd->bnst", q[..., :nope], kv[..., :nope])
              + torch.einsum("bsnd,btd->bnst", q_rope, k_rope[:, :, 0])) / math.sqrt(nope + rope)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    o = torch.einsum("bnst,btnd->bsnd", probs, kv[..., nope:]).reshape(B, T, n * vd)
    return torch.einsum("bto,ho->bth", o, m.wo.weight)


def test_mla_matches_an_einsum_reference_and_the_model_runs_it():
    cfg = ModelConfig(**TINY)
    model = Transformer(cfg)
    attn = model.layers[0].attention
    assert isinstance(attn, MLAttention)
    assert [n for n, _ in attn.named_children()] == ["wq_a", "q_norm", "wq_b", "wkv_a", "kv_norm", "wkv_b", "wo"]
    _init(attn)
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(3))
    rope = (model.rope_cos[:10], model.rope_sin[:10])
    torch.testing.assert_close(attn(x, rope), _reference_mla(attn, x, cfg), rtol=1e-4, atol=1e-4)
    # the count from the formulas is the built model's
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert model.rope_cos.shape == (16, 2)            # rotary tables sized by qk_rope_head_dim
    model.init_weights()
    logits = model(torch.randint(0, 64, (2, 12)))
    assert logits.shape == (2, 12, 64) and torch.isfinite(logits).all()


def test_mla_without_query_compression_and_with_packed_documents():
    cfg = ModelConfig(**{**TINY, "q_lora_rank": None})
    model = Transformer(cfg)
    assert model.layers[0].attention.wq is not None and model.layers[0].attention.wq_a is None
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    model.init_weights()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    docs = torch.tensor([[0] * 5 + [1] * 7])
    packed = model(ids, document_ids=docs)
    torch.testing.assert_close(packed[:, 5:], model(ids[:, 5:]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("changes, words", [
    (dict(attention="mla"), "needs kv_lora_rank"),
    (dict(kv_lora_rank=16), "attention='gqa'"),
    (dict(**MLA, head_dim=8), "head_dim=8"),
    (dict(**MLA, kv_heads=2), "kv_heads=2"),
    (dict(**{**MLA, "qk_rope_head_dim": 3}), "qk_rope_head_dim must be even"),
    (dict(**MLA, family="gpt"), "position='rope'"),
    (dict(attention="mha"), "attention='mha'"),
])
def test_mla_config_refusals(changes, words):
    base = dict(family="llama", layers=1, hidden=32, heads=4, vocab=64)
    with pytest.raises(ConfigError, match=words):
        ModelConfig(**{**base, **changes})


GROUPED = dict(family="moe", layers=1, hidden=16, heads=2, vocab=32, experts=16, topk=3, moe_ffn_hidden=8,
               router="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
               moe_router_topk_scaling_factor=2.5)


def _reference_route(scores: torch.Tensor, bias: torch.Tensor, groups: int, keep: int, k: int, scale: float):
    """Per token, in plain Python: the `keep` groups with the largest sum of their two best biased
    scores, the top-k biased scores inside them, weights from the unbiased scores."""
    experts, weights = [], []
    per = scores.shape[1] // groups
    for s in scores.tolist():
        choice = [v + b for v, b in zip(s, bias.tolist())]
        rank = sorted(range(groups), key=lambda g: -sum(sorted(choice[g * per:(g + 1) * per])[-2:]))
        allowed = [e for g in rank[:keep] for e in range(g * per, (g + 1) * per)]
        picks = sorted(allowed, key=lambda e: -choice[e])[:k]
        total = sum(s[e] for e in picks)
        experts.append(picks)
        weights.append([scale * s[e] / total for e in picks])
    return torch.tensor(experts), torch.tensor(weights)


def test_group_limited_routing_matches_a_reference_and_stays_in_kept_groups():
    moe = MoE(ModelConfig(**GROUPED))
    _init(moe)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.linspace(-0.3, 0.3, 16))
    logits = torch.randn(40, 16, generator=torch.Generator().manual_seed(5)) * 2
    weights, experts, _ = moe._route(logits)
    ref_e, ref_w = _reference_route(logits.sigmoid(), moe.expert_bias, 4, 2, 3, 2.5)
    assert torch.equal(experts, ref_e)
    torch.testing.assert_close(weights, ref_w.float())
    assert max(len(set((row // 4).tolist())) for row in experts) <= 2          # within 2 of the 4 groups
    torch.testing.assert_close(weights.sum(-1), torch.full((40,), 2.5))
    # without the group limit some token reaches into a third group: the limit changes the choice
    free = MoE(ModelConfig(**{**GROUPED, "moe_router_num_groups": None, "moe_router_group_topk": None}))
    free.expert_bias.copy_(moe.expert_bias)
    _, free_e, _ = free._route(logits)
    assert not torch.equal(free_e, experts)
    assert max(len(set((row // 4).tolist())) for row in free_e) == 3
    x = torch.randn(2, 5, 16)
    assert moe(x).shape == x.shape


@pytest.mark.parametrize("changes, words", [
    (dict(moe_router_group_topk=None), "needs both"),
    (dict(moe_router_num_groups=5), "does not divide experts=16"),
    (dict(moe_router_group_topk=5), "exceeds moe_router_num_groups=4"),
    (dict(topk=9), "exceeds the 8 experts"),
    (dict(moe_router_topk_scaling_factor=0), "must be a number > 0"),
    (dict(family="llama", experts=0, topk=0, moe_ffn_hidden=None, router="softmax"), "dense model"),
])
def test_group_routing_refusals(changes, words):
    with pytest.raises(ConfigError, match=words):
        ModelConfig(**{**GROUPED, **changes})


def test_deepseek_v3_preset_is_deepseek_v3():
    c = config("deepseek-v3")
    assert (c.attention, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) \
        == ("mla", 1536, 512, 128, 64, 128)
    assert (c.heads, c.kv_heads, c.head_dim) == (128, 128, 192)
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    # arXiv 2412.19437: 671B total, 37B activated per token; the released checkpoint's MTP layer
    # (its own copies of embedding and head included) brings it to the 685B of the model card
    assert c.num_params() == pytest.approx(671e9, rel=0.01)
    assert c.num_active_params() == pytest.approx(37e9, rel=0.02)
    # (the preset trains with that one depth: models/presets.py)
    assert c.mtp_depth == 1
    mtp = c.num_mtp_params() + 2 * c.vocab * c.hidden
    assert c.num_params() + mtp == pytest.approx(685e9, rel=0.01)
    with torch.device("meta"):
        model = Transformer(c)
    assert sum(p.numel() for p in model.parameters()) == c.num_params() + c.num_mtp_params()


def test_fused_router_skips_group_limited_layers_and_scales_its_weights():
    """The fused router kernel has no group limit: group-limited layers keep the eager router; a
    layer with only the scaling factor takes the kernel, whose weights are checked against eager."""
    from meshplan.runtime.fused import apply_router_kernel
    grouped = MoE(ModelConfig(**GROUPED))
    _init(grouped)
    assert apply_router_kernel(grouped) == [] and grouped.route_fn is None
    scaled = MoE(ModelConfig(**{**GROUPED, "moe_router_num_groups": None, "moe_router_group_topk": None}))
    _init(scaled)
    assert apply_router_kernel(scaled) == [""] and scaled.route_fn is not None
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2))
    fused = scaled(x)
    scaled.route_fn = None
    torch.testing.assert_close(fused, scaled(x))


def test_replace_rederives_mla_widths():
    c = config("deepseek-v3").replace(qk_rope_head_dim=32, heads=64)
    assert (c.head_dim, c.kv_heads) == (160, 64)
    back = ModelConfig(**TINY).replace(attention="gqa", **{k: None for k in MLA if k != "attention"})
    assert (back.attention, back.head_dim, back.kv_heads) == ("gqa", 8, 4)
