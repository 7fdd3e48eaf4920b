"""The plan lists the fused MoE router for MoE layers, and the runtime swaps it in where the plan
says (forced here: on CPU "auto" keeps eager, the reference being slower), with the same loss."""

from __future__ import annotations

import pytest
import torch

import meshplan as mp


pytestmark = pytest.mark.usefixtures("one_process_group")     # tests/conftest.py


def test_router_kernel_planned_and_swapped():
    seq, batch = 32, 4
    model = mp.models.build("tiny-moe", seq_len=seq, device="meta")
    plan = mp.plan(model, mp.Cluster(gpu="cpu", num_gpus=1, gpus_per_node=1), seq_len=seq, global_batch=batch)
    routers = [e.module for e in plan.fused_kernels if e.kernel == "moe_router"]
    assert routers and all(r.endswith(".feed_forward") for r in routers), plan.fused_kernels
    ids = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    losses = {}
    for fused in (False, True):
        torch.manual_seed(3)
        pm = mp.parallelize(mp.models.build("tiny-moe", seq_len=seq, device="meta"), plan, compute_dtype=None,
                            fused_kernels=fused)
        if fused:
            moe_layers = [n for n, m in pm.stages[0].named_modules() if hasattr(m, "route_fn")]
            assert moe_layers and set(moe_layers) <= set(pm.fused_modules), (moe_layers, pm.fused_modules)
        losses[fused] = pm.forward_backward(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-5)
