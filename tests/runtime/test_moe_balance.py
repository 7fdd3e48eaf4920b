"""MoE load balancing on 4 ranks (EP2 x EDP2, two micro-batches per rank) vs one device.

The global auxiliary loss (counts all-reduced over the data-parallel ranks and accumulated over
micro-batches), the router z-loss and the DeepSeek-V3 expert-bias update must give the
single-device gradients, statistics and biases (see moe_workers.py). One spawned group of 4
ranks (`world4`) runs the three cases (ZeRO-3, recompute, PP 1F1B); each test reads its case.
"""

from __future__ import annotations

import pytest

import moe_workers
from worlds import planning_model, plans

CASES_4 = {
    "ep2_edp2_zero3_m2": dict(ep=2, dp=4, tp=1, cp=1, pp=1, zero=3, mbs=1),
    # recomputation replays each micro-batch's global constants (no collective in backward)
    "ep2_edp2_recompute_m2": dict(ep=2, dp=4, tp=1, cp=1, pp=1, zero=1, mbs=1, recompute="full"),
    # the statistics of the two pipeline stages' layers are gathered over pp
    "ep2_pp2_1f1b_m4": dict(ep=2, dp=2, pp=2, vp=1, schedule="1f1b", tp=1, cp=1, mbs=1),
}


@plans
def _plan(world: int, fixed_items: tuple):
    import meshplan as mp
    from meshplan.cluster import Cluster
    model = planning_model(("moe_workers.build_model", "meta"), lambda: moe_workers.build_model(device="meta"))
    return mp.plan(model, Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world), seq_len=moe_workers.SEQ,
                   global_batch=moe_workers.BATCH, fixed=dict(fixed_items))


@pytest.fixture(scope="module")
def world4():
    from meshplan.train.spawn import run_ranks
    cases = {name: dict(plan=_plan(4, tuple(sorted(f.items())))) for name, f in CASES_4.items()}
    results = run_ranks(4, moe_workers.run_cases, cases, timeout_s=240)
    return {name: [r[name] for r in results] for name in cases}


@pytest.mark.parametrize("name", sorted(CASES_4))
def test_global_aux_loss_and_expert_bias_match_single_device(world4, name):
    results = world4[name]
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r['error']}\n{r.get('tb', '')}"
    r = results[0]
    assert r["microbatches"] == (4 if "pp2" in name else 2)
    assert r["router_grad_change"] > 1e-4          # the balancing losses reach the router
    assert r["aux_loss"] >= 1.0 - 1e-6 and r["z_loss"] > 0
    assert all(b == results[0]["bias"] for b in (x["bias"] for x in results))
    assert any(v != 0 for bias in r["bias"].values() for v in bias)
