"""How the model balances its routers is part of what the planner sees and prices:
the trace records it, forced balance is priced at exactly the mean load, a router nothing balances
widens the band's upper side on expert-parallel layouts, and Plan.explain() names the risk."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import meshplan as mp
from meshplan.api import profile
from meshplan.cluster import Cluster
from meshplan.cost_models import uncertainty as U
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.layer import Context, routing_layout
from meshplan.cost_models.moe_load import load_factor as _load_factor
from meshplan.errors import ConfigError
from meshplan.ir.estimate import Estimate
from meshplan.ir.layout import Layout
from meshplan.profiling.analytic import profile_from_config
from meshplan.profiling.traits import balance_from_config, moe_balance

# Mixtral-8x7B's shape (8 experts, top-2), planned from its config: no trace needed
MIXTRAL = dict(family="moe", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000,
               experts=8, topk=2, name="mixtral-8x7b")
H100 = Cluster(gpu="h100-sxm", num_gpus=64, gpus_per_node=8)
EP8 = dict(tp=1, pp=1, dp=64, ep=8, mbs=1, recompute="full")
EP1 = dict(tp=1, pp=1, dp=64, ep=1, mbs=1, recompute="full")


def _mixtral(balance: str):
    return dataclasses.replace(profile_from_config(MIXTRAL), moe_balance=balance)


def _est(balance: str, layout=EP8, seq_len=4096, gbs=256):
    return estimate_profile(_mixtral(balance), H100, layout, seq_len=seq_len, global_batch=gbs)


# --- 1. the trace records the balance ---------------------------------------------------------

@pytest.mark.parametrize("options, expect", [
    ({}, "none"),                                            # tiny-moe as it ships: nothing balances it
    ({"moe_aux_loss_coeff": 1e-2}, "aux_loss"),
    ({"moe_expert_bias": True}, "expert_bias"),
    ({"moe_force_balance": True}, "forced"),
    ({"moe_force_balance": True, "moe_aux_loss_coeff": 1e-2}, "forced"),   # the router is overridden
])
def test_trace_records_meshplan_balance(options, expect):
    prof = profile(mp.models.build("tiny-moe", device="meta", **options), seq_len=64)
    assert prof.moe_balance == expect
    assert prof.moe_capacity_factor is None


def test_trace_records_capacity_and_a_sigmoid_bias_that_is_never_updated():
    prof = profile(mp.models.build("tiny-moe", device="meta", moe_capacity_factor=1.25), seq_len=64)
    assert (prof.moe_balance, prof.moe_capacity_factor) == ("none", 1.25)
    # a sigmoid router holds an expert bias, but only moe_expert_bias updates it: it balances nothing
    assert moe_balance(mp.models.build("tiny-moe", device="meta", router="sigmoid"))[0] == "none"
    assert moe_balance(mp.models.build("tiny-llama", device="meta"))[0] == "unknown"
    assert moe_balance(torch.nn.Linear(2, 2)) == ("unknown", None)


def test_balance_from_config_mappings():
    assert balance_from_config({"moe_aux_loss_coeff": 0.01}) == ("aux_loss", None)
    assert balance_from_config({"moe_expert_bias": True, "moe_capacity_factor": 2}) == ("expert_bias", 2.0)
    assert balance_from_config({"moe_aux_loss_coeff": 0.0}) == ("none", None)
    assert balance_from_config(MIXTRAL) == ("unknown", None)        # says nothing about balance


transformers = pytest.importorskip("transformers")


def _hf_mixtral(**kw):
    cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                     num_local_experts=4, num_experts_per_tok=2, **kw)
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(cfg)


def test_trace_records_transformers_balance():
    # the aux loss joins the loss only with output_router_logits=True (False is transformers' default)
    assert profile(_hf_mixtral(), seq_len=32).moe_balance == "none"
    assert profile(_hf_mixtral(output_router_logits=True), seq_len=32).moe_balance == "aux_loss"
    assert moe_balance(_hf_mixtral(output_router_logits=True, router_aux_loss_coef=0.0))[0] == "none"
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100))
    assert moe_balance(llama)[0] == "unknown"


def test_profile_refuses_an_unknown_balance():
    with pytest.raises(ConfigError, match="moe_balance"):
        _mixtral("sometimes")


# --- 2. the cost model -------------------------------------------------------------------------

def test_forced_balance_has_no_statistical_excess():
    L = Layout.from_dict(dict(EP8, mbs=1))
    for balance, expect_excess in (("aux_loss", True), ("unknown", True), ("none", True), ("forced", False)):
        ctx = Context.build(H100, routing_layout(L, balance), 4096, False)
        f = _load_factor(8, 2, ctx)
        assert (f > 1.0) == expect_excess and (balance != "forced" or f == 1.0)
    # a layout that sets its own capacity keeps it
    own = Layout.from_dict(dict(EP8, moe_capacity_factor=1.5))
    assert routing_layout(own, "forced").moe_capacity_factor == 1.5


def test_forced_balance_prices_the_expert_part_no_slower():
    bal, forced = _est("aux_loss"), _est("forced")
    assert forced.time_s["ep"] < bal.time_s["ep"]
    assert forced.time_s["compute"] <= bal.time_s["compute"]
    assert forced.step_time_s < bal.step_time_s
    # the reported layout is the one asked for (forced balance is a model fact, not a layout choice)
    assert forced.layout.moe_capacity_factor is None
    # every balanced mode, "unknown" and "none" share the balanced point estimate
    for b in ("expert_bias", "unknown", "none"):
        assert _est(b).step_time_s == bal.step_time_s


def test_worst_ep_load():
    assert U.worst_ep_load(4, 2, 2) == 2.0               # tiny-moe at ep2: one rank takes both choices
    assert U.worst_ep_load(8, 2, 8) == 4.0               # one expert per rank: k of ep ranks, mean k/ep
    assert U.worst_ep_load(256, 8, 64) == 32.0           # 4 experts per rank: 4 of a token's 8 copies
    assert U.worst_ep_load(8, 2, 8, capacity=1.25) == 1.25
    assert U.worst_ep_load(8, 2, 1) == 1.0


def test_no_balancing_widens_the_upper_band_on_ep_layouts_only():
    bal, none = _est("aux_loss"), _est("none")
    assert none.step_time_s == bal.step_time_s and none.uncertainty == bal.uncertainty
    assert bal.uncertainty_high == 0.0 and none.uncertainty_high > 0.0
    assert none.moe_worst_load == 4.0 and none.regime.get("moe_unbalanced")
    assert none.step_time_range_s[0] == bal.step_time_range_s[0]
    assert none.step_time_range_s[1] > bal.step_time_range_s[1]
    # the widening is (worst - 1) x the expert part: at least the exposed all-to-all's share
    assert none.uncertainty_high >= 3.0 * none.time_s["ep"] / none.step_time_s
    assert none.uncertainty_high <= 3.0 * (none.time_s["ep"] + none.time_s["compute"]) / none.step_time_s
    # ep = 1: every rank runs every expert, the rows per rank are fixed
    flat = _est("none", layout=EP1)
    assert flat.uncertainty_high == 0.0 and flat.moe_worst_load == 1.0 and not flat.regime.get("moe_unbalanced")
    # the fields round-trip
    again = Estimate.from_dict(none.to_dict())
    assert (again.uncertainty_high, again.moe_balance, again.moe_worst_load) == (none.uncertainty_high, "none", 4.0)
    assert "+" in none.summary() and "/ -" in none.summary()


def test_dense_estimate_has_no_moe_balance():
    prof = profile_from_config(dict(layers=2, hidden=256, heads=4, vocab=1000, ffn_hidden=512))
    e = estimate_profile(prof, H100, dict(tp=1, pp=1, dp=64, mbs=1), seq_len=1024, global_batch=64)
    assert e.moe_balance == "" and e.uncertainty_high == 0.0


# --- 3. Plan.explain() -------------------------------------------------------------------------

def _explain(balance: str, ep: int) -> str:
    plan = mp.plan(_mixtral(balance), H100, seq_len=4096, global_batch=256,
                   fixed=dict(tp=1, pp=1, cp=1, dp=64, ep=ep, mbs=1, recompute="full"))
    return plan.explain()


def test_explain_names_the_risk_only_without_balancing():
    text = _explain("none", 8)
    line = next(ln for ln in text.splitlines() if "without load balancing" in ln)
    assert "mixtral-8x7b" in line and "4.0x" in line and "--moe-aux-loss-coeff" in line
    assert "moe_force_balance" in line
    assert "uncertainty band +" in text and "moe_unbalanced" in text
    for balance in ("aux_loss", "expert_bias", "forced", "unknown"):
        assert "without load balancing" not in _explain(balance, 8), balance
    # ep = 1: the line stays (the model still trains unbalanced) without the EP worst case
    flat = _explain("none", 1)
    assert "without load balancing" in flat and "x the balanced load" not in flat
