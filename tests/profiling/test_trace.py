"""Tests of meshplan.profiling.trace: graph IR, block detection, roles, FLOPs, no real memory."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import meshplan.models as mm
from meshplan.errors import ConfigError, TraceError
from meshplan.ir.fingerprint import fingerprint
from meshplan.profiling.blocks import find_block_containers, signature
from meshplan.ir.profile import OP_KINDS
from meshplan.profiling.trace import trace, trace_graph
from toy_layers import Layer, mlp, n_params

T = 64  # tokens per sequence in the small traces


def roles(block) -> dict[str, str]:
    return {li.name: li.role for li in block.linears}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def analytic_dense_fwd(block, tokens: int) -> float:
    """2 * (linear weights) * T + 4 * T^2 * heads * head_dim (attention counted in full)."""
    linear = sum(li.in_features * li.out_features * li.count for li in block.linears)
    return 2.0 * linear * tokens + 4.0 * tokens**2 * block.heads * block.head_dim


# --- meshplan's own models ------------------------------------------------------------------

def test_tiny_llama_profile():
    model = mm.build("tiny-llama", device="meta")
    p = trace(model, seq_len=T)
    assert len(p.blocks) == 1 and p.layers == (0, 0, 0, 0)
    b = p.blocks[0]
    assert b.instances == ("layers.0", "layers.1", "layers.2", "layers.3")
    assert (b.hidden, b.heads, b.kv_heads, b.head_dim, b.causal) == (128, 4, 2, 32, True)
    assert (b.ffn_hidden, b.gated, b.norm, b.experts) == (384, True, "rmsnorm", 0)
    assert roles(b) == {
        "attention.wq": "attn_qkv", "attention.wk": "attn_qkv", "attention.wv": "attn_qkv",
        "attention.wo": "attn_out", "feed_forward.w1": "mlp_in", "feed_forward.w3": "mlp_in",
        "feed_forward.w2": "mlp_out"}
    assert {li.name: (li.in_features, li.out_features) for li in b.linears}["attention.wk"] == (128, 64)
    assert p.total_params == n_params(model)
    assert b.params == n_params(model.layers[0])
    assert (p.vocab, p.hidden, p.embedding_fqn, p.head_fqn) == (256, 128, "tok_embeddings", "output")
    assert p.embedding_params == 256 * 128 and p.head_params == 256 * 128 and not p.tied_embeddings
    assert b.fwd_flops == pytest.approx(analytic_dense_fwd(b, T), rel=0.01)
    # backward: 2x the linears, torch's SDPA backward (2.5x: it recomputes the scores)
    attn = 4.0 * T**2 * b.q_dim
    assert b.bwd_flops == pytest.approx(2 * (b.fwd_flops - attn) + 2.5 * attn, rel=0.01)
    assert {op.kind for op in b.ops} <= set(OP_KINDS)
    assert any(op.kind == "attention" for op in b.ops)
    assert p.fingerprint == fingerprint(model) and len(p.fingerprint) == 16


def test_tiny_gpt_tied_layernorm_learned_positions():
    model = mm.build("tiny-gpt", device="meta")
    p = trace(model, seq_len=T)
    b = p.blocks[0]
    assert p.tied_embeddings and p.head_params == 0 and p.head_fqn == "output"
    # token + learned position embeddings (positions up to the model's seq_len)
    assert p.embedding_params == 256 * 128 + model.config.seq_len * 128
    assert (b.norm, b.gated, b.ffn_hidden, b.heads, b.kv_heads) == ("layernorm", False, 512, 4, 4)
    assert all(li.bias for li in b.linears)
    assert p.total_params == n_params(model)


def test_tiny_moe_first_dense_then_moe():
    model = mm.build("tiny-moe", device="meta")
    p = trace(model, seq_len=T)
    dense, moe = p.blocks
    assert dense.instances == ("layers.0",) and moe.instances == ("layers.1", "layers.2", "layers.3")
    assert p.layers == (0, 1, 1, 1)
    assert not dense.is_moe and dense.ffn_hidden == 384
    assert (moe.experts, moe.topk, moe.moe_ffn_hidden, moe.shared_ffn_hidden) == (4, 2, 96, 96)
    r = roles(moe)
    assert r["feed_forward.router"] == "router"
    assert r["feed_forward.experts.w1"] == r["feed_forward.experts.w3"] == "expert_in"
    assert r["feed_forward.experts.w2"] == "expert_out"
    assert r["feed_forward.shared_experts.w2"] == "shared_out"
    experts = [li for li in moe.linears if li.role.startswith("expert")]
    assert all(li.count == 4 and li.tokens_per_token == pytest.approx(2 / 4) for li in experts)
    # routed expert FLOPs = 2 * tokens * topk * h * f per matrix (three matrices, SwiGLU)
    expert_ops = [op for op in moe.ops if op.role.startswith("expert")]
    assert sum(op.fwd_flops for op in expert_ops) == pytest.approx(3 * 2 * T * 2 * 128 * 96)
    assert moe.expert_params == 3 * 4 * 128 * 96
    assert p.total_params == n_params(model)
    assert any(op.kind == "moe_dispatch" for op in moe.ops)
    assert any(op.kind == "router" for op in moe.ops)


@pytest.mark.slow
def test_llama3_405b_fast_and_without_memory():
    trace(mm.build("tiny-llama", device="meta"), seq_len=16)   # export's one-time warm-up
    model = mm.build("llama3-405b", device="meta")
    rss = rss_bytes()
    t0 = time.perf_counter()
    p = trace(model, seq_len=8192)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, f"tracing llama3-405b took {elapsed:.1f} s (target ~1 s)"
    assert rss_bytes() - rss < 1 << 30
    assert all(t.device.type == "meta" for t in model.parameters())
    assert len(model.layers) == 126                                 # the block list is restored
    (b,) = p.blocks
    assert b.count == 126 and p.num_layers == 126
    assert (b.heads, b.kv_heads, b.head_dim, b.ffn_hidden, b.hidden) == (128, 8, 128, 53248, 16384)
    assert p.total_params == n_params(model)
    assert b.fwd_flops == pytest.approx(analytic_dense_fwd(b, 8192), rel=0.01)


def test_llama3_8b_and_deepseek_v3():
    p = trace(mm.build("llama3-8b", device="meta"), seq_len=1024)
    assert p.blocks[0].count == 32 and (p.blocks[0].heads, p.blocks[0].kv_heads) == (32, 8)
    model = mm.build("deepseek-v3", device="meta")
    p = trace(model, seq_len=1024)
    dense, moe = p.blocks
    assert dense.count == 3 and moe.count == 58 and p.layers == (0,) * 3 + (1,) * 58
    assert (moe.experts, moe.topk, moe.moe_ffn_hidden, moe.shared_ffn_hidden) == (256, 8, 2048, 2048)
    assert all(li.tokens_per_token == pytest.approx(8 / 256) for li in moe.linears if li.role.startswith("expert"))
    assert p.total_params == n_params(model)
    assert p.active_params < p.total_params / 10


# --- transformers models ----------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def hf_llama(**kw):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100, **kw)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def test_hf_llama_roles_by_data_flow_and_gqa():
    model = hf_llama()
    p = trace(model, seq_len=T)
    (b,) = p.blocks
    assert b.instances == ("model.layers.0", "model.layers.1", "model.layers.2")
    assert (b.heads, b.kv_heads, b.head_dim, b.causal, b.gated, b.ffn_hidden) == (4, 2, 16, True, True, 128)
    assert roles(b) == {
        "self_attn.q_proj": "attn_qkv", "self_attn.k_proj": "attn_qkv", "self_attn.v_proj": "attn_qkv",
        "self_attn.o_proj": "attn_out", "mlp.gate_proj": "mlp_in", "mlp.up_proj": "mlp_in",
        "mlp.down_proj": "mlp_out"}
    assert p.total_params == n_params(model) and not p.tied_embeddings
    assert (p.embedding_fqn, p.head_fqn) == ("model.embed_tokens", "lm_head")
    assert b.fwd_flops == pytest.approx(analytic_dense_fwd(b, T), rel=0.01)
    # eager attention (matmul + softmax + matmul) is recognised as attention too
    eager = trace(hf_llama(attn_implementation="eager"), seq_len=T).blocks[0]
    assert roles(eager) == roles(b) and (eager.heads, eager.kv_heads) == (4, 2)
    assert eager.fwd_flops == pytest.approx(b.fwd_flops, rel=0.01)


def test_hf_tied_embeddings():
    model = hf_llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    p = trace(model, seq_len=16)
    assert p.tied_embeddings and p.head_params == 0
    assert p.total_params == n_params(model)


def test_hf_mixtral_static_experts_and_flops():
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                     num_local_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(cfg)
    model.config._experts_implementation = None     # the data-dependent loop over experts
    p = trace(model, seq_len=T)
    assert model.config._experts_implementation is None             # restored
    (b,) = p.blocks
    assert (b.experts, b.topk, b.moe_ffn_hidden, b.gated) == (4, 2, 96, True)
    r = roles(b)
    assert r["mlp.gate"] == "router" and r["mlp.experts.gate_up_proj"] == "expert_in"
    assert r["mlp.experts.down_proj"] == "expert_out"
    # routed FLOPs: 2 * tokens * topk * h * f per matrix (gate, up, down)
    routed = sum(op.fwd_flops for op in b.ops if op.role.startswith("expert"))
    assert routed == pytest.approx(3 * 2 * T * 2 * 64 * 96)
    assert b.expert_params == 3 * 4 * 64 * 96
    assert p.total_params == n_params(model)


# --- errors, fallbacks and memory --------------------------------------------------------------

class LoopMoE(nn.Module):
    """Routes with a Python loop over the chosen experts: cannot be traced without data."""

    def __init__(self, h: int = 32, experts: int = 4):
        super().__init__()
        self.router = nn.Linear(h, experts)
        self.experts = nn.ModuleList(nn.Linear(h, h) for _ in range(experts))

    def forward(self, x):
        _, idx = self.router(x).topk(1, dim=-1)
        out = torch.zeros_like(x)
        for e in idx.unique():
            sel = (idx == e).squeeze(-1)
            out[sel] = self.experts[int(e)](x[sel])
        return out


class Net(nn.Module):
    def __init__(self, layers: list[nn.Module], by_index: bool = False):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(layers)
        self.count = len(layers)
        self.by_index = by_index
        self.head = nn.Linear(32, 50)

    def forward(self, ids):
        x = self.emb(ids)
        if self.by_index:          # indexes the list by absolute position
            for i in range(self.count):
                x = self.layers[i](x)
        else:
            for layer in self.layers:
                x = layer(x)
        return self.head(x)


def test_untraceable_module_names_its_fqn():
    with torch.device("meta"):
        model = Net([Layer(mlp()), Layer(LoopMoE()), Layer(LoopMoE())])
    with pytest.raises(TraceError, match=r"layers\.1\.inner.*data-dependent.*grouped_mm") as info:
        trace(model, seq_len=8)
    assert info.value.__cause__ is not None
    assert len(model.layers) == 3 and model.layers[2].inner.__class__ is LoopMoE   # restored


def test_absolute_indexing_falls_back_to_a_whole_trace():
    with torch.device("meta"):
        model = Net([Layer(mlp()) for _ in range(3)], by_index=True)
    p = trace(model, seq_len=8)
    (b,) = p.blocks
    assert b.instances == ("layers.0", "layers.1", "layers.2") and p.layers == (0, 0, 0)
    assert roles(b) == {"inner.0": "mlp_in", "inner.2": "mlp_out"}
    assert [op.module for op in p.pre_ops] == ["emb"] and p.post_ops[-1].module == "head"


def test_layers_that_do_not_repeat_are_blocks_of_their_own():
    with torch.device("meta"):
        model = Net([Layer(mlp()), Layer(nn.Linear(32, 32))])
    p = trace(model, seq_len=8)
    first, second = p.blocks
    assert (first.instances, second.instances) == (("layers.0",), ("layers.1",)) and p.layers == (0, 1)
    assert roles(first) == {"inner.0": "mlp_in", "inner.2": "mlp_out"} and len(second.linears) == 1
    assert [op.module for op in p.pre_ops] == ["emb"] and p.post_ops[-1].module == "head"
    assert p.total_params == n_params(model)


class Unlisted(nn.Module):
    """Two layers held as plain attributes, not in a list: no block to find."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 32), nn.Linear(32, 50)
        self.first, self.second = Layer(mlp()), Layer(mlp())

    def forward(self, ids):
        return self.head(self.second(self.first(self.emb(ids))))


def test_layers_outside_any_list_traced_whole():
    with torch.device("meta"):
        model = Unlisted()
    p = trace(model, seq_len=8)
    assert p.blocks == () and p.layers == ()
    assert sum(op.kind == "linear" for op in p.pre_ops) == 5
    assert p.total_params == n_params(model)


def test_fake_tensor_model_and_real_weights_untouched():
    with FakeTensorMode():
        fake = mm.build("tiny-llama", device="cpu")
    p = trace(fake, seq_len=T)
    assert p.blocks[0].count == 4 and p.total_params == n_params(fake)
    real = mm.build("tiny-moe", device="cpu").eval()
    ptrs = {n: t.data_ptr() for n, t in real.named_parameters()}
    q = trace(real, seq_len=T)
    assert {n: t.data_ptr() for n, t in real.named_parameters()} == ptrs
    assert not any(m.training for m in real.modules())                 # modes restored
    assert [b.fwd_flops for b in q.blocks] == [b.fwd_flops for b in trace(mm.build("tiny-moe"), seq_len=T).blocks]


def test_trace_graph_maps_names_to_the_original_model():
    model = mm.build("tiny-moe", device="meta")
    ops = trace_graph(model, seq_len=16)
    modules = {op.module for op in ops}
    assert "layers.1.feed_forward.experts" in modules and "layers.2.attention" not in modules
    names = {op.name for op in ops}
    linear = next(op for op in ops if op.role == "attn_qkv")
    assert linear.params == ("layers.0.attention.wq.weight",)
    assert all(i in names or i.startswith(("p_", "b_", "input")) for op in ops for i in op.inputs)


def test_block_signatures_ignore_layer_index_but_not_structure():
    model = mm.build("tiny-moe", device="meta")
    (c,) = find_block_containers(model)
    assert c.fqn == "layers" and c.representatives() == ("0", "1")
    assert signature(model.layers[1]) == signature(model.layers[3]) != signature(model.layers[0])
    assert fingerprint(model) == fingerprint(mm.build("tiny-moe")) != fingerprint(mm.build("tiny-llama"))


@torch.library.custom_op("meshplan_test::opaque_mm", mutates_args=())
def opaque_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


@opaque_mm.register_fake
def _(x, w):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def test_custom_matmul_without_flop_formula_is_reported():
    class Opaque(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(32, 32))

        def forward(self, x):
            return opaque_mm(x, self.weight)

    with torch.device("meta"):
        model = Net([Layer(Opaque()), Layer(Opaque())])
    with pytest.raises(TraceError, match=r"meshplan_test\.opaque_mm.*layers\.0\.inner.*register_flop_formula"):
        trace(model, seq_len=8)


def test_bad_arguments():
    model = mm.build("tiny-llama", device="meta")
    with pytest.raises(ConfigError, match="seq_len"):
        trace(model, seq_len=0)
    with pytest.raises(ConfigError, match="dtype"):
        trace(model, seq_len=8, dtype=torch.int8)
    with pytest.raises(TraceError, match="example_inputs"):
        trace(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), seq_len=8)


def test_cpu_flash_attention_flops_registered():
    b, h, s, d = 1, 4, 128, 32
    with FakeTensorMode():
        q = torch.empty(b, h, s, d, requires_grad=True)
        counter = FlopCounterMode(display=False)
        with counter:
            F.scaled_dot_product_attention(q, q, q).sum().backward()
    fwd = 4 * b * h * s * s * d
    assert counter.get_total_flops() == pytest.approx(fwd + 2.5 * fwd)
