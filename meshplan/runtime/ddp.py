"""Data parallelism without FSDP: plain DDP for zero=0 (`ddp_runs`), and autocast for mixed
precision where no FSDP wrapper casts (`autocast_forward`, with the residual stream in the compute
dtype from the embeddings on: `cast_embeddings`). `data_parallel_mode` says which of
FSDP2 (fsdp.py), DDP or nothing a plan runs.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshplan.errors import ConfigError
from meshplan.ir.support import runs_as_ddp

__all__ = ["ddp_runs", "data_parallel_mode", "wrap_ddp", "autocast_forward", "cast_embeddings"]


def ddp_runs(layout) -> bool:
    """Whether the runtime runs this layout's data parallelism as plain DDP (ir.support.runs_as_ddp)."""
    return runs_as_ddp(zero=layout.zero, dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                       etp=layout.etp)


def data_parallel_mode(plan) -> str:
    """"ddp", "fsdp" or "none" (one data-parallel rank: no wrapper at all, not FSDP over a one-rank
    mesh, whose hooks, copies and sharded optimizer cost ~30 ms a step on CPU for nothing)."""
    lay = plan.layout
    if plan.mesh.get("dp", 1) * plan.mesh.get("cp", 1) == 1:
        return "none"
    return "ddp" if ddp_runs(lay) else "fsdp"


def _sum_allreduce_hook(group, bucket):
    """DDP communication hook: SUM the bucket over the group (DDP's default averages; the loss is
    already divided by the global token count, so the sum is the global-batch mean gradient)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _sum_allreduce_bf16_hook(group, bucket, fp32: frozenset = frozenset()):
    """DDP communication hook for grad_dtype "bf16": the bucket is cast to bf16, SUMmed over the
    group in bf16 (half the bytes, as the cost model prices it) and written back into the fp32
    bucket. Not torch's bf16_compress_hook: that one divides by the world size (an average).
    A bucket holding a parameter of `fp32` (ids; fp32_grads.py) is summed in fp32."""
    if fp32 and any(id(p) in fp32 for p in bucket.parameters()):
        return _sum_allreduce_hook(group, bucket)
    buf = bucket.buffer()
    low = buf.to(torch.bfloat16)
    work = dist.all_reduce(low, group=group, async_op=True)

    def back(fut):
        buf.copy_(fut.value()[0])
        return buf
    return work.get_future().then(back)


def wrap_ddp(stage: nn.Module, group, device: torch.device, *, ignore: list[str] = (),
             grad_dtype: str = "fp32", fp32_params: list[str] = ()) -> nn.Module:
    """DDP over `group`; `ignore`: parameter names DDP leaves alone (expert-parallel DTensors, whose
    gradients are reduced over their own data-parallel ranks: moe_folding.reduce_expert_grads).
    `grad_dtype`: the layout's gradient reduction dtype, "fp32" or "bf16" (the all-reduce runs in
    bf16; ir.support refuses bf16 where expert gradients would be reduced apart in fp32).
    `fp32_params`: names of parameters whose buckets reduce in fp32 all the same (fp32_grads.py)."""
    if grad_dtype not in ("fp32", "bf16"):
        raise ConfigError(f"grad_dtype={grad_dtype!r}: DDP reduces gradients in 'fp32' or 'bf16'")
    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(stage, list(ignore))
    with warnings.catch_warnings():     # broadcast_buffers=False: buffers are derived (rope tables), never synced
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(stage, process_group=group, broadcast_buffers=False,
                                      gradient_as_bucket_view=True,
                                      device_ids=[device.index] if device.type == "cuda" else None)
    named = dict(stage.named_parameters())
    keep = frozenset(id(named[n]) for n in fp32_params if n in named)
    bf16 = functools.partial(_sum_allreduce_bf16_hook, fp32=keep) if keep else _sum_allreduce_bf16_hook
    ddp.register_comm_hook(group, bf16 if grad_dtype == "bf16" else _sum_allreduce_hook)
    return ddp


def autocast_forward(stage: nn.Module, dtype: torch.dtype, device_type: str) -> None:
    """Mixed precision without FSDP: the stage's forward runs under autocast (bf16 matmuls, fp32
    master weights, gradients and reductions), as a user writes it by hand. Only the forward:
    backward ops follow the dtypes autocast chose for their forward ops."""
    inner = stage.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return inner(*args, **kwargs)
    stage.forward = forward


def _cast_output(dtype: torch.dtype, _module: nn.Module, _args, out):
    if isinstance(out, torch.Tensor) and out.is_floating_point() and out.dtype != dtype:
        return out.to(dtype)
    return None


def cast_embeddings(stage: nn.Module, dtype: torch.dtype) -> list[str]:
    """Under autocast, the embeddings' outputs in the compute dtype, so the residual stream starts
    (and crosses pipeline stages) in `dtype`, as it does under FSDP2's bf16 parameters. Autocast
    casts only at the matmuls: with fp32 master weights and nothing else, the embedding's output,
    the residual stream, the inputs of recomputed blocks and the tensors sent between stages
    would be fp32, twice the bf16 bytes the plan charges for each. The residual adds then run in
    `dtype` (Megatron's default; its fp32_residual_connection is off by default). Registered
    after TP's hooks, so a vocabulary-parallel embedding's partial sums are reduced in fp32 first.
    Returns the FQNs of the embeddings cast."""
    cast = functools.partial(_cast_output, dtype)
    names = []
    for fqn, m in stage.named_modules():
        if isinstance(m, nn.Embedding):
            m.register_forward_hook(cast)
            names.append(fqn)
    return names
