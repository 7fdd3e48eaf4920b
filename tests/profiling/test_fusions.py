"""Fused-kernel matching from the traced graph (profiling/fusions.py) and its cost accounting."""

from __future__ import annotations

import re

import dataclasses

import pytest
import torch
from torch import nn

import meshplan as mp
from meshplan.errors import ConfigError
from meshplan.ir.plan import FusedKernel
from meshplan.profiling.fusions import find_fusions
from meshplan.profiling.trace import trace


class MyNorm(nn.Module):
    """A user's own RMSNorm with its weight under another name."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + self.eps)).type_as(x) * self.scale


class MyMLP(nn.Module):
    def __init__(self, d: int, f: int, extra: bool = False):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)
        self.extra = extra

    def forward(self, x):
        h = nn.functional.silu(self.a(x)) * self.b(x)
        if self.extra:               # not a plain SwiGLU any more: must not match
            h = h * 0.5
        return self.c(h)


class Block(nn.Module):
    def __init__(self, d: int, extra: bool):
        super().__init__()
        self.n1, self.n2 = MyNorm(d), MyNorm(d)
        self.attn = nn.Linear(d, d, bias=False)
        self.mlp = MyMLP(d, 3 * d, extra)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class UserLM(nn.Module):
    def __init__(self, vocab=96, d=32, layers=2, extra=False, head_bias=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, extra) for _ in range(layers))
        self.norm = MyNorm(d)
        self.head = nn.Linear(d, vocab, bias=head_bias)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _kernels(modules):
    """(kernel, module path inside its block, or FQN outside the blocks), once per block path."""
    return sorted({(m.kernel, re.sub(r"^(.*?\.)?\d+\.", "", m.module)) for m in modules})


def test_users_own_modules_are_matched_by_computation():
    with torch.device("meta"):
        model = UserLM()
    f = find_fusions(trace(model, seq_len=16))
    assert _kernels(f.modules) == [("linear_cross_entropy", "head"), ("rms_norm", "n1"), ("rms_norm", "n2"),
                                     ("rms_norm", "norm"), ("swiglu", "mlp")]
    norm = next(m for m in f.modules if m.kernel == "rms_norm" and m.option.get("weight") == "scale")
    assert norm.option == {"eps": "1e-05", "weight": "scale"}
    mlp = next(m for m in f.modules if m.kernel == "swiglu")
    assert mlp.option == {"gate": "a", "up": "b", "down": "c"}
    assert f.applied_map() == {"rms_norm": True, "swiglu": True, "linear_cross_entropy": True}


def test_near_misses_are_not_matched():
    with torch.device("meta"):
        model = UserLM(extra=True, head_bias=True)
    f = find_fusions(trace(model, seq_len=16))
    kinds = {m.kernel for m in f.modules}
    assert "swiglu" not in kinds and "linear_cross_entropy" not in kinds
    assert f.applied_map()["linear_cross_entropy"] is False


def test_tensor_parallel_head_keeps_eager_loss():
    with torch.device("meta"):
        model = UserLM()
    f = find_fusions(trace(model, seq_len=16), tp=2)
    assert "linear_cross_entropy" not in {m.kernel for m in f.modules}


def test_reference_models():
    llama = find_fusions(trace(mp.models.build("tiny-llama", device="meta"), seq_len=16))
    # F.rms_norm is already one fused op in PyTorch: left alone; rotary stays eager
    assert {m.kernel for m in llama.modules} == {"swiglu", "linear_cross_entropy"}
    assert llama.applied_map()["rope"] is False
    gpt = find_fusions(trace(mp.models.build("tiny-gpt", device="meta"), seq_len=16))
    assert {m.kernel for m in gpt.modules} == {"linear_cross_entropy"}     # LayerNorm, GELU


def test_hf_llama_matches():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    f = find_fusions(trace(model, seq_len=16))
    assert _kernels(f.modules) == [("linear_cross_entropy", "lm_head"), ("rms_norm", "input_layernorm"),
                                     ("rms_norm", "model.norm"), ("rms_norm", "post_attention_layernorm"),
                                     ("swiglu", "mlp")]


def test_malformed_entries():
    with pytest.raises(ConfigError, match="malformed"):
        FusedKernel.from_dict({"kernel": "rms_norm"})
    with pytest.raises(ConfigError, match="meshplan fuses"):
        FusedKernel.from_dict({"kernel": "layernorm", "module": "x"})
    with pytest.raises(ConfigError, match="one non-empty name"):
        FusedKernel(kernel="rms_norm", module="a b")


def _hf_profile(seq):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=8)
    with torch.device("meta"):
        return trace(transformers.LlamaForCausalLM(cfg), seq_len=seq)


def test_cost_model_counts_the_bytes_fusions_save():
    from meshplan.cost_models.estimate import estimate_profile
    from meshplan.kernels import fusion as FU
    prof = _hf_profile(128)
    cl = mp.Cluster.preset("dgx-h100")
    lay = dict(tp=1, pp=1, dp=8, mbs=1, zero=1)
    kw = dict(seq_len=2048, global_batch=8)
    fused = estimate_profile(prof, cl, lay, **kw)
    eager = estimate_profile(dataclasses.replace(prof, fusions=tuple((k, False) for k, _ in prof.fusions)),
                             cl, lay, **kw)
    assert eager.step_time_s > fused.step_time_s
    # layer fusions: exactly meshplan.kernels.fusion's bytes over the HBM roofline
    T, b = 2048, prof.blocks[0]
    saved = prof.num_layers * (2 * FU.rms_norm_bytes_saved(tokens=T, hidden=b.hidden)
                               + FU.swiglu_bytes_saved(tokens=T, ffn_hidden=b.ffn_hidden))
    from meshplan.cost_models import constants as K
    bw = cl.gpu.hbm_tb_s * 1e12 * K.HBM_EFF
    head_saved = FU.linear_cross_entropy_bytes_saved(tokens=T, vocab=prof.vocab)
    assert eager.time_s["compute"] - fused.time_s["compute"] == pytest.approx((saved + head_saved) / bw, rel=1e-6)
    # the fused loss never holds the full logits
    assert eager.peak_memory_gb - fused.peak_memory_gb > 0.9 * 6 * T * prof.vocab / 2**30 - 0.2


def test_plan_lists_fused_modules_and_can_turn_them_off():
    p = mp.plan("tiny-llama", "local-cpu", seq_len=64, global_batch=8, fixed={"tp": 1})
    assert {k.kernel for k in p.fused_kernels} == {"swiglu", "linear_cross_entropy"}
    assert "fused kernels: swiglu" in p.explain()
    q = mp.plan("tiny-llama", "local-cpu", seq_len=64, global_batch=8, fixed={"tp": 1}, fused_kernels=False)
    assert q.fused_kernels == ()
    assert mp.Plan.from_json(p.to_json()).fused_kernels == p.fused_kernels
