"""Multi-token prediction (meshplan.models.mtp) under the runtime's layouts.

The planner prices each MTP depth's block as one more layer of the main stack's last kind
(cost_models/ranks.py: its weights split by tp and its experts by ep x etp like that layer's, its
activations sequence-sharded under SP) and lists the MTP modules as one post module, "mtp", on
the last pipeline stage. `with_mtp_blocks` turns that into what the runtime's steps read: each
depth's block `mtp.<k>.block` becomes a block of the plan, placed module by module as the last
layer `plan.blocks[-1]` is (same class, same FQNs below the block: models/mtp.py builds it as a
layer after the last one), so TP/SP, EP with MoE folding, CP's ring attention, compile and FSDP
units treat it as they treat the main blocks. Activation recompute leaves it out (`main_blocks`),
as the cost model prices it.

The depth's own modules: its two input norms, the (2h -> h) projection of their concatenation
and its output norm. Under SP they run on the sequence shards ("sequence": weights replicated,
gradients summed over TP): the hidden state and the shifted tokens' embeddings arrive
sequence-sharded like the residual stream (the vocabulary-parallel embedding reduce-scatters each
lookup), the concatenation is along the features, so every token's inputs are on one rank, and the
projection does 1/tp of the work. Without SP they run on whole tokens, weights replicated.

The shift by k tokens is made where the sequence is whole: on the token ids each TP rank holds
whole (the lookups), and on the labels, which the runtime shifts before any context-parallel split
(`stacked_targets`). Under CP a rank holds two chunks of every sequence (the load-balanced
split), so the ids it needs for position i + k may sit on another CP rank: context_parallel.py's
`mtp_shifted_ids` makes the model's shifted lookups read ids gathered over the CP group (B x T
int64 per micro-batch, small beside the activations), shifted whole and cut back to this rank's
chunks.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from meshplan.errors import LayoutError
from meshplan.models.mtp import IGNORE_INDEX, mtp_targets

__all__ = ["mtp_depth", "with_mtp_blocks", "owned_mtp_blocks", "main_blocks", "stacked_targets", "split_targets"]

ROOT = "mtp"                   # the model attribute holding the depths (models/transformer.py)
_OWN = ("hnorm", "enorm", "proj", "norm")


def mtp_depth(model: nn.Module) -> int:
    """The multi-token-prediction depths of a meshplan model (config.mtp_depth with its `mtp`
    module present); 0 for any other model."""
    depth = getattr(getattr(model, "config", None), "mtp_depth", 0)
    if not isinstance(depth, int) or depth <= 0 or not isinstance(model._modules.get(ROOT), nn.Module):
        return 0
    return depth


def _is_mtp(fqn: str) -> bool:
    return fqn == ROOT or fqn.startswith(ROOT + ".")


def with_mtp_blocks(model: nn.Module, plan):
    """`plan` with each MTP depth's block among its blocks (after the main ones: execution order)
    and the depths' modules placed (module docstring). The plan itself for a model without MTP, or
    when its blocks name the depths already."""
    depth = mtp_depth(model)
    if not depth or not plan.blocks or any(_is_mtp(b) for b in plan.blocks):
        return plan
    last = plan.blocks[-1]
    modules = dict(model.named_modules())
    # placements name modules and, for routed experts, parameters ("expert")
    names = set(modules) | {n for n, _ in model.named_parameters()}
    own = "sequence" if plan.sequence_parallel else "replicate"
    placements = {fqn: label for fqn, label in plan.placements.items() if not _is_mtp(fqn)}
    blocks = list(plan.blocks)
    for k in range(depth):
        block = f"{ROOT}.{k}.block"
        if type(modules.get(block)) is not type(modules.get(last)):
            raise LayoutError(f"{block} is a {type(modules.get(block)).__name__} and the plan's last block {last} "
                              f"a {type(modules.get(last)).__name__}; the runtime places the MTP block as the "
                              "main stack's last layer (the kind the cost model priced it as); build the MTP "
                              "block as a layer after the last one (models/mtp.py), or re-plan with mtp_depth=0")
        for fqn, label in plan.placements.items():
            if fqn.startswith(last + "."):
                mapped = block + fqn[len(last):]
                if mapped not in names:
                    raise LayoutError(f"the plan places {fqn} ({label}) but the MTP block has no {mapped}: "
                                      f"{block} is not built as {last} is; re-plan with mtp_depth=0")
                placements[mapped] = label
        placements.update({f"{ROOT}.{k}.{name}": own for name in _OWN})
        blocks.append(block)
    return dataclasses.replace(plan, placements=placements, blocks=tuple(blocks))


def owned_mtp_blocks(blocks, owned) -> list[str]:
    """The MTP depths' blocks among `blocks` of a pipeline stage owning modules `owned` (the
    stage that owns the depths' module)."""
    return [b for b in blocks if _is_mtp(b)] if ROOT in owned else []


def main_blocks(blocks: list[str]) -> list[str]:
    """`blocks` without the MTP depths' (activation recompute wraps the main stack's only)."""
    return [b for b in blocks if not _is_mtp(b)]


def stacked_targets(labels: Tensor, depth: int) -> Tensor:
    """The targets of the main loss and of each depth along the sequence, (B, (1 + depth) T):
    labels, then labels shifted by 1 .. depth (models.mtp.mtp_targets), shifted while the sequence
    is whole so that a context-parallel split cuts each part as it cuts the labels."""
    return torch.cat([labels] + [mtp_targets(labels, k, IGNORE_INDEX) for k in range(1, depth + 1)], dim=1)


def split_targets(target: Tensor, depth: int) -> list[Tensor]:
    """`stacked_targets` (sharded or not) -> [main, depth 1, ..., depth D] of equal length."""
    return list(target.split(target.shape[1] // (1 + depth), dim=1))
