"""Expert parallelism in the runtime (gloo, CPU): dispatch, whole-model numerics, checkpoints, refusals.

Each whole-model case parallelises a tiny MoE with a Plan made by `meshplan.plan` (ep fixed by
the test), runs one global batch forward and backward, measures the global gradient norm, takes
one AdamW step, and compares loss, every full gradient (all E experts under their original
FQNs), the norm and every parameter with the single-device model (tolerances: numerics.py).
Cases that share a world size run in one spawned process group (starting ranks costs seconds):
2 ranks (`world2`: EP2 x DP2 under ZeRO-3, ZeRO-1 and DDP, shared experts, recompute, the
dispatch alone, DCP reshards between ep sizes, bf16 training) and 4 ranks (`world4`: EP with
expert data parallelism at ZeRO-0/1/3, EP x PP 1F1B and zero-bubble V, the dispatch alone over
four ranks). Each test reads its cases' results.
"""

from __future__ import annotations

import pytest

import ep_workers
from worlds import planning_model, plans

SEQ, BATCH = ep_workers.SEQ, ep_workers.BATCH

# name -> (model, fixed layout); the world size is pp * dp
CASES_2 = {
    "ep2_dp2": ("moe", dict(ep=2, dp=2, tp=1, cp=1, pp=1, zero=3, mbs=2)),
    "ep2_dp2_zero1_accum2": ("moe", dict(ep=2, dp=2, tp=1, cp=1, pp=1, zero=1, mbs=2)),
    "ep2_shared_dense": ("moe-shared", dict(ep=2, dp=2, tp=1, cp=1, pp=1, zero=3, mbs=4)),
    # recompute re-runs both all-to-alls in backward, in the same order on every EP rank
    "ep2_recompute_full": ("moe", dict(ep=2, dp=2, tp=1, cp=1, pp=1, zero=3, mbs=2, recompute="full")),
    # zero=0: DDP for the dense weights, the experts' gradients all-reduced over their edp ranks
    "ep2_dp2_zero0_accum2": ("moe", dict(ep=2, dp=2, tp=1, cp=1, pp=1, zero=0, mbs=2)),
}
CASES_4 = {
    "ep2_edp2_zero3": ("moe", dict(ep=2, dp=4, tp=1, cp=1, pp=1, zero=3, mbs=1)),
    "ep2_edp2_zero1": ("moe-shared", dict(ep=2, dp=4, tp=1, cp=1, pp=1, zero=1, mbs=1)),
    "ep2_edp2_zero0": ("moe-shared", dict(ep=2, dp=4, tp=1, cp=1, pp=1, zero=0, mbs=1)),
    # (EP over all four ranks with one expert each - what ep2_dp2 runs over two, on the same path -
    # is left to the dispatch case, which runs the 4-way exchange with uneven and empty experts)
    "ep2_pp2": ("moe-shared", dict(ep=2, dp=2, pp=2, vp=1, schedule="1f1b", tp=1, cp=1, mbs=1)),
    # zero-bubble V: two virtual stages per rank, weight gradients computed apart from input ones
    "ep2_pp2_zbv": ("moe-shared", dict(ep=2, dp=2, pp=2, vp=2, schedule="zbv", tp=1, cp=1, mbs=1)),
}


def _cluster(world: int):
    from meshplan.cluster import Cluster
    return Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world)


@plans
def _plan(kind: str, world: int, fixed_items: tuple, stack: str = "meshplan"):
    import meshplan as mp
    device = "cpu" if kind.startswith("hf") else "meta"
    model = planning_model(("ep_workers.build_model", kind, device),
                           lambda: ep_workers.build_model(kind, device=device))
    return mp.plan(model, _cluster(world), seq_len=SEQ, global_batch=BATCH, fixed=dict(fixed_items),
                   stack=stack)


def _cases(table: dict, world: int, more: tuple = ()) -> dict:
    """The table's cases with their plans (made two at a time, with the plans `more` names)."""
    specs = [(kind, world, tuple(sorted(fixed.items()))) for kind, fixed in table.values()]
    _plan.prefetch(specs + list(more))
    return {name: dict(model=kind, plan=_plan(*spec)) for (name, (kind, _)), spec in zip(table.items(), specs)}


def _run(world: int, cases: dict) -> dict:
    from meshplan.train.spawn import run_ranks
    results = run_ranks(world, ep_workers.run_cases, cases, timeout_s=240)
    return {name: [r[name] for r in results] for name in cases}


def _ok(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r['error']}\n{r.get('tb', '')}"


@pytest.fixture(scope="module")
def world2():
    spec = lambda **kw: ("moe", 2, tuple(sorted(dict(tp=1, cp=1, pp=1, dp=2, mbs=2, **kw).items())))  # noqa: E731
    cases = _cases(CASES_2, 2, [spec(ep=2, zero=3), spec(ep=1, zero=3), spec(ep=1, zero=1)])
    cases["dispatch"] = dict(kind="dispatch")
    moe = lambda **kw: _plan(*spec(**kw))  # noqa: E731
    # DCP reshards experts between ep sizes, both ways
    cases["reshard_ep2_to_ep1"] = dict(kind="reshard", model="moe", save=moe(ep=2, zero=3), load=moe(ep=1, zero=3))
    cases["reshard_ep1_to_ep2"] = dict(kind="reshard", model="moe", save=moe(ep=1, zero=1), load=moe(ep=2, zero=3))
    # the plan's own precision (bf16 parameters and tokens through gloo's all-to-all): loss falls
    cases["train_bf16"] = dict(kind="train", model="moe", plan=moe(ep=2, zero=3))
    return _run(2, cases)


@pytest.fixture(scope="module")
def world4():
    cases = _cases(CASES_4, 4)
    cases["dispatch"] = dict(kind="dispatch")
    return _run(4, cases)


def _data_parallel(table: dict, name: str) -> str:
    return "ddp" if table[name][1]["zero"] == 0 else "fsdp"


@pytest.mark.parametrize("name", sorted(CASES_2))
def test_two_ranks(world2, name):
    _ok(world2[name])
    r0 = world2[name][0]
    assert r0["data_parallel"] == _data_parallel(CASES_2, name)
    assert {r["loss"] for r in world2[name]} == {r0["loss"]}, "ranks disagree on the loss"
    assert all(shape[0] == 2 for shape in r0["local_experts"].values()), r0["local_experts"]   # 4 experts / ep 2


@pytest.mark.parametrize("name", sorted(CASES_4))
def test_four_ranks(world4, name):
    _ok(world4[name])
    r0 = world4[name][0]
    if "zero" in CASES_4[name][1]:
        assert r0["data_parallel"] == _data_parallel(CASES_4, name)
    assert {r["loss"] for r in world4[name]} == {r0["loss"]}, "ranks disagree on the loss"


def test_dispatch_uneven_and_empty_experts(world2, world4):
    """The dispatch alone (no FSDP): forward, input and weight gradients vs the whole module."""
    for res in (world2["dispatch"], world4["dispatch"]):
        _ok(res)
    assert [r["rows"] for r in world2["dispatch"]] == [11, 5]
    assert [r["local_experts"] for r in world4["dispatch"]] == [1, 1, 1, 1]
    assert [r["rows"] for r in world4["dispatch"]] == [11, 5, 4, 0]


def test_checkpoint_reshards_between_ep_sizes(world2):
    for name in ("reshard_ep2_to_ep1", "reshard_ep1_to_ep2"):
        _ok(world2[name])


def test_trains_in_plan_precision(world2):
    runs = world2["train_bf16"]
    _ok(runs)
    losses = runs[0]["losses"]
    assert all(r["losses"] == losses for r in runs), "ranks disagree on the losses"
    assert losses[-1] < losses[0] - 0.5, losses


def test_planner_offers_etp_for_hf_mixtral():
    """transformers' Mixtral experts run under EP and ETP (runtime/hf_experts.py splits each
    expert's gate and up halves; numerics in test_hf_moe_ep.py): the planner returns etp > 1."""
    plan = _plan("hf-mixtral", 2, (("dp", 2), ("ep", 1), ("etp", 2), ("zero", 3)))
    assert (plan.layout.ep, plan.layout.etp) == (1, 2)


def test_experts_not_divisible_by_ep():
    from meshplan.errors import LayoutError
    from meshplan.runtime.expert_parallel import check_expert_parallel
    model = ep_workers.build_model("moe", device="meta")
    assert check_expert_parallel(model, 2) == ["layers.0.feed_forward.experts", "layers.1.feed_forward.experts"]
    with pytest.raises(LayoutError, match=r"4 experts.*ep=3.*\[1, 2, 4\]"):
        check_expert_parallel(model, 3)


def test_mixtral_experts_found_by_structure_without_plan():
    """Structure alone (no plan labels) finds Mixtral's stacked experts."""
    from meshplan.runtime.expert_parallel import find_expert_modules
    assert find_expert_modules(ep_workers.build_model("hf-mixtral")) == [
        "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_dense_model_with_ep_is_refused():
    import meshplan as mp
    from meshplan.errors import LayoutError
    from meshplan.runtime.expert_parallel import check_expert_parallel
    with pytest.raises(LayoutError, match="no routed-experts module"):
        check_expert_parallel(mp.models.build("tiny-llama", device="meta"), 2)


def test_plan_labels_decide_which_modules_are_experts():
    """With the plan's labels, a look-alike module is left alone and a labelled module that breaks
    the contract (experts as a list of Linear layers) is named."""
    import torch
    from torch import nn

    from meshplan.errors import LayoutError
    from meshplan.runtime.expert_parallel import find_expert_modules
    model = nn.Module()
    model.heads = nn.Module()                                  # stacked per-head weights, not experts
    model.heads.a = nn.Parameter(torch.zeros(4, 2, 2))
    model.heads.b = nn.Parameter(torch.zeros(4, 2, 2))
    model.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    assert find_expert_modules(model, {"something.else"}) == []
    with pytest.raises(LayoutError, match=r"module experts\.0 .*not 3-D"):
        find_expert_modules(model, {"experts.0.weight"})
    with pytest.raises(LayoutError, match=r"module heads .*forward"):
        find_expert_modules(model)                            # structure alone: a look-alike is a candidate
