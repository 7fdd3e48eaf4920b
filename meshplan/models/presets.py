"""Named presets of published architectures, plus tiny models for CPU tests and examples.

A preset is a plain dict of the `ModelConfig` fields it sets; the rest is derived from the
family, so overriding a size re-derives what depends on it. Each entry cites where its numbers
come from. Parameter totals (from `ModelConfig.num_params`) are listed in docs/models.md.
"""

from __future__ import annotations

from meshplan.errors import UnknownNameError
from meshplan.models.config import ModelConfig, _check_keys

__all__ = ["PRESETS", "presets", "config"]

_LLAMA3 = dict(family="llama", vocab=128256, seq_len=8192, rope_theta=500000.0, norm_eps=1e-5)
_LLAMA2 = dict(family="llama", vocab=32000, seq_len=4096, rope_theta=10000.0, norm_eps=1e-5)
# Megatron-LM pads GPT-2's 50257-token vocabulary to a multiple of 128 * TP (51200 at TP=8);
# Narayanan et al. SC'21 size their models with V=51200, so the GPT presets do the same.
_GPT3 = dict(family="gpt", vocab=51200, seq_len=2048, norm_eps=1e-5)

PRESETS: dict[str, dict[str, object]] = {
    # --- GPT-3 (Brown et al. 2020, arXiv 2005.14165, Table 2.1; 2048-token context) ---------
    "gpt3-1.3b": dict(_GPT3, layers=24, hidden=2048, heads=16),
    "gpt3-2.7b": dict(_GPT3, layers=32, hidden=2560, heads=32),
    "gpt3-6.7b": dict(_GPT3, layers=32, hidden=4096, heads=32),
    # Table 2.1 lists d_model 5140 with 40 heads of 128; Megatron and most re-implementations use 5120.
    "gpt3-13b": dict(_GPT3, layers=40, hidden=5120, heads=40),
    "gpt3-175b": dict(_GPT3, layers=96, hidden=12288, heads=96),
    # --- Megatron GPT sizes (Narayanan et al. SC'21, arXiv 2104.04473, Table 1; Korthikanti
    # et al. 2022, arXiv 2205.05198, Table 3) used by the published-run validation -----------
    "megatron-22b": dict(_GPT3, layers=48, hidden=6144, heads=64),
    "megatron-530b": dict(_GPT3, layers=105, hidden=20480, heads=128),
    "megatron-1t": dict(_GPT3, layers=128, hidden=25600, heads=160),
    # --- Llama 2 (Touvron et al. 2023, arXiv 2307.09288; meta-llama/Llama-2-*-hf config.json)
    "llama2-7b": dict(_LLAMA2, layers=32, hidden=4096, heads=32, ffn_hidden=11008),
    "llama2-13b": dict(_LLAMA2, layers=40, hidden=5120, heads=40, ffn_hidden=13824),
    "llama2-70b": dict(_LLAMA2, layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672),
    # --- Llama 3 (Llama 3 herd paper, arXiv 2407.21783, Table 3; meta-llama/Meta-Llama-3.1-*
    # config.json). seq_len is the 8K pre-training context, not the 128K long-context stage.
    "llama3-8b": dict(_LLAMA3, layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336),
    "llama3-70b": dict(_LLAMA3, layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672),
    "llama3-405b": dict(_LLAMA3, layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248),
    # --- Mixtral (Jiang et al. 2024, arXiv 2401.04088; mistralai/Mixtral-8x7B-v0.1 and
    # Mixtral-8x22B-v0.1 config.json: softmax top-2 of 8, no shared experts) ----------------
    # Balancing: the paper names no load-balancing loss or coefficient. Mistral's released configs
    # carry transformers' `router_aux_loss_coef` (0.02 for 8x7B, 0.001 for 8x22B), but transformers'
    # loss pools every layer's tokens into one loss worth k when balanced, where meshplan (like
    # Megatron-Core) adds one loss per layer worth 1: 0.02 there pulls each router as ~0.02 k / L =
    # 0.00125 does here. Taken instead: Megatron-LM's own Mixtral recipe (examples/mixtral,
    # --moe-aux-loss-coeff 1e-2 per layer, the normalisation meshplan uses), per micro-batch
    # ("local", as both frameworks compute it).
    "mixtral-8x7b": dict(
        family="moe", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=32000,
        seq_len=32768, rope_theta=1e6, experts=8, topk=2, norm_eps=1e-5,
        moe_aux_loss_coeff=0.01, moe_aux_loss_scope="local"),
    "mixtral-8x22b": dict(
        family="moe", layers=56, hidden=6144, heads=48, kv_heads=8, ffn_hidden=16384, vocab=32000,
        seq_len=65536, rope_theta=1e6, experts=8, topk=2, norm_eps=1e-5,
        moe_aux_loss_coeff=0.01, moe_aux_loss_scope="local"),
    # --- Qwen3 MoE (Qwen3 technical report, arXiv 2505.09388, Table 2; Qwen/Qwen3-30B-A3B and
    # Qwen3-235B-A22B config.json: head_dim 128, 128 experts, top-8 renormalised, no shared
    # expert). Not modelled: the per-head RMSNorm on q and k (2 * 128 weights per layer).
    # Balancing: the report (Sec. 2) trains with the global-batch load-balancing loss (Qiu et al.
    # 2025, arXiv 2501.11873): expert counts gathered over the whole global batch, i.e. meshplan's
    # scope "global" (Megatron's global_aux_loss); the coefficient, absent from the report, is the
    # config.json's router_aux_loss_coef 0.001 (also transformers' Qwen3MoeConfig default).
    "qwen3-30b-a3b": dict(
        family="moe", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn_hidden=6144,
        moe_ffn_hidden=768, experts=128, topk=8, vocab=151936, seq_len=32768, rope_theta=1e6,
        norm_eps=1e-6, moe_aux_loss_coeff=0.001, moe_aux_loss_scope="global"),
    "qwen3-235b-a22b": dict(
        family="moe", layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128, ffn_hidden=12288,
        moe_ffn_hidden=1536, experts=128, topk=8, vocab=151936, seq_len=32768, rope_theta=1e6,
        norm_eps=1e-6, moe_aux_loss_coeff=0.001, moe_aux_loss_scope="global"),
    # --- DeepSeek-V3 (arXiv 2412.19437, Sec. 4.2; deepseek-ai/DeepSeek-V3 config.json):
    # 61 layers, first 3 dense (ffn 18432), then 256 routed experts (top-8, sigmoid scores with
    # a selection bias) + 1 shared expert of 2048.
    # Multi-head latent attention (Sec. 2.1.1, models/mla.py): 128 heads, queries through a
    # 1536-rank latent, keys and values through a 512-rank latent, query/key heads of 128 + 64
    # rotary channels, values of 128; softmax scale 1/sqrt(192). YaRN (Sec. 4.3) extends the
    # context after pre-training and is not modelled (it rescales nothing at the 4K context).
    # Routing (Sec. 2.1.2, config.json n_group 8, topk_group 4, routed_scaling_factor 2.5,
    # norm_topk_prob true): each token's top-8 lie in its 4 best of 8 expert groups (a group
    # scored by its two best biased scores), weights renormalised over the 8 and scaled by 2.5.
    # Multi-token prediction (Sec. 2.2 and 4.2): D = 1 depth, its loss weight lambda 0.3 for the
    # first 10T tokens, then 0.1 (a schedule not modelled: pass mtp_loss_weight=0.1 for that phase;
    # mtp_depth=0 drops the depth). The depth's block is a MoE block, run and priced as the last
    # layer (its experts sharded by EP, runtime/mtp_parallel.py).
    # Balancing (Sec. 2.1.2 and 4.2): auxiliary-loss-free, the selection bias moved by
    # gamma = 0.001 per step against each expert's load (meshplan's moe_expert_bias, same sign
    # rule; the paper's gamma = 0 for the last 500B tokens is a schedule not modelled), plus the
    # complementary sequence-wise balance loss alpha = 0.0001 (same normalisation as meshplan's
    # loss, over the sigmoid scores normalised per token). meshplan has no per-sequence scope: the
    # nearest is "local", each rank's micro-batch, one sequence per micro-batch at mbs 1.
    "deepseek-v3": dict(
        family="moe", layers=61, hidden=7168, heads=128, attention="mla", q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, ffn_hidden=18432,
        moe_ffn_hidden=2048, experts=256, topk=8, shared_experts=1, dense_layers=3, router="sigmoid",
        moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
        vocab=129280, seq_len=4096, rope_theta=10000.0, norm_eps=1e-6,
        moe_expert_bias=True, moe_bias_update_rate=0.001, moe_aux_loss_coeff=0.0001, moe_aux_loss_scope="local",
        mtp_depth=1, mtp_loss_weight=0.3),
    # --- GPT-OSS (OpenAI gpt-oss-120b / gpt-oss-20b model card, 2025; transformers GptOssConfig and
    # openai/gpt-oss-*b config.json): 36 (20b: 24) layers of width 2880, 64 query heads and 8 KV heads
    # of head_dim 64 (q width 4096 != hidden), biases on the attention projections, 128 (20b: 32)
    # routed experts top-4 of width 2880, no shared expert, vocabulary 201088 (o200k_harmony),
    # untied output, RMSNorm eps 1e-5, RoPE theta 150000 over a 4096-token pre-training context
    # (YaRN extends it to 131072 afterwards; not modelled). layer_types alternate
    # "sliding_attention" / "full_attention" starting with sliding, sliding_window 128: meshplan's
    # "alternate" pattern. Attention sinks: a learned logit per head in each softmax denominator.
    # Not modelled: the experts' and router's biases (~0.1% of the parameters), the clamped
    # SwiGLU (alpha 1.702, limit 7; priced and run as SwiGLU) and the router's softmax over only the
    # top-4 logits. Balancing: the model card names none; taken Megatron-Core's per-layer 1e-2
    # aux loss per micro-batch, as for Mixtral above.
    "gpt-oss-120b": dict(
        family="moe", layers=36, hidden=2880, heads=64, kv_heads=8, head_dim=64, ffn_hidden=2880,
        moe_ffn_hidden=2880, experts=128, topk=4, vocab=201088, seq_len=4096, rope_theta=150000.0,
        norm_eps=1e-5, bias=True, sliding_window=128, sliding_window_pattern="alternate",
        attention_sinks=True, moe_aux_loss_coeff=0.01, moe_aux_loss_scope="local"),
    "gpt-oss-20b": dict(
        family="moe", layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64, ffn_hidden=2880,
        moe_ffn_hidden=2880, experts=32, topk=4, vocab=201088, seq_len=4096, rope_theta=150000.0,
        norm_eps=1e-5, bias=True, sliding_window=128, sliding_window_pattern="alternate",
        attention_sinks=True, moe_aux_loss_coeff=0.01, moe_aux_loss_scope="local"),
    # --- Tiny models for CPU training and tests (byte-level vocabulary) ---------------------
    # tiny-moe ships with nothing balancing its router, on purpose: it is the unbalanced case the
    # tests and the imbalance band are calibrated on (cost_models/uncertainty.py); pass
    # moe_aux_loss_coeff / moe_expert_bias / moe_force_balance to train it balanced.
    "tiny-gpt": dict(family="gpt", layers=4, hidden=128, heads=4, vocab=256, seq_len=256),
    "tiny-llama": dict(
        family="llama", layers=4, hidden=128, heads=4, kv_heads=2, ffn_hidden=384, vocab=256, seq_len=256),
    "tiny-moe": dict(
        family="moe", layers=4, hidden=128, heads=4, kv_heads=2, ffn_hidden=384, moe_ffn_hidden=96,
        experts=4, topk=2, shared_experts=1, dense_layers=1, vocab=256, seq_len=256),
}


def presets() -> list[str]:
    """Names accepted by `build` and `config`, sorted."""
    return sorted(PRESETS)


def config(name: str, **overrides: object) -> ModelConfig:
    """The `ModelConfig` of preset ``name``, with ``overrides`` applied before derivation."""
    if name not in PRESETS:
        raise UnknownNameError("model", name, presets())
    _check_keys(overrides)
    fields = {**PRESETS[name], "name": name, **overrides}
    return ModelConfig(**fields)  # type: ignore[arg-type]
