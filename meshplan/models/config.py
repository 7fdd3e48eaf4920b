"""`ModelConfig`: the architecture of a reference decoder-only transformer.

One config describes three families that share one implementation:

- ``"gpt"``: GPT-3 / Megatron GPT (learned positions, LayerNorm, GELU MLP of 4h, MHA, biases,
  tied embeddings).
- ``"llama"``: Llama 2/3 (RoPE, RMSNorm, SwiGLU, GQA, no biases, untied output).
- ``"moe"``: the Llama block with a mixture-of-experts MLP in every layer after the first
  ``dense_layers`` (Mixtral, Qwen3-MoE, DeepSeek-V3).

Fields left as ``None`` are derived in ``__post_init__`` from the family and the other sizes, so
``ModelConfig(family="llama", layers=2, hidden=256, heads=4, vocab=1000)`` is complete. A preset
stores only the fields it sets; overriding ``hidden`` of a preset therefore re-derives
``head_dim`` and ``ffn_hidden`` unless the preset fixed them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshplan.errors import ConfigError

__all__ = ["ModelConfig", "FAMILIES", "CONFIG_KEYS"]

FAMILIES = ("gpt", "llama", "moe")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")
ROUTERS = ("softmax", "sigmoid")
ATTENTIONS = ("gqa", "mla")
WINDOW_PATTERNS = ("alternate", "all")   # which layers sliding_window applies to (ModelConfig.layer_window)
# multi-head latent attention's sizes (DeepSeek-V2/V3 config.json names): None unless attention="mla"
MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
AUX_LOSS_SCOPES = ("global", "local")
# The MoE-only options with their neutral values: setting any of them on a dense model is an error.
MOE_OPTIONS = {"moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 0.0, "moe_expert_bias": False,
               "moe_capacity_factor": None, "moe_force_balance": False, "moe_router_num_groups": None,
               "moe_router_group_topk": None, "moe_router_topk_scaling_factor": None}

# Per-family defaults for the switches the user did not set.
_FAMILY_DEFAULTS = {
    "gpt": dict(norm="layernorm", activation="gelu", position="learned", bias=True, tie_embeddings=True),
    "llama": dict(norm="rmsnorm", activation="swiglu", position="rope", bias=False, tie_embeddings=False),
    "moe": dict(norm="rmsnorm", activation="swiglu", position="rope", bias=False, tie_embeddings=False),
}

# SwiGLU width rule of the Llama reference code: 2/3 of 4h (same parameters as a 4h GELU MLP),
# rounded up to a multiple of 256 (Llama 2 `multiple_of=256`: 4096 -> 11008).
_SWIGLU_MULTIPLE_OF = 256


def _swiglu_default(hidden: int) -> int:
    width = int(2 * 4 * hidden / 3)
    return _SWIGLU_MULTIPLE_OF * ((width + _SWIGLU_MULTIPLE_OF - 1) // _SWIGLU_MULTIPLE_OF)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (see the module docstring for the families).

    Sizes: ``layers`` blocks of width ``hidden``; ``heads`` query heads of ``head_dim`` and
    ``kv_heads`` key/value heads (GQA when fewer than ``heads``); a dense MLP of inner width
    ``ffn_hidden``; ``vocab`` tokens; positions up to ``seq_len``.
    MoE (``family="moe"``): ``experts`` routed experts of inner width ``moe_ffn_hidden``, each
    token picks ``topk``; ``shared_experts`` always-on experts (one SwiGLU MLP of width
    ``shared_experts * moe_ffn_hidden``); the first ``dense_layers`` blocks keep the dense MLP.
    Attention ``"gqa"`` (default) or ``"mla"``: DeepSeek-V2/V3's multi-head latent attention,
    sized by `MLA_DIMS` (``head_dim`` is then the query/key width ``qk_nope + qk_rope`` and every
    head has its own key and value: ``kv_heads == heads``).
    """

    family: str = "llama"
    layers: int
    hidden: int
    heads: int
    vocab: int
    kv_heads: int | None = None        # None -> heads (MHA)
    head_dim: int | None = None        # None -> hidden // heads
    ffn_hidden: int | None = None      # None -> 4h (gelu) or the Llama SwiGLU rule
    seq_len: int = 2048
    experts: int = 0
    topk: int = 0
    moe_ffn_hidden: int | None = None  # None -> ffn_hidden
    shared_experts: int = 0
    dense_layers: int = 0
    norm: str | None = None            # None -> family default
    activation: str | None = None
    position: str | None = None
    rope_theta: float = 10000.0
    tie_embeddings: bool | None = None
    bias: bool | None = None
    router: str = "softmax"
    attention: str = "gqa"
    # MLA (attention="mla"; DeepSeek-V3 arXiv 2412.19437 Sec. 2.1.1): queries from a rank-q_lora_rank
    # latent (None: a full-rank query projection), keys and values from one rank-kv_lora_rank latent
    # per token; each head's key is qk_nope_head_dim channels from the latent plus qk_rope_head_dim
    # rotary channels shared by all heads; values are v_head_dim wide
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # MoE load balancing and routing (docs/training.md, "MoE load balancing"; Megatron-Core names)
    moe_aux_loss_coeff: float = 0.0     # Switch load-balancing loss added to the training loss
    moe_aux_loss_scope: str = "global"  # "global": counts over dp x cp ranks and micro-batches; "local"
    moe_z_loss_coeff: float = 0.0       # router z-loss (ST-MoE): mean logsumexp(logits)^2
    moe_expert_bias: bool = False       # aux-loss-free balancing (DeepSeek-V3): fp32 bias steers top-k
    moe_bias_update_rate: float = 1e-3  # bias step per optimizer step, times sign(mean load - load)
    moe_capacity_factor: float | None = None   # None: dropless; else keep <= cf * N k / E copies per expert
    moe_force_balance: bool = False     # benchmarking: route round-robin, exactly balanced
    # group-limited routing (DeepSeek-V3 n_group / topk_group): experts in num_groups equal groups, a
    # group scored by the sum of its two best selection scores, top-k only inside the group_topk best
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None   # routed weights times this (None: 1)
    norm_eps: float = 1e-5
    # Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 Sec. 2.2; models/mtp.py): mtp_depth
    # extra sequential modules, depth k predicting token i+k+1; their mean cross entropy times
    # mtp_loss_weight is added to the training loss. 0 (the default): no MTP, no extra parameters.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    # Sliding-window attention (Mistral 7B, arXiv 2310.06825; GPT-OSS): on the layers the pattern
    # picks, query i attends keys i-w+1..i (w = sliding_window tokens; 0: every layer full causal).
    # Pattern "alternate": layers 0, 2, 4, ... windowed, the others full (GPT-OSS layer_types);
    # "all": every layer windowed.
    sliding_window: int = 0
    sliding_window_pattern: str = "alternate"
    # Attention sinks (GPT-OSS): one learned logit per query head joins each softmax's denominator
    # (a virtual key with a zero value), so a head can put weight on "nothing".
    attention_sinks: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"model family {self.family!r} is not one of {', '.join(FAMILIES)}")
        for key in ("layers", "hidden", "heads", "vocab", "seq_len"):
            _check_int(key, getattr(self, key), minimum=1)
        for key in ("experts", "topk", "shared_experts", "dense_layers", "mtp_depth"):
            _check_int(key, getattr(self, key), minimum=0)
        w = self.mtp_loss_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0:
            raise ConfigError(f"mtp_loss_weight must be a number >= 0, got {w!r} (DeepSeek-V3 trains with 0.3, "
                              "then 0.1)")
        for key, value in _FAMILY_DEFAULTS[self.family].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        self._derive_sizes()
        for key in ("kv_heads", "head_dim", "ffn_hidden", "moe_ffn_hidden"):
            _check_int(key, getattr(self, key), minimum=1)
        _check_choice("norm", self.norm, NORMS)
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("position", self.position, POSITIONS)
        _check_choice("router", self.router, ROUTERS)
        _check_choice("attention", self.attention, ATTENTIONS)
        for key in ("tie_embeddings", "bias"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be True or False, got {getattr(self, key)!r}")
        for key in ("rope_theta", "norm_eps"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{key} must be a positive number, got {value!r}")
        if not isinstance(self.name, str):
            raise ConfigError(f"name must be a string, got {self.name!r}")
        self._check_mla()
        self._check_window()
        if self.heads % self.kv_heads:
            divisors = [d for d in range(1, self.heads + 1) if self.heads % d == 0]
            raise ConfigError(
                f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}: each key/value head "
                f"serves a whole group of query heads; use kv_heads in {divisors}")
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(
                f"rotary positions rotate pairs of channels, so head_dim must be even (got {self.head_dim}); "
                f"use head_dim={self.head_dim + 1} or position='learned'")
        self._check_moe()

    def _check_window(self) -> None:
        _check_int("sliding_window", self.sliding_window, minimum=0)
        _check_choice("sliding_window_pattern", self.sliding_window_pattern, WINDOW_PATTERNS)
        if not isinstance(self.attention_sinks, bool):
            raise ConfigError(f"attention_sinks must be True or False, got {self.attention_sinks!r}")
        if self.attention == "mla" and (self.sliding_window or self.attention_sinks):
            raise ConfigError("sliding_window / attention_sinks apply to the standard attention; "
                              "attention='mla' has neither: use attention='gqa' or sliding_window=0, "
                              "attention_sinks=False")

    def layer_window(self, index: int) -> int:
        """Attention window of block ``index`` (0-based) in tokens; 0 = full causal attention."""
        if not self.sliding_window:
            return 0
        return self.sliding_window if self.sliding_window_pattern == "all" or index % 2 == 0 else 0

    def _derive_mla(self) -> None:
        """MLA's head_dim is the query/key width and kv_heads the query heads (checked, not
        guessed, when the user set them)."""
        if self.attention != "mla":
            set_ = [k for k in MLA_DIMS if getattr(self, k) is not None]
            if set_:
                raise ConfigError(f"{', '.join(set_)} size multi-head latent attention, but attention="
                                  f"{self.attention!r}; use attention='mla' or leave them None")
            return
        for key in MLA_DIMS[1:]:
            if getattr(self, key) is None:
                raise ConfigError(f"attention='mla' needs {key} (DeepSeek-V3: kv_lora_rank=512, "
                                  "qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)")
            _check_int(key, getattr(self, key), minimum=1)
        if self.q_lora_rank is not None:
            _check_int("q_lora_rank", self.q_lora_rank, minimum=1)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.head_dim not in (None, qk):
            raise ConfigError(f"head_dim={self.head_dim} with attention='mla' must be qk_nope_head_dim + "
                              f"qk_rope_head_dim = {qk} (the query/key width); leave head_dim None")
        if self.kv_heads not in (None, self.heads):
            raise ConfigError(f"kv_heads={self.kv_heads} with attention='mla': every head gets its own key and "
                              f"value from the shared latent; leave kv_heads None (= heads={self.heads})")
        object.__setattr__(self, "head_dim", qk)
        object.__setattr__(self, "kv_heads", self.heads)

    def _check_mla(self) -> None:
        if self.attention != "mla":
            return
        if self.position != "rope":
            raise ConfigError(f"attention='mla' rotates a decoupled key/query part, so it needs position='rope' "
                              f"(got {self.position!r})")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"rotary positions rotate pairs of channels, so qk_rope_head_dim must be even "
                              f"(got {self.qk_rope_head_dim}); use {self.qk_rope_head_dim + 1}")

    def _derive_sizes(self) -> None:
        self._derive_mla()
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ConfigError(
                    f"hidden={self.hidden} is not divisible by heads={self.heads}, so head_dim cannot be "
                    f"derived; set head_dim explicitly or pick heads dividing {self.hidden}")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.ffn_hidden is None:
            width = 4 * self.hidden if self.activation == "gelu" else _swiglu_default(self.hidden)
            object.__setattr__(self, "ffn_hidden", width)
        if self.moe_ffn_hidden is None:
            object.__setattr__(self, "moe_ffn_hidden", self.ffn_hidden)

    def _check_moe_options(self) -> None:
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_bias_update_rate"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"{key} must be a number >= 0, got {value!r} (e.g. {key}=1e-2)")
        _check_choice("moe_aux_loss_scope", self.moe_aux_loss_scope, AUX_LOSS_SCOPES)
        for key in ("moe_expert_bias", "moe_force_balance"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be True or False, got {getattr(self, key)!r}")
        cf = self.moe_capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0):
            raise ConfigError(f"moe_capacity_factor must be > 0 (or None for dropless routing), got {cf!r}; "
                              "e.g. moe_capacity_factor=1.25")
        self._check_group_routing()
        if self.family != "moe":
            set_ = [k for k, neutral in MOE_OPTIONS.items() if getattr(self, k) != neutral]
            if set_:
                raise ConfigError(
                    f"{', '.join(f'{k}={getattr(self, k)!r}' for k in set_)} balance(s) mixture-of-experts "
                    f"routing, but family={self.family!r} is a dense model with no experts; leave "
                    f"{set_[0]}={MOE_OPTIONS[set_[0]]!r} or use family='moe'")

    def _check_group_routing(self) -> None:
        groups, keep, scale = self.moe_router_num_groups, self.moe_router_group_topk, self.moe_router_topk_scaling_factor
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
            raise ConfigError(f"moe_router_topk_scaling_factor must be a number > 0 (or None), got {scale!r}; "
                              "DeepSeek-V3 uses 2.5")
        if (groups is None) != (keep is None):
            raise ConfigError("group-limited routing needs both moe_router_num_groups and moe_router_group_topk "
                              f"(got {groups!r} and {keep!r}); DeepSeek-V3: 8 and 4")
        if groups is None or self.family != "moe":
            return
        _check_int("moe_router_num_groups", groups, minimum=1)
        _check_int("moe_router_group_topk", keep, minimum=1)
        if self.experts % groups:
            raise ConfigError(f"moe_router_num_groups={groups} does not divide experts={self.experts}: the experts "
                              "form equal groups; use a divisor of experts")
        if keep > groups:
            raise ConfigError(f"moe_router_group_topk={keep} exceeds moe_router_num_groups={groups}; use 1..{groups}")
        per_group = self.experts // groups
        if per_group < 2:
            raise ConfigError(f"{per_group} expert per group: a group is scored by its two best experts; use "
                              f"moe_router_num_groups <= {self.experts // 2}")
        if self.topk > keep * per_group:
            raise ConfigError(f"topk={self.topk} exceeds the {keep * per_group} experts of the "
                              f"moe_router_group_topk={keep} groups kept; raise moe_router_group_topk")

    def _check_moe(self) -> None:
        self._check_moe_options()
        if self.family != "moe":
            if self.experts or self.topk or self.shared_experts or self.dense_layers:
                raise ConfigError(
                    f"experts/topk/shared_experts/dense_layers are set but family={self.family!r} has no "
                    f"mixture-of-experts layers; use family='moe'")
            return
        if self.experts < 1:
            raise ConfigError("family='moe' needs experts >= 1 routed experts (e.g. experts=8, topk=2)")
        if not 1 <= self.topk <= self.experts:
            raise ConfigError(
                f"topk={self.topk} must be between 1 and experts={self.experts}: each token is sent to topk "
                f"distinct experts")
        if self.dense_layers > self.layers:
            raise ConfigError(
                f"dense_layers={self.dense_layers} exceeds layers={self.layers}; use 0..{self.layers}")

    # ----------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.family == "moe"

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) uses the MoE MLP."""
        return self.is_moe and index >= self.dense_layers

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with ``changes`` applied (validated again)."""
        _check_keys(changes)
        if "mla" in (self.attention, changes.get("attention")):
            # MLA derives head_dim and kv_heads from its sizes: re-derive them unless given
            if {"qk_nope_head_dim", "qk_rope_head_dim", "attention"} & set(changes):
                changes.setdefault("head_dim", None)
            if {"heads", "attention"} & set(changes):
                changes.setdefault("kv_heads", None)
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameters of the model this config builds, counted from the formulas (tied weights once),
        without the MTP modules: published totals leave them out (DeepSeek-V3's 671B), since they
        are dropped after training; `num_mtp_params` counts them."""
        return self._count(active=False)

    def num_active_params(self) -> int:
        """Parameters one token uses: routed experts counted ``topk`` times instead of ``experts``."""
        return self._count(active=True)

    def num_mtp_params(self) -> int:
        """Parameters of the ``mtp_depth`` multi-token-prediction modules (0 without MTP)."""
        return self._count(active=False, mtp=True)

    def _count(self, *, active: bool, mtp: bool = False) -> int:
        h, b = self.hidden, int(self.bias)
        norm = h * (2 if self.norm == "layernorm" and self.bias else 1)
        if self.attention == "mla":
            attention = self._mla_params()
        else:
            q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
            attention = h * q_dim + 2 * h * kv_dim + q_dim * h + b * (q_dim + 2 * kv_dim + h)
            attention += self.heads if self.attention_sinks else 0     # one sink logit per head
        gates = 3 if self.activation == "swiglu" else 2

        def mlp(width: int, bias: bool) -> int:
            return gates * h * width + int(bias) * ((gates - 1) * width + h)

        dense_block = 2 * norm + attention + mlp(self.ffn_hidden, self.bias)
        moe_block = 2 * norm + attention + h * self.experts  # router: no bias
        routed = self.topk if active else self.experts
        moe_block += routed * mlp(self.moe_ffn_hidden, False)
        if self.shared_experts:
            moe_block += mlp(self.shared_experts * self.moe_ffn_hidden, False)
        moe_layers = self.layers - self.dense_layers if self.is_moe else 0
        total = (self.layers - moe_layers) * dense_block + moe_layers * moe_block
        total += self.vocab * h + norm
        total += self.seq_len * h if self.position == "learned" else 0
        total += 0 if self.tie_embeddings else self.vocab * h  # output projection: never a bias
        if mtp:
            # each MTP depth: two input norms, the 2h -> h projection, one block of the last
            # layer's kind, its output norm (embedding and output layer are the main model's)
            last = moe_block if self.is_moe_layer(self.layers) else dense_block
            return self.mtp_depth * (3 * norm + 2 * h * h + last)
        return total


    def mla_linears(self) -> tuple[tuple[str, int, int], ...]:
        """(name, in_features, out_features) of MLA's projections in forward order: the query
        down / up projections (or the full-rank wq without q_lora_rank), the key/value down
        projection (latent + shared rotary key), its up projection (per-head key and value) and wo."""
        h, n = self.hidden, self.heads
        qk, nope, rope, v = self.head_dim, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q = ((("wq_a", h, self.q_lora_rank), ("wq_b", self.q_lora_rank, n * qk)) if self.q_lora_rank
             else (("wq", h, n * qk),))
        return q + (("wkv_a", h, self.kv_lora_rank + rope), ("wkv_b", self.kv_lora_rank, n * (nope + v)),
                    ("wo", n * v, h))

    def _mla_params(self) -> int:
        linears = self.mla_linears()
        norms = self.kv_lora_rank + (self.q_lora_rank or 0)      # RMSNorm on each latent
        return sum(i * o + int(self.bias) * o for _, i, o in linears) + norms


CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig))


def _check_keys(keys: object) -> None:
    unknown = sorted(set(keys) - set(CONFIG_KEYS))  # type: ignore[arg-type]
    if unknown:
        raise ConfigError(
            f"unknown model config key(s) {', '.join(unknown)}; allowed keys: {', '.join(CONFIG_KEYS)}")


def _check_int(key: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")


def _check_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not supported; use one of {', '.join(choices)}")
