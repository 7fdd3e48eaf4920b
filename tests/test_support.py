"""One declaration of what the runtime runs (meshplan.ir.support), read by the planner and the runtime."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import meshplan as mp
from meshplan.errors import LayoutError
from meshplan.planner.traits import model_traits
from meshplan.ir.support import ModelTraits, runtime_limits


def test_layout_rules():
    assert runtime_limits({"tp": 2, "dp": 2}) == []
    assert runtime_limits({"ep": 2, "dp": 4}) == []
    for bad in ({"ep": 2, "tp": 2}, {"ep": 2, "cp": 2}, {"ep": 2, "etp": 2}):
        (why,) = runtime_limits(bad)
        assert "MoE parallel folding" in why
    (why,) = runtime_limits({"ep": 2, "dp": 4, "zero": 3, "fsdp_shard": 2})
    assert "HSDP" in why


def test_model_rules():
    t = ModelTraits(moe=True, fused_qkv=True, fused_gate_up=True, sdpa_causal=False, layers=2)
    assert runtime_limits({"tp": 1, "cp": 1}, t) == []
    text = " ".join(runtime_limits({"tp": 2, "cp": 2, "pp": 2, "vp": 2}, t))
    for part in ("MoE model", "fused QKV", "gate/up", "scaled_dot_product_attention", "4 pipeline stages for 2"):
        assert part in text


def test_traits_from_traced_models():
    meta = lambda name: mp.profile(mp.models.build(name, device="meta"), seq_len=64)   # noqa: E731
    assert model_traits(meta("tiny-llama")) == ModelTraits(layers=4)
    assert model_traits(meta("tiny-moe")).moe
    spec = importlib.util.spec_from_file_location("my_model", Path(__file__).parents[1] / "examples" / "my_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import torch
    with torch.device("meta"):
        fused = mp.profile(mod.build(), seq_len=64)
    assert model_traits(fused).fused_qkv


def test_planner_never_returns_what_the_runtime_refuses():
    model = mp.models.build("tiny-moe", device="meta")
    cl = mp.Cluster(gpu="h100-sxm", gpus_per_node=8, nodes=1)
    plan = mp.plan(model, cl, seq_len=4096, global_batch=64)
    traits = model_traits(mp.profile(model, seq_len=4096))
    assert runtime_limits(plan.layout, traits) == []
    assert plan.search["runtime_excluded"] > 0
    for r in plan.runner_ups:
        assert runtime_limits(r.layout, traits) == []
    with pytest.raises(LayoutError, match="no layout the runtime can run.*MoE parallel folding"):
        mp.plan(model, cl, seq_len=4096, global_batch=64, fixed={"ep": 2, "tp": 2})


def test_explain_names_an_excluded_faster_layout():
    model = mp.models.build("mixtral-8x7b", device="meta")
    plan = mp.plan(model, mp.Cluster.preset("dgx-h100", nodes=2), seq_len=4096, global_batch=64)
    note = plan.search.get("runtime_excluded_note")
    if note:                         # when the fastest layout was excluded, explain() says why
        assert "excluded: the runtime cannot run it" in note and note in plan.explain()
    assert runtime_limits(plan.layout, model_traits(mp.profile(model, seq_len=4096))) == []


def test_plans_for_other_frameworks_skip_the_runtime_limits():
    model = mp.models.build("tiny-moe", device="meta")
    cl = mp.Cluster(gpu="h100-sxm", gpus_per_node=8, nodes=1)
    plan = mp.plan(model, cl, seq_len=4096, global_batch=64, fixed={"ep": 2, "tp": 2}, for_runtime=False)
    assert plan.layout.ep == 2 and plan.layout.tp == 2
