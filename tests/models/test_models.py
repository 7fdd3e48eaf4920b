"""Tests of meshplan.models: configs, presets, the dense/MoE transformer and meshplan::grouped_mm."""

from __future__ import annotations

import math
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import meshplan.models as mm
from meshplan.errors import ConfigError, MeshplanError, UnknownNameError
from meshplan.models import ModelConfig
from meshplan.models.grouped_mm import grouped_mm, grouped_mm_reference
from meshplan.models.moe import MoE

# Published totals (embedding and output included). Sources are cited next to each preset in
# meshplan/models/presets.py; GPT figures follow Megatron's count with the vocabulary padded to 51200.
PUBLISHED_PARAMS = {
    "gpt3-175b": 174.6e9,       # Narayanan et al. SC'21, Table 2 "174.6B"
    "megatron-530b": 529.6e9,   # SC'21 Table 1
    "megatron-1t": 1008.0e9,    # SC'21 Table 1
    "llama2-7b": 6.74e9,
    "llama2-13b": 13.0e9,
    "llama2-70b": 69.0e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    "mixtral-8x7b": 46.7e9,
    "mixtral-8x22b": 141e9,
    "qwen3-30b-a3b": 30.5e9,
    "qwen3-235b-a22b": 235e9,
    "deepseek-v3": 671e9,       # without the MTP module (docs/models.md)
}
PUBLISHED_ACTIVE = {"mixtral-8x7b": 12.9e9, "mixtral-8x22b": 39e9, "qwen3-30b-a3b": 3.3e9, "qwen3-235b-a22b": 22e9,
                    "deepseek-v3": 37e9}


@pytest.fixture(scope="module", autouse=True)
def _warm_up():
    # The first meta build in a process pays one-off lazy imports inside torch (~1.5 s);
    # the per-preset time limit is about building, not about importing torch.
    mm.build("tiny-moe")


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", mm.presets())
def test_every_preset_builds_on_meta_fast_with_the_formula_param_count(name):
    start = time.perf_counter()
    model = mm.build(name)
    elapsed = time.perf_counter() - start
    # typically 0.01-0.3 s; the bound is loose because CI shares its 2 cores with spawned ranks
    assert elapsed < 3.0, f"{name} took {elapsed:.2f} s on meta"
    assert model.config.name == name
    assert all(p.device.type == "meta" for p in model.parameters())
    # num_params leaves the MTP modules out, as published totals do (DeepSeek-V3's 671B)
    assert _params(model) == model.config.num_params() + model.config.num_mtp_params()


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_param_counts_match_published_totals(name):
    cfg = mm.config(name)
    tolerance = 0.01 if name == "deepseek-v3" else 0.02
    assert cfg.num_params() == pytest.approx(PUBLISHED_PARAMS[name], rel=tolerance)
    if name in PUBLISHED_ACTIVE:
        assert cfg.num_active_params() == pytest.approx(PUBLISHED_ACTIVE[name], rel=0.03)


def test_deepseek_v3_shape_and_stated_totals():
    model = mm.build("deepseek-v3")
    cfg = model.config
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.vocab) == (61, 7168, 128, 129280)
    assert [type(b.feed_forward).__name__ for b in model.layers[:4]] == ["FeedForward"] * 3 + ["MoE"]
    moe = model.layers[3].feed_forward
    assert tuple(moe.experts.w1.shape) == (256, 2048, 7168)
    assert moe.shared_experts.w1.out_features == 2048 and moe.expert_bias.shape == (256,)
    assert model.layers[0].feed_forward.w1.out_features == 18432
    attn = model.layers[0].attention
    assert (attn.wq_b.out_features, attn.wkv_a.out_features, attn.wkv_b.out_features, attn.wo.in_features) \
        == (128 * 192, 512 + 64, 128 * 256, 128 * 128)
    # the figures docs/models.md states
    assert round(cfg.num_params() / 1e9, 1) == 671.0
    assert round(cfg.num_active_params() / 1e9, 1) == 37.6


def test_preset_overrides_rederive_dependent_sizes():
    cfg = mm.config("llama3-8b", layers=2, hidden=256, heads=4, kv_heads=2, ffn_hidden=512, vocab=1000)
    assert (cfg.layers, cfg.head_dim, cfg.kv_heads, cfg.rope_theta) == (2, 64, 2, 500000.0)
    model = mm.build("llama3-8b", layers=2)
    assert len(model.layers) == 2 and model.config.hidden == 4096


def test_unknown_preset_and_unknown_key_errors_name_what_works():
    with pytest.raises(UnknownNameError) as err:
        mm.build("llama9-1t")
    assert "llama3-8b" in str(err.value) and "moe" in str(err.value)
    with pytest.raises(UnknownNameError):
        mm.config("nope")
    with pytest.raises(ConfigError, match="allowed keys: .*ffn_hidden"):
        mm.build("llama3-8b", n_layers=2)
    with pytest.raises(ConfigError, match="allowed keys"):
        mm.build("llama", layers=2, hidden=64, heads=4, vocab=10, dim=3)


def test_build_from_family_and_from_config():
    model = mm.build("moe", layers=2, hidden=64, heads=4, vocab=100, experts=4, topk=1)
    assert model.config.family == "moe" and isinstance(model.layers[0].feed_forward, MoE)
    cfg = mm.config("tiny-llama")
    assert mm.build(cfg, layers=1).config.layers == 1


def test_dtype_applies_to_params_and_default_dtype_is_restored():
    model = mm.build("tiny-moe", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == torch.float32  # rotary tables stay exact
    assert torch.get_default_dtype() == torch.float32


# ---------------------------------------------------------------------------------------------
# config validation
# ---------------------------------------------------------------------------------------------
BASE = dict(family="llama", layers=2, hidden=64, heads=4, vocab=100)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(kv_heads=3), r"kv_heads in \[1, 2, 4\]"),
        (dict(layers=0), "layers must be >= 1"),
        (dict(hidden=-8), "hidden must be >= 1"),
        (dict(heads=2.5), "heads must be an integer"),
        (dict(layers=True), "layers must be an integer"),
        (dict(hidden=66, heads=4), "set head_dim explicitly"),
        (dict(head_dim=15), "head_dim must be even"),
        (dict(norm="batchnorm"), "layernorm, rmsnorm"),
        (dict(activation="relu"), "gelu, swiglu"),
        (dict(position="alibi"), "learned, rope"),
        (dict(family="bert"), "gpt, llama, moe"),
        (dict(experts=8, topk=2), "use family='moe'"),
        (dict(family="moe"), "experts >= 1"),
        (dict(family="moe", experts=4, topk=5), "topk=5 must be between 1 and experts=4"),
        (dict(family="moe", experts=4, topk=0), "between 1 and experts"),
        (dict(family="moe", experts=4, topk=2, dense_layers=3), "use 0..2"),
        (dict(family="moe", experts=4, topk=2, router="hash"), "softmax, sigmoid"),
        (dict(norm_eps=0.0), "norm_eps must be a positive number"),
        (dict(bias="yes"), "bias must be True or False"),
        (dict(ffn_hidden=0), "ffn_hidden must be >= 1"),
    ],
)
def test_config_validation(changes, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**BASE, **changes})


def test_config_defaults_follow_the_family():
    gpt = ModelConfig(family="gpt", layers=1, hidden=64, heads=4, vocab=10)
    assert (gpt.norm, gpt.activation, gpt.position, gpt.bias, gpt.tie_embeddings) == (
        "layernorm", "gelu", "learned", True, True)
    assert (gpt.ffn_hidden, gpt.head_dim, gpt.kv_heads) == (256, 16, 4)
    llama = ModelConfig(family="llama", layers=1, hidden=4096, heads=32, vocab=10)
    assert (llama.norm, llama.activation, llama.position, llama.bias, llama.tie_embeddings) == (
        "rmsnorm", "swiglu", "rope", False, False)
    assert llama.ffn_hidden == 11008  # Llama 2 7B's width from the 2/3 * 4h rule
    moe = ModelConfig(family="moe", layers=1, hidden=64, heads=4, vocab=10, experts=2, topk=1, ffn_hidden=96)
    assert moe.moe_ffn_hidden == 96
    with pytest.raises(ConfigError):
        gpt.replace(unknown=1)
    with pytest.raises(Exception):
        gpt.hidden = 3  # frozen


# ---------------------------------------------------------------------------------------------
# model structure: the GPT / Llama switches
# ---------------------------------------------------------------------------------------------
def test_gpt_switches_build_gpt3_modules():
    model = mm.build("tiny-gpt")
    block = model.layers[0]
    assert isinstance(model.pos_embeddings, nn.Embedding) and model.rope_cos is None
    assert isinstance(block.attention_norm, nn.LayerNorm) and block.attention_norm.bias is not None
    assert block.attention.wq.bias is not None and block.attention.wo.bias is not None
    assert block.feed_forward.w3 is None and block.feed_forward.w1.out_features == 4 * 128
    assert model.output.weight is model.tok_embeddings.weight and model.output.bias is None


def test_llama_switches_build_llama_modules():
    model = mm.build("tiny-llama")
    block = model.layers[0]
    assert model.pos_embeddings is None and model.rope_cos.shape == (256, 16)
    assert isinstance(block.attention_norm, nn.RMSNorm) and isinstance(model.norm, nn.RMSNorm)
    assert all(getattr(block.attention, n).bias is None for n in ("wq", "wk", "wv", "wo"))
    assert block.attention.wq.out_features == 4 * 32 and block.attention.wk.out_features == 2 * 32
    assert block.feed_forward.w3 is not None and block.feed_forward.w1.out_features == 384
    assert model.output.weight is not model.tok_embeddings.weight
    names = {n for n, _ in model.named_parameters()}
    assert "layers.3.feed_forward.w3.weight" in names and "output.weight" in names


def test_moe_layers_follow_dense_layers():
    model = mm.build("tiny-moe")
    kinds = [type(b.feed_forward).__name__ for b in model.layers]
    assert kinds == ["FeedForward", "MoE", "MoE", "MoE"]
    moe = model.layers[1].feed_forward
    assert tuple(moe.experts.w1.shape) == (4, 96, 128) and tuple(moe.experts.w2.shape) == (4, 128, 96)
    assert moe.router.bias is None and moe.router.out_features == 4
    assert moe.shared_experts.w1.out_features == 96 and moe.expert_bias is None


# ---------------------------------------------------------------------------------------------
# real tensors on CPU
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama", "tiny-moe"])
def test_tiny_models_train_step_on_cpu(name):
    torch.manual_seed(0)
    model = mm.build(name, device="cpu")
    ids = torch.randint(0, 256, (2, 32))
    logits = model(ids)
    assert logits.shape == (2, 32, 256)
    loss = mm.causal_lm_loss(logits[:, :-1], ids[:, 1:])
    # Small init: the first loss is close to uniform guessing over 256 bytes.
    assert torch.isfinite(loss) and abs(loss.item() - math.log(256)) < 0.1
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, n
    before = loss.item()
    with torch.no_grad():
        for p in model.parameters():
            p -= 1.0 * p.grad
    assert mm.causal_lm_loss(model(ids)[:, :-1], ids[:, 1:]).item() < before


def test_init_is_deterministic_and_scales_residual_projections():
    torch.manual_seed(1)
    a = mm.build("tiny-llama", device="cpu")
    torch.manual_seed(1)
    b = mm.build("tiny-llama", device="cpu")
    torch.manual_seed(2)
    c = mm.build("tiny-llama", device="cpu")
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if pa.dim() > 1:
            assert not torch.equal(pa, pc), n
    big = mm.build("llama", layers=8, hidden=512, heads=8, vocab=256, device="cpu")
    assert big.layers[0].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.layers[0].attention.wo.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)


def test_meta_build_materialised_with_to_empty_matches_a_real_build():
    torch.manual_seed(3)
    real = mm.build("tiny-moe", device="cpu")
    lazy = mm.build("tiny-moe").to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.init_weights()
    ids = torch.randint(0, 256, (1, 16))
    torch.testing.assert_close(lazy(ids), real(ids))
    gpt = mm.build("tiny-gpt").to_empty(device="cpu")
    gpt.init_weights()
    assert gpt.output.weight is gpt.tok_embeddings.weight  # re-tied after to_empty()
    assert all(torch.isfinite(p).all() for p in gpt.parameters())


def test_bf16_forward_on_cpu_and_switch_overrides():
    torch.manual_seed(9)
    model = mm.build("tiny-moe", device="cpu", dtype=torch.bfloat16)
    logits = model(torch.randint(0, 256, (1, 16)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    gpt_rope = mm.build("gpt", layers=1, hidden=64, heads=4, vocab=50, position="rope", device="cpu")
    assert gpt_rope.pos_embeddings is None and gpt_rope(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 50)


def test_pipeline_stages_may_drop_embedding_norm_and_output():
    torch.manual_seed(10)
    model = mm.build("tiny-llama", device="cpu")
    ids = torch.randint(0, 256, (1, 8))
    full = model(ids)
    hidden = model.tok_embeddings(ids)
    embeddings = model.tok_embeddings
    model.tok_embeddings = None
    torch.testing.assert_close(model(hidden), full)
    model.tok_embeddings, model.norm, model.output = embeddings, None, None
    assert model(ids).shape == (1, 8, 128)


def test_causal_lm_loss_ignores_minus_100():
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    masked = labels.clone()
    masked[:, 3:] = -100
    expected = F.cross_entropy(logits[:, :3].reshape(-1, 7), labels[:, :3].reshape(-1))
    torch.testing.assert_close(mm.causal_lm_loss(logits, masked), expected)


def test_sequence_longer_than_seq_len_is_rejected():
    model = mm.build("tiny-gpt", seq_len=8)
    with pytest.raises(ConfigError, match="seq_len>=9"):
        model(torch.zeros(1, 9, dtype=torch.long, device="meta"))


# ---------------------------------------------------------------------------------------------
# MoE numerics against a per-token loop
# ---------------------------------------------------------------------------------------------
def _naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Route and run every token on its own: the definition the vectorised MoE must match."""
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    tokens = x.reshape(-1, x.shape[-1])
    rows = []
    for tok in tokens:
        logits = (moe.router.weight @ tok).float()
        if moe.score_func == "softmax":
            probs = logits.softmax(-1)
            chosen = probs.topk(moe.topk).indices
            gate = probs[chosen]
        else:
            scores = logits.sigmoid()
            chosen = (scores + moe.expert_bias).topk(moe.topk).indices
            gate = scores[chosen]
        gate = gate / gate.sum()
        y = torch.zeros_like(tok)
        for g, e in zip(gate, chosen.tolist()):
            y = y + g * (w2[e] @ (F.silu(w1[e] @ tok) * (w3[e] @ tok)))
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(tok)
        rows.append(y)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_moe_matches_per_token_reference_and_grads_flow(router):
    torch.manual_seed(4)
    model = mm.build("moe", layers=1, hidden=16, heads=2, vocab=32, experts=5, topk=2, moe_ffn_hidden=8,
                     shared_experts=1, router=router, device="cpu")
    moe = model.layers[0].feed_forward
    if router == "sigmoid":
        with torch.no_grad():
            moe.expert_bias.copy_(torch.tensor([0.0, 0.1, -0.1, 0.0, -100.0]))  # expert 4 never chosen
    x = torch.randn(3, 7, 16)
    out = moe(x)
    torch.testing.assert_close(out, _naive_moe(moe, x))
    assert int(moe.tokens_per_expert.sum()) == 21 * 2
    (out.square().sum() + moe.aux_loss).backward()
    assert moe.router.weight.grad.abs().sum() > 0
    for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3, moe.shared_experts.w1.weight):
        assert w.grad is not None and w.grad.abs().sum() > 0
    if router == "sigmoid":
        assert int(moe.tokens_per_expert[4]) == 0
        assert moe.experts.w1.grad[4].abs().sum() == 0  # an expert with no tokens gets zero grad
        assert moe.expert_bias.grad is None


def test_moe_gradients_match_reference_gradients():
    torch.manual_seed(5)
    model = mm.build("moe", layers=1, hidden=16, heads=2, vocab=32, experts=4, topk=2, moe_ffn_hidden=8,
                     device="cpu", dtype=torch.float64)
    moe = model.layers[0].feed_forward
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    params = [x, moe.router.weight, moe.experts.w1, moe.experts.w2, moe.experts.w3]
    got = torch.autograd.grad(moe(x).sum(), params)
    want = torch.autograd.grad(_naive_moe(moe, x).sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_aux_loss_is_one_under_uniform_routing_and_update_expert_bias_balances():
    torch.manual_seed(6)
    moe = mm.build("moe", layers=1, hidden=8, heads=2, vocab=8, experts=4, topk=1, router="sigmoid",
                   device="cpu").layers[0].feed_forward
    with torch.no_grad():
        moe.router.weight.zero_()  # equal scores: aux loss = E * sum(f_e / E) = 1
    moe(torch.randn(1, 8, 8))
    assert moe.aux_loss.item() == pytest.approx(1.0)
    load = moe.tokens_per_expert.float()
    moe.update_expert_bias(rate=0.5)
    overloaded = load > load.mean()
    assert (moe.expert_bias[overloaded] < 0).all() and (moe.expert_bias[~overloaded] >= 0).all()


# ---------------------------------------------------------------------------------------------
# meshplan::grouped_mm
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 0, 4], [4, 1, 0, 0], [0, 0, 0, 0]])
def test_grouped_mm_forward_and_grads_match_a_per_group_loop(counts):
    torch.manual_seed(7)
    M = sum(counts) + 2  # two trailing rows belong to no group
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(M, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, 6, dtype=torch.float64, requires_grad=True)
    out = grouped_mm(x, w, offs)
    ref = grouped_mm_reference(x, w, offs)
    torch.testing.assert_close(out, ref)
    assert out[sum(counts):].abs().sum() == 0
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, (x, w), grad), torch.autograd.grad(ref, (x, w), grad))
    for g, c in enumerate(counts):  # the definition, spelled out per group
        start = sum(counts[:g])
        torch.testing.assert_close(out[start:start + c], x[start:start + c] @ w[g].T)


def test_grouped_mm_passes_torch_opcheck():
    torch.manual_seed(8)
    x = torch.randn(9, 4, requires_grad=True)
    w = torch.randn(3, 5, 4, requires_grad=True)
    offs = torch.tensor([2, 2, 9], dtype=torch.int32)
    torch.library.opcheck(grouped_mm, (x, w, offs))


def test_grouped_mm_fake_shapes_and_flop_formulas():
    with FakeTensorMode():
        x = torch.empty(12, 6, requires_grad=True)
        w = torch.empty(4, 10, 6, requires_grad=True)
        offs = torch.empty(4, dtype=torch.int32)
        counter = FlopCounterMode(display=False)
        with counter:
            out = grouped_mm(x, w, offs)
            out.sum().backward()
        assert out.shape == (12, 10) and x.grad.shape == x.shape and w.grad.shape == w.shape
    flops = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert flops == {"meshplan.grouped_mm": 2 * 12 * 6 * 10, "meshplan.grouped_mm_backward": 4 * 12 * 6 * 10}


def test_grouped_mm_rejects_mismatched_inputs():
    x, w = torch.randn(4, 3), torch.randn(2, 5, 3)
    with pytest.raises(MeshplanError, match="w must be"):
        grouped_mm(x, torch.randn(2, 5, 4), torch.tensor([1, 4], dtype=torch.int32))
    with pytest.raises(MeshplanError, match="non-decreasing"):
        grouped_mm(x, w, torch.tensor([3, 1], dtype=torch.int32))
    with pytest.raises(MeshplanError, match="within 0..4"):
        grouped_mm(x, w, torch.tensor([1, 6], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# tracing: what the planner's tracer does
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe", "tiny-gpt"])
def test_export_on_meta(name):
    model = mm.build(name)
    ids = torch.randint(0, 256, (2, 64), device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. tensors assigned to module attributes while exporting
        program = torch.export.export(model, (ids,), strict=False)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count("meshplan.grouped_mm.default") == (9 if name == "tiny-moe" else 0)
    assert sum("scaled_dot_product" in t for t in targets) == 4
    out = next(n for n in program.graph.nodes if n.op == "output").args[0][0]
    assert tuple(out.meta["val"].shape) == (2, 64, 256)
    if name == "tiny-moe":
        assert model.layers[1].feed_forward.aux_loss is None  # nothing fake leaked into the module


def test_export_of_moe_under_fake_tensor_mode():
    with FakeTensorMode():
        model = mm.build("tiny-moe", device="cpu")
        ids = torch.randint(0, 256, (1, 32))
        program = torch.export.export(model, (ids,), strict=False)
    assert any(str(n.target) == "meshplan.grouped_mm.default" for n in program.graph.nodes)
