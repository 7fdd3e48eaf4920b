"""Plan exports to Megatron-LM, torchtitan, NeMo 2 and Megatron-Bridge (meshplan/export/).

CI has none of the target frameworks, so the exported names are checked against name lists copied
below from each target's source at the version named in the comment. Where a target's real parser
is importable (MESHPLAN_MEGATRON_SRC = a Megatron-LM checkout; torchtitan <= 0.2.x installed),
the last tests also parse the export with it; they are skipped otherwise.
"""

from __future__ import annotations

import os
import shlex
import sys
import tomllib

import pytest

import meshplan as mp
from meshplan import models
from meshplan.errors import ConfigError, UnknownNameError
from meshplan.api import Plan
import meshplan.export as ex

# the test plans include Mixtral, which torchtitan does not ship: its export warns (test_export_tools.py checks it)
pytestmark = pytest.mark.filterwarnings("ignore:torchtitan export:UserWarning")

# ---- reference names ------------------------------------------------------------------------------
# Megatron-LM main d98e8a6 (2026-08-22): flags defined in megatron/training/arguments.py plus those
# generated from the TransformerConfig / ModelParallelConfig / TrainingConfig / CheckpointConfig /
# DistributedInitConfig dataclass fields (megatron/training/argument_utils.py: "--" + name with "-").
MEGATRON_FLAGS = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout", "--sequence-parallel",
    "--tp-comm-overlap", "--use-distributed-optimizer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
    "--ckpt-format", "--overlap-grad-reduce", "--overlap-param-gather", "--recompute-granularity",
    "--recompute-method", "--recompute-num-layers", "--recompute-modules", "--micro-batch-size",
    "--global-batch-size", "--seq-length", "--bf16", "--fp16", "--fp8-format", "--fp8-recipe",
    "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16", "--num-layers",
    "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--group-query-attention",
    "--num-query-groups", "--kv-channels", "--max-position-embeddings", "--vocab-size", "--normalization",
    "--swiglu", "--position-embedding-type", "--rotary-base", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
    "--moe-grouped-gemm", "--moe-shared-expert-intermediate-size", "--moe-layer-freq",
    "--moe-router-score-function", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
    "--moe-z-loss-coeff", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
    "--moe-expert-capacity-factor", "--moe-router-force-load-balancing", "--mtp-num-layers",
    "--mtp-loss-scaling-factor", "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "--kv-lora-rank",
    "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--rope-type", "--no-rope-fusion",
    "--moe-router-num-groups", "--moe-router-group-topk", "--moe-router-topk-scaling-factor",
    # sliding windows and attention sinks (megatron/training/arguments.py)
    "--window-size", "--window-attn-skip-freq", "--softmax-type",
}
# torchtitan v0.2.2 (2026-02-20) torchtitan/config/job_config.py: the fields of each section.
TITAN_KEYS = {
    "training": {"dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm",
                 "steps", "enable_cpu_offload", "dtype", "mixed_precision_param", "mixed_precision_reduce",
                 "gc_freq", "gc_debug", "dataloader"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "disable_loss_parallel", "enable_async_tensor_parallel",
                    "pipeline_parallel_degree", "module_fqns_per_model_part",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
                    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
                    "pipeline_parallel_expert_parallel_overlap", "context_parallel_degree",
                    "context_parallel_load_balancer", "context_parallel_rotate_method", "expert_parallel_degree",
                    "expert_tensor_parallel_degree", "expert_parallel_comm_backend"},
    "activation_checkpoint": {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
                              "early_stop", "memory_budget", "visualize_memory_budget_pareto",
                              "preserve_rng_state", "determinism_check", "debug"},
    "compile": {"enable", "components", "backend"},
    "model": {"name", "flavor", "hf_assets_path", "tokenizer_path", "converters", "print_after_conversion"},
}
TITAN_FLOAT8_KEYS = {"enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp", "recipe_name",
                     "filter_fqns", "emulate"}
# torch.distributed.pipelining get_schedule_class names (torch 2.x; torchtitan passes them through)
TITAN_SCHEDULES = {"1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                   "DualPipeV"}
# NeMo 2 at NVIDIA/NeMo 8cfedd7 (2025-09-20): MegatronStrategy.__init__ parameters, the
# DistributedDataParallelConfig / OptimizerConfig / TransformerConfig fields of Megatron-Core, the
# MegatronMixedPrecision.__init__ parameters and the data module arguments of the llm recipes.
STRATEGY = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "context_parallel_size", "sequence_parallel", "expert_model_parallel_size",
            "expert_tensor_parallel_size", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
            "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
            "pipeline_model_parallel_layout", "fsdp", "ddp"}
DDP = {"overlap_grad_reduce", "overlap_param_gather", "data_parallel_sharding_strategy", "use_distributed_optimizer",
       "use_megatron_fsdp"}
TRANSFORMER = {"recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
               "seq_length", "pipeline_model_parallel_layout", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
               "moe_z_loss_coeff", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
               "moe_expert_capacity_factor", "moe_router_force_load_balancing", "tp_comm_overlap",
               "mtp_num_layers", "mtp_loss_scaling_factor", "window_size", "window_attn_skip_freq",
               "softmax_type"} | STRATEGY - {"fsdp", "ddp"}
PRECISION = {"precision", "fp8", "fp8_recipe", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
             "num_layers_at_end_in_bf16"}
NEMO_PREFIXES = {"trainer.strategy.": STRATEGY, "trainer.strategy.ddp.": DDP, "model.config.": TRANSFORMER,
                 "trainer.plugins.": PRECISION, "optim.config.": {"use_distributed_optimizer"},
                 "data.": {"micro_batch_size", "global_batch_size", "seq_length"}}
# Megatron-Bridge 067f987 (2026-08-22): ConfigContainer sections model (a GPTModelProvider =
# TransformerConfig, or a builder-backed GPTModelConfig holding the TransformerConfig as `transformer`,
# as in the Llama recipes), train (TrainingConfig), dataset, ddp, optimizer, mixed_precision (a recipe
# name), checkpoint.
BRIDGE_PREFIXES = {"model.": TRANSFORMER, "train.": {"micro_batch_size", "global_batch_size"},
                   "dataset.": {"seq_length"}, "ddp.": DDP, "optimizer.": {"use_distributed_optimizer"},
                   "": {"mixed_precision"}, "checkpoint.": {"ckpt_format"}}
GPT_MODEL_CONFIG = {"seq_length", "vocab_size"}     # megatron/training/models/gpt.py GPTModelConfig's own fields
BRIDGE_BUILDER_PREFIXES = dict(BRIDGE_PREFIXES, **{"model.": GPT_MODEL_CONFIG,
                                                   "model.transformer.": TRANSFORMER - GPT_MODEL_CONFIG})


# ---- plans ----------------------------------------------------------------------------------------
def _plan(model: str, cluster, *, seq_len: int, global_batch: int, precision: str = "bf16", **fixed) -> Plan:
    prof = mp.profile_from_config(models.config(model), seq_len=seq_len)
    return mp.plan(prof, cluster, seq_len=seq_len, global_batch=global_batch, precision=precision,
                   fixed=fixed or None, stack="megatron-core")     # plans for other frameworks


H100x64 = mp.Cluster.preset("dgx-h100", nodes=8)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {
        "fp8": _plan("llama3-8b", "dgx-h100", seq_len=8192, global_batch=64, precision="fp8",
                     tp=2, zero=1, recompute="none"),
        "vp": _plan("llama3-70b", H100x64, seq_len=4096, global_batch=512, tp=8, pp=4, vp=5,
                    recompute="selective", zero=1),
        "uneven": _plan("llama3-70b", H100x64, seq_len=4096, global_batch=512, tp=8, pp=8, vp=1, recompute=3,
                        schedule="1f1b", stage_layers=(9, 10, 10, 10, 10, 10, 10, 11)),
        "layout": _plan("llama3-70b", H100x64, seq_len=4096, global_batch=512, tp=8, pp=4, vp=2,
                        recompute="full", stage_layers=(9, 10, 10, 10, 10, 10, 10, 11)),
        "moe": _plan("mixtral-8x7b", mp.Cluster.preset("dgx-h100", nodes=4), seq_len=4096, global_batch=256,
                     ep=8, tp=2, etp=1, pp=2, vp=1, schedule="1f1b", zero=3, recompute="none"),
    }


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# ---- Megatron-LM ----------------------------------------------------------------------------------
def test_megatron_flag_names_are_megatron_flags(plans):
    for name, pl in plans.items():
        flags = {a for a in pl.to_megatron_args() if a.startswith("--")}
        assert flags <= MEGATRON_FLAGS, (name, flags - MEGATRON_FLAGS)


def test_megatron_values_follow_the_plan(plans):
    pl = plans["vp"]
    a = pl.to_megatron_args()
    assert (_flag(a, "--tensor-model-parallel-size"), _flag(a, "--pipeline-model-parallel-size")) == ("8", "4")
    assert _flag(a, "--num-layers-per-virtual-pipeline-stage") == str(80 // (4 * 5))
    assert "--sequence-parallel" in a and "--use-distributed-optimizer" in a
    assert _flag(a, "--recompute-granularity") == "selective" and _flag(a, "--recompute-modules") == "core_attn"
    assert (_flag(a, "--global-batch-size"), _flag(a, "--seq-length")) == ("512", "4096")
    assert _flag(a, "--micro-batch-size") == str(pl.micro_batch_size)
    assert (_flag(a, "--num-layers"), _flag(a, "--hidden-size"), _flag(a, "--num-query-groups")) == ("80", "8192", "8")
    assert "--bf16" in a and "--fp8-format" not in a


def test_megatron_uneven_stages_and_block_recompute(plans):
    a = plans["uneven"].to_megatron_args()
    assert _flag(a, "--decoder-first-pipeline-num-layers") == "9"
    assert _flag(a, "--decoder-last-pipeline-num-layers") == "11"
    assert (_flag(a, "--recompute-method"), _flag(a, "--recompute-num-layers")) == ("block", "3")
    # an uneven split with virtual stages needs the explicit layout string, in virtual-stage order
    b = plans["layout"].to_megatron_args()
    assert _flag(b, "--pipeline-model-parallel-layout") == "Et*9|t*10|t*10|t*10|t*10|t*10|t*10|t*11L"
    assert "--num-layers-per-virtual-pipeline-stage" not in b
    assert (_flag(b, "--recompute-granularity"), _flag(b, "--recompute-method")) == ("full", "uniform")


def test_megatron_fp8_moe_and_fsdp(plans):
    fp8 = ex.megatron_export(plans["fp8"])
    a = list(fp8.args)
    assert (_flag(a, "--fp8-format"), _flag(a, "--fp8-recipe")) == ("hybrid", "tensorwise")
    layers_in_fp8 = {m.split(".")[1] for m in plans["fp8"].fp8_modules}
    lead = _flag(a, "--num-layers-at-start-in-bf16") if "--first-last-layers-bf16" in a else "0"
    assert "0" not in layers_in_fp8 or lead == "0"
    assert fp8.env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}      # tp=2 before Blackwell
    # the plan's own scaling, not always tensorwise; torchao's row-wise scaling has no Megatron name
    import dataclasses
    blockwise = dataclasses.replace(plans["fp8"], layout=dataclasses.replace(plans["fp8"].layout,
                                                                             fp8_recipe="blockwise"))
    assert _flag(list(ex.megatron_export(blockwise).args), "--fp8-recipe") == "blockwise"
    delayed = dataclasses.replace(plans["fp8"], layout=dataclasses.replace(plans["fp8"].layout, fp8_recipe="delayed"))
    assert _flag(list(ex.megatron_export(delayed).args), "--fp8-recipe") == "delayed"
    assert delayed.to_nemo()["trainer.plugins.fp8_recipe"] == "delayed"
    assert delayed.to_nemo(flavor="megatron-bridge")["mixed_precision"] == "bf16_with_fp8_delayed_scaling_mixed"
    rowwise = dataclasses.replace(plans["fp8"], layout=dataclasses.replace(plans["fp8"].layout, fp8_recipe="rowwise"))
    with pytest.raises(ConfigError, match=r"no FP8 scaling 'rowwise'.*fixed=\{'fp8_recipe': 'tensorwise'\}"):
        ex.megatron_export(rowwise)
    moe = ex.megatron_export(plans["moe"])
    m = list(moe.args)
    assert (_flag(m, "--expert-model-parallel-size"), _flag(m, "--expert-tensor-parallel-size")) == ("8", "1")
    assert (_flag(m, "--num-experts"), _flag(m, "--moe-router-topk")) == ("8", "2")
    assert _flag(m, "--data-parallel-sharding-strategy") in ("optim_grads_params", "optim_grads")
    assert _flag(m, "--ckpt-format") == "fsdp_dtensor" and moe.env == {}   # Megatron-FSDP wants it unset
    # the expert all-to-all overlap needs several hardware queues; before Blackwell TP's userbuffers
    # overlap then loses its kernel order, which the plan prices and the notes say
    a2a = _plan("mixtral-8x7b", mp.Cluster.preset("dgx-h100", nodes=4), seq_len=4096, global_batch=256, ep=8,
                tp=2, etp=1, pp=1, zero=1, recompute="selective", ep_comm_overlap=True, tp_comm_overlap=True)
    ov = ex.megatron_export(a2a)
    assert "--overlap-moe-expert-parallel-comm" in ov.args and ov.env == {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    assert any("--tp-comm-overlap then hides nothing" in n for n in ov.notes)


@pytest.mark.parametrize("preset, fields", [
    # Megatron-LM's Mixtral recipe: a per-micro-batch loss of 1e-2 (models/presets.py)
    ("mixtral-8x7b", {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-2}),
    ("qwen3-30b-a3b", {"moe_router_load_balancing_type": "global_aux_loss", "moe_aux_loss_coeff": 1e-3}),
    ("deepseek-v3", {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-4,
                     "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 1e-3}),
    ("tiny-moe", {"moe_router_load_balancing_type": "none"}),
])
def test_exports_train_the_routers_balanced_as_the_preset_does(preset, fields):
    """A MoE preset's balancing reaches Megatron-LM's flags and the NeMo / Megatron-Bridge model
    config: without it Megatron trains with its default (aux_loss at coefficient 0, i.e. none)."""
    from meshplan.export.shape import ModelShape
    cfg = models.config(preset)
    got = ModelShape.from_config(cfg).balancing.megatron_fields()
    assert {k: got[k] for k in fields} == pytest.approx(fields)
    assert set(got) == set(fields)                      # nothing else switched on
    import dataclasses
    pl = _plan("mixtral-8x7b", mp.Cluster.preset("dgx-h100", nodes=2), seq_len=4096, global_batch=64,
               ep=8, tp=1, pp=1, zero=1)
    as_plan = dataclasses.replace(cfg, layers=32)            # the plan's layer count: the shape is kept
    args = list(ex.megatron_export(pl, as_plan).args)
    for name, value in fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in args
        if value is not True:
            got_value = _flag(args, flag)
            assert got_value == value if isinstance(value, str) else float(got_value) == pytest.approx(value)
    assert {a for a in args if a.startswith("--")} <= MEGATRON_FLAGS
    for flavor, prefix in (("nemo", "model.config."), ("megatron-bridge", "model.")):
        data = ex.nemo_export(pl, as_plan, flavor=flavor).data
        assert {k: data[prefix + k] for k in fields} == pytest.approx(fields)
    # variants the presets do not use: capacity dropping, z-loss, forced balance
    var = dataclasses.replace(cfg, moe_capacity_factor=1.25, moe_z_loss_coeff=1e-3, moe_force_balance=True)
    extra = ModelShape.from_config(var).balancing.megatron_fields()
    assert extra["moe_expert_capacity_factor"] == 1.25 and extra["moe_z_loss_coeff"] == 1e-3
    assert extra["moe_router_force_load_balancing"] is True
    # a shape read from a profile knows only the kind of balancing, not its settings: no flags
    prof = mp.profile_from_config(cfg, seq_len=4096)
    assert ModelShape.from_profile(prof).balancing is None


def test_deepseek_v3_exports_as_mla_with_group_limited_routing():
    """The deepseek-v3 preset reaches every target as DeepSeek-V3 (MLA, 8 groups keeping 4, weights
    scaled by 2.5), not as grouped-query attention; a dense GQA preset gets none of it."""
    import dataclasses
    cfg = models.config("deepseek-v3")
    pl = _plan("mixtral-8x7b", mp.Cluster.preset("dgx-h100", nodes=2), seq_len=4096, global_batch=64,
               ep=8, tp=1, pp=1, zero=1)
    as_plan = dataclasses.replace(cfg, layers=32)
    args = list(ex.megatron_export(pl, as_plan).args)
    assert {a for a in args if a.startswith("--")} <= MEGATRON_FLAGS
    assert "--multi-latent-attention" in args and "--qk-layernorm" in args and "--no-rope-fusion" in args
    want = {"--q-lora-rank": "1536", "--kv-lora-rank": "512", "--qk-head-dim": "128", "--qk-pos-emb-head-dim": "64",
            "--v-head-dim": "128", "--rope-type": "rope", "--moe-router-num-groups": "8",
            "--moe-router-group-topk": "4", "--moe-router-topk-scaling-factor": "2.5", "--num-attention-heads": "128"}
    assert {k: _flag(args, k) for k in want} == want
    assert not {"--group-query-attention", "--num-query-groups", "--kv-channels"} & set(args)
    fields = {"multi_latent_attention": True, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_head_dim": 128,
              "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "qk_layernorm": True, "rope_type": "rope",
              "moe_router_num_groups": 8, "moe_router_group_topk": 4, "moe_router_topk_scaling_factor": 2.5}
    for flavor, prefix in (("nemo", "model.config."), ("megatron-bridge", "model.")):
        data = ex.nemo_export(pl, as_plan, flavor=flavor).data
        assert {k: data[prefix + k] for k in fields} == fields
    dense = list(ex.megatron_export(pl, dataclasses.replace(models.config("llama3-8b"), layers=32)).args)
    assert not {"--multi-latent-attention", "--moe-router-num-groups", "--q-lora-rank"} & set(dense)
    # torchtitan: DeepSeek-V3's own flavor, matched on the MLA and routing sizes too
    from meshplan.export.torchtitan import _titan_flavor
    from meshplan.export.shape import ModelShape
    assert _titan_flavor(ModelShape.from_config(cfg)).flavor == "671B"
    assert _titan_flavor(ModelShape.from_config(cfg.replace(kv_lora_rank=256))) is None
    assert _titan_flavor(ModelShape.from_config(cfg.replace(moe_router_group_topk=2))) is None


def test_megatron_rejects_zero_bubble_and_notes_gpipe(plans):
    d = plans["uneven"].to_dict()
    zb = Plan.from_dict(dict(d, layout=dict(d["layout"], schedule="zb")))
    # Megatron-Core has no zero-bubble flag: say what it runs and what to re-plan with
    with pytest.raises(ConfigError, match=r"zero-bubble.*1F1B.*interleaved 1F1B.*fixed=\{'schedule': '1f1b'\}"):
        zb.to_megatron_args()
    for flavor, target in (("nemo", "NeMo 2"), ("megatron-bridge", "Megatron-Bridge")):
        with pytest.raises(ConfigError, match=f"{target} has no zero-bubble.*InterleavedZeroBubble"):
            zb.to_nemo(flavor=flavor)
    gp = Plan.from_dict(dict(d, layout=dict(d["layout"], schedule="gpipe")))
    assert any("GPipe" in n for n in ex.megatron_export(gp).notes)


def test_layers_are_found_through_plan_blocks_not_names(plans):
    """Stage sizes and the FP8 layer split come from plan.blocks, whatever the blocks are called
    (a regex for names ending in an index found no layers in 'trunk.layer_3')."""
    for name in ("fp8", "vp"):
        pl = plans[name]
        renamed = Plan.from_json(pl.to_json().replace('"layers.', '"trunk.layer_'))
        assert renamed.blocks[0] == "trunk.layer_0"
        a, b = ex.megatron_export(pl), ex.megatron_export(renamed)
        assert (a.args, a.notes) == (b.args, b.notes), name
        assert not any("could not be matched" in n for n in b.notes)
    # without blocks (and without model=) the stage sizes cannot be read
    d = plans["vp"].to_dict()
    bare = Plan.from_dict(dict(d, model="my-own-model", blocks=[]))
    with pytest.raises(ConfigError, match="plan.blocks"):
        ex.megatron_export(bare)


def test_megatron_text_is_a_shell_command(plans):
    pl = plans["fp8"]
    text = ex.export_text(pl, "megatron")
    lines = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert all(ln.endswith("\\") for ln in lines[:-1]) and not lines[-1].endswith("\\")
    words = shlex.split(" ".join(ln.rstrip("\\") for ln in lines))
    assert words[0] == "CUDA_DEVICE_MAX_CONNECTIONS=1" and "pretrain_gpt.py" in words
    assert words[words.index("pretrain_gpt.py") + 1:] == pl.to_megatron_args()
    assert "# names checked against Megatron-LM" in text


def test_shape_flags_need_a_known_model(plans):
    d = plans["vp"].to_dict()
    custom = Plan.from_dict(dict(d, model="my-own-model"))
    exp = ex.megatron_export(custom)
    assert "--hidden-size" not in exp.args and any("model=" in n for n in exp.notes)
    prof = mp.profile_from_config(models.config("llama3-70b"), seq_len=4096)
    assert _flag(custom.to_megatron_args(prof), "--hidden-size") == "8192"
    assert _flag(custom.to_megatron_args("llama3-70b"), "--ffn-hidden-size") == "28672"
    with pytest.raises(UnknownNameError):
        custom.to_megatron_args("no-such-model")


# ---- torchtitan -----------------------------------------------------------------------------------
def _check_titan_keys(cfg: dict) -> None:
    for section, body in cfg.items():
        if section == "quantize":
            assert set(body) == {"linear"} and set(body["linear"]) == {"float8"}
            assert set(body["linear"]["float8"]) <= TITAN_FLOAT8_KEYS
            continue
        assert set(body) <= TITAN_KEYS[section], (section, set(body) - TITAN_KEYS[section])


def test_torchtitan_toml_round_trips_with_known_keys(plans):
    for name, pl in plans.items():
        text = ex.export_text(pl, "torchtitan")
        cfg = tomllib.loads(text)
        assert cfg == pl.to_torchtitan(), name
        _check_titan_keys(cfg)
        par = cfg["parallelism"]
        world = (par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] * par["tensor_parallel_degree"]
                 * par["context_parallel_degree"] * par["pipeline_parallel_degree"])
        assert world == pl.world_size, name
        if par["pipeline_parallel_degree"] > 1:
            assert par["pipeline_parallel_schedule"] in TITAN_SCHEDULES


def test_torchtitan_pipeline_split_and_batches(plans):
    pl = plans["layout"]
    par = pl.to_torchtitan()["parallelism"]
    parts = par["module_fqns_per_model_part"]
    assert [sum(m.startswith("layers.") for m in p) for p in parts] == [9, 10, 10, 10, 10, 10, 10, 11]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    assert [m for p in parts for m in p if m.startswith("layers.")] == [f"layers.{i}" for i in range(80)]
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert "pipeline_parallel_layers_per_stage" not in par            # uneven: explicit parts only
    tr = pl.to_torchtitan()["training"]
    assert tr["local_batch_size"] * pl.layout.dp == 512 and par["pipeline_parallel_microbatch_size"] == pl.micro_batch_size
    ac = plans["uneven"].to_torchtitan()["activation_checkpoint"]
    # 3 of (at most) 11 layers per rank -> one layer in every 3, at least as many as planned
    assert ac == {"mode": "selective", "selective_ac_option": "3"}
    assert plans["vp"].to_torchtitan()["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    vp = plans["vp"].to_torchtitan()["parallelism"]
    # the stages are listed (pp x vp = 20 parts of 4 layers); layers_per_stage would be checked
    # against torchtitan's own model and stage count, so it is left out
    assert "pipeline_parallel_layers_per_stage" not in vp
    assert [sum(m.startswith("layers.") for m in p) for p in vp["module_fqns_per_model_part"]] == [4] * 20


def test_torchtitan_fp8_and_zero(plans):
    cfg = plans["fp8"].to_torchtitan()
    assert cfg["model"]["converters"] == ["quantize.linear.float8"]
    f8 = cfg["quantize"]["linear"]["float8"]
    # tensorwise is torchtitan's default (no recipe_name), the one recipe FSDP may all-gather in float8
    assert "recipe_name" not in f8 and "output" in f8["filter_fqns"] and f8["enable_fsdp_float8_all_gather"]
    assert cfg["model"]["name"] == "llama3" and cfg["model"]["flavor"] == "8B"
    assert cfg["parallelism"]["data_parallel_shard_degree"] == plans["fp8"].layout.dp
    assert cfg["parallelism"]["fsdp_reshard_after_forward"] == "never"      # ZeRO-1 -> FSDP, no reshard


def test_torchtitan_runs_zb_h1_as_interleaved_zero_bubble(plans):
    """The planner's frequent ZB-H1 ('zb', one stage per rank) maps to torch.distributed.pipelining's
    InterleavedZeroBubble with one stage per rank; torchtitan refuses that schedule class with fewer
    than 2 stages per rank when pipeline_parallel_layers_per_stage is set, so it is left out."""
    for name in ("uneven", "moe"):
        d = plans[name].to_dict()
        zb = Plan.from_dict(dict(d, layout=dict(d["layout"], schedule="zb")))
        exp = ex.torchtitan_export(zb)
        par = exp.data["parallelism"]
        assert par["pipeline_parallel_schedule"] == "InterleavedZeroBubble" in TITAN_SCHEDULES
        assert "pipeline_parallel_layers_per_stage" not in par
        assert len(par["module_fqns_per_model_part"]) == zb.layout.pp       # one stage per rank
        assert any("ZB-H1" in n for n in exp.notes)
        assert tomllib.loads(ex.export_text(zb, "torchtitan")) == exp.data
    # torch's ScheduleInterleavedZeroBubble needs n_microbatches % max(1, n_microbatches // pp) == 0
    d = plans["uneven"].to_dict()                      # pp=8, dp=1; at mbs=2 a micro-batch is 2 sequences
    odd = Plan.from_dict(dict(d, global_batch=2 * 9 * 2, num_microbatches=18,
                              layout=dict(d["layout"], schedule="zb", mbs=2)))     # 18 micro-batches: 18 % 2 == 0
    assert ex.to_torchtitan(odd)["parallelism"]["pipeline_parallel_schedule"] == "InterleavedZeroBubble"
    bad = Plan.from_dict(dict(d, global_batch=2 * 25, num_microbatches=25,
                              layout=dict(d["layout"], schedule="zb", mbs=2)))     # 25 % 3 != 0
    with pytest.raises(ConfigError, match="multiple of"):
        bad.to_torchtitan()


def test_torchtitan_rejects_what_it_cannot_run(plans):
    m = plans["moe"].to_dict()
    bad = Plan.from_dict(dict(m, layout=dict(m["layout"], etp=4, tp=2)))
    with pytest.raises(ConfigError, match="etp=1 or etp=2"):
        bad.to_torchtitan()


# ---- NeMo 2 / Megatron-Bridge -----------------------------------------------------------------------
def _check_prefixed(keys, prefixes) -> None:
    for key in keys:
        prefix = max((p for p in prefixes if key.startswith(p)), key=len, default=None)
        assert prefix is not None, key
        assert key[len(prefix):] in prefixes[prefix], key


def test_nemo_and_bridge_keys_are_known(plans):
    for name, pl in plans.items():
        _check_prefixed(pl.to_nemo(), NEMO_PREFIXES)
        builder = pl.model.startswith("llama")        # the Llama recipes are builder-backed
        _check_prefixed(pl.to_nemo(flavor="megatron-bridge"), BRIDGE_BUILDER_PREFIXES if builder else BRIDGE_PREFIXES)


def test_nemo_values(plans):
    o = plans["vp"].to_nemo()
    assert o["trainer.strategy.tensor_model_parallel_size"] == 8
    assert o["trainer.strategy.virtual_pipeline_model_parallel_size"] == 5
    assert o["trainer.strategy.sequence_parallel"] is True
    assert o["model.config.recompute_granularity"] == "selective"
    assert (o["data.micro_batch_size"], o["data.global_batch_size"]) == (plans["vp"].micro_batch_size, 512)
    f = plans["fp8"].to_nemo(flavor="megatron-bridge")
    # Bridge recipes name their mixed precision ("bf16_mixed"): an override replaces the name
    assert f["mixed_precision"] == "bf16_with_fp8_current_scaling_mixed"
    assert not any(k.startswith("mixed_precision.") for k in f)
    # an arbitrary split: NeMo 2's MegatronStrategy and Megatron-Bridge both take the layout string
    exp = ex.nemo_export(plans["layout"])
    assert exp.data["trainer.strategy.pipeline_model_parallel_layout"].startswith("Et*9|")
    assert exp.data["trainer.strategy.num_layers_in_first_pipeline_stage"] is None
    assert not any("even split" in n for n in exp.notes)
    bridge = plans["layout"].to_nemo(flavor="megatron-bridge")      # llama3-70b: a builder-backed recipe
    assert bridge["model.transformer.pipeline_model_parallel_layout"].startswith("Et*9|")
    u = plans["uneven"].to_nemo()
    assert (u["trainer.strategy.num_layers_in_first_pipeline_stage"], u["model.config.recompute_num_layers"]) == (9, 3)
    with pytest.raises(UnknownNameError):
        plans["vp"].to_nemo(flavor="nemo1")


def test_override_text(plans):
    text = ex.export_text(plans["vp"], "megatron-bridge")
    body = [ln for ln in text.splitlines() if not ln.startswith("#")]
    kv = dict(shlex.split(ln)[0].split("=", 1) for ln in body)
    assert kv["model.transformer.tensor_model_parallel_size"] == "8"      # llama3-70b: builder-backed recipe
    assert kv["model.transformer.sequence_parallel"] == "true"
    assert kv["model.transformer.recompute_modules"] == '["core_attn"]'
    assert kv["model.seq_length"] == "4096"
    nemo = ex.export_text(plans["fp8"], "nemo")
    vp = plans["fp8"].layout.vp        # NeMo spells "no interleaving" None
    assert f"trainer.strategy.virtual_pipeline_model_parallel_size={vp if vp > 1 else None}" in nemo
    with pytest.raises(UnknownNameError, match="megatron"):
        ex.export_text(plans["fp8"], "deepspeed")


def test_cli_plan_export(plans, monkeypatch, capsys):
    from meshplan import cli
    monkeypatch.setattr(mp, "plan", lambda *a, **k: plans["vp"])   # skip tracing: the wiring is under test
    assert cli.main(["plan", "--model", "llama3-70b", "--export", "torchtitan"]) == 0
    out = capsys.readouterr().out
    cfg = tomllib.loads(out[out.index("# meshplan plan for"):])
    assert cfg["parallelism"]["tensor_parallel_degree"] == 8


@pytest.mark.parametrize("fmt", ex.FORMATS)
def test_cli_plan_export_reaches_every_format(plans, monkeypatch, capsys, fmt):
    """`meshplan plan --export` offers every format export_text prints (megatron-bridge was missing)."""
    from meshplan import cli
    monkeypatch.setattr(mp, "plan", lambda *a, **k: plans["vp"])
    assert cli.main(["plan", "--model", "llama3-70b", "--export", fmt]) == 0
    out = capsys.readouterr().out
    assert out[out.index("# meshplan plan for"):].rstrip("\n") == ex.export_text(plans["vp"], fmt)


# ---- the targets' own parsers, where available --------------------------------------------------------
def test_megatron_real_parser(plans):
    src = os.environ.get("MESHPLAN_MEGATRON_SRC")
    if not src or not os.path.isdir(os.path.join(src, "megatron")):
        pytest.skip("set MESHPLAN_MEGATRON_SRC to a Megatron-LM checkout to parse with its argparse")
    import argparse
    import typing
    sys.path.insert(0, src)
    if not hasattr(typing, "override"):       # Megatron uses the Python 3.12 typing.override
        import typing_extensions
        typing.override = typing_extensions.override
    from megatron.training.arguments import add_megatron_arguments
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    for pl in plans.values():
        args = parser.parse_args(pl.to_megatron_args())
        assert args.tensor_model_parallel_size == pl.layout.tp
        assert args.micro_batch_size == pl.micro_batch_size


def test_torchtitan_real_parser(plans, tmp_path):
    job_config = pytest.importorskip("torchtitan.config.job_config", reason="torchtitan <= 0.2 not installed")
    from torchtitan.config import ConfigManager
    assert job_config.JobConfig
    for name, pl in plans.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(ex.export_text(pl, "torchtitan"))
        cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
        assert cfg.parallelism.tensor_parallel_degree == pl.layout.tp
