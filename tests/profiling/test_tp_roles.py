"""The TP placements by linear role (meshplan.profiling.tp_roles): Megatron's pattern from the
traced roles, the labels the TP probe tries and the Plan falls back to."""

from __future__ import annotations

import pytest

import meshplan as mp
from meshplan.ir.layout import Layout
from meshplan.planner.build import placements_for
from meshplan.profiling.tp_roles import role_placements


@pytest.fixture(scope="module")
def llama():
    return mp.profile(mp.models.build("tiny-llama", device="meta"), seq_len=64)


@pytest.fixture(scope="module")
def moe():
    return mp.profile(mp.models.build("tiny-moe", device="meta"), seq_len=64)


def test_megatron_pattern_by_role(llama):
    labels = role_placements(llama.blocks[0], tp=2, sp=True)
    assert {k: labels[k] for k in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                                   "feed_forward.w3")} == dict.fromkeys(
        ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"), "colwise")
    assert labels["attention.wo"] == labels["feed_forward.w2"] == "rowwise"
    assert labels["attention"] == "heads"                     # the attention module runs on local heads
    assert labels["attention_norm"] == labels["ffn_norm"] == "sequence"
    # without sequence parallelism the norms hold the whole sequence
    plain = role_placements(llama.blocks[0], tp=2)
    assert plain["attention_norm"] == plain["ffn_norm"] == "replicate"
    assert {k: v for k, v in plain.items() if "norm" not in k} == {k: v for k, v in labels.items() if "norm" not in k}


def test_tp1_labels_only_routed_experts(llama, moe):
    assert set(role_placements(llama.blocks[0], tp=1, ep=2).values()) == {"replicate"}
    moe_block = next(b for b in moe.blocks if any(li.role.startswith("expert") for li in b.linears))
    labels = role_placements(moe_block, tp=1, ep=2)
    experts = {li.name for li in moe_block.linears if li.role.startswith("expert")}
    assert experts and {labels[n] for n in experts} == {"expert"}
    assert {v for k, v in labels.items() if k not in experts} == {"replicate"}
    assert set(role_placements(moe_block, tp=1, ep=1).values()) == {"replicate"}
    # under TP the shared experts follow the dense pattern, the routed ones stay whole per expert
    tp = role_placements(moe_block, tp=2)
    assert {tp[n] for n in experts} == {"expert"} and tp["attention.wo"] == "rowwise"


@pytest.mark.parametrize("sp", [False, True])
def test_the_plan_falls_back_to_the_same_labels(llama, sp):
    """Without a cluster the sharding ILP is not run: the Plan's placements are the role pattern
    for every instance of every block, the labels the TP probe checked the forward with."""
    out = placements_for(llama, Layout(tp=2, sp=sp))
    for b in llama.blocks:
        for inst in b.instances:
            for rel, label in role_placements(b, tp=2, sp=sp).items():
                assert out[f"{inst}.{rel}"] == label, (inst, rel)
