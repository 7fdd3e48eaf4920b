"""Export a `Plan` to the configuration of other training frameworks.

One module per job: view.py (what every exporter reads from the plan: layers per stage from
`plan.blocks`, FP8 split, the `Export` record), shape.py (the model's shape), megatron.py,
torchtitan.py, nemo.py (NeMo 2 and Megatron-Bridge), text.py (`export_text`, `to_toml`,
`export_constraints`).
This package imports only meshplan.errors, meshplan.ir and meshplan.models (docs/architecture.md).

Targets, and the source each name was checked against (docs/exports.md has the full mapping):

- Megatron-LM (`pretrain_gpt.py` flags): megatron/training/arguments.py and the dataclass-generated
  flags of TransformerConfig / ModelParallelConfig / TrainingConfig at NVIDIA/Megatron-LM main
  d98e8a6 (2026-08-22, megatron-core 0.20.0 dev). Flag names were validated once by parsing the
  export with that commit's own `add_megatron_arguments` parser.
- torchtitan: the TOML job config of torchtitan v0.2.2 (2026-02-20; torchtitan/config/job_config.py),
  the last release that reads TOML, with the model flavors it ships and the checks it makes before
  training (pipeline stages, mesh, DDP, CP, FP8). torchtitan 0.3 replaced TOML with Python config
  functions and renamed several fields (docs/exports.md says which). `export_constraints` names the
  layout keys torchtitan fixes for a model (cp=1 for its FlexAttention models), which
  `meshplan plan --export` plans with.
- NeMo 2 (`nemo llm pretrain --factory <recipe> key=value ...`): MegatronStrategy (and its
  ParallelismConfig), MegatronMixedPrecision and the llm recipes at NVIDIA/NeMo 8cfedd7 (2025-09-20,
  the 2.5 line).
- Megatron-Bridge (Hydra-style `section.key=value` overrides of a recipe's ConfigContainer, applied
  in struct mode to its dataclass fields): NVIDIA-NeMo/Megatron-Bridge 067f987 (2026-08-22, 0.7.0
  dev); builder-backed recipes hold TransformerConfig fields under `model.transformer.`.

A plan choice a target cannot express raises ConfigError naming it and what would work, unless
a nearest equivalent exists that is never worse than the plan (then the export carries a note,
printed as a comment by `export_text`). The plan does not record the model's shape; it is taken
from `model` (a ModelConfig, ModelProfile, config mapping or preset name) or, when the plan's model
name is a meshplan preset, from that preset. Without it the shape flags are left out (noted).
"""

from __future__ import annotations

from meshplan.export.megatron import megatron_export, to_megatron_args
from meshplan.export.nemo import nemo_export, to_nemo
from meshplan.export.shape import ModelShape, model_shape
from meshplan.export.text import export_constraints, export_text, to_toml
from meshplan.export.torchtitan import to_torchtitan, torchtitan_export
from meshplan.export.view import EXPORT_STACKS, FORMATS, VERSIONS, Export

__all__ = [
    "EXPORT_STACKS", "FORMATS", "VERSIONS", "ModelShape", "Export", "model_shape", "megatron_export", "torchtitan_export",
    "nemo_export", "to_megatron_args", "to_torchtitan", "to_nemo", "export_text", "to_toml", "export_constraints",
]
