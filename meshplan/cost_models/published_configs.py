"""What the frameworks behind the published runs set that the rows themselves do not state, each
read from the framework's own configs at the release the row names (cost_models.validation applies
them to the rows)."""

from __future__ import annotations

from typing import Any

__all__ = ["BRIDGE_PERF_MODEL", "BRIDGE_PERF_CONFIGS", "NEMO_LAUNCHER_CONFIGS", "NEMO_LAUNCHER_ATTN_KERNEL"]

# What Megatron-Bridge's performance configs set and its summary rows do not state, for the rows the
# configs match exactly (GPU, GPU count, global batch, parallel degrees, precision):
# NVIDIA-NeMo/Megatron-Bridge scripts/performance/configs/{deepseek/deepseek,gpt_oss/gpt_oss,qwen/qwen3}_
# workload_base_configs.py (DEEPSEEK_V3_PRETRAIN_CONFIG_B200_FP8_MX_V2: DeepEP dispatch, moe_a2a_overlap,
# recompute_modules [mla_up_proj, mlp]; GPT_OSS_120B_PRETRAIN_CONFIG_H100_BF16_V2: recompute_modules
# [layernorm, moe_act]; QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1: HybridEP dispatch). HybridEP, like
# DeepEP, sends a token once per destination GPU within NVLink and once per destination node across it:
# the Layout's "deepep" dispatcher prices both.
# The model the config trains where it differs from the preset: DeepSeek-V3 with its one MTP depth
# (pp_layout "Et*4|(t*4|)*14tmL": "m" is the MTP layer).
BRIDGE_PERF_MODEL: dict[str, dict[str, Any]] = {"mb-2604.01-deepseekv3-b200": dict(mtp_depth=1)}
BRIDGE_PERF_CONFIGS: dict[str, dict[str, Any]] = {
    "mb-2604.01-deepseekv3-b200": dict(moe_dispatcher="deepep", ep_comm_overlap=True, recompute="mla_up"),
    "mb-2604.01-gptoss-120b-h100": dict(recompute="norm_act"),
    "mb-2604.01-qwen3-30b-a3b-h100": dict(moe_dispatcher="deepep"),
    "mb-2604.01-qwen3-235b-a22b-h100": dict(ep_comm_overlap=True),
    "mb-2604.01-llama3-70b-h100": dict(tp_comm_overlap=True),
    "mb-2604.01-llama31-405b-h100": dict(tp_comm_overlap=True, recompute="none"),
}


# What NeMo-Framework-Launcher's config for the model sets and the NeMo 24.07 summary does not state:
# conf/training/nemotron/nemotron_340b.yaml (tags 24.07-24.12; 24.12 has the summary's pp 8 / vp 12) runs
# selective recompute and distributed_fused_adam with dtype bf16 (bf16 moments, no main weights: memory.master_bytes)
NEMO_LAUNCHER_CONFIGS = {"nemo2407-nemotron-340b-128gpu": dict(recompute="selective", optimizer_dtype="bf16")}


# The attention kernel the NeMo 1.x performance runs (NeMo 24.03.01 long-sequence page, NeMo 24.07
# performance summary) ran: FlashAttention-2, not cuDNN. Transformer Engine would pick cuDNN's fused
# attention on Hopper (TE 1.4 attention.py: "Select FusedAttention on sm90"), but
# NeMo-Framework-Launcher's launcher_scripts/conf/config.yaml sets env_vars NVTE_FUSED_ATTN: 0
# ("Disable cudnn FA until we've tested it more") in every release from 24.01 through 24.07 (tags
# 24.01, 24.03, 24.03.01, 24.05, 24.07); commit 04b8d098 (2024-08-29, "enable fused attention")
# removed it for 24.09. With cuDNN disabled TE runs its FlashAttention backend (flash-attn 2).
# Megatron-LM, the Model Zoo and Megatron-Bridge leave TE's choice (cuDNN on Hopper) in place.
NEMO_LAUNCHER_ATTN_KERNEL = "fa2"
