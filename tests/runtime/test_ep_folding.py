"""MoE parallel folding in the runtime (gloo, CPU): experts over their own EP x ETP x EDP groups
folded over the dense layers' TP x CP x DP ranks (runtime/mesh.py, runtime/moe_folding.py).

Each case parallelises a tiny MoE with a Plan made by `meshplan.plan` (the layout fixed by the
test), runs one global batch forward and backward, measures the global gradient norm, takes one
AdamW step and compares loss, every full gradient, the norm and every parameter with the
single-device model (ep_workers.equivalence; tolerances: numerics.py). Cases that share a world
size run in one spawned process group (starting ranks costs seconds): 2 ranks (`world2`: the
folded layouts on 2 ranks, global load balancing over folded ranks, DCP reshards between folded
layouts, deferred initialisation with folded experts) and 4 ranks (`world4`). The layouts that
need 8 ranks (CASES_8: EP x TP x PP with data parallelism, fewer local experts than
expert-data-parallel ranks, and everything folded at once) run in the suite's one group of 8
ranks, with the dense 8-rank case: test_parallel_numerics_8.py's `world8` and
`test_eight_ranks_moe_folding`. The 2- and 4-rank cases with shared experts run the dense layer
and two MoE layers ("moe-shared-3l", ep_workers.CONFIGS): folding shards each MoE layer the same
way, so a third would repeat the check.
"""

from __future__ import annotations

import pytest

import ep_workers
import moe_workers
import numerics
from test_expert_parallel import _cases, _ok, _plan, _run
from worlds import planning_model, plans, prefetch

# name -> (model, fixed layout); the world size is tp * cp * pp * dp
CASES_2 = {
    # TP on a MoE model without EP: each TP rank routes its own sequence shard to replicated
    # experts; no data parallelism, so the runtime sums the experts' gradients over edp = tp itself
    "tp2_sp_ep1": ("moe-shared-3l", dict(tp=2, sp=True, ep=1, dp=1, cp=1, pp=1, mbs=4)),
    # EP over the two TP ranks (edp = 1), shared experts tensor-parallel
    "ep2_tp2_sp": ("moe-shared-3l", dict(tp=2, sp=True, ep=2, dp=1, cp=1, pp=1, mbs=4)),
    # without SP the whole input is cut to this rank's shard and the routed output all-gathered
    "ep2_tp2_nosp": ("moe", dict(tp=2, sp=False, ep=2, dp=1, cp=1, pp=1, mbs=4)),
    # EP over the two CP ranks, which hold other tokens of every sequence
    "ep2_cp2": ("moe", dict(cp=2, ep=2, dp=1, tp=1, pp=1, mbs=4)),
    # recompute re-runs the folded layer (cut, dispatch, ETP gathers) in backward on every rank
    "ep2_tp2_sp_recompute_full": ("moe", dict(tp=2, sp=True, ep=2, dp=1, cp=1, pp=1, mbs=4, recompute="full")),
    "etp2_tp2_sp_recompute_full": ("moe", dict(tp=2, sp=True, etp=2, ep=1, dp=1, cp=1, pp=1, mbs=4,
                                               recompute="full")),
    # ETP alone: each expert's inner features split over the two data-parallel ranks
    "etp2_dp2_zero3": ("moe-shared-3l", dict(etp=2, ep=1, dp=2, tp=1, cp=1, pp=1, zero=3, mbs=2)),
    # ETP over the TP ranks (what Megatron calls expert-tensor-parallel = tp)
    "etp2_tp2_sp": ("moe", dict(etp=2, tp=2, sp=True, ep=1, dp=1, cp=1, pp=1, mbs=4)),
}
CASES_4 = {
    # EP x CP: an EP group spans the CP ranks, expert gradients reduced over edp = dp
    "ep2_cp2_dp2_zero3": ("moe-shared-3l", dict(cp=2, ep=2, dp=2, tp=1, pp=1, zero=3, mbs=2)),
    # EP x CP with the EP group inside dp x cp: ep = 4 over 2 dp x 2 cp ranks
    "ep4_cp2_dp2": ("moe", dict(cp=2, ep=4, dp=2, tp=1, pp=1, zero=1, mbs=2)),
    # EP x TP x DP with SP: FSDP over dp for dense weights, over edp = 2 for experts
    "ep2_tp2_dp2_sp_zero3": ("moe-shared-3l", dict(tp=2, sp=True, ep=2, dp=2, cp=1, pp=1, zero=3, mbs=2)),
    # no shared experts: the MoE layer gets its input gathered by the norm, returns a sequence shard
    "ep2_tp2_dp2_sp_zero1": ("moe", dict(tp=2, sp=True, ep=2, dp=2, cp=1, pp=1, zero=1, mbs=2)),
    "ep4_tp2_dp2_nosp": ("moe-shared-3l", dict(tp=2, sp=False, ep=4, dp=2, cp=1, pp=1, zero=3, mbs=2)),
    # EP x TP x CP: tokens differ over every one of the four ranks
    "ep2_tp2_cp2_sp": ("moe-shared-3l", dict(tp=2, sp=True, cp=2, ep=2, dp=1, pp=1, zero=3, mbs=4)),
    # HSDP for the dense weights (shard inside groups, replicate across), experts fully sharded
    # over edp (what the cost model prices)
    "ep2_dp4_hsdp2": ("moe-shared-3l", dict(ep=2, dp=4, tp=1, cp=1, pp=1, zero=3, fsdp_shard=2, mbs=1)),
    "ep2_tp2_dp2_hsdp1": ("moe", dict(ep=2, dp=2, tp=2, cp=1, pp=1, zero=3, fsdp_shard=1, mbs=2)),
    # EP x ETP: experts over 2 EP ranks, each expert's inner features over 2 ETP ranks
    "ep2_etp2_dp4_zero3": ("moe-shared-3l", dict(ep=2, etp=2, dp=4, tp=1, cp=1, pp=1, zero=3, mbs=1)),
    "ep2_etp2_tp2_dp2_sp_zero1": ("moe", dict(ep=2, etp=2, tp=2, sp=True, dp=2, cp=1, pp=1, zero=1, mbs=2)),
}

# run by test_parallel_numerics_8.py (test_eight_ranks_moe_folding), in its group of 8 ranks
CASES_8 = {
    # EP x TP x PP: each pipeline stage folds its own dp x tp ranks (SP residual across stages);
    # 2 micro-batches a data-parallel rank run every phase of 1F1B on the first stage
    "ep2_tp2_pp2_dp2_sp": ("moe-shared", dict(tp=2, sp=True, ep=2, pp=2, vp=1, schedule="1f1b", dp=2, cp=1,
                                              zero=1, mbs=2)),
    # fewer local experts (4 / ep4 = 1) than edp ranks (2): FSDP shards the experts on another dim
    "ep4_edp2_tp2_dp4_sp_zero3": ("moe", dict(tp=2, sp=True, ep=4, dp=4, cp=1, pp=1, zero=3, mbs=1)),
    # everything folded at once: dense TP2 x CP2 x DP2, experts EP2 x ETP2 x EDP2
    "ep2_etp2_tp2_cp2_dp2_sp_zero3": ("moe-shared", dict(tp=2, sp=True, cp=2, dp=2, ep=2, etp=2, pp=1,
                                                         zero=3, mbs=2)),
}

# load balancing with folded experts: the routing statistics are global over dp x cp x tp
BALANCE_2 = {
    "balance_ep2_tp2_sp": dict(tp=2, sp=True, ep=2, dp=1, cp=1, pp=1, mbs=4),
    "balance_ep2_cp2": dict(cp=2, ep=2, dp=1, tp=1, pp=1, mbs=4),
}


@plans
def _balance_plan(world: int, fixed_items: tuple):
    import meshplan as mp
    from meshplan.cluster import Cluster
    model = planning_model(("moe_workers.build_model", "meta"), lambda: moe_workers.build_model(device="meta"))
    return mp.plan(model, Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world),
                   seq_len=moe_workers.SEQ, global_batch=moe_workers.BATCH, fixed=dict(fixed_items))


@pytest.fixture(scope="module")
def world2():
    spec = lambda **kw: ("moe", 2, tuple(sorted(dict(pp=1, mbs=4, **kw).items())))  # noqa: E731
    reshards = [spec(ep=2, tp=2, sp=True, dp=1, cp=1), spec(etp=2, ep=1, tp=1, dp=2, cp=1, zero=3),
                spec(etp=2, ep=1, tp=2, sp=True, dp=1, cp=1), spec(ep=2, cp=2, tp=1, dp=1, zero=1)]
    # every plan of this world, made two at a time
    prefetch([(_plan, (kind, 2, tuple(sorted(fixed.items())))) for kind, fixed in CASES_2.values()]
             + [(_plan, s) for s in reshards]
             + [(_balance_plan, (2, tuple(sorted(fixed.items())))) for fixed in BALANCE_2.values()]
             + [(numerics.plan_for, ("tiny-moe", 2, fixed, *DEFERRED_SHAPE)) for fixed in DEFERRED])
    cases = _cases(CASES_2, 2)
    for name, fixed in BALANCE_2.items():
        cases[name] = dict(kind="balance", plan=_balance_plan(2, tuple(sorted(fixed.items()))))
    moe = lambda **kw: _plan(*spec(**kw))  # noqa: E731
    # DCP moves folded experts (and the TP-replicated router) between layouts, both ways
    cases["reshard_ep2_tp2_to_etp2_dp2"] = dict(kind="reshard", model="moe",
                                                save=moe(ep=2, tp=2, sp=True, dp=1, cp=1),
                                                load=moe(etp=2, ep=1, tp=1, dp=2, cp=1, zero=3))
    cases["reshard_etp2_tp2_to_ep2_cp2"] = dict(kind="reshard", model="moe",
                                                save=moe(etp=2, ep=1, tp=2, sp=True, dp=1, cp=1),
                                                load=moe(ep=2, cp=2, tp=1, dp=1, zero=1))
    # a meta model with folded experts: test_deferred_init_with_folded_experts
    for i, fixed in enumerate(DEFERRED):
        cases[f"deferred_fixed{i}"] = dict(kind="deferred", model="tiny-moe",
                                           plan=numerics.plan_for("tiny-moe", 2, fixed, *DEFERRED_SHAPE),
                                           seq_len=DEFERRED_SHAPE[0], batch=DEFERRED_SHAPE[1], seed=DEFERRED_SEED)
    return _run(2, cases)


def _agreed(results):
    """Rank 0's result, after checking every rank succeeded and all computed the same loss."""
    _ok(results)
    assert {r["loss"] for r in results} == {results[0]["loss"]}, "ranks disagree on the loss"
    return results[0]


@pytest.fixture(scope="module")
def world4():
    return _run(4, _cases(CASES_4, 4))


@pytest.mark.parametrize("name", sorted(CASES_2))
def test_two_ranks(world2, name):
    r0 = _agreed(world2[name])
    fixed = CASES_2[name][1]
    # 4 experts over ep; FSDP (dp*cp > 1) cuts the leading dim again over edp = dp*cp*tp / (ep*etp)
    edp = fixed["dp"] * fixed["cp"] * fixed["tp"] // (fixed["ep"] * fixed.get("etp", 1))
    want = 4 // fixed["ep"] // (edp if fixed["dp"] * fixed["cp"] > 1 else 1)
    assert all(shape[0] == want for shape in r0["local_experts"].values()), r0["local_experts"]


def test_checkpoint_reshards_between_folded_layouts(world2):
    for name in ("reshard_ep2_tp2_to_etp2_dp2", "reshard_etp2_tp2_to_ep2_cp2"):
        _ok(world2[name])


@pytest.mark.parametrize("name", sorted(BALANCE_2))
def test_global_balancing_over_folded_ranks(world2, name):
    _ok(world2[name])
    r = world2[name][0]
    assert r["microbatches"] == 2 and r["router_grad_change"] > 1e-4
    assert all(x["bias"] == r["bias"] for x in world2[name])


@pytest.mark.parametrize("name", sorted(CASES_4))
def test_four_ranks(world4, name):
    _agreed(world4[name])


def test_planner_offers_folded_layouts():
    """The planner's search keeps EP with TP and CP now that the runtime runs them."""
    plan = _plan("moe-shared", 4, tuple(sorted(dict(tp=2, ep=2, dp=2, cp=1, pp=1).items())))
    assert (plan.layout.tp, plan.layout.ep) == (2, 2)
    plan = _plan("moe", 4, tuple(sorted(dict(cp=2, ep=2, dp=2, tp=1, pp=1).items())))
    assert (plan.layout.cp, plan.layout.ep) == (2, 2)


def test_etp_with_ddp_is_refused():
    from meshplan.ir.support import runtime_limits
    why = runtime_limits(dict(etp=2, dp=2, zero=0))
    assert any("etp=2" in w and "DDP" in w for w in why), why
    assert runtime_limits(dict(etp=2, ep=2, tp=2, dp=2, zero=1)) == []


def test_tp_view_leaves_moe_layers_to_folding():
    """TP applies the shared experts' placements; router and routed experts are the folding's."""
    from meshplan.runtime.expert_parallel import check_expert_parallel, expert_labelled_params
    from meshplan.runtime.moe_folding import tp_view
    plan = _plan("moe-shared", 4, tuple(sorted(dict(tp=2, ep=2, dp=2, cp=1, pp=1).items())))
    model = ep_workers.build_model("moe-shared", device="meta")
    experts = check_expert_parallel(model, 2, expert_labelled_params(plan.placements))
    view = tp_view(plan, experts).placements
    assert "layers.1.feed_forward.router" not in view
    assert not any(label == "expert" for label in view.values())
    assert view["layers.1.feed_forward.shared_experts.w1"] == "colwise"
    assert view["layers.0.feed_forward.w1"] == "colwise"      # the dense block is untouched


DEFERRED = [(("ep", 2), ("sp", True), ("tp", 2)),
            (("etp", 2), ("sp", True), ("tp", 2))]
DEFERRED_SHAPE, DEFERRED_SEED = (32, 8), 7          # seq_len, batch


@pytest.mark.parametrize("i", range(len(DEFERRED)), ids=[f"fixed{i}" for i in range(len(DEFERRED))])
def test_deferred_init_with_folded_experts(world2, i):
    """A meta model: router replicated over TP and experts split over ep / etp get the single-device
    initialisation, sliced (deferred_workers.deferred_run), and the single-device loss."""
    import torch

    import deferred_workers
    res = world2[f"deferred_fixed{i}"]
    _ok(res)
    seq, batch = DEFERRED_SHAPE
    ref = deferred_workers.reference_model("tiny-moe", seq, DEFERRED_SEED)
    want = ref.state_dict()
    assert set(res[0]["state"]) == set(want)
    for k in want:
        torch.testing.assert_close(res[0]["state"][k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    x, y = numerics.batch(batch, seq)
    torch.testing.assert_close(res[0]["loss"], numerics.reference(ref, x, y)[0], rtol=1e-5, atol=1e-5)
