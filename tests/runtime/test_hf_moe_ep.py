"""Expert parallelism for transformers MoE models (Mixtral, Qwen2-MoE) on gloo (CPU).

Their experts modules (gate_up_proj / down_proj stacked over E, forward(hidden_states,
top_k_index, top_k_weights)) are adapted by structure (meshplan/runtime/hf_experts.py), and split
over ETP too (gate and up halves each). Each whole-model case parallelises a tiny model with a
plan of a fixed layout (ep=2 x dp=2 on 2 ranks; TP / ETP folding on 4), runs one global batch
forward and backward and one AdamW step, and compares loss, every full gradient, the gradient norm
and every weight with the single-device model (numerics.py's tolerances). One spawned group per
world size runs every case of that size (starting ranks costs seconds): 2 ranks (`world2`: EP2
x DP2 for both models, the experts module alone) and 4 ranks (`world4`: ETP, TP folding with and
without SP); each test reads its case's result.
"""

from __future__ import annotations

import hf_moe_workers
import pytest

from worlds import planning_model, plans

CASES = {
    "mixtral_ep2_zero3": ("hf-mixtral", dict(ep=2, dp=2, tp=1, cp=1, pp=1, zero=3, mbs=2)),
    "mixtral_ep2_zero1_accum2": ("hf-mixtral", dict(ep=2, dp=2, tp=1, cp=1, pp=1, zero=1, mbs=2)),
    "qwen2_moe_ep2_zero3": ("hf-qwen2-moe", dict(ep=2, dp=2, tp=1, cp=1, pp=1, zero=3, mbs=4)),
}
# 4 ranks: tensor parallelism folding the MoE layers, expert tensor parallelism
CASES_4 = {
    # each expert's inner features over 2 ETP ranks (gate and up halves split alike)
    "mixtral_ep2_etp2_zero3": ("hf-mixtral", dict(ep=2, etp=2, dp=4, tp=1, cp=1, pp=1, zero=3, mbs=1)),
    "qwen2_moe_ep2_etp2": ("hf-qwen2-moe", dict(ep=2, etp=2, dp=4, tp=1, cp=1, pp=1, zero=1, mbs=1)),
    # Qwen2-MoE's shared expert (and its gate) placed "replicate" (fold_shared_roles): whole on
    # every TP rank, run on the rank's sequence shard, gradients summed over TP
    "qwen2_moe_tp2_ep2_sp_zero3": ("hf-qwen2-moe", dict(tp=2, sp=True, ep=2, dp=2, cp=1, pp=1, zero=3, mbs=2)),
    "qwen2_moe_tp2_ep2_nosp": ("hf-qwen2-moe", dict(tp=2, sp=False, ep=2, dp=2, cp=1, pp=1, zero=1, mbs=2)),
    # Mixtral (router and experts only) under TP with EP and ETP over the TP ranks
    "mixtral_tp2_ep2_etp2_sp": ("hf-mixtral", dict(tp=2, sp=True, ep=2, etp=2, dp=2, cp=1, pp=1, zero=1, mbs=2)),
}


def _cluster(world: int):
    from meshplan.cluster import Cluster
    return Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world)


@plans
def _plan(kind: str, world: int, fixed_items: tuple):
    import meshplan as mp
    from meshplan.profiling.traits import fold_shared_roles
    fixed = dict(fixed_items)
    model = planning_model(("hf_moe_workers.build_model", kind), lambda: hf_moe_workers.build_model(kind))
    if kind == "hf-qwen2-moe" and fixed.get("tp", 1) > 1:
        # its shared expert (and gate) placed "replicate": the profile with role "shared_folded"
        model = fold_shared_roles(mp.profile(model, seq_len=hf_moe_workers.SEQ), model)
    return mp.plan(model, _cluster(world), seq_len=hf_moe_workers.SEQ, global_batch=hf_moe_workers.BATCH,
                   fixed=fixed)


def _run(world: int, table: dict, extra: dict | None = None) -> dict:
    from meshplan.train.spawn import run_ranks
    _plan.prefetch([(kind, world, tuple(sorted(fixed.items()))) for kind, fixed in table.values()])
    cases = {name: dict(model=kind, plan=_plan(kind, world, tuple(sorted(fixed.items()))))
             for name, (kind, fixed) in table.items()}
    cases.update(extra or {})
    results = run_ranks(world, hf_moe_workers.run_cases, cases, timeout_s=300)
    return {name: [r[name] for r in results] for name in cases}


@pytest.fixture(scope="module")
def world2():
    return _run(2, CASES, {"experts_alone": dict(kind="experts")})


@pytest.fixture(scope="module")
def world4():
    return _run(4, CASES_4)


def _ok(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r['error']}\n{r.get('tb', '')}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_single_device(world2, name):
    _ok(world2[name])
    r0 = world2[name][0]
    assert {r["loss"] for r in world2[name]} == {r0["loss"]}, "ranks disagree on the loss"
    assert r0["local_experts"] and all(s[0] == 2 for s in r0["local_experts"].values()), r0["local_experts"]


@pytest.mark.parametrize("name", sorted(CASES_4))
def test_tp_and_etp_match_single_device(world4, name):
    _ok(world4[name])
    fixed = CASES_4[name][1]
    r0 = world4[name][0]
    assert {r["loss"] for r in world4[name]} == {r0["loss"]}, "ranks disagree on the loss"
    # gate_up_proj (4 experts, 2 x 32 inner rows, hidden 64): experts over ep, rows over etp
    # (FSDP may cut the experts again over edp)
    want = (64 // fixed.get("etp", 1), 64)
    assert all(s[1:] == want for s in r0["local_experts"].values()), r0["local_experts"]
    if fixed["tp"] > 1 and CASES_4[name][0] == "hf-qwen2-moe":
        assert r0["shared_whole"], "the shared expert should be whole on every rank (replicated over TP)"


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
    """Both models' experts open EP and ETP to the planner, and TP: Qwen2-MoE's shared expert (no
    routed(x) beside it) once its profile places it "replicate" (fold_shared_roles)."""
    import meshplan as mp
    from meshplan.ir.layout import Layout
    from meshplan.planner.build import placements_for
    from meshplan.profiling.traits import _ep_experts, _moe_tp_fold, fold_shared_roles
    mixtral, qwen = (hf_moe_workers.build_model(k) for k in ("hf-mixtral", "hf-qwen2-moe"))
    assert _ep_experts(mixtral) and _ep_experts(qwen)
    assert _moe_tp_fold(mp.profile(mixtral, seq_len=hf_moe_workers.SEQ), mixtral)
    folded = fold_shared_roles(mp.profile(qwen, seq_len=hf_moe_workers.SEQ), qwen)
    assert _moe_tp_fold(folded, qwen) and fold_shared_roles(folded, qwen) is folded
    roles = {li.name: li.role for li in folded.blocks[0].linears}
    assert roles["mlp.shared_expert.down_proj"] == roles["mlp.shared_expert_gate"] == "shared_folded", roles
    labels = placements_for(folded, Layout(tp=2, ep=2, dp=1))
    shared = {k: v for k, v in labels.items() if ".mlp.shared_expert" in k}
    assert len(shared) == 2 * 4 and set(shared.values()) == {"replicate"}, shared
    assert labels["model.layers.0.self_attn.q_proj"] == "colwise"
