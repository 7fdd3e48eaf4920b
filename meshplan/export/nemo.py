"""NeMo 2 and Megatron-Bridge export: recipe overrides (dotted key -> value) for a Plan
(`nemo_export`, `to_nemo`; flavor "nemo" or "megatron-bridge").

Names checked against NVIDIA/NeMo 8cfedd7 (2025-09-20, the 2.5 line: MegatronStrategy and its
ParallelismConfig, MegatronMixedPrecision, the llm recipes) and NVIDIA-NeMo/Megatron-Bridge 067f987
(2026-08-22, 0.7.0 dev: the ConfigContainer sections, training/utils/omegaconf_utils.py for how
overrides are applied, training/mixed_precision.py, the recipes). Both run Megatron-Core underneath,
so schedules and recompute follow the Megatron-LM export's rules (meshplan/export/megatron.py).

Megatron-Bridge applies `key=value` overrides to the ConfigContainer's dataclass fields (Hydra, in
struct mode: a key that is not a field is an error). A recipe's `cfg.model` is either a
GPTModelProvider, itself a TransformerConfig (`model.<field>`), or a builder-backed
GPTModelConfig (`AutoBridge.get_model_config()`, the Llama recipes), which holds the
TransformerConfig as its `transformer` field: there TransformerConfig fields are
`model.transformer.<field>` and only the GPT fields (seq_length, vocab_size, ...) stay `model.<field>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.errors import ConfigError, UnknownNameError
from meshplan.ir.precision import Precision
from meshplan.export.megatron import (
    MEGATRON_CORE,
    _megatron_offload,
    _megatron_recompute,
    _megatron_schedule,
    _pipeline_layout_string,
)
from meshplan.export.view import (
    FP8_FORMAT, VERSIONS, Export, megatron_fp8_recipe, _check_precision, _fp8_notes, _model_name, _uniform_middle, _View, _view,
)

__all__ = ["nemo_export", "to_nemo", "NEMO_RECIPES", "BRIDGE_RECIPES"]


@dataclass(frozen=True)
class _Paths:
    """Where each group of settings lives in a flavor's config tree."""

    par: str        # parallelism (NeMo: MegatronStrategy arguments; Bridge: TransformerConfig fields)
    tf: str         # TransformerConfig fields (recompute, MoE, pipeline split in Bridge)
    model: str      # the model config's own fields (seq_length)
    mp: str         # mixed precision
    batch: str
    ddp: str
    opt: str


_NEMO = _Paths(par="trainer.strategy.", tf="model.config.", model="model.config.", mp="trainer.plugins.",
               batch="data.", ddp="trainer.strategy.ddp.", opt="optim.config.")
_BRIDGE_PROVIDER = _Paths(par="model.", tf="model.", model="model.", mp="mixed_precision.", batch="train.",
                          ddp="ddp.", opt="optimizer.")
_BRIDGE_BUILDER = _Paths(par="model.transformer.", tf="model.transformer.", model="model.",
                         mp="mixed_precision.", batch="train.", ddp="ddp.", opt="optimizer.")

# meshplan preset -> the NeMo 2 recipe (`nemo llm pretrain --factory <recipe>`, nemo/collections/llm/recipes)
NEMO_RECIPES = {
    "llama2-7b": "llama2_7b", "llama3-8b": "llama3_8b", "llama3-70b": "llama3_70b", "llama3-405b": "llama31_405b",
    "mixtral-8x7b": "mixtral_8x7b", "mixtral-8x22b": "mixtral_8x22b", "qwen3-30b-a3b": "qwen3_30b_a3b",
    "qwen3-235b-a22b": "qwen3_235b_a22b", "deepseek-v3": "deepseek_v3", "gpt3-175b": "gpt3_175b",
}
# meshplan preset -> (the Megatron-Bridge recipe, whether its cfg.model is builder-backed): the Llama
# recipes (recipes/llama/h100/llama{2,3}.py) use AutoBridge.get_model_config(), the others a provider
BRIDGE_RECIPES = {
    "llama2-7b": ("llama2_7b_pretrain_config", True), "llama3-8b": ("llama3_8b_pretrain_config", True),
    "llama3-70b": ("llama3_70b_pretrain_config", True), "llama3-405b": ("llama31_405b_pretrain_config", True),
    "qwen3-30b-a3b": ("qwen3_30b_a3b_pretrain_config", False),
    "qwen3-235b-a22b": ("qwen3_235b_a22b_pretrain_config", False),
    "deepseek-v3": ("deepseek_v3_pretrain_config", False),
}
# recipes whose model has multi-token prediction layers (NeMo's deepseek_v3 use_mtp=True, Bridge's
# DeepSeek-V3 provider from the HF config); a plan for a model without MTP switches them off
_MTP_RECIPES = {"deepseek_v3", "deepseek_v3_pretrain_config"}

# the plan's FP8 recipe -> Megatron-Bridge's mixed-precision recipe of that scaling
# (training/mixed_precision.py), and the BF16 layers (start, end) that recipe keeps
_BRIDGE_FP8 = {"tensorwise": ("bf16_with_fp8_current_scaling_mixed", (1, 1)),
               "delayed": ("bf16_with_fp8_delayed_scaling_mixed", (0, 0)),
               "blockwise": ("bf16_with_fp8_subchannel_scaling_mixed", (0, 0)),
               "mxfp8": ("bf16_with_mxfp8_mixed", (0, 0))}


def _pipeline_split(v: _View) -> dict[str, Any]:
    """Every Megatron-Core pipeline-split setting, written whether or not the plan needs it: the
    recipes set some themselves (llama31_405b counts the embedding and loss as layers, NeMo's
    deepseek_v3 sets the first/last stage sizes, Bridge's a layout for its own pp), and
    TransformerConfig refuses first/last stage sizes or a layout next to the account_for_* flags."""
    lay = v.layout
    sl = v.stage_layers
    first = last = layout = None
    if lay.pp > 1 and not v.even:
        if lay.vp == 1 and _uniform_middle(sl):
            first, last = sl[0], sl[-1]
        else:
            layout = _pipeline_layout_string(sl, v.shape.mtp_depth if v.shape is not None else 0)
    return {"num_layers_in_first_pipeline_stage": first, "num_layers_in_last_pipeline_stage": last,
            "account_for_embedding_in_pipeline_split": False, "account_for_loss_in_pipeline_split": False,
            "pipeline_model_parallel_layout": layout}


def nemo_export(plan: Any, model: Any = None, *, flavor: str = "nemo") -> Export:
    """Override keys (dotted path -> value) for a NeMo 2 recipe (flavor 'nemo') or a
    Megatron-Bridge recipe (flavor 'megatron-bridge')."""
    if flavor not in ("nemo", "megatron-bridge"):
        raise UnknownNameError("NeMo flavor", flavor, ["nemo", "megatron-bridge"])
    target = "NeMo 2" if flavor == "nemo" else "Megatron-Bridge"
    _check_precision(plan, target, (Precision.BF16, Precision.FP16, Precision.FP8))
    v = _view(plan, model)
    lay = v.layout
    _megatron_schedule(v, target)   # the same Megatron-Core schedules underneath
    name = _model_name(plan, model)
    if flavor == "nemo":
        P, recipe = _NEMO, NEMO_RECIPES.get(name)
        where = f"recipe {recipe} (nemo llm pretrain --factory {recipe})" if recipe else ""
    else:
        recipe, builder = BRIDGE_RECIPES.get(name, (None, False))
        P = _BRIDGE_BUILDER if builder else _BRIDGE_PROVIDER
        if recipe:
            where = (f"recipe {recipe} (cfg.model builder-backed: TransformerConfig fields at model.transformer.*)"
                     if builder else f"recipe {recipe} (cfg.model a GPTModelProvider: fields at model.*)")
        else:
            where = ""
            v.notes.append(f"no Megatron-Bridge recipe is known for {name!r}: the overrides assume a recipe whose "
                           "cfg.model is a GPTModelProvider (TransformerConfig fields at model.<field>); where it is "
                           "builder-backed (AutoBridge.get_model_config(), as in the Llama recipes) those fields are "
                           "model.transformer.<field>")
    o: dict[str, Any] = {
        P.par + "tensor_model_parallel_size": lay.tp,
        P.par + "pipeline_model_parallel_size": lay.pp,
        P.par + "virtual_pipeline_model_parallel_size": lay.vp if lay.vp > 1 else None,
        P.par + "context_parallel_size": lay.cp,
        P.par + "sequence_parallel": bool(lay.tp > 1 and lay.sp),
        P.par + "expert_model_parallel_size": lay.ep,
        P.par + "expert_tensor_parallel_size": lay.etp,
    }
    # NeMo 2's MegatronStrategy copies these onto the model config and re-runs its __post_init__,
    # which parses the layout (nemo/lightning/_strategy_lib.set_model_parallel_attributes)
    o.update({P.par + k: val for k, val in _pipeline_split(v).items()})
    if recipe in _MTP_RECIPES and not (v.shape is not None and v.shape.mtp_depth):
        o[P.tf + "mtp_num_layers"] = None
        v.notes.append("MTP: the recipe's model has a multi-token-prediction layer and the plan's model has none, so "
                       "the export sets mtp_num_layers=None. To keep MTP, drop that override (with a pipeline layout, "
                       "also add 'm' before the final 'L'); the last stage then holds one more layer than planned")
    # ZeRO / FSDP
    o[P.opt + "use_distributed_optimizer"] = lay.zero >= 1
    if flavor == "megatron-bridge":
        o["ddp.use_distributed_optimizer"] = lay.zero >= 1
    if lay.zero >= 2:
        strategy = "optim_grads_params" if lay.zero == 3 and lay.reshard_after_forward else "optim_grads"
        if flavor == "nemo":
            o["trainer.strategy.fsdp"] = "megatron"
        else:
            o["ddp.use_megatron_fsdp"] = True
            o["checkpoint.ckpt_format"] = "fsdp_dtensor"   # Megatron-FSDP's only checkpoint format
        o[P.ddp + "data_parallel_sharding_strategy"] = strategy
        if lay.fsdp_shard:
            v.notes.append(f"HSDP (fsdp_shard={lay.fsdp_shard}) is exported as full sharding over all "
                           "data-parallel ranks")
    if lay.dp * lay.cp > 1:
        o[P.ddp + "overlap_grad_reduce"] = True
        o[P.ddp + "overlap_param_gather"] = lay.zero >= 1
    # recompute (Megatron-Core TransformerConfig fields)
    rc = _megatron_recompute(v, lay.recompute)
    o[P.tf + "recompute_granularity"] = rc.granularity
    o[P.tf + "recompute_method"] = rc.method
    o[P.tf + "recompute_num_layers"] = rc.num_layers
    if rc.modules:
        o[P.tf + "recompute_modules"] = list(rc.modules)
    if _megatron_offload(v):        # TransformerConfig cpu_offloading (checked as Megatron-LM's flags are)
        o[P.tf + "cpu_offloading"] = True
        o[P.tf + "cpu_offloading_num_layers"] = max(1, v.num_layers - 1)
    # batch and sequence
    o[P.batch + "micro_batch_size"] = lay.mbs
    o[P.batch + "global_batch_size"] = plan.global_batch
    o[P.model + "seq_length"] = plan.seq_len
    o[("data." if flavor == "nemo" else "dataset.") + "seq_length"] = plan.seq_len
    _precision(plan, v, o, P, flavor, target)
    # the routers' balancing (a preset or a given config): the recipe's own may differ
    bal = v.shape.balancing if v.shape is not None else None
    for key, value in (bal.megatron_fields() if bal else {}).items():
        o[P.tf + key] = value
    # MLA sizes and group-limited routing (MLATransformerConfig / TransformerConfig fields)
    for key, value in (v.shape.megatron_attention_routing_fields() if v.shape is not None else {}).items():
        o[P.tf + key] = value
    # multi-token prediction: Megatron-Core TransformerConfig fields (Megatron-Bridge's
    # docs/training/multi-token-prediction.md names them for the model config too)
    if v.shape is not None and v.shape.mtp_depth:
        o[P.tf + "mtp_num_layers"] = v.shape.mtp_depth
        if v.shape.mtp_loss_weight is not None:
            o[P.tf + "mtp_loss_scaling_factor"] = v.shape.mtp_loss_weight
    if MEGATRON_CORE.runs_ep_overlap(lay):
        # TransformerConfig.overlap_moe_expert_parallel_comm (Megatron-LM's --overlap-moe-expert-parallel-comm)
        o[P.tf + "overlap_moe_expert_parallel_comm"] = True
    if lay.tp_comm_overlap:
        if flavor == "nemo":
            v.notes.append("TP communication overlap is a callback in NeMo 2: add "
                           "MegatronCommOverlapCallback(tp_comm_overlap=True) to trainer.callbacks")
        else:
            # the model config's flag switches the userbuffers on (training/initialize.py); a recipe's
            # CommOverlapConfig, where it has one, writes its own value over it
            o[P.par + "tp_comm_overlap"] = True
            v.notes.append("TP communication overlap: set on the model config; where the recipe sets a "
                           "CommOverlapConfig (cfg.comm_overlap), its tp_comm_overlap must be true too "
                           "(comm_overlap.tp_comm_overlap=true)")
    return Export(fmt=flavor, version=VERSIONS[flavor], data=o, notes=tuple(v.notes), target=where)


def _precision(plan: Any, v: _View, o: dict[str, Any], P: _Paths, flavor: str, target: str) -> None:
    """Precision overrides. NeMo 2's recipes hold a MegatronMixedPrecision config (its fields are
    overridable); Megatron-Bridge's hold the *name* of a mixed-precision recipe ("bf16_mixed"), which
    a Hydra override can replace but not reach into, and whose settings overwrite the model config's
    (MixedPrecisionConfig.setup), so Bridge gets the name of the recipe with the plan's scaling."""
    recipe = getattr(v.layout, "fp8_recipe", "tensorwise")
    if plan.precision == Precision.FP16:
        o["trainer.plugins.precision" if flavor == "nemo" else "mixed_precision"] = \
            "16-mixed" if flavor == "nemo" else "fp16_mixed"
    if plan.precision != Precision.FP8:
        return
    lead, tail = _fp8_notes(plan, v, target)
    if flavor == "nemo":
        o[P.mp + "fp8"] = FP8_FORMAT
        o[P.mp + "fp8_recipe"] = megatron_fp8_recipe(v.layout, "NeMo")
        o[P.mp + "first_last_layers_bf16"] = bool(lead or tail)
        o[P.mp + "num_layers_at_start_in_bf16"] = lead
        o[P.mp + "num_layers_at_end_in_bf16"] = tail
        return
    if recipe not in _BRIDGE_FP8:
        raise ConfigError(f"Megatron-Bridge has no mixed-precision recipe for FP8 scaling {recipe!r}; re-plan with "
                          f"fixed={{'fp8_recipe': 'tensorwise'}} (or one of {sorted(_BRIDGE_FP8)})")
    name, (start, end) = _BRIDGE_FP8[recipe]
    o["mixed_precision"] = name
    if (lead, tail) != (start, end):
        v.notes.append(f"FP8: {name} keeps the first {start} and last {end} layers in BF16, the plan {lead} and "
                       f"{tail}; a Hydra override cannot change a recipe given by name: set "
                       f"cfg.mixed_precision.num_layers_at_start_in_bf16 = {lead} and ..._at_end_in_bf16 = {tail} "
                       "in the recipe script to match")


def to_nemo(plan: Any, model: Any = None, *, flavor: str = "nemo") -> dict[str, Any]:
    """NeMo 2 (default) or Megatron-Bridge (`flavor='megatron-bridge'`) recipe overrides."""
    return nemo_export(plan, model, flavor=flavor).data
