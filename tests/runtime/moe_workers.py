"""Workers for the MoE load-balancing tests (imported by spawned ranks; see test_moe_balance.py).

`balance`: one training step of a tiny MoE with the global auxiliary loss, the router z-loss and
the aux-loss-free expert bias, on the plan's ranks (EP x DP, micro-batches), against the same
model on one device fed the same global micro-batches: every gradient, the global routing
counts, the aux / z loss values and the updated expert biases must agree.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import ep_workers
import numerics

SEQ, BATCH = ep_workers.SEQ, ep_workers.BATCH
BALANCE = dict(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.05, moe_expert_bias=True, moe_bias_update_rate=0.01)


def build_model(*, device: str = "cpu", **options):
    from meshplan import models
    torch.manual_seed(1234)
    model = models.build("moe", seq_len=SEQ, device=device, **ep_workers.MOE, **{**BALANCE, **options})
    if device != "meta":
        model.init_weights()
    return model


def _microbatches(plan, x, y):
    """The global micro-batches: micro-batch i gathers micro-batch i of every data-parallel rank."""
    dp, m = plan.mesh.get("dp", 1), plan.num_microbatches
    n = x.shape[0] // dp
    rows = [[r * n + i * (n // m) + j for r in range(dp) for j in range(n // m)] for i in range(m)]
    return [(x[r], y[r]) for r in rows]


def reference(model, plan, x, y, *, losses: bool = True):
    """Single device: the global micro-batches in turn, gradients summed, then the bias update."""
    from meshplan.runtime.expert_parallel import _routing_layers, summarize_routing
    from meshplan.runtime.pipeline import logits_of
    layers = _routing_layers([model])
    for _, m in layers:
        m.num_microbatches = plan.num_microbatches
        m.window.reset()
        if not losses:
            m.aux_loss_coeff = m.z_loss_coeff = 0.0
    denom = float((y != -100).sum())
    for xm, ym in _microbatches(plan, x, y):
        logits = logits_of(model(xm))
        (F.cross_entropy(logits.flatten(0, -2).float(), ym.flatten(), ignore_index=-100, reduction="sum")
         / denom).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for _, m in layers:
        m.update_expert_bias()
    stats = summarize_routing({fqn: m.step_stats() for fqn, m in layers})
    return grads, stats, {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}


def balance(rank: int, world: int, case: dict) -> dict:
    from meshplan.runtime import parallelize
    from meshplan.runtime.expert_parallel import MoEBalancer
    model = build_model()
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    x, y = numerics.batch(BATCH, SEQ)
    plan = case["plan"]
    pm = parallelize(model, plan, compute_dtype=None)
    balancer = MoEBalancer(pm)
    balancer.begin_step()
    pm.forward_backward(x, y)
    grads = pm.full_grads()
    stats = balancer.finish_step()
    state = pm.full_state_dict()
    ref_grads, ref_stats, ref_bias = reference(ref, plan, x, y)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **numerics.GRAD_TOL, msg=lambda m, n=n: f"grad {n}: {m}")
    assert stats["layers"].keys() == ref_stats["layers"].keys()
    for fqn, s in ref_stats["layers"].items():
        assert stats["layers"][fqn]["tokens_per_expert"] == s["tokens_per_expert"], fqn
        for key in ("aux_loss", "z_loss", "imbalance"):
            torch.testing.assert_close(stats["layers"][fqn][key], s[key], rtol=1e-5, atol=1e-7)
    for n, b in ref_bias.items():
        assert state[n].dtype == torch.float32
        torch.testing.assert_close(state[n], b, rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
    # the losses do change the gradients (the comparison above is not vacuous)
    plain_grads, _, _ = reference(plain, plan, x, y, losses=False)
    router = [n for n in ref_grads if n.endswith("router.weight")]
    changed = max(float((ref_grads[n] - plain_grads[n]).abs().max()) for n in router)
    return {"aux_loss": stats["aux_loss"], "z_loss": stats["z_loss"], "imbalance": stats["imbalance"],
            "router_grad_change": changed, "bias": {n: b.tolist() for n, b in ref_bias.items()},
            "microbatches": plan.num_microbatches}


def run_cases(rank: int, world: int, cases: dict) -> dict:
    return ep_workers.each_case(rank, cases, lambda name, case: balance(rank, world, case))
