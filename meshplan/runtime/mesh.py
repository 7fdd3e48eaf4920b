"""The Plan's DeviceMesh and the sub-meshes each technique works on (`build_mesh` -> `Meshes`).

Axes are the Plan's MESH_AXES (pp, dp, cp, tp, slowest first); HSDP splits dp into
(dp_replicate, dp_shard) and expert parallelism splits it into (edp, ep), ep fastest.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import init_device_mesh

__all__ = ["Meshes", "build_mesh", "hsdp"]


def hsdp(plan) -> bool:
    lay = plan.layout
    return bool(lay.zero == 3 and lay.fsdp_shard and lay.fsdp_shard < plan.mesh.get("dp", 1))


@dataclass(frozen=True)
class Meshes:
    """The plan's DeviceMesh and the sub-meshes each step of `parallelize` works on.

    Rank order is Megatron's tp-cp-ep-dp-pp (fastest first). With expert parallelism the
    data-parallel ranks are split as (edp, ep), ep fastest, so an EP group is `ep` consecutive
    data-parallel ranks and expert weights are data-parallel (FSDP) over `edp`.
    """

    root: object                # named axes: pp, dp | dp_replicate+dp_shard | edp+ep, cp, tp
    dp: object                  # data-parallel ranks, 1-D (None with HSDP: two axes)
    fsdp: object                # where FSDP shards dense weights: dp (x cp), 2-D (replicate, shard) for HSDP
    ep: object = None           # the expert-parallel group (ep > 1)
    expert_fsdp: object = None  # where FSDP shards expert weights under EP: edp


def _flatten(mesh, dims: tuple[str, ...], name: str):
    # the flattened mesh is book-kept here (slicing flattened names from the root is deprecated)
    return mesh[dims]._flatten(name)


def build_mesh(plan, device_type: str) -> Meshes:
    lay = plan.layout
    dp, cp, tp, pp = (plan.mesh.get(a, 1) for a in ("dp", "cp", "tp", "pp"))
    if hsdp(plan):
        root = init_device_mesh(device_type, (pp, dp // lay.fsdp_shard, lay.fsdp_shard, cp, tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
        if cp == 1:
            return Meshes(root=root, dp=None, fsdp=root["dp_replicate", "dp_shard"])
        _flatten(root, ("dp_shard", "cp"), "dp_shard_cp")
        with warnings.catch_warnings():     # HSDP over (replicate, shard x cp) needs the 2-D slice
            warnings.simplefilter("ignore", UserWarning)
            return Meshes(root=root, dp=None, fsdp=root["dp_replicate", "dp_shard_cp"])
    if lay.ep > 1:
        root = init_device_mesh(device_type, (pp, dp // lay.ep, lay.ep, cp, tp),
                                mesh_dim_names=("pp", "edp", "ep", "cp", "tp"))
        dp_mesh = _flatten(root, ("edp", "ep"), "dp")
        return Meshes(root=root, dp=dp_mesh, fsdp=dp_mesh, ep=root["ep"], expert_fsdp=root["edp"])
    root = init_device_mesh(device_type, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    # with CP, each CP rank's gradients are partial sums over its part of the sequence: FSDP
    # shards and reduces over dp x cp together (Megatron's data-parallel-with-CP group)
    fsdp = root["dp"] if cp == 1 else _flatten(root, ("dp", "cp"), "dp_cp")
    return Meshes(root=root, dp=root["dp"], fsdp=fsdp)
