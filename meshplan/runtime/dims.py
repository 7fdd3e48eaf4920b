"""`ParallelDims`: a Plan's parallel degrees and the DeviceMeshes `parallelize`'s steps run on.

Built once per `parallelize` call (`ParallelDims.build(plan, device_type)`): the degrees come from
the Plan alone (`ParallelDims.from_plan`, no process group needed), the meshes from mesh.py's
`build_mesh` over the initialised default process group. Every step reads the sub-mesh it
needs by name (`dims.tp_mesh`, `dims.fsdp_mesh`, `dims.expert_mesh`, ...) instead of slicing the
root mesh itself, so the mesh layout (HSDP axes, the flattened dp x cp group, the folded
experts' mesh) is decided in one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshplan.errors import ConfigError
from meshplan.runtime.mesh import Meshes, build_mesh, folds_experts, hsdp

__all__ = ["ParallelDims"]


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a Plan's mesh and, once built, its DeviceMeshes (`meshes`).

    Dense ranks: pp x dp x cp x tp (= world). Under HSDP (zero 3 with Layout.fsdp_shard < dp) the
    dp ranks are `replicate` groups of `shard` ranks; otherwise `shard` = dp and `replicate` = 1.
    Routed experts, when folded (`folded`, mesh.folds_experts), regroup each pipeline rank's
    dp x cp x tp ranks as edp x ep x etp.
    """

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1             # expert parallelism: ranks the routed experts are split over
    etp: int = 1            # expert tensor parallelism: ranks each expert's inner features are split over
    edp: int = 1            # ranks an expert's weights are data-parallel (FSDP-sharded) over: dp*cp*tp/(ep*etp)
    shard: int = 1          # FSDP shard group size within dp (HSDP: Layout.fsdp_shard; else dp)
    replicate: int = 1      # HSDP replica groups (dp / shard)
    folded: bool = False    # routed experts on their own (edp, ep, etp) mesh
    meshes: Meshes | None = None    # the DeviceMeshes (None from `from_plan`: degrees only)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def hsdp(self) -> bool:
        return self.replicate > 1

    @classmethod
    def from_plan(cls, plan) -> ParallelDims:
        """The degrees of `plan` (no meshes); refuses an expert split that does not divide the ranks."""
        lay = plan.layout
        pp, dp, cp, tp = (int(plan.mesh.get(a, 1)) for a in ("pp", "dp", "cp", "tp"))
        ep, etp = int(lay.ep), int(lay.etp)
        dense = dp * cp * tp
        if dense % (ep * etp):
            raise ConfigError(f"the plan's ep={ep} x etp={etp} does not divide its dp x cp x tp = {dense} ranks "
                              "per pipeline stage; re-plan (meshplan.plan folds experts over whole groups)")
        shard = int(lay.fsdp_shard) if hsdp(plan) else dp
        return cls(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, etp=etp, edp=dense // (ep * etp), shard=shard,
                   replicate=dp // shard, folded=folds_experts(plan))

    @classmethod
    def build(cls, plan, device_type: str) -> ParallelDims:
        """The degrees of `plan` and its DeviceMeshes over the default process group (collective)."""
        return dataclasses.replace(cls.from_plan(plan), meshes=build_mesh(plan, device_type))

    # ---- the sub-meshes each step works on -------------------------------------------------
    def _built(self) -> Meshes:
        if self.meshes is None:
            raise ConfigError("these ParallelDims hold degrees only (ParallelDims.from_plan); build the "
                              "DeviceMeshes with ParallelDims.build(plan, device_type) inside a process group")
        return self.meshes

    @property
    def root(self):
        """The dense mesh, axes pp, dp (or dp_replicate, dp_shard), cp, tp."""
        return self._built().root

    @property
    def pp_mesh(self):
        return self.root["pp"]

    @property
    def tp_mesh(self):
        return self.root["tp"]

    @property
    def cp_mesh(self):
        return self.root["cp"]

    @property
    def fsdp_mesh(self):
        """Where FSDP shards (and DDP replicates) the dense weights: dp (x cp), 2-D under HSDP."""
        return self._built().fsdp

    @property
    def ep_mesh(self):
        """The expert-parallel group of the folded experts (None when not folded)."""
        return self._built().ep

    @property
    def expert_mesh(self):
        """The folded experts' 3-D mesh (edp, ep, etp) (None when not folded)."""
        return self._built().experts

    @property
    def expert_fsdp_mesh(self):
        """Where FSDP shards the folded experts' weights: edp (None when not folded)."""
        return self._built().expert_fsdp
