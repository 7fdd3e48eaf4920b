"""Layers whose kind does not repeat are blocks of their own (meshplan.profiling.blocks): a one-layer
model, and a hybrid model whose sliding-window and global layers alternate at a depth of two, trace
to blocks that carry their real heads, KV heads, widths, window and experts (count 1 each)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshplan.models as mm
from meshplan.profiling.blocks import find_block_containers
from meshplan.profiling.trace import trace
from toy_layers import Layer, mlp, n_params

T = 32


def geometry(b) -> tuple:
    return b.heads, b.kv_heads, b.head_dim, b.attn_window, b.hidden, b.ffn_hidden, b.experts


def test_one_layer_llama_is_one_block():
    model = mm.build("tiny-llama", layers=1, device="meta")
    p = trace(model, seq_len=T)
    (b,) = p.blocks
    assert b.instances == ("layers.0",) and b.count == 1 and p.layers == (0,)
    assert geometry(b) == (4, 2, 32, 0, 128, 384, 0) and b.causal and b.gated
    assert {li.role for li in b.linears} == {"attn_qkv", "attn_out", "mlp_in", "mlp_out"}
    assert b.params == n_params(model.layers[0]) and p.total_params == n_params(model)
    assert [op.module for op in p.pre_ops if op.params] == ["tok_embeddings"]
    assert p.head_fqn == "output" and p.other_params == n_params(model.norm)


def test_alternating_window_and_global_layers_are_two_blocks():
    """Layer 0 attends an 8-token window, layer 1 the whole causal prefix (pattern "alternate"):
    at two layers neither kind repeats, and each is its own block with its own window."""
    model = mm.build("tiny-llama", layers=2, sliding_window=8, sliding_window_pattern="alternate", device="meta")
    p = trace(model, seq_len=T)
    local, full = p.blocks
    assert (local.instances, full.instances) == (("layers.0",), ("layers.1",)) and p.layers == (0, 1)
    assert geometry(local) == (4, 2, 32, 8, 128, 384, 0)
    assert geometry(full) == (4, 2, 32, 0, 128, 384, 0)
    assert local.signature != full.signature
    assert p.total_params == n_params(model)
    # at four layers the kinds repeat: the same two blocks, each twice
    deeper = trace(mm.build("tiny-llama", layers=4, sliding_window=8, device="meta"), seq_len=T)
    assert [b.count for b in deeper.blocks] == [2, 2] and deeper.layers == (0, 1, 0, 1)
    assert [geometry(b) for b in deeper.blocks] == [geometry(local), geometry(full)]


def test_one_layer_moe_keeps_its_experts():
    model = mm.build("tiny-moe", layers=1, dense_layers=0, device="meta")
    p = trace(model, seq_len=T)
    (b,) = p.blocks
    assert b.instances == ("layers.0",) and (b.heads, b.kv_heads) == (4, 2)
    assert (b.experts, b.topk, b.moe_ffn_hidden) == (4, 2, 96) and b.expert_params == 3 * 4 * 128 * 96
    assert p.total_params == n_params(model)


class NanoGPTLike(nn.Module):
    """Layers in a ModuleList inside a ModuleDict that also holds the embedding and final norm."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(50, 32), "h": nn.ModuleList(layers),
                                           "ln_f": nn.LayerNorm(32)})
        self.head = nn.Linear(32, 50)

    def forward(self, ids):
        x = self.transformer.wte(ids)
        for layer in self.transformer.h:
            x = layer(x)
        return self.head(self.transformer.ln_f(x))


def test_a_dict_of_mixed_modules_is_not_a_layer_list():
    """The ModuleDict holds an embedding and a norm beside the list: only the list's children are
    layers; a list of lists is looked into, not taken for layers itself."""
    with torch.device("meta"):
        model = NanoGPTLike([Layer(mlp())])
    (c,) = find_block_containers(model)
    assert c.fqn == "transformer.h" and c.representatives() == ("0",)
    p = trace(model, seq_len=8)
    (b,) = p.blocks
    assert b.instances == ("transformer.h.0",) and {li.role for li in b.linears} == {"mlp_in", "mlp_out"}
    assert p.total_params == n_params(model)
    with torch.device("meta"):
        nested = nn.ModuleList([nn.ModuleList([Layer(nn.Linear(32, 32))]), nn.ModuleList([Layer(nn.GELU())])])
    assert [c.fqn for c in find_block_containers(nested)] == ["0", "1"]


transformers = pytest.importorskip("transformers")


def test_hf_gemma2_two_layers_local_then_global():
    """transformers' Gemma 2 alternates sliding-window and global attention layers (layer_types)."""
    cfg = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=100, sliding_window=16)
    with torch.device("meta"):
        model = transformers.Gemma2ForCausalLM(cfg)
    p = trace(model, seq_len=T)
    local, full = p.blocks
    assert (local.instances, full.instances) == (("model.layers.0",), ("model.layers.1",))
    assert (local.heads, local.kv_heads, local.head_dim, local.attn_window) == (4, 2, 16, 16)
    assert (full.heads, full.kv_heads, full.head_dim, full.attn_window) == (4, 2, 16, 0)
    assert p.total_params == n_params(model)
