"""One declaration of what the runtime runs (meshplan.ir.support), read by the planner and the runtime."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import meshplan as mp
from meshplan.errors import LayoutError
from meshplan.profiling.traits import model_traits
from meshplan.ir.support import ModelTraits, runtime_limits


def test_layout_rules():
    assert runtime_limits({"tp": 2, "dp": 2}) == []
    assert runtime_limits({"ep": 2, "dp": 4}) == []
    # MoE parallel folding: experts on their own EP x ETP x EDP groups over the dense ranks
    for folded in ({"ep": 2, "tp": 2}, {"ep": 2, "cp": 2}, {"ep": 2, "etp": 2, "dp": 4}, {"etp": 2, "tp": 2}):
        assert runtime_limits(folded) == []
    (why,) = runtime_limits({"etp": 2, "dp": 2, "zero": 0})
    assert "DDP" in why
    # experts fully sharded over edp while the dense weights run HSDP (what the cost model prices)
    assert runtime_limits({"ep": 2, "dp": 4, "zero": 3, "fsdp_shard": 2}) == []


def test_model_rules():
    t = ModelTraits(moe=True, fused_qkv=True, fused_gate_up=True, sdpa_causal=False, ep_experts=False, layers=2)
    assert runtime_limits({"tp": 1, "cp": 1}, t) == []
    text = " ".join(runtime_limits({"tp": 2, "cp": 2, "pp": 2, "vp": 2}, t))
    for part in ("MoE model", "scaled_dot_product_attention", "4 pipeline stages for 2"):
        assert part in text
    # transformers' Qwen2-MoE: its experts split over ep and etp; tp is refused, because the planner
    # places its shared expert tensor-parallel beside routed experts without a routed(x) method
    qwen = ModelTraits(moe=True, moe_tp_fold=False, layers=2)
    assert runtime_limits({"ep": 2, "etp": 2, "dp": 4}, qwen) == []
    (why,) = runtime_limits({"tp": 2, "ep": 2, "dp": 2}, qwen)
    assert "shared expert" in why and "routed(x)" in why and "use tp=1" in why
    # packed projections run under TP (meshplan.runtime.packed_projections); other packings do not
    assert runtime_limits({"tp": 2}, ModelTraits(fused_qkv=True, fused_gate_up=True, layers=2)) == []
    (why,) = runtime_limits({"tp": 2}, ModelTraits(partly_fused_qkv=True, layers=2))
    assert "fused K|V" in why


def test_traits_from_traced_models():
    meta = lambda name: mp.profile(mp.models.build(name, device="meta"), seq_len=64)   # noqa: E731
    assert model_traits(meta("tiny-llama")) == ModelTraits(layers=4)
    assert model_traits(meta("tiny-moe")).moe
    spec = importlib.util.spec_from_file_location("my_model", Path(__file__).parents[2] / "examples" / "my_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import torch
    with torch.device("meta"):
        fused = mp.profile(mod.build(), seq_len=64)
    assert model_traits(fused).fused_qkv
    # its attention runs in the block's own forward (splitting the fused output by the block
    # input's width): TP is refused; the planner would label the fused QKV per head
    assert model_traits(fused).partly_fused_qkv
    assert "no attention sub-module" in runtime_limits({"tp": 2}, model_traits(fused))[0]
    from meshplan.ir.layout import Layout
    from meshplan.planner.build import placements_for
    labels = placements_for(fused, Layout(tp=2))
    assert labels["blocks.0.qkv"] == "colwise_qkv" and labels["blocks.0.up"] == "colwise"


def test_planner_never_returns_what_the_runtime_refuses():
    model = mp.models.build("tiny-moe", device="meta")
    cl = mp.Cluster(gpu="h100-sxm", gpus_per_node=8, nodes=1)
    plan = mp.plan(model, cl, seq_len=4096, global_batch=64)
    traits = model_traits(mp.profile(model, seq_len=4096))
    assert runtime_limits(plan.layout, traits) == []
    # (MoE parallel folding runs every layout the search scores for tiny-moe here: nothing excluded)
    for r in plan.runner_ups:
        assert runtime_limits(r.layout, traits) == []
    with pytest.raises(LayoutError, match="no layout the runtime can run.*DDP"):
        mp.plan(model, cl, seq_len=4096, global_batch=64,
                fixed={"etp": 2, "ep": 1, "dp": 8, "tp": 1, "cp": 1, "pp": 1, "zero": 0})


def test_explain_names_an_excluded_faster_layout():
    model = mp.models.build("mixtral-8x7b", device="meta")
    plan = mp.plan(model, mp.Cluster.preset("dgx-h100", nodes=2), seq_len=4096, global_batch=64)
    note = plan.notes.runtime_excluded_note
    if note:                         # when the fastest layout was excluded, explain() says why
        assert "excluded: the runtime cannot run it" in note and note in plan.explain()
    assert runtime_limits(plan.layout, model_traits(mp.profile(model, seq_len=4096))) == []


def test_plans_for_other_frameworks_skip_the_runtime_limits():
    model = mp.models.build("tiny-moe", device="meta")
    cl = mp.Cluster(gpu="h100-sxm", gpus_per_node=8, nodes=1)
    plan = mp.plan(model, cl, seq_len=4096, global_batch=64, fixed={"ep": 2, "tp": 2}, stack="megatron-core")
    assert plan.layout.ep == 2 and plan.layout.tp == 2


def test_block_placements_keep_packed_projections_per_part():
    """A fused QKV / gate-up placed plainly column-parallel (rows split in blocks) would mix parts
    across ranks: the planner falls back to the runtime's per-part labels."""
    from meshplan.ir.support import block_placement_limits
    roles = {"attn.qkv": "attn_qkv", "attn.o": "attn_out", "mlp.gate_up": "mlp_in", "mlp.down": "mlp_out"}
    packed = {"attn.qkv": "colwise_qkv", "mlp.gate_up": "colwise_gate_up"}
    megatron = {"attn.qkv": "colwise", "attn.o": "rowwise", "mlp.gate_up": "colwise", "mlp.down": "rowwise"}
    assert block_placement_limits(megatron, roles) == []
    why = block_placement_limits(megatron, roles, packed=packed)
    assert len(why) == 2 and "attn.qkv (attn_qkv) is a packed projection placed 'colwise'" in why[0]
    assert block_placement_limits({**megatron, **packed}, roles, packed=packed) == []


def test_stack_choices_the_runtime_does_not_run_are_refused():
    """Layouts may name FP8 recipes and CP implementations other frameworks run (the cost model
    prices them); the runtime refuses those it does not have, so the planner never returns them."""
    from meshplan.ir.layout import Layout
    assert runtime_limits(Layout(fp8_recipe="rowwise")) == []
    (why,) = runtime_limits(Layout(fp8_recipe="mxfp8"))
    assert "tensorwise or rowwise" in why
    (why,) = runtime_limits(Layout(cp=2, cp_comm_type="all_gather"))
    assert "ring" in why
    assert runtime_limits(Layout(cp=1, cp_comm_type="all_gather")) == []
    (why,) = runtime_limits(Layout(tp=2, pp=2, schedule="zbv"))
    assert "ZB-V" in why and "sp=False" in why
    assert runtime_limits(Layout(tp=2, pp=2, schedule="zbv", sp=False)) == []
    assert runtime_limits(Layout(tp=2, pp=2, schedule="zb")) == []


def test_runtime_limits_read_a_dict_as_the_layout_it_describes():
    """A dict (tests, external callers) is read as Layout.from_dict reads it: the same reasons as
    the Layout, missing keys at Layout's defaults, a key Layout does not know refused by name."""
    from meshplan.errors import ConfigError
    from meshplan.ir.layout import Layout
    dicts = [{"tp": 2, "pp": 2, "schedule": "zbv"}, {"dp": 4, "zero": 3, "fsdp_impl": "megatron"},
             {"cp": 2, "cp_comm_type": "a2a", "fp8_recipe": "mxfp8"}, {"tp": 2, "dp": 2}, {}]
    reasons = [runtime_limits(d) for d in dicts]
    assert reasons == [runtime_limits(Layout.from_dict(d)) for d in dicts]
    assert [len(r) for r in reasons] == [1, 1, 2, 0, 0]
    with pytest.raises(ConfigError, match=r"unknown layout key\(s\) \['tensor_parallel'\]"):
        runtime_limits({"tensor_parallel": 2})


def test_planner_drops_sequence_parallelism_where_only_it_is_refused():
    """ZB-V with TP runs without SP: a fixed zbv schedule with tp=2 plans sp=False instead of
    failing; fixing sp=True explicitly is refused with the runtime's reason."""
    model = mp.models.build("tiny-llama", seq_len=64, device="meta")
    cl = mp.Cluster.preset("local-cpu")
    plan = mp.plan(model, cl, seq_len=64, global_batch=8, fixed={"tp": 2, "pp": 2, "schedule": "zbv"})
    assert plan.layout.schedule == "zbv" and plan.layout.tp == 2 and plan.layout.sp is False
    with pytest.raises(LayoutError, match="ZB-V"):
        mp.plan(model, cl, seq_len=64, global_batch=8, fixed={"tp": 2, "pp": 2, "schedule": "zbv", "sp": True})
