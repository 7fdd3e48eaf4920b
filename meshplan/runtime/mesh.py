"""The Plan's DeviceMesh and the sub-meshes each technique works on (`build_mesh` -> `Meshes`).

Axes are the Plan's MESH_AXES (pp, dp, cp, tp, slowest first); HSDP splits dp into
(dp_replicate, dp_shard). Routed experts get their own mesh over the same ranks (Megatron-Core's
"MoE parallel folding"): a pipeline rank's dp x cp x tp ranks, flattened in that order (tp
fastest), are regrouped as (edp, ep, etp), etp fastest, so an ETP group is `etp` consecutive
ranks, an EP group has stride `etp` and the expert-data-parallel (EDP) group holds the rest.
With tp = cp = etp = 1 an EP group is `ep` consecutive data-parallel ranks, as before folding.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import init_device_mesh

from meshplan.ir.support import experts_folded

__all__ = ["Meshes", "build_mesh", "hsdp", "folds_experts"]


def hsdp(plan) -> bool:
    lay = plan.layout
    return bool(lay.zero == 3 and lay.fsdp_shard and lay.fsdp_shard < plan.mesh.get("dp", 1))


@dataclass(frozen=True)
class Meshes:
    """The plan's DeviceMesh and the sub-meshes each step of `parallelize` works on.

    Rank order is Megatron's tp-cp-ep-dp-pp (fastest first). The experts' mesh (`experts`,
    axes edp, ep, etp) folds the same dp x cp x tp ranks (module docstring); expert weights are
    split over (ep, etp) and data-parallel (FSDP) over `edp`. It exists when the experts are
    folded (`folded`): ep > 1, etp > 1, or a MoE model under tp > 1 (then the MoE layer runs on
    each TP rank's own tokens, so its experts see different tokens on every dense rank).
    """

    root: object                # named axes: pp, dp | dp_replicate+dp_shard, cp, tp
    dp: object                  # data-parallel ranks, 1-D (None with HSDP: two axes)
    fsdp: object                # where FSDP shards dense weights: dp (x cp), 2-D (replicate, shard) for HSDP
    ep: object = None           # the expert-parallel group (folded experts)
    expert_fsdp: object = None  # where FSDP shards expert weights: edp (folded experts)
    etp: object = None          # the expert-tensor-parallel group (folded experts)
    experts: object = None      # the experts' 3-D mesh (edp, ep, etp) (folded experts)
    fold: object = None         # dp x cp x tp flattened: every rank holding other tokens of the MoE layers

    @property
    def folded(self) -> bool:
        return self.experts is not None


def _flatten(mesh, dims: tuple[str, ...], name: str):
    # the flattened mesh is book-kept here (slicing flattened names from the root is deprecated)
    return mesh[dims]._flatten(name)


def folds_experts(plan) -> bool:
    """Whether the plan's routed experts run on their own (edp, ep, etp) mesh (Meshes.folded)."""
    lay = plan.layout
    moe = any(label == "expert" for label in plan.placements.values())
    return experts_folded(ep=lay.ep, etp=lay.etp, tp=lay.tp, moe=moe)


def _fold(root, plan) -> dict:
    """The experts' meshes over the root's dp x cp x tp ranks (module docstring)."""
    lay = plan.layout
    fold = _flatten(root, tuple(a for a in root.mesh_dim_names if a != "pp"), "fold")
    edp = fold.size() // (lay.ep * lay.etp)
    experts = fold._unflatten(0, (edp, lay.ep, lay.etp), ("edp", "ep", "etp"))
    return dict(ep=experts["ep"], expert_fsdp=experts["edp"], etp=experts["etp"], experts=experts, fold=fold)


def build_mesh(plan, device_type: str) -> Meshes:
    lay = plan.layout
    dp, cp, tp, pp = (plan.mesh.get(a, 1) for a in ("dp", "cp", "tp", "pp"))
    if hsdp(plan):
        root = init_device_mesh(device_type, (pp, dp // lay.fsdp_shard, lay.fsdp_shard, cp, tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
        experts = _fold(root, plan) if folds_experts(plan) else {}
        if cp == 1:
            return Meshes(root=root, dp=None, fsdp=root["dp_replicate", "dp_shard"], **experts)
        _flatten(root, ("dp_shard", "cp"), "dp_shard_cp")
        with warnings.catch_warnings():     # HSDP over (replicate, shard x cp) needs the 2-D slice
            warnings.simplefilter("ignore", UserWarning)
            return Meshes(root=root, dp=None, fsdp=root["dp_replicate", "dp_shard_cp"], **experts)
    root = init_device_mesh(device_type, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    # with CP, each CP rank's gradients are partial sums over its part of the sequence: FSDP
    # shards and reduces over dp x cp together (Megatron's data-parallel-with-CP group)
    fsdp = root["dp"] if cp == 1 else _flatten(root, ("dp", "cp"), "dp_cp")
    return Meshes(root=root, dp=root["dp"], fsdp=fsdp, **(_fold(root, plan) if folds_experts(plan) else {}))
