"""Planning models whose layers do not repeat (one layer; local and global attention alternating at a
depth of two) with a fixed TP degree: the divisibility checks see the layers' real heads and KV heads,
and a model whose trace finds no block at all is refused in its own terms, never as "heads 1"."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import meshplan as mp
from meshplan.errors import ConfigError, LayoutError

CPU4 = mp.Cluster.preset("local-cpu")


def _plan(model: nn.Module, fixed: dict):
    return mp.plan(model, CPU4, seq_len=64, global_batch=8, fixed=fixed)


def test_one_layer_llama_plans_with_tp2_and_names_its_kv_heads_at_tp4():
    model = mp.models.build("tiny-llama", layers=1, device="meta")
    plan = _plan(model, {"tp": 2})
    assert plan.layout.tp == 2
    assert "layers.0.attention.wq" in plan.placements
    # 4 heads, 2 KV heads: tp=4 splits the heads but not the KV heads, and says so
    with pytest.raises(ConfigError, match=r"tp=4 does not divide tiny-llama's kv heads 2; .*\[1, 2\]") as e:
        _plan(model, {"tp": 4})
    assert "heads 1" not in str(e.value)


def test_alternating_window_and_global_layers_plan_with_tp2():
    model = mp.models.build("tiny-llama", layers=2, sliding_window=8, device="meta")
    plan = _plan(model, {"tp": 2})
    assert plan.layout.tp == 2
    assert {"layers.0.attention.wq", "layers.1.attention.wq"} <= set(plan.placements)
    with pytest.raises(ConfigError, match="kv heads 2") as e:
        _plan(model, {"tp": 4})
    assert "heads 1" not in str(e.value)


class Layer(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.inner = inner

    def forward(self, x):
        return x + self.inner(self.norm(x))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


class Unlisted(nn.Module):
    """Layers held as plain attributes: the tracer finds no block."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.first, self.second = Layer(_mlp()), Layer(_mlp())

    def forward(self, ids):
        return self.head(self.second(self.first(self.emb(ids))))


class Listed(Unlisted):
    """The same layers in an nn.ModuleList: blocks, but without attention."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([self.first, self.second])
        del self.first, self.second

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("fixed", [{}, {"tp": 2}, {"pp": 1}])
def test_a_model_without_blocks_is_refused_in_its_terms(fixed):
    with torch.device("meta"):
        model = Unlisted()
    with pytest.raises(LayoutError, match=r"cannot plan Unlisted: its trace found no blocks") as e:
        _plan(model, fixed)
    msg = str(e.value)
    assert "parameters sit in emb, first, second, head" in msg
    assert "nn.ModuleList" in msg and "heads 1" not in msg


def test_blocks_without_attention_name_the_missing_attention_for_tp():
    with torch.device("meta"):
        model = Listed()
    assert _plan(model, {}).layout.tp == 1
    with pytest.raises(ConfigError, match=r"tp=2: the trace found no attention in Listed's blocks "
                                          r"\(layers\.0, layers\.1;.*use tp=1") as e:
        _plan(model, {"tp": 2})
    assert "heads 1" not in str(e.value)
