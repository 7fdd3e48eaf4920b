"""What every exporter reads from a Plan: the common view (`_view`: layout, layers per virtual
stage, block FQNs, model shape, notes), the FP8 layer split, precision checks, and the `Export`
record each target returns; also the target names (`FORMATS`) and the versions checked (`VERSIONS`).

Blocks are the plan's own `plan.blocks` (the repeated blocks' FQNs in execution order); a stage's
layer count is the number of those blocks it holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from meshplan.errors import ConfigError
from meshplan.export.shape import ModelShape, model_shape
from meshplan.ir.layout import Layout
from meshplan.ir.precision import Precision

__all__ = ["FORMATS", "VERSIONS", "FP8_FORMAT", "FP8_RECIPE", "Export", "megatron_fp8_recipe"]

FORMATS = ("megatron", "torchtitan", "nemo", "megatron-bridge")
# the stack (meshplan.ir.stack preset) each export target runs: `meshplan plan --export X` plans for it
EXPORT_STACKS = {"megatron": "megatron-core", "torchtitan": "torchtitan", "nemo": "megatron-core",
                 "megatron-bridge": "megatron-core"}
VERSIONS = {
    "megatron": "Megatron-LM main d98e8a6 (2026-08-22, megatron-core 0.20.0 dev)",
    "torchtitan": "torchtitan v0.2.2 (2026-02-20, TOML job config)",
    "nemo": "NeMo 2 llm collection, NVIDIA/NeMo 8cfedd7 (2025-09-20, 2.5 line)",
    "megatron-bridge": "Megatron-Bridge 067f987 (2026-08-22, 0.7.0 dev)",
}

# meshplan's FP8 is Transformer-Engine-style per-tensor *current* scaling (DESIGN.md, runtime FP8):
# Megatron/NeMo call it the "tensorwise" recipe, torchao/torchtitan the "tensorwise" recipe too.
# "hybrid" = E4M3 forward, E5M2 gradients, the format every Megatron FP8 recipe uses.
FP8_FORMAT = "hybrid"
FP8_RECIPE = "tensorwise"
# the FP8 scalings Megatron-Core's --fp8-recipe / TransformerConfig.fp8_recipe take (all of them);
# row-wise scaling is torchao's
MEGATRON_FP8_RECIPES = ("tensorwise", "delayed", "blockwise", "mxfp8")


def megatron_fp8_recipe(layout: Any, target: str) -> str:
    """The plan's FP8 scaling as Megatron-Core names it, or a ConfigError saying what to re-plan with."""
    recipe = getattr(layout, "fp8_recipe", None) or FP8_RECIPE
    if recipe not in MEGATRON_FP8_RECIPES:
        raise ConfigError(f"{target} (Megatron-Core) has no FP8 scaling {recipe!r} (torchao's row-wise scaling); "
                          f"re-plan with fixed={{'fp8_recipe': 'tensorwise'}} (or one of "
                          f"{', '.join(MEGATRON_FP8_RECIPES[1:])})")
    return recipe


@dataclass(frozen=True, kw_only=True)
class Export:
    """One export: `args` (Megatron flags) or `data` (a dict), plus notes on approximations."""

    fmt: str
    version: str
    args: tuple[str, ...] = ()
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    env: dict[str, str] = dataclasses.field(default_factory=dict)   # environment the launch needs
    notes: tuple[str, ...] = ()
    # what the export is written for beyond the version: the recipe (NeMo 2, Megatron-Bridge) or the
    # model name and flavor (torchtitan); printed in the header
    target: str = ""


# ---- what every exporter reads from the plan ------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class _View:
    layout: Layout
    stage_layers: tuple[int, ...]     # layers per virtual stage, in Megatron / meshplan stage order
    blocks: tuple[str, ...]           # block instance FQNs in execution order (() when unknown)
    shape: ModelShape | None
    notes: list[str]

    @property
    def num_layers(self) -> int:
        return sum(self.stage_layers)

    @property
    def even(self) -> bool:
        return len(set(self.stage_layers)) == 1

    @property
    def layers_per_rank(self) -> int:
        return max(sum(self.stage_layers[r::self.layout.pp]) for r in range(self.layout.pp))


def _view(plan: Any, model: Any) -> _View:
    lay = plan.layout
    notes: list[str] = []
    blocks = tuple(plan.blocks)
    known = set(blocks)
    counted = tuple(sum(1 for m in stage if m in known) for stage in plan.stages)
    shape = model_shape(plan, model)
    if lay.stage_layers is not None:
        stage_layers = tuple(lay.stage_layers)
    elif len(counted) == lay.pp * lay.vp and sum(counted) > 0:
        stage_layers = counted
    elif shape is not None and shape.layers % (lay.pp * lay.vp) == 0:
        stage_layers = (shape.layers // (lay.pp * lay.vp),) * (lay.pp * lay.vp)
    else:
        raise ConfigError("cannot tell how many layers each pipeline stage holds: the plan has no "
                          "stage_layers and lists no repeated blocks (plan.blocks); pass model= "
                          "(a preset name, ModelConfig or ModelProfile)")
    if shape is not None and shape.layers != sum(stage_layers):
        notes.append(f"{shape.source} has {shape.layers} layers but the plan's stages hold "
                     f"{sum(stage_layers)}: model-shape settings left out; pass model= to include them")
        shape = None
    if shape is None and model is None:
        notes.append(f"model {plan.model!r} is not a meshplan preset, so model-shape settings "
                     "(layers, hidden size, heads, ...) are left out; pass model= to include them")
    if not lay.flash_attention:
        notes.append("the plan assumes unfused attention (flash_attention=False); the targets default "
                     "to fused/flash attention, which is faster and needs less memory")
    return _View(layout=lay, stage_layers=stage_layers, blocks=blocks if len(blocks) == sum(stage_layers) else (),
                 shape=shape, notes=notes)


def _fp8_layer_split(plan: Any, v: _View) -> tuple[int, int, list[int], bool] | None:
    """(leading BF16 layers, trailing BF16 layers, other BF16 layers, some FP8 layer keeps a linear in
    BF16) from the plan's FP8 module set; None when the block names are unknown."""
    if not v.blocks:
        return None
    fp8 = set(plan.fp8_modules)
    per_layer = [sorted(m[len(b) + 1:] for m in fp8 if m.startswith(b + ".")) for b in v.blocks]
    bf16 = [i for i, mods in enumerate(per_layer) if not mods]
    lead = 0
    while lead < len(per_layer) and not per_layer[lead]:
        lead += 1
    tail = 0
    while tail < len(per_layer) - lead and not per_layer[-1 - tail]:
        tail += 1
    middle = [i for i in bf16 if lead <= i < len(per_layer) - tail]
    union = set().union(*(set(m) for m in per_layer if m)) if any(per_layer) else set()
    partial = any(mods and set(mods) != union for mods in per_layer)
    # linears no FP8 layer uses (e.g. small K/V projections) stay BF16 in meshplan; the targets
    # quantise every linear of an FP8 layer
    return lead, tail, middle, partial or bool(union) and len(union) < _typical_linears(v)


def _typical_linears(v: _View) -> int:
    """Linears per block the targets quantise: q, k, v, o + the MLP's 2 (GELU) or 3 (SwiGLU)."""
    if v.shape is None:
        return 0
    return 4 + (3 if v.shape.gated else 2)


def _fp8_notes(plan: Any, v: _View, target: str) -> tuple[int, int]:
    """Leading/trailing BF16 layer counts to export, plus notes on what cannot be expressed."""
    split = _fp8_layer_split(plan, v)
    if split is None:
        v.notes.append(f"FP8: the plan's FP8 module set could not be matched to layers; {target} runs "
                       "every transformer layer's linears in FP8")
        return 0, 0
    lead, tail, middle, partial = split
    if middle:
        v.notes.append(f"FP8: meshplan keeps layers {middle} in BF16; {target} can only keep leading/trailing "
                       "layers in BF16, so they run in FP8 (faster, slightly riskier numerics)")
    if partial:
        v.notes.append(f"FP8: meshplan keeps some linears of FP8 layers in BF16 (see plan.fp8_modules); {target} "
                       "quantises every linear of an FP8 layer")
    if lead + tail >= v.num_layers:
        v.notes.append("FP8: the plan puts no transformer layer in FP8")
    return lead, tail


def _check_precision(plan: Any, target: str, allowed: tuple[Precision, ...]) -> None:
    if plan.precision not in allowed:
        raise ConfigError(f"{target} export: precision '{plan.precision}' is not supported there; "
                          f"re-plan with precision in {tuple(p.value for p in allowed)}")


def _model_name(plan: Any, model: Any) -> str:
    """The model's name: `model` when it names one (a preset name, a ModelConfig's or profile's
    name, a config mapping's "name"), else the plan's."""
    if isinstance(model, str):
        return model
    name = model.get("name") if isinstance(model, dict) else getattr(model, "name", None)
    return name or plan.model


def _uniform_middle(sl: tuple[int, ...]) -> bool:
    return len(sl) >= 2 and len(set(sl[1:-1])) <= 1
