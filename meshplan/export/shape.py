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
    # how the routers are kept balanced while training (ModelConfig's moe_* options); None where the
    # shape came from a profile, which records only the kind (ModelProfile.moe_balance)
    balancing: "MoEBalancing | None" = None
    # multi-token prediction (ModelConfig.mtp_*): depths, and the loss weight where the shape came
    # from a config (None from a profile, which records only the depths)
    mtp_depth: int = 0
    mtp_loss_weight: float | None = None
    source: str = ""

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
                   balancing=MoEBalancing.from_config(cfg) if cfg.experts else None,
                   mtp_depth=cfg.mtp_depth, mtp_loss_weight=float(cfg.mtp_loss_weight) if cfg.mtp_depth else None,
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
                   dense_layers=lead if m else 0, mtp_depth=prof.mtp_depth, source=f"model profile {prof.name!r}")


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
