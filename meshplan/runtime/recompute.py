"""Activation recomputation per block, as the Plan's `recompute` says.

- "full": each block's forward runs under non-reentrant `torch.utils.checkpoint`; only its
  input is kept and the whole block is recomputed in backward (Megatron's full recompute).
- "selective": selective activation checkpointing: the outputs of matrix multiplies are saved
  and everything else (attention core, softmax, norms, activations) is recomputed, which is
  where Korthikanti et al. (2022) find most activation memory for the least recompute FLOPs.
- N (int): full recompute of the first N blocks a pipeline rank holds (over its virtual
  stages, in execution order), none for the rest: `Layout.recompute_policy`, the same rule the
  cost model prices.

The block's `forward` is wrapped on the instance, so parameter FQNs do not change (checkpoint
wrappers that add a module level would rename every parameter).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["apply_recompute"]

# ops whose outputs selective recompute keeps: matrix multiplies (their recompute is the costly
# part) and TP collectives (recomputing them would repeat the communication, and a replayed
# collective must see the same inputs on every rank)
_SAVE_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "linear")
_SAVE_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")


def _selective_context():
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        create_selective_checkpoint_contexts,
    )
    save = {getattr(torch.ops.aten, n).default for n in _SAVE_OPS if hasattr(torch.ops.aten, n)}
    save |= {getattr(torch.ops._c10d_functional, n).default for n in _SAVE_COLLECTIVES
             if hasattr(torch.ops._c10d_functional, n)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def _wrap(block: nn.Module, selective: bool) -> None:
    from torch.utils.checkpoint import checkpoint
    inner = block.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        ctx = {"context_fn": _selective_context} if selective else {}
        return checkpoint(inner, *args, use_reentrant=False, **ctx, **kwargs)
    block.forward = forward


def apply_recompute(stage: nn.Module, blocks: list[str], layout, first_index: int = 0) -> list[str]:
    """Wrap the stage's blocks (FQNs in execution order) as `layout.recompute_policy` says;
    `first_index`: how many layers this pipeline rank's earlier virtual stages hold. Returns the
    FQNs wrapped."""
    chosen = []
    for k, fqn in enumerate(blocks):
        policy = layout.recompute_policy(first_index + k)
        if policy != "none":
            _wrap(stage.get_submodule(fqn), policy == "selective")
            chosen.append(fqn)
    return chosen
