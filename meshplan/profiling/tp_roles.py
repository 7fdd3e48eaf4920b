"""The tensor-parallel placements the runtime gives a block by its linears' data-flow roles
(Megatron's pattern), read by the planner (a Plan's placements where the sharding ILP is not used)
and by the TP probe (the local shapes it tries the model's forward on), so both agree on one rule.

Roles come from the traced graph or the config, never from class names.
"""

from __future__ import annotations

from meshplan.ir.profile import BlockProfile
from meshplan.ir.support import TP_ROLE_PLACEMENT
from meshplan.profiling.traits import packing

__all__ = ["role_placements"]


def role_placements(block: BlockProfile, *, tp: int, ep: int = 1, sp: bool = False) -> dict[str, str]:
    """{path in block: placement} for one block at tensor-parallel degree `tp` (expert-parallel
    degree `ep`, sequence parallelism `sp`). A packed projection (fused QKV, fused gate/up) is
    column-parallel per part (traits.packing). At tp == 1 only routed experts are labelled
    ("expert" where ep > 1)."""
    out: dict[str, str] = {}
    for li in block.linears:
        out[li.name] = (packing(block, li) or TP_ROLE_PLACEMENT.get(li.role, "replicate")) if tp > 1 \
            else ("expert" if li.role.startswith("expert") and ep > 1 else "replicate")
    if tp > 1 and block.ops and block.instances:
        inst = block.instances[0]
        owners = {o.module for o in block.ops if o.params}
        attention = [o.module for o in block.ops if o.kind == "attention"]
        for o in block.ops:
            if not o.module.startswith(inst + "."):
                continue
            rel = o.module[len(inst) + 1:]
            if o.kind == "attention":
                # the attention between column- and row-parallel linears runs on the local heads
                # (the runtime adjusts the module's head counts)
                out[rel] = "heads"
            elif o.kind == "norm" and o.module in owners:
                # a norm inside the attention (MLA's latent norms) runs on the input the runtime
                # gathers whole for its column-parallel linears, never on a sequence shard
                inside = any(o.module.startswith(a + ".") for a in attention)
                out[rel] = "sequence" if sp and not inside else "replicate"
    return out
