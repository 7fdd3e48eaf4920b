"""NeMo 2 and Megatron-Bridge export: recipe overrides (dotted key -> value) for a Plan
(`nemo_export`, `to_nemo`; flavor "nemo" or "megatron-bridge").

Names checked against NVIDIA/NeMo 8cfedd7 (2025-09-20, the 2.5 line: MegatronStrategy,
MegatronMixedPrecision, the llama3 recipes) and NVIDIA-NeMo/Megatron-Bridge 067f987 (2026-08-22,
0.7.0 dev: the ConfigContainer sections). Both run Megatron-Core underneath, so schedules and
recompute follow the Megatron-LM export's rules (meshplan/export/megatron.py).
"""

from __future__ import annotations

from typing import Any

from meshplan.errors import UnknownNameError
from meshplan.export.megatron import _megatron_recompute, _megatron_schedule, _pipeline_layout_string
from meshplan.export.view import (
    FP8_FORMAT, FP8_RECIPE, VERSIONS, Export, _check_precision, _fp8_notes, _uniform_middle, _view,
)

__all__ = ["nemo_export", "to_nemo"]

_NEMO_PREFIX = {  # where each group of settings lives in the two config trees
    "nemo": dict(par="trainer.strategy.", model="model.config.", mp="trainer.plugins.", batch="data.",
                 ddp="trainer.strategy.ddp.", opt="optim.config."),
    "megatron-bridge": dict(par="model.", model="model.", mp="mixed_precision.", batch="train.",
                            ddp="ddp.", opt="optimizer."),
}


def nemo_export(plan: Any, model: Any = None, *, flavor: str = "nemo") -> Export:
    """Override keys (dotted path -> value) for a NeMo 2 recipe (flavor 'nemo') or a
    Megatron-Bridge recipe (flavor 'megatron-bridge')."""
    if flavor not in _NEMO_PREFIX:
        raise UnknownNameError("NeMo flavor", flavor, list(_NEMO_PREFIX))
    target = "NeMo 2" if flavor == "nemo" else "Megatron-Bridge"
    _check_precision(plan, target, ("bf16", "fp16", "fp8"))
    v = _view(plan, model)
    lay = v.layout
    _megatron_schedule(v, target)   # the same Megatron-Core schedules underneath
    P = _NEMO_PREFIX[flavor]
    o: dict[str, Any] = {
        P["par"] + "tensor_model_parallel_size": lay.tp,
        P["par"] + "pipeline_model_parallel_size": lay.pp,
        P["par"] + "virtual_pipeline_model_parallel_size": lay.vp if lay.vp > 1 else None,
        P["par"] + "context_parallel_size": lay.cp,
        P["par"] + "sequence_parallel": bool(lay.tp > 1 and lay.sp),
        P["par"] + "expert_model_parallel_size": lay.ep,
        P["par"] + "expert_tensor_parallel_size": lay.etp,
    }
    sl = v.stage_layers
    if lay.pp > 1 and not v.even:
        if lay.vp == 1 and _uniform_middle(sl):
            o[P["par"] + "num_layers_in_first_pipeline_stage"] = sl[0]
            o[P["par"] + "num_layers_in_last_pipeline_stage"] = sl[-1]
        elif flavor == "megatron-bridge":
            o["model.pipeline_model_parallel_layout"] = _pipeline_layout_string(sl)
        else:
            v.notes.append(f"pipeline split {list(sl)}: NeMo 2's MegatronStrategy only sets the first and last "
                           "stage sizes; exported as an even split (use the megatron or megatron-bridge export "
                           "for --pipeline-model-parallel-layout)")
    # ZeRO / FSDP
    o[P["opt"] + "use_distributed_optimizer"] = lay.zero >= 1
    if flavor == "megatron-bridge":
        o["ddp.use_distributed_optimizer"] = lay.zero >= 1
    if lay.zero >= 2:
        strategy = "optim_grads_params" if lay.zero == 3 and lay.reshard_after_forward else "optim_grads"
        if flavor == "nemo":
            o["trainer.strategy.fsdp"] = "megatron"
        else:
            o["ddp.use_megatron_fsdp"] = True
            o["checkpoint.ckpt_format"] = "fsdp_dtensor"   # Megatron-FSDP's only checkpoint format
        o[P["ddp"] + "data_parallel_sharding_strategy"] = strategy
        if lay.fsdp_shard:
            v.notes.append(f"HSDP (fsdp_shard={lay.fsdp_shard}) is exported as full sharding over all "
                           "data-parallel ranks")
    if lay.dp * lay.cp > 1:
        o[P["ddp"] + "overlap_grad_reduce"] = True
        o[P["ddp"] + "overlap_param_gather"] = lay.zero >= 1
    # recompute (Megatron-Core TransformerConfig fields)
    rc = _megatron_recompute(v, lay.recompute)
    o[P["model"] + "recompute_granularity"] = rc.granularity
    o[P["model"] + "recompute_method"] = rc.method
    o[P["model"] + "recompute_num_layers"] = rc.num_layers
    if rc.modules:
        o[P["model"] + "recompute_modules"] = list(rc.modules)
    # batch and sequence
    o[P["batch"] + "micro_batch_size"] = lay.mbs
    o[P["batch"] + "global_batch_size"] = plan.global_batch
    o[P["model"] + "seq_length"] = plan.seq_len
    o[("data." if flavor == "nemo" else "dataset.") + "seq_length"] = plan.seq_len
    # precision: NeMo 2 recipes default to bf16_mixed(), Bridge recipes to "bf16_mixed"
    if plan.precision == "fp16":
        o["trainer.plugins.precision" if flavor == "nemo" else "mixed_precision"] = \
            "16-mixed" if flavor == "nemo" else "fp16_mixed"
    if plan.precision == "fp8":
        o[P["mp"] + "fp8"] = FP8_FORMAT
        o[P["mp"] + "fp8_recipe"] = FP8_RECIPE
        lead, tail = _fp8_notes(plan, v, target)
        if lead or tail:
            o[P["mp"] + "first_last_layers_bf16"] = True
            o[P["mp"] + "num_layers_at_start_in_bf16"] = lead
            o[P["mp"] + "num_layers_at_end_in_bf16"] = tail
    # the routers' balancing (a preset or a given config): the recipe's own may differ
    bal = v.shape.balancing if v.shape is not None else None
    for name, value in (bal.megatron_fields() if bal else {}).items():
        o[P["model"] + name] = value
    if lay.tp_comm_overlap:
        if flavor == "nemo":
            v.notes.append("TP communication overlap is a callback in NeMo 2: add "
                           "MegatronCommOverlapCallback(tp_comm_overlap=True) to trainer.callbacks")
        else:
            o["comm_overlap.tp_comm_overlap"] = True
    return Export(fmt=flavor, version=VERSIONS[flavor], data=o, notes=tuple(v.notes))


def to_nemo(plan: Any, model: Any = None, *, flavor: str = "nemo") -> dict[str, Any]:
    """NeMo 2 (default) or Megatron-Bridge (`flavor='megatron-bridge'`) recipe overrides."""
    return nemo_export(plan, model, flavor=flavor).data
