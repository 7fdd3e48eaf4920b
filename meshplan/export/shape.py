"""The model's shape as the exports need it (Megatron's model flags): `ModelShape`, read from a
ModelConfig, a ModelProfile, a config mapping or a preset name (`model_shape`).

A Plan records the model's name, not its shape; when that name is a meshplan preset the shape
comes from the preset, otherwise the caller passes `model=`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from meshplan.errors import ConfigError, UnknownNameError
from meshplan.ir.profile import ModelProfile

__all__ = ["ModelShape", "MoEBalancing", "model_shape"]


@dataclass(frozen=True, kw_only=True)
class MoEBalancing:
    """A routed model's balancing settings (models.ModelConfig moe_*), as the exports pass them on."""

    aux_loss_coeff: float = 0.0
    aux_loss_scope: str = "global"    # "global": over dp x cp ranks and micro-batches; "local": per rank
    z_loss_coeff: float = 0.0
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    capacity_factor: float | None = None
    force_balance: bool = False

    @classmethod
    def from_config(cls, cfg: Any) -> "MoEBalancing":
        return cls(aux_loss_coeff=cfg.moe_aux_loss_coeff, aux_loss_scope=cfg.moe_aux_loss_scope,
                   z_loss_coeff=cfg.moe_z_loss_coeff, expert_bias=cfg.moe_expert_bias,
                   bias_update_rate=cfg.moe_bias_update_rate, capacity_factor=cfg.moe_capacity_factor,
                   force_balance=cfg.moe_force_balance)

    def megatron_fields(self) -> dict[str, Any]:
        """Megatron-Core TransformerConfig fields (also its `--` flags, with dashes) that train the
        model balanced as meshplan does: the loss's scope maps to `aux_loss` (per micro-batch on
        each rank) or `global_aux_loss` (counts over the data-parallel ranks); no loss is `none`,
        not Megatron's default `aux_loss` at coefficient 0, so the choice is explicit."""
        kind = ("global_aux_loss" if self.aux_loss_scope == "global" else "aux_loss") if self.aux_loss_coeff \
            else "none"
        out: dict[str, Any] = {"moe_router_load_balancing_type": kind}
        if self.aux_loss_coeff:
            out["moe_aux_loss_coeff"] = self.aux_loss_coeff
        if self.z_loss_coeff:
            out["moe_z_loss_coeff"] = self.z_loss_coeff
        if self.expert_bias:
            out["moe_router_enable_expert_bias"] = True
            out["moe_router_bias_update_rate"] = self.bias_update_rate
        if self.capacity_factor is not None:
            out["moe_expert_capacity_factor"] = self.capacity_factor
        if self.force_balance:
            out["moe_router_force_load_balancing"] = True
        return out


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The architecture numbers the exports need (Megatron's model flags)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    vocab: int
    gated: bool = True            # SwiGLU
    norm: str = "rmsnorm"
    rope: bool = True
    rope_theta: float = 10000.0
    bias: bool = False
    tied: bool = False
    experts: int = 0
    topk: int = 0
    moe_ffn_hidden: int = 0
    shared_ffn_hidden: int = 0
    dense_layers: int = 0         # leading layers with a dense MLP in an MoE model
    sigmoid_router: bool = False
    # group-limited routing and the routed weights' scale (ModelConfig.moe_router_*): 0 groups = none
    router_groups: int = 0
    router_group_topk: int = 0
    router_scaling: float | None = None
    # multi-head latent attention (ModelConfig.attention == "mla"): kv_lora_rank 0 = not MLA;
    # q_lora_rank 0 = a full-rank query projection
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # how the routers are kept balanced while training (ModelConfig's moe_* options); None where the
    # shape came from a profile, which records only the kind (ModelProfile.moe_balance)
    balancing: "MoEBalancing | None" = None
    # multi-token prediction (ModelConfig.mtp_*): depths, and the loss weight where the shape came
    # from a config (None from a profile, which records only the depths)
    mtp_depth: int = 0
    mtp_loss_weight: float | None = None
    # sliding-window attention: each layer's window in tokens (0: full causal), () when no layer has
    # one; attention sinks (a learned per-head softmax logit, GPT-OSS)
    layer_windows: tuple[int, ...] = ()
    attention_sinks: bool = False
    source: str = ""

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def megatron_attention_routing_fields(self) -> dict[str, Any]:
        """Megatron-Core TransformerConfig / MLATransformerConfig fields for MLA and for
        group-limited, scaled routing (what NeMo 2 and Megatron-Bridge configs take; the
        Megatron-LM export passes the same as flags). MLA's latent norms exist in Megatron-Core
        only with qk_layernorm; its default YaRN RoPE is swapped for the plain RoPE meshplan trains
        with (the fused rope kernel runs YaRN only)."""
        out: dict[str, Any] = {}
        if self.mla:
            out.update(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=self.q_lora_rank or None,
                       kv_lora_rank=self.kv_lora_rank, qk_head_dim=self.qk_nope_head_dim,
                       qk_pos_emb_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
                       rope_type="rope", apply_rope_fusion=False)
        if self.experts and self.router_groups:
            out.update(moe_router_num_groups=self.router_groups, moe_router_group_topk=self.router_group_topk)
        if self.experts and self.router_scaling is not None:
            out["moe_router_topk_scaling_factor"] = self.router_scaling
        window = self.megatron_window()
        if window is not None:
            out.update(window_size=window[0], window_attn_skip_freq=window[1])
        if self.attention_sinks:
            out["softmax_type"] = "learnable"
        return out

    def megatron_window(self) -> tuple[tuple[int, int], int | list[int] | None] | None:
        """Megatron-Core's (window_size, window_attn_skip_freq) for the sliding windows, None without.
        window_size is (keys left of the query, keys right): meshplan's window w (the query and its
        w - 1 predecessors, transformers' convention) is (w - 1, 0). window_attn_skip_freq: N when
        every N-th layer (1-based) is full attention (GPT-OSS's alternation, layer 0 windowed: 2),
        None when all layers are windowed, else the per-layer list (1: windowed, 0: full)."""
        sizes = sorted({w for w in self.layer_windows if w})
        if not sizes:
            return None
        if len(sizes) > 1:
            raise ConfigError(f"sliding windows of {sizes} tokens on different layers: Megatron-Core applies one "
                              "window_size to every windowed layer; give the windowed layers one window")
        pattern = [1 if w else 0 for w in self.layer_windows]
        if all(pattern):
            return (sizes[0] - 1, 0), None
        for n in range(2, len(pattern) + 1):
            if pattern == [0 if (i + 1) % n == 0 else 1 for i in range(len(pattern))]:
                return (sizes[0] - 1, 0), n
        return (sizes[0] - 1, 0), pattern

    def group_score_note(self) -> str:
        """A note where Megatron-Core's group score (the sum of a group's top topk / group_topk
        scores) differs from meshplan's (its top 2, DeepSeek-V3's rule); "" where they agree."""
        if not (self.experts and self.router_groups) or self.topk // max(1, self.router_group_topk) == 2:
            return ""
        return (f"routing: Megatron-Core scores an expert group by its top {self.topk // self.router_group_topk} "
                f"scores (topk / group_topk), meshplan by its top 2; the groups kept may differ")

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn_hidden", "vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"model shape {name}={v!r}: must be a positive integer")

    @classmethod
    def from_config(cls, cfg: Any, source: str = "") -> "ModelShape":
        return cls(layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads,
                   head_dim=cfg.head_dim, ffn_hidden=cfg.ffn_hidden, vocab=cfg.vocab,
                   gated=cfg.activation == "swiglu", norm=cfg.norm, rope=cfg.position == "rope",
                   rope_theta=float(cfg.rope_theta), bias=bool(cfg.bias), tied=bool(cfg.tie_embeddings),
                   experts=cfg.experts, topk=cfg.topk,
                   moe_ffn_hidden=cfg.moe_ffn_hidden if cfg.experts else 0,
                   shared_ffn_hidden=cfg.shared_experts * cfg.moe_ffn_hidden if cfg.experts else 0,
                   dense_layers=cfg.dense_layers if cfg.experts else 0,
                   sigmoid_router=cfg.router == "sigmoid",
                   router_groups=(cfg.moe_router_num_groups or 0) if cfg.experts else 0,
                   router_group_topk=(cfg.moe_router_group_topk or 0) if cfg.experts else 0,
                   router_scaling=cfg.moe_router_topk_scaling_factor if cfg.experts else None,
                   **_mla_fields(cfg),
                   balancing=MoEBalancing.from_config(cfg) if cfg.experts else None,
                   mtp_depth=cfg.mtp_depth, mtp_loss_weight=float(cfg.mtp_loss_weight) if cfg.mtp_depth else None,
                   layer_windows=(tuple(cfg.layer_window(i) for i in range(cfg.layers))
                                  if getattr(cfg, "sliding_window", 0) else ()),
                   attention_sinks=bool(getattr(cfg, "attention_sinks", False)),
                   source=source or f"model config {cfg.name!r}")

    @classmethod
    def from_profile(cls, prof: Any) -> "ModelShape":
        blocks = prof.layer_blocks()
        attn = [b for b in blocks if b.heads]
        if not blocks or not attn:
            raise ConfigError(f"profile {prof.name!r} has no attention blocks to read a shape from")
        a = attn[0]
        moe = [b for b in blocks if b.is_moe]
        dense = [b for b in blocks if b.ffn_hidden]
        m = moe[0] if moe else None
        lead = 0
        while lead < len(blocks) and not blocks[lead].is_moe:
            lead += 1
        return cls(layers=len(blocks), hidden=prof.hidden, heads=a.heads, kv_heads=a.kv_heads,
                   head_dim=a.head_dim, ffn_hidden=(dense[0].ffn_hidden if dense else m.moe_ffn_hidden),
                   vocab=prof.vocab, gated=(dense[0] if dense else a).gated, norm=a.norm,
                   bias=any(li.bias for li in a.linears), tied=prof.tied_embeddings,
                   experts=m.experts if m else 0, topk=m.topk if m else 0,
                   moe_ffn_hidden=m.moe_ffn_hidden if m else 0, shared_ffn_hidden=m.shared_ffn_hidden if m else 0,
                   dense_layers=lead if m else 0, mtp_depth=prof.mtp_depth, source=f"model profile {prof.name!r}",
                   layer_windows=(tuple(b.attn_window for b in blocks) if any(b.attn_window for b in blocks) else ()),
                   attention_sinks=any(b.attn_sinks for b in attn),
                   **_mla_from_block(a))


def _mla_from_block(b: Any) -> dict[str, int]:
    """MLA's sizes read back from a profiled block's linears: the down-projections (role
    "attn_down") feed up-projections whose input width is their latent rank; the key/value one
    is wider than its latent by the shared rotary key. {} for other attention."""
    down = [li for li in b.linears if li.role == "attn_down"]
    ranks = sorted({li.in_features for li in b.linears if li.role == "attn_qkv"})
    kv = [li for li in down if li.out_features not in ranks]
    if len(kv) != 1:
        return {}
    kv_lora = max((r for r in ranks if r < kv[0].out_features), default=0)
    rope = kv[0].out_features - kv_lora
    q = [li for li in down if li is not kv[0]]
    if not kv_lora or not 0 < rope < b.head_dim:
        return {}
    return dict(q_lora_rank=q[0].out_features if q else 0, kv_lora_rank=kv_lora, qk_nope_head_dim=b.head_dim - rope,
                qk_rope_head_dim=rope, v_head_dim=getattr(b, "v_head_dim", 0) or b.head_dim)


def _mla_fields(cfg: Any) -> dict[str, int]:
    if getattr(cfg, "attention", "gqa") != "mla":
        return {}
    return dict(q_lora_rank=cfg.q_lora_rank or 0, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim)


def model_shape(plan: Any, model: Any = None) -> ModelShape | None:
    """The model's shape from `model` (ModelShape, ModelConfig, ModelProfile, config mapping or
    preset name), else from the plan's model name when it is a meshplan preset, else None."""
    # meshplan.models imports torch: only when a shape is asked for (`import meshplan.api` stays light)
    from meshplan.models.config import ModelConfig
    from meshplan.models.presets import PRESETS, config
    if model is None:
        if plan.model in PRESETS:
            return ModelShape.from_config(config(plan.model), source=f"meshplan preset {plan.model!r}")
        return None
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, ModelConfig):
        return ModelShape.from_config(model)
    if isinstance(model, ModelProfile):
        return ModelShape.from_profile(model)
    if isinstance(model, str):
        if model not in PRESETS:
            raise UnknownNameError("model preset", model, list(PRESETS))
        return ModelShape.from_config(config(model), source=f"meshplan preset {model!r}")
    if isinstance(model, Mapping):
        return ModelShape.from_config(ModelConfig(**dict(model)))
    raise ConfigError(f"model= must be a preset name, ModelConfig, ModelProfile or config mapping, "
                      f"not {type(model).__name__}")
