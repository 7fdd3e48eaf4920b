"""Workers for tests/runtime/test_priced_knobs.py (imported by spawned ranks).

`grad_dtype_pair` runs one global batch forward and backward twice on the same weights and batch:
with the plan as made (grad_dtype "fp32") and with its layout's grad_dtype set to "bf16". Compute
runs in fp32 (compute_dtype=None) so that the only difference is the gradient reduction: each
rank's gradient rounded to bf16 before the sum. It records the dtype of every reduce-scatter and
all-reduce that carries gradients (DDP's comm hook and FSDP2's collectives call these
torch.distributed functions; patched here, so what is recorded is what went over the wire).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from numerics import batch, build_model

_RECORDED = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor")


def _reduced(name: str, args: tuple, kwargs: dict):
    if name == "all_reduce":
        return kwargs.get("tensor", args[0] if args else None)
    return kwargs.get("input", args[1] if len(args) > 1 else None)


@contextlib.contextmanager
def _record_reductions():
    """Record (dtype, numel) of each reduction issued inside the block."""
    log: list[tuple[torch.dtype, int]] = []
    saved = {name: getattr(dist, name) for name in _RECORDED if hasattr(dist, name)}

    def wrap(name, fn):
        def call(*args, **kwargs):
            tensor = _reduced(name, args, kwargs)
            if isinstance(tensor, torch.Tensor):
                log.append((tensor.dtype, tensor.numel()))
            return fn(*args, **kwargs)
        return call
    try:
        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _run(plan, case: dict) -> dict:
    from meshplan.runtime import parallelize
    model = build_model(case["model"], seq_len=case["seq_len"])
    x, y = batch(case["global_batch"], case["seq_len"])
    pm = parallelize(model, plan, compute_dtype=None)
    with _record_reductions() as log:
        loss = pm.forward_backward(x, y)
    policies = sorted({str(u._get_fsdp_state()._mp_policy.reduce_dtype) for u in pm.fsdp_units})
    # elements reduced per dtype; single elements are the loss's token counts, not gradients
    moved = {str(dt): sum(n for d, n in log if d == dt and n > 1) for dt in (torch.float32, torch.bfloat16)}
    return dict(loss=loss, grads=pm.full_grads(), moved=moved, policies=policies, data_parallel=pm.data_parallel)


def grad_dtype_pair(rank: int, world: int, case: dict) -> dict:
    """fp32- and bf16-gradient runs of one plan: losses, gradient differences and reduction dtypes."""
    plan = case["plan"]
    bf16 = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, grad_dtype="bf16"))
    ref, low = _run(plan, case), _run(bf16, case)
    rel = {n: float((low["grads"][n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref["grads"].items()}
    return dict(loss=(ref["loss"], low["loss"]), rel=rel, data_parallel=low["data_parallel"],
                policies=(ref["policies"], low["policies"]), moved=(ref["moved"], low["moved"]),
                params=sum(g.numel() for g in ref["grads"].values()))


def run_cases(rank: int, world: int, cases: dict) -> dict:
    from worlds import each_case
    return each_case(rank, cases, lambda name, case: grad_dtype_pair(rank, world, case))
