"""Selective recompute of the norms and the MoE activation: Megatron-Core's
--recompute-granularity selective --recompute-modules layernorm moe_act, the cost model's policy
"norm_act" (cost_models.layer). The norms' outputs (the QKV, MLP and router inputs) and the routed
experts' activation outputs are not stored; backward re-runs the two norms and the activation."""

from __future__ import annotations

import pytest

from meshplan.cluster import Cluster
from meshplan.cost_models import constants as K
from meshplan.cost_models.compute import elementwise_time
from meshplan.cost_models.layer import NORM_ACT, Context, activation_bytes, layer_cost, moe_load_factor
from meshplan.ir.layout import Layout
from meshplan.profiling.analytic import profile_from_config

MOE = profile_from_config(dict(family="moe", layers=2, hidden=2048, heads=16, kv_heads=4, vocab=32000,
                               ffn_hidden=4096, experts=8, topk=2, moe_ffn_hidden=1408))
DENSE = profile_from_config(dict(family="llama", layers=2, hidden=2048, heads=16, kv_heads=4, vocab=32000,
                                 ffn_hidden=5632))
CLUSTER = Cluster(gpu="h100-sxm", num_gpus=16, gpus_per_node=8)


def _block(p, moe: bool):
    return next(b for b in p.layer_blocks() if b.is_moe == moe)


@pytest.mark.parametrize("fp8", [False, True])
def test_norm_act_drops_the_norm_outputs_and_the_expert_activation(fp8):
    lay = Layout(tp=2, ep=8, dp=8)                       # SP on: norm outputs are sequence-sharded
    c = Context.build(CLUSTER, lay, 4096, fp8)
    b = _block(MOE, True)
    half = 0.5 if fp8 else 1.0
    norm_outputs = 2 * K.BF16 * b.hidden * half * c.tokens / lay.tp
    expert_act = b.topk * K.BF16 * b.moe_ffn_hidden * half / lay.etp * c.tokens / lay.tp
    saved = activation_bytes(b, c, policy="none") - activation_bytes(b, c, policy=NORM_ACT)
    assert saved == pytest.approx(norm_outputs + expert_act, rel=1e-9)
    # core attention is not recomputed: "selective" (Korthikanti) saves the attention output instead
    assert activation_bytes(b, c, policy="selective") != activation_bytes(b, c, policy=NORM_ACT)


def test_norm_act_on_a_dense_layer_drops_only_the_norm_outputs():
    lay = Layout(tp=2, dp=8)
    c = Context.build(CLUSTER, lay, 4096, False)
    b = _block(DENSE, False)
    saved = activation_bytes(b, c, policy="none") - activation_bytes(b, c, policy=NORM_ACT)
    assert saved == pytest.approx(2 * K.BF16 * b.hidden * c.tokens / lay.tp, rel=1e-9)


def test_norm_act_recompute_time_is_the_norms_and_the_activation_rerun():
    lay = Layout(tp=2, ep=8, dp=8)
    c = Context.build(CLUSTER, lay, 4096, False)
    b = _block(MOE, True)
    rerun = (2 * 2 * K.BF16 * b.hidden * c.tokens / lay.tp
             + 3 * K.BF16 * b.moe_ffn_hidden * b.topk * c.tokens / lay.tp * moe_load_factor(b, c))
    cost = layer_cost(b, c, policy=NORM_ACT)
    none = layer_cost(b, c, policy="none")
    assert cost.recompute_s == pytest.approx(elementwise_time(rerun, CLUSTER), rel=1e-9)
    assert cost.compute_s == pytest.approx(none.compute_s + cost.recompute_s, rel=1e-9)
    # cheaper than recomputing core attention at this sequence length
    assert 0 < cost.recompute_s < layer_cost(b, c, policy="selective").recompute_s
