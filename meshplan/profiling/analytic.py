"""A `ModelProfile` from architecture numbers alone (no nn.Module, no torch).

The tracer is the general path; this builder describes the same standard decoder from its
config, for what-if sweeps over architectures nobody has written down as a module and as an
independent check of the tracer (tests assert that both agree on meshplan's own models).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from meshplan.errors import ConfigError
from meshplan.ir.profile import BlockProfile, LinearInfo, ModelProfile

__all__ = ["profile_from_config"]

_KEYS = ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "experts", "topk",
         "moe_ffn_hidden", "shared_experts", "dense_layers", "head_dim", "gated", "norm", "bias",
         "tie_embeddings", "position", "seq_len", "name", "max_positions")
# ModelConfig's MoE routing options (meshplan.models.config, not imported: it would bring torch):
# they shape no weight, so they stay out of the fingerprint, but how the routers are balanced is
# read from them (ModelProfile.moe_balance), as the tracer reads it from the built model.
_MOE_OPTION_KEYS = ("moe_aux_loss_coeff", "moe_aux_loss_scope", "moe_z_loss_coeff", "moe_expert_bias",
                    "moe_bias_update_rate", "moe_capacity_factor", "moe_force_balance")
# Multi-token prediction (ModelConfig.mtp_*): priced on the last stage (ModelProfile.mtp_depth)
_MTP_KEYS = ("mtp_depth", "mtp_loss_weight")
# Sliding-window attention and sinks (ModelConfig.sliding_window*, attention_sinks): windowed layers
# are blocks of their own (BlockProfile.attn_window); in the fingerprint only when set
_WINDOW_KEYS = ("sliding_window", "sliding_window_pattern", "attention_sinks")
# Multi-head latent attention (ModelConfig.attention == "mla", models/mla.py)
_MLA_KEYS = ("attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _dense_block(h: int, heads: int, kv: int, hd: int, f: int, gated: bool, bias: bool, norm: str,
                 mla: tuple[int, int, int, int, int] | None = None) -> dict[str, Any]:
    if mla is not None:
        return _mla_block(h, heads, bias, norm, *mla)
    q, k = heads * hd, kv * hd
    lin = [LinearInfo(name="attention.wq", in_features=h, out_features=q, role="attn_qkv", bias=bias),
           LinearInfo(name="attention.wk", in_features=h, out_features=k, role="attn_qkv", bias=bias),
           LinearInfo(name="attention.wv", in_features=h, out_features=k, role="attn_qkv", bias=bias),
           LinearInfo(name="attention.wo", in_features=q, out_features=h, role="attn_out", bias=bias)]
    norm_params = 2 * h * (2 if norm == "layernorm" else 1)
    return dict(hidden=h, heads=heads, kv_heads=kv, head_dim=hd, causal=True, norm=norm,
                linears=lin, norm_params=norm_params)


def _mlp(prefix: str, h: int, f: int, gated: bool, bias: bool, role_in: str, role_out: str,
         count: int = 1, tpt: float = 1.0) -> list[LinearInfo]:
    lin = [LinearInfo(name=f"{prefix}.w1", in_features=h, out_features=f, role=role_in, count=count,
                      tokens_per_token=tpt, bias=bias)]
    if gated:
        lin.append(LinearInfo(name=f"{prefix}.w3", in_features=h, out_features=f, role=role_in, count=count,
                              tokens_per_token=tpt, bias=bias))
    lin.append(LinearInfo(name=f"{prefix}.w2", in_features=f, out_features=h, role=role_out, count=count,
                          tokens_per_token=tpt, bias=bias))
    return lin


def _mla_block(h: int, heads: int, bias: bool, norm: str, q_lora: int, kv_lora: int, nope: int, rope: int,
               v: int) -> dict[str, Any]:
    """Multi-head latent attention's projections (models/mla.py): the down-projections (role
    attn_down: whole on every TP rank), the up-projections split by heads, wo; the latent RMSNorms."""
    qk = nope + rope
    lin = ([LinearInfo(name="attention.wq_a", in_features=h, out_features=q_lora, role="attn_down", bias=bias),
            LinearInfo(name="attention.wq_b", in_features=q_lora, out_features=heads * qk, role="attn_qkv",
                       bias=bias)] if q_lora else
           [LinearInfo(name="attention.wq", in_features=h, out_features=heads * qk, role="attn_qkv", bias=bias)])
    lin += [LinearInfo(name="attention.wkv_a", in_features=h, out_features=kv_lora + rope, role="attn_down",
                       bias=bias),
            LinearInfo(name="attention.wkv_b", in_features=kv_lora, out_features=heads * (nope + v), role="attn_qkv",
                       bias=bias),
            LinearInfo(name="attention.wo", in_features=heads * v, out_features=h, role="attn_out", bias=bias)]
    norm_params = 2 * h * (2 if norm == "layernorm" else 1) + q_lora + kv_lora
    return dict(hidden=h, heads=heads, kv_heads=heads, head_dim=qk, v_head_dim=v if v != qk else 0, causal=True,
                norm=norm, linears=lin, norm_params=norm_params)


def _mla_dims(c: Mapping[str, Any]) -> tuple[int, int, int, int, int] | None:
    """(q_lora_rank (0: full-rank queries), kv_lora_rank, qk_nope, qk_rope, v head dims) of an
    attention="mla" config, else None."""
    if c.get("attention", "gqa") != "mla":
        return None
    try:
        dims = tuple(int(c[k]) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    except KeyError as e:
        raise ConfigError(f"attention='mla' needs {e.args[0]!r} (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
                          "v_head_dim; DeepSeek-V3: 512, 128, 64, 128)") from None
    if min(dims) < 1:
        raise ConfigError(f"MLA sizes {dims} (kv_lora_rank, qk_nope, qk_rope, v head dims) must be >= 1")
    return (int(c.get("q_lora_rank") or 0),) + dims


def profile_from_config(cfg: Mapping[str, Any] | Any, *, seq_len: int | None = None) -> ModelProfile:
    """Build a profile from config names (`layers, hidden, ffn_hidden, heads, kv_heads, vocab,
    experts, topk, moe_ffn_hidden, shared_experts, dense_layers`, plus `head_dim, gated, norm,
    bias, tie_embeddings, position`). Accepts a mapping or any object with those attributes.
    A MoE config's routing options (`moe_aux_loss_coeff`, `moe_expert_bias`, `moe_force_balance`,
    `moe_capacity_factor`, ...) set `moe_balance` and `moe_capacity_factor` as a trace of the built
    model would; a mapping that names none of them leaves the balance "unknown". `sliding_window`,
    `sliding_window_pattern` and `attention_sinks` (ModelConfig's) make the windowed layers blocks
    of their own (`BlockProfile.attn_window`)."""
    if not isinstance(cfg, Mapping):
        cfg = {k: getattr(cfg, k) for k in (*_KEYS, *_MOE_OPTION_KEYS, *_MTP_KEYS, *_WINDOW_KEYS, *_MLA_KEYS,
                                            "activation", "family") if hasattr(cfg, k)}
    c = {k: v for k, v in dict(cfg).items() if v is not None}
    unknown = sorted(set(c) - set(_KEYS) - set(_MOE_OPTION_KEYS) - set(_MTP_KEYS) - set(_WINDOW_KEYS)
                     - set(_MLA_KEYS) - {"activation", "family"})
    if unknown:
        raise ConfigError(f"unknown model config key(s) {unknown}; known: {sorted(_KEYS + _MOE_OPTION_KEYS)}")
    try:
        L, h, heads, vocab = int(c["layers"]), int(c["hidden"]), int(c["heads"]), int(c["vocab"])
    except KeyError as e:
        raise ConfigError(f"model config needs {e.args[0]!r} (layers, hidden, heads, vocab are required)") from None
    kv = int(c.get("kv_heads") or heads)
    hd = int(c.get("head_dim") or h // heads)
    gated = bool(c.get("gated", c.get("activation", "swiglu") == "swiglu"))
    f = int(c.get("ffn_hidden") or (4 * h if not gated else int(8 * h / 3 + 255) // 256 * 256))
    norm = c.get("norm", "rmsnorm")
    bias = bool(c.get("bias", False))
    E, k = int(c.get("experts") or 0), int(c.get("topk") or 0)
    fm = int(c.get("moe_ffn_hidden") or (f if E else 0))
    shared = int(c.get("shared_experts") or 0)
    dense_layers = int(c.get("dense_layers") or 0) if E else L
    seq = int(seq_len or c.get("seq_len") or 2048)
    for name, val in (("layers", L), ("hidden", h), ("heads", heads), ("vocab", vocab), ("kv_heads", kv)):
        if val < 1:
            raise ConfigError(f"model config {name}={val}: must be >= 1")
    if heads % kv:
        raise ConfigError(f"heads={heads} must be a multiple of kv_heads={kv}")
    if E and not (1 <= k <= E):
        raise ConfigError(f"topk={k} must be between 1 and experts={E}")
    mla = _mla_dims(c)
    if mla is not None:
        kv, hd = heads, mla[2] + mla[3]
    window, pattern, sinks = int(c.get("sliding_window") or 0), c.get("sliding_window_pattern", "alternate"), \
        bool(c.get("attention_sinks", False))
    if window < 0 or pattern not in ("alternate", "all"):
        raise ConfigError(f"sliding_window={window}, sliding_window_pattern={pattern!r}: a window >= 0 tokens "
                          "and a pattern 'alternate' or 'all'")

    def layer_window(i: int) -> int:     # ModelConfig.layer_window
        return window if window and (pattern == "all" or i % 2 == 0) else 0

    blocks: list[BlockProfile] = []
    base = _dense_block(h, heads, kv, hd, f, gated, bias, norm, mla)
    norm_params = base.pop("norm_params") + (heads if sinks else 0)   # one sink logit per head

    def finish(kind: str, lin: list[LinearInfo], w: int, **extra) -> BlockProfile:
        params = sum(li.params for li in lin) + norm_params
        expert = sum(li.params for li in lin if li.role.startswith("expert"))
        key = [kind, h, heads, kv, hd, extra] + ([w] if w else []) + ([list(mla)] if mla else [])
        sig = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        geo = {k: v for k, v in base.items() if k != "linears"}
        mine = [i for i in range(L) if kinds[i] == (kind, w)]
        return BlockProfile(signature=sig, instances=tuple(f"layers.{i}" for i in mine), attn_window=w, attn_sinks=sinks,
                            linears=tuple(lin), params=params, expert_params=expert, **geo, **extra)

    # one block per (MLP kind, attention window), in the order the layers first run them
    kinds = [("dense" if i < dense_layers else "moe", layer_window(i)) for i in range(L)]
    order = list(dict.fromkeys(kinds))
    for kind, w in order:
        if kind == "dense":
            lin = base["linears"] + _mlp("feed_forward", h, f, gated, bias, "mlp_in", "mlp_out")
            blocks.append(finish("dense", lin, w, ffn_hidden=f, gated=gated))
        else:
            lin = base["linears"] + [LinearInfo(name="moe.router", in_features=h, out_features=E, role="router")]
            lin += _mlp("moe.experts", h, fm, gated, False, "expert_in", "expert_out", count=E, tpt=k / E)
            if shared:
                lin += _mlp("moe.shared_experts", h, shared * fm, gated, False, "shared_in", "shared_out")
            blocks.append(finish("moe", lin, w, gated=gated, experts=E, topk=k,
                                 moe_ffn_hidden=fm, shared_ffn_hidden=shared * fm))
    layers = tuple(order.index(kd) for kd in kinds)
    tie = bool(c.get("tie_embeddings", False))
    emb = vocab * h + (int(c.get("max_positions") or seq) * h if c.get("position") == "learned" else 0)
    other = h * (2 if norm == "layernorm" else 1)
    mtp = int(c.get("mtp_depth") or 0)
    if mtp < 0:
        raise ConfigError(f"model config mtp_depth={mtp}: must be >= 0")
    name = str(c.get("name") or f"custom-{L}L-{h}h")
    fp = hashlib.sha1(json.dumps({k: c.get(k) for k in _KEYS if k != "name"}, sort_keys=True,
                                 default=str).encode()).hexdigest()[:16]
    if mla:     # likewise: GQA configs keep their fingerprints
        fp = hashlib.sha1(f"{fp}|mla={list(mla)}".encode()).hexdigest()[:16]
    if mtp:     # only then, so that fingerprints of configs without MTP stay what they were
        fp = hashlib.sha1(f"{fp}|mtp={mtp}".encode()).hexdigest()[:16]
    if window or sinks:
        fp = hashlib.sha1(f"{fp}|window={window}:{pattern}|sinks={sinks}".encode()).hexdigest()[:16]
    balance, capacity = _balance(c) if E else ("unknown", None)
    # traced FLOPs are filled from the architecture so the profile is self-consistent
    out = []
    for b in blocks:
        # attention core: QK^T over q_dim and PV over the values' width (equal but for MLA)
        fl = seq * sum(li.flops_per_token for li in b.linears) + 2.0 * seq * seq * (b.q_dim + b.o_dim)
        out.append(BlockProfile(**{**{fld: getattr(b, fld) for fld in b.__dataclass_fields__},
                                   "fwd_flops": fl, "bwd_flops": 2 * fl}))
    # each MTP depth (models/mtp.py): two input norms + its output norm and the 2h -> h projection,
    # on the last stage with the final norm; its block is priced as a layer (ModelProfile.mtp_depth)
    other += mtp * (3 * (h * (2 if norm == "layernorm" else 1)) + 2 * h * h)
    return ModelProfile(name=name, fingerprint=fp, seq_len=seq, vocab=vocab, hidden=h,
                        embedding_params=emb, head_params=0 if tie else vocab * h, tied_embeddings=tie,
                        other_params=other, blocks=tuple(out), layers=layers,
                        embedding_fqn="tok_embeddings", head_fqn="output",
                        pre_modules=("tok_embeddings",) + (("pos_embeddings",) if c.get("position") == "learned" else ()),
                        post_modules=("norm",) + (() if tie else ("output",)) + (("mtp",) if mtp else ()),
                        moe_balance=balance, moe_capacity_factor=capacity, mtp_depth=mtp)


def _balance(c: Mapping[str, Any]) -> tuple[str, float | None]:
    """(moe_balance, capacity factor) of a MoE config mapping: the tracer's reading of the same
    options (meshplan.profiling.traits.balance_from_config), imported here and only for MoE configs
    because that module imports torch, which dense what-if sweeps never need."""
    from meshplan.profiling.traits import balance_from_config
    return balance_from_config(c)
