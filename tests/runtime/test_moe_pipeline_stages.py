"""tiny-moe at pp=4 on 4 gloo ranks, trained as the training loop does, vs one device.

tiny-moe has 4 layers, the first dense (dense_layers=1): at pp=4 stage 0 holds no routed layer
and stages 1-3 one MoE layer each. The loop's MoE balancer (`meshplan.train.loop._balancer`)
gathers the step's routing statistics over the pipeline ranks in `finish_step`; it used to be
inactive on stage 0, which then skipped that gather and started the next step while the routed
stages waited in it: `meshplan train --model tiny-moe --fix pp=4` hung in step 2 until the
collective timeout, and rank 0 died with gloo's "Connection closed by peer".

Three steps (balancer begin_step, forward_backward, AdamW step, finish_step, as the loop runs
them): the loss and every gradient of each step, the routing statistics of every routed layer
and the weights at the end must match the single-device model fed the same micro-batches
(tolerances: numerics.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

import moe_workers
import numerics

SEQ, BATCH, STEPS = 32, 8, 3
FIXED = (("mbs", 2), ("pp", 4), ("schedule", "1f1b"), ("vp", 1))     # 4 micro-batches of 2


def train_pipeline_stages(rank: int, world: int, plan) -> dict:
    from meshplan.runtime import parallelize
    from meshplan.runtime.expert_parallel import _routing_layers
    from meshplan.train.loop import _balancer
    model = numerics.build_model("tiny-moe", seq_len=SEQ)
    ref = copy.deepcopy(model)
    pm = parallelize(model, plan, compute_dtype=None)
    balancer = _balancer(pm)            # the loop's own: None where the step's gather is skipped
    out = {"routed": [fqn for fqn, _ in _routing_layers(pm.stages)], "balancer": balancer is not None,
           "losses": [], "max_grad_err": 0.0}
    assert balancer is not None, f"rank {rank} has no MoE balancer: it would skip finish_step's gather over pp"
    opt = torch.optim.AdamW(pm.parameters(), lr=numerics.LR, eps=numerics.EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=numerics.LR, eps=numerics.EPS)
    x, y = numerics.batch(BATCH, SEQ)
    for step in range(1, STEPS + 1):
        balancer.begin_step()
        loss = pm.forward_backward(x, y)
        grads = pm.full_grads()
        opt.step()
        pm.zero_grad()
        stats = balancer.finish_step()
        with torch.no_grad():           # no autograd: the routed layers record no statistics
            ref_loss = float(numerics.reference_loss(ref, x, y))
        ref_grads, ref_stats, _ = moe_workers.reference(ref, plan, x, y)
        ref_opt.step()
        ref.zero_grad()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step} loss: {m}")
        assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], **numerics.GRAD_TOL,
                                       msg=lambda m, n=n: f"step {step} grad {n}: {m}")
        # every stage's routed layers, gathered over pp on every rank
        assert stats["layers"].keys() == ref_stats["layers"].keys(), (step, sorted(stats["layers"]))
        for fqn, s in ref_stats["layers"].items():
            assert stats["layers"][fqn]["tokens_per_expert"] == s["tokens_per_expert"], (step, fqn)
        out["losses"].append(loss)
        out["max_grad_err"] = max(out["max_grad_err"],
                                  max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads))
    params, ref_params = pm.full_state_dict(), ref.state_dict()
    for n in ref_params:
        torch.testing.assert_close(params[n], ref_params[n], **numerics.PARAM_TOL,
                                   msg=lambda m, n=n: f"param {n} after {STEPS} steps: {m}")
    return out


@pytest.fixture(scope="module")
def world4():
    from meshplan.train.spawn import run_ranks
    plan = numerics.plan_for("tiny-moe", 4, FIXED, SEQ, BATCH)
    # a rank that skips a collective leaves the others waiting: a short collective timeout makes
    # that a failure within a minute instead of a long hang
    return plan, run_ranks(4, train_pipeline_stages, plan, timeout_s=60)


def test_plan_is_pp4_with_a_stage_without_routed_layers(world4):
    plan, results = world4
    lay = plan.layout
    assert (lay.pp, lay.tp, lay.dp, lay.schedule, plan.num_microbatches) == (4, 1, 1, "1f1b", 4)
    assert [r["routed"] for r in results] == [[], ["layers.1.feed_forward"], ["layers.2.feed_forward"],
                                              ["layers.3.feed_forward"]]
    assert all(r["balancer"] for r in results)


def test_three_steps_match_single_device(world4):
    _, results = world4
    losses = results[0]["losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    assert all(r["losses"] == losses for r in results)      # the global loss, on every rank
    assert results[0]["max_grad_err"] < 1e-4
