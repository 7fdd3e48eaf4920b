"""Workers for tests/runtime/test_mtp_parallel.py (imported by spawned ranks).

Each case parallelises tiny-llama with one multi-token-prediction depth by a Plan made by
`meshplan.plan`, runs one step and compares it with the single-device model trained on the
objective of meshplan.models.mtp (numerics.py's tolerances: loss, every full gradient, every
parameter after AdamW).
"""

from __future__ import annotations

import copy

import numerics
import torch

from worlds import each_case

MTP = dict(layers=2, mtp_depth=1, mtp_loss_weight=0.3)


def build(seq_len: int):
    from meshplan import models
    torch.manual_seed(1234)
    return models.build("tiny-llama", seq_len=seq_len, device="cpu", **MTP)


def _step(case: dict) -> dict:
    from meshplan.models.mtp import mtp_causal_lm_loss
    from meshplan.runtime import parallelize
    model = build(case["seq_len"])
    ref = copy.deepcopy(model)
    x, y = numerics.batch(case["global_batch"], case["seq_len"])
    pm = parallelize(model, case["plan"], compute_dtype=None, fused_kernels=True)
    loss = pm.forward_backward(x, y)
    grads = pm.full_grads()
    torch.optim.AdamW(pm.parameters(), lr=numerics.LR, eps=numerics.EPS).step()
    params = pm.full_state_dict()
    ref_loss = mtp_causal_lm_loss(ref(x), y, ref.config)
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    torch.optim.AdamW(ref.parameters(), lr=numerics.LR, eps=numerics.EPS).step()
    ref_params = {n: p.detach().clone() for n, p in ref.state_dict().items()}
    numerics.assert_matches_reference(loss, grads, params, float(ref_loss), ref_grads, ref_params)
    shard = pm.vocab_shard
    return {"loss": loss, "vocab_shard": None if shard is None else (shard.start, shard.width),
            "data_parallel": pm.data_parallel}


def run_cases(rank: int, world: int, cases: dict) -> dict:
    return each_case(rank, cases, lambda name, case: _step(case))
