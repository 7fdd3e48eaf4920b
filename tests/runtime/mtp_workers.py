"""Workers for tests/runtime/test_mtp_parallel.py (imported by spawned ranks).

Each case parallelises a model with one multi-token-prediction depth (tiny-llama, or a small
MoE whose MTP block is a MoE block, as DeepSeek-V3's) by a Plan made by `meshplan.plan`, runs one step and compares it with the single-device model trained on the
objective of meshplan.models.mtp (numerics.py's tolerances: loss, every full gradient, every
parameter after AdamW).
"""

from __future__ import annotations

import copy

import numerics
import torch

from worlds import each_case, planning_model, plans

MTP = dict(layers=2, mtp_depth=1, mtp_loss_weight=0.3)
# a small DeepSeek-V3-like MoE (every layer routed, a shared expert, multi-head latent attention):
# its MTP block is a MoE block with latent attention
MOE = dict(MTP, hidden=64, ffn_hidden=128, heads=4, kv_heads=None, vocab=256, experts=4, topk=2, moe_ffn_hidden=32,
           shared_experts=1, attention="mla", q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16)
MODELS = {"llama": ("tiny-llama", MTP), "moe": ("moe", MOE)}


def build(seq_len: int, kind: str = "llama", device: str = "cpu"):
    from meshplan import models
    torch.manual_seed(1234)
    name, overrides = MODELS[kind]
    return models.build(name, seq_len=seq_len, device=device, **overrides)


@plans
def plan_for(kind: str, world: int, fixed_items: tuple, seq_len: int, global_batch: int):
    """meshplan's plan for the MTP model `kind` on `world` CPU processes, the layout fixed by
    `fixed_items` (cached; `plan_for.prefetch` makes several at once)."""
    import meshplan as mp
    from meshplan.cluster import Cluster
    model = planning_model(("mtp", kind, seq_len), lambda: build(seq_len, kind, device="meta"))
    return mp.plan(model, Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world), seq_len=seq_len,
                   global_batch=global_batch, fixed=dict(fixed_items))


def _step(case: dict) -> dict:
    from meshplan.models.mtp import mtp_causal_lm_loss
    from meshplan.runtime import parallelize
    model = build(case["seq_len"], case.get("kind", "llama"))
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
    numerics.assert_matches_reference(loss, grads, params, float(ref_loss.detach()), ref_grads, ref_params)
    shard = pm.vocab_shard
    return {"loss": loss, "vocab_shard": None if shard is None else (shard.start, shard.width),
            "data_parallel": pm.data_parallel, "blocks": list(pm.plan.blocks),
            "mtp_own": {m: pm.plan.placements.get(f"mtp.0.{m}") for m in ("hnorm", "enorm", "proj", "norm")},
            "experts": [e for stage in pm.expert_modules for e in stage]}


def run_cases(rank: int, world: int, cases: dict) -> dict:
    return each_case(rank, cases, lambda name, case: _step(case))
