"""`Plan`: the frozen, versioned, JSON-serialisable contract between the planner and the runtime.

The planner writes it (meshplan.planner.build); the runtime reads it and nothing else of the
planner. It therefore carries everything the runtime needs, already resolved to the module
names of the user's (unsplit) model:

- `layout` (a typed `Layout`; the device `mesh`, axis -> degree in MESH_AXES order, is derived
  from it and written to JSON for readers only) and the `precision` (a `Precision`);
- `blocks`: the repeated blocks' FQNs in execution order (FSDP units, recompute, async TP);
- `placements`: module FQN -> how tensor/expert parallelism treats it (PLACEMENTS);
- `stages`: per virtual pipeline stage, the module FQNs it holds;
- `fp8_modules`: the linears that run FP8 GEMMs; `fused_kernels`: each fused-kernel swap as a
  typed `FusedKernel` record;
- the fingerprints of the model and cluster it was made for, the predicted `Estimate`, and the
  runner-up layouts with the reason each lost.

Plans of an older version are refused with a message to re-plan (the layout is cheap to
re-derive; a silently misread plan is not).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from meshplan.errors import ConfigError
from meshplan.ir.estimate import Estimate
from meshplan.ir.layout import Layout
from meshplan.ir.precision import Precision, parse_precision

__all__ = ["Plan", "PlanNotes", "RunnerUp", "FusedKernel", "PLAN_VERSION", "MESH_AXES", "PLACEMENTS", "FUSED_KERNELS"]

# 2: typed layout/estimate, placements and fused kernels by module FQN, `blocks` (2026-11-24)
PLAN_VERSION = 2
# mesh axes from slowest- to fastest-varying rank, as init_device_mesh wants them (Megatron order
# tp-cp-ep-dp-pp read backwards)
MESH_AXES = ("pp", "dp", "cp", "tp")
# What a placement means to the runtime (meshplan.runtime.tensor_parallel / expert_parallel):
PLACEMENTS = (
    "colwise",         # nn.Linear split on its output features
    "rowwise",         # nn.Linear split on its input features (output reduced)
    "sequence",        # weights replicated, runs on this rank's sequence shard (SP norms)
    "replicate",       # whole tensors and weights
    "heads",           # attention module whose integer head counts become local (/ tp)
    "vocab_parallel",  # nn.Embedding split over the vocabulary
    "seq_split",       # output cut to this rank's sequence shard (learned positions under SP)
    "expert",          # routed-expert weights, split over the expert-parallel group
    # packed projections (one linear computing several side by side): each rank holds its slice
    # of every part, not a contiguous block of rows (meshplan.runtime.packed_projections)
    "colwise_qkv",     # fused Q|K|V linear: each rank holds its heads' rows of q, of k and of v
    "colwise_gate_up", # fused SwiGLU gate|up linear: each rank holds its slice of gate and of up
)
FUSED_KERNELS = ("rms_norm", "swiglu", "linear_cross_entropy", "moe_router")


@dataclass(frozen=True, kw_only=True)
class FusedKernel:
    """One fused-kernel swap: `kernel` replaces the forward of `module`.

    `module` is an absolute FQN in a Plan; the planner's fusion finder also uses
    `<block signature>:<path in block>` keys before it expands them to every instance.
    `options` are facts the kernel needs, read from the traced graph (e.g. ("eps", "1e-05")).
    """

    kernel: str
    module: str
    options: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.kernel not in FUSED_KERNELS:
            raise ConfigError(f"fused kernel {self.kernel!r}: meshplan fuses {FUSED_KERNELS}")
        if not self.module or " " in self.module:
            raise ConfigError(f"fused kernel module {self.module!r} must be one non-empty name")
        object.__setattr__(self, "options", tuple(sorted((str(k), str(v)) for k, v in self.options)))

    @property
    def option(self) -> dict[str, str]:
        return dict(self.options)

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "module": self.module, "options": dict(self.options)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FusedKernel":
        try:
            return cls(kernel=d["kernel"], module=d["module"], options=tuple(dict(d.get("options", {})).items()))
        except (KeyError, TypeError, AttributeError):
            raise ConfigError(f"plan fused_kernels entry {d!r} is malformed: expected "
                              "{'kernel': ..., 'module': ..., 'options': {...}}; re-run meshplan plan") from None


@dataclass(frozen=True, kw_only=True)
class RunnerUp:
    layout: Layout
    step_time_s: float
    peak_memory_gb: float
    fits: bool
    reason: str             # why it lost to the chosen layout


@dataclass(frozen=True, kw_only=True)
class PlanNotes:
    """How the planner arrived at a plan: what the search looked at and why the choice is what it is.
    Read by `Plan.explain()`; numbers only describe the search, nothing the runtime reads."""

    meshes: int = 0                    # device meshes enumerated
    estimates: int = 0                 # layouts costed
    pruned_divisibility: int = 0       # candidates the model's shapes cannot split
    pruned_memory: int = 0             # meshes whose every layout was over memory
    pruned_bound: int = 0              # candidates skipped by the step-time lower bound
    runtime_excluded: int = 0          # layouts the stack cannot run (costed, never returned)
    seconds: float = 0.0               # search wall time
    fixed: dict[str, Any] = field(default_factory=dict)   # what the user pinned (`fixed=`, --fix)
    band_choice: str = ""              # a simpler layout chosen inside the uncertainty band, and why
    runtime_excluded_note: str = ""    # what the stack's limits cost (a faster layout it cannot run)
    placement_note: str = ""           # the sharding ILP's fallback, when it failed
    optimizer_note: str = ""           # the optimizer-state dtype had to change to fit
    fp8_emulated: bool = False         # FP8 planned for a CPU run (emulated, for correctness only)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PlanNotes":
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"malformed plan JSON: unknown note(s) {', '.join(unknown)}")
        return cls(**d)

    def replace(self, **changes: Any) -> "PlanNotes":
        return replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class Plan:
    version: int = PLAN_VERSION
    model: str
    model_fingerprint: str
    # how to build the model again: a preset name, path/to/file.py:factory or a transformers config
    # JSON ("" when planned from a module object); `meshplan train --plan` builds it from this
    model_source: str = ""
    stack: str = "meshplan"            # the software it was planned for (meshplan.ir.stack presets)
    cluster: dict[str, Any]            # Cluster.to_dict()
    cluster_fingerprint: str
    seq_len: int
    global_batch: int
    precision: Precision               # a name ("bf16") is read as its Precision
    layout: Layout
    blocks: tuple[str, ...] = ()       # repeated-block FQNs, execution order
    placements: dict[str, str]         # module FQN -> one of PLACEMENTS
    stages: tuple[tuple[str, ...], ...]   # virtual stage -> module FQNs (stage s runs on pipeline rank s % pp)
    num_microbatches: int              # = gradient-accumulation steps per data-parallel rank
    fp8_modules: tuple[str, ...] = ()
    fused_kernels: tuple[FusedKernel, ...] = ()
    estimate: Estimate
    runner_ups: tuple[RunnerUp, ...] = ()
    notes: PlanNotes = field(default_factory=PlanNotes)     # how the search arrived here (explain() reads it)

    def __post_init__(self) -> None:
        if self.version != PLAN_VERSION:
            raise ConfigError(f"plan version {self.version} is not supported by this meshplan "
                              f"(expects {PLAN_VERSION}); re-run meshplan plan")
        for name, typ in (("layout", Layout), ("estimate", Estimate)):
            if not isinstance(getattr(self, name), typ):
                raise TypeError(f"Plan.{name} must be a {typ.__name__}, not {type(getattr(self, name)).__name__}")
        object.__setattr__(self, "precision", parse_precision(self.precision, allowed=tuple(Precision),
                                                              what="plan precision"))
        lay = self.layout
        if len(self.stages) != lay.pp * lay.vp:
            raise ConfigError(f"plan lists {len(self.stages)} pipeline stages; its layout has pp*vp = "
                              f"{lay.pp * lay.vp}; re-plan")
        bad = sorted({v for v in self.placements.values() if v not in PLACEMENTS})
        if bad:
            raise ConfigError(f"plan placements {bad} are unknown; placements are one of {PLACEMENTS}")

    # ---- derived views (one home: the layout) --------------------------------------------
    @property
    def mesh(self) -> dict[str, int]:
        """The device mesh: axis name -> degree, in MESH_AXES order (pp, dp, cp, tp)."""
        return _mesh_of(self.layout)

    @property
    def world_size(self) -> int:
        return self.layout.world

    @property
    def schedule(self) -> str:
        return self.layout.schedule

    @property
    def micro_batch_size(self) -> int:
        return self.layout.mbs

    @property
    def recompute(self) -> str | int:
        return self.layout.recompute

    @property
    def sequence_parallel(self) -> bool:
        """Whether the blocks keep the residual stream sharded on the sequence over TP."""
        return bool(self.layout.sp) and self.layout.tp > 1

    def block_of(self, fqn: str) -> str | None:
        """The repeated block that holds module `fqn`, or None outside the blocks."""
        for b in self.blocks:
            if fqn.startswith(b + "."):
                return b
        return None

    def summary(self) -> str:
        return self.estimate.summary()

    # ---- serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["layout"] = self.layout.to_dict()
        d["estimate"] = self.estimate.to_dict()
        d["blocks"] = list(self.blocks)
        d["stages"] = [list(s) for s in self.stages]
        d["fp8_modules"] = list(self.fp8_modules)
        d["fused_kernels"] = [k.to_dict() for k in self.fused_kernels]
        d["runner_ups"] = [dict(asdict(r), layout=r.layout.to_dict()) for r in self.runner_ups]
        d["mesh"] = dict(self.mesh)
        d["placements"] = dict(self.placements)
        d["notes"] = self.notes.to_dict()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        d = dict(d)
        if "version" not in d:
            raise ConfigError("not a meshplan plan: no 'version' field")
        # the mesh is written for readers and derived from the layout on load; a file whose mesh
        # disagrees with its layout was edited by hand
        saved_mesh = d.pop("mesh", None)
        # plans saved before the notes were typed carry them as a "search" dict of the same keys
        old_notes = d.pop("search", None)
        if isinstance(old_notes, dict) and "notes" not in d:
            d["notes"] = {k: v for k, v in old_notes.items() if k in {f.name for f in fields(PlanNotes)}}
        if d["version"] != PLAN_VERSION:
            raise ConfigError(f"plan version {d['version']} is not supported by this meshplan "
                              f"(expects {PLAN_VERSION}); re-run meshplan plan")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"malformed plan JSON: missing field(s) {', '.join(missing)}; write the plan with "
                              "`meshplan plan ... --json plan.json` (or Plan.save)")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"malformed plan JSON: unknown field(s) {', '.join(unknown)}")
        try:
            d["layout"] = Layout.from_dict(d["layout"])
            d["estimate"] = Estimate.from_dict(d["estimate"])
            if saved_mesh is not None:
                lay = d["layout"]
                if {a: int(saved_mesh[a]) for a in MESH_AXES} != _mesh_of(lay):
                    raise ConfigError(f"plan mesh {dict(saved_mesh)} disagrees with its layout ({lay.short()}); "
                                      "re-plan")
            d["blocks"] = tuple(d.get("blocks", ()))
            d["stages"] = tuple(tuple(s) for s in d["stages"])
            d["fp8_modules"] = tuple(d.get("fp8_modules", ()))
            d["fused_kernels"] = tuple(FusedKernel.from_dict(k) for k in d.get("fused_kernels", ()))
            d["runner_ups"] = tuple(RunnerUp(**dict(r, layout=Layout.from_dict(r["layout"])))
                                    for r in d.get("runner_ups", ()))
            d["notes"] = PlanNotes.from_dict(d.get("notes", {}))
            return cls(**d)
        except KeyError as e:
            raise ConfigError(f"malformed plan JSON: missing key {e} (in a layout, mesh or estimate)") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"malformed plan JSON: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"plan is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def save(self, path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path) -> "Plan":
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read plan {str(path)!r}: {e.strerror}") from None
        try:
            return cls.from_json(text)
        except ConfigError as e:
            raise ConfigError(f"plan {str(path)!r}: {e}") from None

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


def _mesh_of(layout: Layout) -> dict[str, int]:
    """Axis name -> degree of `layout`'s device mesh, in MESH_AXES order."""
    return {axis: getattr(layout, axis) for axis in MESH_AXES}
