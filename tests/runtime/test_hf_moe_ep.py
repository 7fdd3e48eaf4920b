"""Expert parallelism for transformers MoE models (Mixtral, Qwen2-MoE) on gloo (CPU).

Their experts modules (gate_up_proj / down_proj stacked over E, forward(hidden_states,
top_k_index, top_k_weights)) are adapted by structure (meshplan/runtime/hf_experts.py). Each
whole-model case parallelises a tiny model with a plan fixed to ep=2, dp=2, runs one global batch
forward and backward and one AdamW step, and compares loss, every full gradient, the gradient norm
and every weight with the single-device model (numerics.py's tolerances).
"""

from __future__ import annotations

import functools

import hf_moe_workers
import pytest

CASES = {
    "mixtral_ep2_zero3": ("hf-mixtral", dict(ep=2, dp=2, tp=1, cp=1, pp=1, zero=3, mbs=2)),
    "mixtral_ep2_zero1_accum2": ("hf-mixtral", dict(ep=2, dp=2, tp=1, cp=1, pp=1, zero=1, mbs=2)),
    # planned without the runtime limits: the planner keeps Qwen2-MoE at ep=1 (its shared expert
    # would be refused under tp > 1, which the trait also opens); the runtime runs ep=2 all the same
    "qwen2_moe_ep2_zero3": ("hf-qwen2-moe", dict(ep=2, dp=2, tp=1, cp=1, pp=1, zero=3, mbs=4)),
}


def _cluster(world: int):
    from meshplan.cluster import Cluster
    return Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world)


@functools.lru_cache(maxsize=None)
def _plan(kind: str, world: int, fixed_items: tuple):
    import meshplan as mp
    return mp.plan(hf_moe_workers.build_model(kind), _cluster(world), seq_len=hf_moe_workers.SEQ,
                   global_batch=hf_moe_workers.BATCH, fixed=dict(fixed_items), for_runtime=kind == "hf-mixtral")


@pytest.fixture(scope="module")
def world2():
    from meshplan.train.spawn import run_ranks
    cases = {name: dict(model=kind, plan=_plan(kind, 2, tuple(sorted(fixed.items()))))
             for name, (kind, fixed) in CASES.items()}
    cases["experts_alone"] = dict(kind="experts")
    results = run_ranks(2, hf_moe_workers.run_cases, cases, timeout_s=300)
    return {name: [r[name] for r in results] for name in cases}


def _ok(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r['error']}\n{r.get('tb', '')}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_single_device(world2, name):
    _ok(world2[name])
    r0 = world2[name][0]
    assert {r["loss"] for r in world2[name]} == {r0["loss"]}, "ranks disagree on the loss"
    assert r0["local_experts"] and all(s[0] == 2 for s in r0["local_experts"].values()), r0["local_experts"]


def test_experts_module_alone(world2):
    _ok(world2["experts_alone"])
    assert [r["local_experts"] for r in world2["experts_alone"]] == [2, 2]


def test_structure_is_recognised():
    from meshplan.runtime.expert_parallel import find_expert_modules
    from meshplan.ir.routed_experts import is_routed_experts
    for kind in ("hf-mixtral", "hf-qwen2-moe"):
        model = hf_moe_workers.build_model(kind)
        assert find_expert_modules(model) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        assert sum(is_routed_experts(m) for m in model.modules()) == 2


def test_planner_offers_ep_for_hf_mixtral():
    import sys
    from pathlib import Path

    import meshplan as mp
    from meshplan.cluster import Cluster
    sys.path.insert(0, str(Path(__file__).parent))
    import fake_world
    meta = fake_world.hf_model("hf-mixtral", device="meta", seq_len=64)
    plan = mp.plan(meta, Cluster(gpu="cpu", num_gpus=4, gpus_per_node=4), seq_len=64, global_batch=8,
                   fixed={"ep": 2})
    assert plan.layout.ep == 2, plan.layout.short()


def test_traits():
    """Mixtral's experts open EP to the planner; Qwen2-MoE's stay closed (the trait also opens
    tp > 1, which its shared expert next to the routed experts cannot fold)."""
    from meshplan.planner.traits import _ep_experts
    assert _ep_experts(hf_moe_workers.build_model("hf-mixtral"))
    assert not _ep_experts(hf_moe_workers.build_model("hf-qwen2-moe"))
