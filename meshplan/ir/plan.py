"""`Plan`: the frozen, versioned, JSON-serialisable result of planning — the only thing the
runtime reads.

It holds the mesh axes and degrees, per-module placements, the pipeline stages as module
FQNs, the schedule, micro-batch and gradient-accumulation counts, the recompute policy, the
FP8 module set, the fingerprints of the model and cluster it was made for, the predicted
`Estimate`, and the runner-up layouts with the reason each lost.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from meshplan.ir.estimate import Estimate
from meshplan.ir.layout import Layout
from meshplan.errors import ConfigError

__all__ = ["Plan", "RunnerUp", "PLAN_VERSION"]

PLAN_VERSION = 1
# mesh axes from slowest- to fastest-varying rank, as init_device_mesh wants them (Megatron order
# tp-cp-ep-dp-pp read backwards)
MESH_AXES = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True, kw_only=True)
class RunnerUp:
    layout: dict[str, Any]
    step_time_s: float
    peak_memory_gb: float
    fits: bool
    reason: str             # why it lost to the chosen layout


@dataclass(frozen=True, kw_only=True)
class Plan:
    version: int = PLAN_VERSION
    model: str
    model_fingerprint: str
    cluster: dict[str, Any]            # Cluster.to_dict()
    cluster_fingerprint: str
    seq_len: int
    global_batch: int
    precision: str
    layout: dict[str, Any]             # Layout.to_dict()
    mesh: dict[str, int]               # axis name -> degree, in MESH_AXES order
    placements: dict[str, str]         # module FQN pattern (relative to a block, or absolute) -> placement
    stages: tuple[tuple[str, ...], ...]   # virtual stage -> module FQNs (stage s runs on pipeline rank s % pp)
    schedule: str
    micro_batch_size: int
    num_microbatches: int              # = gradient-accumulation steps per data-parallel rank
    recompute: str | int
    fp8_modules: tuple[str, ...]
    fused_kernels: tuple[str, ...] = ()
    estimate: dict[str, Any]           # Estimate.to_dict()
    runner_ups: tuple[RunnerUp, ...] = ()
    search: dict[str, Any] = field(default_factory=dict)   # candidates seen, pruned, time taken

    def __post_init__(self) -> None:
        if self.version != PLAN_VERSION:
            raise ConfigError(f"plan version {self.version} is not supported by this meshplan "
                              f"(expects {PLAN_VERSION}); re-run meshplan plan")

    # ---- convenience views -------------------------------------------------------------
    @property
    def layout_obj(self) -> Layout:
        return Layout.from_dict(self.layout)

    @property
    def estimate_obj(self) -> Estimate:
        return Estimate.from_dict(self.estimate)

    @property
    def world_size(self) -> int:
        n = 1
        for v in self.mesh.values():
            n *= v
        return n

    # ---- serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stages"] = [list(s) for s in self.stages]
        d["fp8_modules"] = list(self.fp8_modules)
        d["fused_kernels"] = list(self.fused_kernels)
        d["runner_ups"] = [asdict(r) for r in self.runner_ups]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        d = dict(d)
        if "version" not in d:
            raise ConfigError("not a meshplan plan: no 'version' field")
        d["stages"] = tuple(tuple(s) for s in d["stages"])
        d["fp8_modules"] = tuple(d.get("fp8_modules", ()))
        d["fused_kernels"] = tuple(d.get("fused_kernels", ()))
        d["runner_ups"] = tuple(RunnerUp(**r) for r in d.get("runner_ups", ()))
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"malformed plan JSON: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"plan is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def save(self, path) -> None:
        from pathlib import Path
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path) -> "Plan":
        from pathlib import Path
        return cls.from_json(Path(path).read_text())

    def check_matches(self, *, model_fingerprint: str | None = None, cluster=None, world_size: int | None = None) -> None:
        """Refuse a plan made for another model, cluster or world size, naming the mismatch."""
        if model_fingerprint is not None and model_fingerprint != self.model_fingerprint:
            raise ConfigError(f"this plan was made for model {self.model!r} (fingerprint {self.model_fingerprint}), "
                              f"not for this model (fingerprint {model_fingerprint}); re-plan for this model")
        if cluster is not None and cluster.fingerprint() != self.cluster_fingerprint:
            raise ConfigError(f"this plan was made for cluster {self.cluster.get('name')!r} "
                              f"({self.world_size} GPUs), not {cluster.name!r} ({cluster.num_gpus} GPUs); re-plan")
        if world_size is not None and world_size != self.world_size:
            raise ConfigError(f"this plan needs {self.world_size} processes, but the job has {world_size}")

    # ---- explanation -------------------------------------------------------------------
    def explain(self) -> str:
        from meshplan.planner.explain import explain
        return explain(self)

    def summary(self) -> str:
        return self.estimate_obj.summary()

    # ---- exports to other frameworks (meshplan/reports/export.py, docs/exports.md) ------
    def to_megatron_args(self, model=None) -> list[str]:
        """Megatron-LM flags; `model` (preset name, ModelConfig, ModelProfile) adds the shape flags."""
        from meshplan.reports.export import to_megatron_args
        return to_megatron_args(self, model)

    def to_torchtitan(self, model=None) -> dict[str, Any]:
        """torchtitan (v0.2.2 TOML) job config sections as a nested dict."""
        from meshplan.reports.export import to_torchtitan
        return to_torchtitan(self, model)

    def to_nemo(self, model=None, *, flavor: str = "nemo") -> dict[str, Any]:
        """NeMo 2 (or flavor='megatron-bridge') recipe overrides, dotted key -> value."""
        from meshplan.reports.export import to_nemo
        return to_nemo(self, model, flavor=flavor)
