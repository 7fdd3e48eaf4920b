"""Run `parallelize` for a real plan at its real world size in one process (torch's fake process
group: collectives are no-ops, the model stays on the meta device), and count what one rank holds."""

from __future__ import annotations

import torch
import torch.distributed as dist


def local_state(model, plan, rank: int) -> dict:
    """Parameters this rank holds after `parallelize` (elements), and its pipeline rank."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshplan.runtime.parallel import parallelize
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        pm = parallelize(model, plan, materialize=False)
        held = 0
        for st in pm.stages:
            for p in st.parameters():
                held += (p.to_local() if hasattr(p, "to_local") else p).numel()
        pp_rank = pm.mesh["pp"].get_local_rank()
    finally:
        dist.destroy_process_group()
    return {"params": held, "pp_rank": pp_rank}


def predicted_optimizer_bytes(plan, pp_rank: int) -> float:
    """The cost model's optimizer state (fp32 master + Adam moments) on pipeline rank `pp_rank`."""
    return plan.estimate["memory_by_stage"][pp_rank]["optimizer"] * 2**30


def optimizer_bytes_per_param(plan) -> int:
    return 4 + 2 * (2 if plan.layout.get("optimizer_dtype", "fp32") == "bf16" else 4)


def check(model_name: str, cluster, *, seq_len: int, global_batch: int, ranks=(0, -1), fixed=None,
          tol: float = 0.05) -> list[dict]:
    import meshplan as mp
    model = mp.models.build(model_name, device="meta")
    plan = mp.plan(model, cluster, seq_len=seq_len, global_batch=global_batch, fixed=fixed)
    out = []
    for r in ranks:
        rank = r % plan.world_size
        got = local_state(mp.models.build(model_name, device="meta"), plan, rank)
        runtime = got["params"] * optimizer_bytes_per_param(plan)
        predicted = predicted_optimizer_bytes(plan, got["pp_rank"])
        out.append(dict(model=model_name, world=plan.world_size, layout=mp.Layout.from_dict(plan.layout).short(),
                        rank=rank, runtime_gb=runtime / 1e9, predicted_gb=predicted / 1e9,
                        error=abs(runtime - predicted) / predicted))
    return out
