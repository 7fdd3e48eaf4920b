"""Workers for tests/runtime/test_offload.py (imported by spawned ranks and by the test process).

`offload_step`: a plan with offload_activations runs one step (forward + backward + AdamW) and is
compared with the single-device model (numerics.py's tolerances); it returns the bytes each
rank's pack hooks moved to host memory and brought back.
"""

from __future__ import annotations

import copy

import numerics
import torch


def offload_step(rank: int, world: int, case: dict) -> dict:
    from meshplan.runtime import parallelize
    torch.manual_seed(0)
    model = numerics.build_model(case["model"], seq_len=case["seq_len"])
    ref = copy.deepcopy(model)
    x, y = numerics.batch(case["global_batch"], case["seq_len"])
    pm = parallelize(model, case["plan"], compute_dtype=None)
    loss = pm.forward_backward(x, y)
    numerics.step_matches_reference(pm, ref, x, y, loss)
    return {"loss": loss, "offloaded": sum(o.bytes_offloaded for o in pm.offload), "data_parallel": pm.data_parallel,
            "reloaded": sum(o.bytes_reloaded for o in pm.offload), "stages": len(pm.offload)}


def run_cases(rank: int, world: int, cases: dict) -> dict:
    from worlds import each_case
    return each_case(rank, cases, lambda name, case: offload_step(rank, world, case))
