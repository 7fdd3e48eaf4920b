"""Export a `Plan` to the configuration of other training frameworks.

Targets, and the source each name was checked against (docs/exports.md has the full mapping):

- Megatron-LM (`pretrain_gpt.py` flags): megatron/training/arguments.py and the dataclass-generated
  flags of TransformerConfig / ModelParallelConfig / TrainingConfig at NVIDIA/Megatron-LM main
  d98e8a6 (2026-08-22, megatron-core 0.20.0 dev). Flag names were validated once by parsing the
  export with that commit's own `add_megatron_arguments` parser.
- torchtitan: the TOML job config of torchtitan v0.2.2 (2026-02-20; torchtitan/config/job_config.py),
  the last release that reads TOML. torchtitan 0.3 replaced TOML with Python config functions and
  renamed several fields (docs/exports.md says which).
- NeMo 2 (`nemo llm pretrain --factory <recipe> key=value ...`): MegatronStrategy,
  MegatronMixedPrecision and the llama3 recipes at NVIDIA/NeMo 8cfedd7 (2025-09-20, the 2.5 line).
- Megatron-Bridge (Hydra-style `section.key=value` overrides of a recipe's ConfigContainer):
  NVIDIA-NeMo/Megatron-Bridge 067f987 (2026-08-22, 0.7.0 dev).

A plan choice a target cannot express raises ConfigError naming it and what would work, unless
a nearest equivalent exists that is never worse than the plan (then the export carries a note,
printed as a comment by `export_text`). The plan does not record the model's shape; it is taken
from `model` (a ModelConfig, ModelProfile, config mapping or preset name) or, when the plan's model
name is a meshplan preset, from that preset. Without it the shape flags are left out (noted).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from meshplan.ir.layout import Layout
from meshplan.errors import ConfigError, UnknownNameError

__all__ = [
    "FORMATS", "VERSIONS", "ModelShape", "Export", "model_shape", "megatron_export", "torchtitan_export",
    "nemo_export", "to_megatron_args", "to_torchtitan", "to_nemo", "export_text", "to_toml",
]

FORMATS = ("megatron", "torchtitan", "nemo", "megatron-bridge")
VERSIONS = {
    "megatron": "Megatron-LM main d98e8a6 (2026-08-22, megatron-core 0.20.0 dev)",
    "torchtitan": "torchtitan v0.2.2 (2026-02-20, TOML job config)",
    "nemo": "NeMo 2 llm collection, NVIDIA/NeMo 8cfedd7 (2025-09-20, 2.5 line)",
    "megatron-bridge": "Megatron-Bridge 067f987 (2026-08-22, 0.7.0 dev)",
}

# meshplan's FP8 is Transformer-Engine-style per-tensor *current* scaling (DESIGN.md, runtime FP8):
# Megatron/NeMo call it the "tensorwise" recipe, torchao/torchtitan the "tensorwise" recipe too.
# "hybrid" = E4M3 forward, E5M2 gradients, the format every Megatron FP8 recipe uses.
FP8_FORMAT = "hybrid"
FP8_RECIPE = "tensorwise"

# torchtitan (v0.2.2) and torch.distributed.pipelining schedule names
_TITAN_SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B", "gpipe": "GPipe", "zbv": "ZBVZeroBubble"}

_BLOCK_NAME = re.compile(r"(^|\.)\d+$")   # a repeated block's FQN ends in its index: "layers.12"


# ---- the model's shape ------------------------------------------------------------------------
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
                   sigmoid_router=cfg.router == "sigmoid", source=source or f"model config {cfg.name!r}")

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
                   dense_layers=lead if m else 0, source=f"model profile {prof.name!r}")


def model_shape(plan: Any, model: Any = None) -> ModelShape | None:
    """The model's shape from `model` (ModelShape, ModelConfig, ModelProfile, config mapping or
    preset name), else from the plan's model name when it is a meshplan preset, else None."""
    from meshplan.models.config import ModelConfig
    from meshplan.ir.profile import ModelProfile
    if model is None:
        from meshplan.models.presets import PRESETS, config
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
        from meshplan.models.presets import PRESETS, config
        if model not in PRESETS:
            raise UnknownNameError("model preset", model, list(PRESETS))
        return ModelShape.from_config(config(model), source=f"meshplan preset {model!r}")
    if isinstance(model, Mapping):
        return ModelShape.from_config(ModelConfig(**dict(model)))
    raise ConfigError(f"model= must be a preset name, ModelConfig, ModelProfile or config mapping, "
                      f"not {type(model).__name__}")


# ---- what every exporter reads from the plan ------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class _View:
    layout: Layout
    stage_layers: tuple[int, ...]     # layers per virtual stage, in Megatron / meshplan stage order
    blocks: tuple[str, ...]           # block instance FQNs in execution order ("" when unknown)
    shape: ModelShape | None
    notes: list[str]

    @property
    def num_layers(self) -> int:
        return sum(self.stage_layers)

    @property
    def even(self) -> bool:
        return len(set(self.stage_layers)) == 1

    @property
    def layers_per_rank(self) -> int:
        return max(sum(self.stage_layers[r::self.layout.pp]) for r in range(self.layout.pp))


def _view(plan: Any, model: Any) -> _View:
    lay = plan.layout
    notes: list[str] = []
    blocks = tuple(m for stage in plan.stages for m in stage if _BLOCK_NAME.search(m))
    counted = tuple(sum(1 for m in stage if _BLOCK_NAME.search(m)) for stage in plan.stages)
    shape = model_shape(plan, model)
    if lay.stage_layers is not None:
        stage_layers = tuple(lay.stage_layers)
    elif len(counted) == lay.pp * lay.vp and sum(counted) > 0:
        stage_layers = counted
    elif shape is not None and shape.layers % (lay.pp * lay.vp) == 0:
        stage_layers = (shape.layers // (lay.pp * lay.vp),) * (lay.pp * lay.vp)
    else:
        raise ConfigError("cannot tell how many layers each pipeline stage holds: the plan has no "
                          "stage_layers and its stage module names carry no block indices; pass model= "
                          "(a preset name, ModelConfig or ModelProfile)")
    if shape is not None and shape.layers != sum(stage_layers):
        notes.append(f"{shape.source} has {shape.layers} layers but the plan's stages hold "
                     f"{sum(stage_layers)}: model-shape settings left out; pass model= to include them")
        shape = None
    if shape is None and model is None:
        notes.append(f"model {plan.model!r} is not a meshplan preset, so model-shape settings "
                     "(layers, hidden size, heads, ...) are left out; pass model= to include them")
    if not lay.flash_attention:
        notes.append("the plan assumes unfused attention (flash_attention=False); the targets default "
                     "to fused/flash attention, which is faster and needs less memory")
    return _View(layout=lay, stage_layers=stage_layers, blocks=blocks if len(blocks) == sum(stage_layers) else (),
                 shape=shape, notes=notes)


def _fp8_layer_split(plan: Any, v: _View) -> tuple[int, int, list[int], bool] | None:
    """(leading BF16 layers, trailing BF16 layers, other BF16 layers, some FP8 layer keeps a linear in
    BF16) from the plan's FP8 module set; None when the block names are unknown."""
    if not v.blocks:
        return None
    fp8 = set(plan.fp8_modules)
    per_layer = [sorted(m[len(b) + 1:] for m in fp8 if m.startswith(b + ".")) for b in v.blocks]
    bf16 = [i for i, mods in enumerate(per_layer) if not mods]
    lead = 0
    while lead < len(per_layer) and not per_layer[lead]:
        lead += 1
    tail = 0
    while tail < len(per_layer) - lead and not per_layer[-1 - tail]:
        tail += 1
    middle = [i for i in bf16 if lead <= i < len(per_layer) - tail]
    union = set().union(*(set(m) for m in per_layer if m)) if any(per_layer) else set()
    partial = any(mods and set(mods) != union for mods in per_layer)
    # linears no FP8 layer uses (e.g. small K/V projections) stay BF16 in meshplan; the targets
    # quantise every linear of an FP8 layer
    return lead, tail, middle, partial or bool(union) and len(union) < _typical_linears(v)


def _typical_linears(v: _View) -> int:
    """Linears per block the targets quantise: q, k, v, o + the MLP's 2 (GELU) or 3 (SwiGLU)."""
    if v.shape is None:
        return 0
    return 4 + (3 if v.shape.gated else 2)


def _fp8_notes(plan: Any, v: _View, target: str) -> tuple[int, int]:
    """Leading/trailing BF16 layer counts to export, plus notes on what cannot be expressed."""
    split = _fp8_layer_split(plan, v)
    if split is None:
        v.notes.append(f"FP8: the plan's FP8 module set could not be matched to layers; {target} runs "
                       "every transformer layer's linears in FP8")
        return 0, 0
    lead, tail, middle, partial = split
    if middle:
        v.notes.append(f"FP8: meshplan keeps layers {middle} in BF16; {target} can only keep leading/trailing "
                       "layers in BF16, so they run in FP8 (faster, slightly riskier numerics)")
    if partial:
        v.notes.append(f"FP8: meshplan keeps some linears of FP8 layers in BF16 (see plan.fp8_modules); {target} "
                       "quantises every linear of an FP8 layer")
    if lead + tail >= v.num_layers:
        v.notes.append("FP8: the plan puts no transformer layer in FP8")
    return lead, tail


def _check_precision(plan: Any, target: str, allowed: tuple[str, ...]) -> None:
    if plan.precision not in allowed:
        raise ConfigError(f"{target} export: precision {plan.precision!r} is not supported there; "
                          f"re-plan with precision in {allowed}")


def _uniform_middle(sl: tuple[int, ...]) -> bool:
    return len(sl) >= 2 and len(set(sl[1:-1])) <= 1


# ---- Megatron-LM ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Export:
    """One export: `args` (Megatron flags) or `data` (a dict), plus notes on approximations."""

    fmt: str
    version: str
    args: tuple[str, ...] = ()
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    env: dict[str, str] = dataclasses.field(default_factory=dict)   # environment the launch needs
    notes: tuple[str, ...] = ()


def _megatron_schedule(v: _View) -> None:
    s = v.layout.schedule
    if s in ("zb", "zbv"):
        raise ConfigError(f"Megatron-LM has no zero-bubble pipeline schedule (plan schedule {s!r}); re-plan "
                          "with fixed schedule='1f1b' (or vp > 1 for the interleaved schedule), or export to "
                          "torchtitan, whose ZBVZeroBubble schedule runs 'zbv'")
    if s == "gpipe":
        v.notes.append("schedule: Megatron-LM has no GPipe schedule; its 1F1B (same bubble, fewer micro-batches "
                       "in flight) is used, so memory is at most the plan's")


def _pipeline_layout_string(sl: tuple[int, ...]) -> str:
    """Megatron's --pipeline-model-parallel-layout: stages in virtual-stage order, 'E' embedding,
    't' a transformer layer, 'L' the loss (megatron/core/transformer/pipeline_parallel_layer_layout.py)."""
    parts = []
    for s, n in enumerate(sl):
        body = "" if n == 0 else ("t" if n == 1 else f"t*{n}")
        parts.append(("E" if s == 0 else "") + body + ("L" if s == len(sl) - 1 else ""))
    return "|".join(parts)


@dataclass(frozen=True)
class _Recompute:
    """Megatron-Core's recompute settings (TransformerConfig recompute_* fields)."""

    granularity: str | None = None     # None | "selective" | "full"
    method: str | None = None          # None | "uniform" | "block"
    num_layers: int | None = None
    modules: tuple[str, ...] = ()

    def flags(self) -> list[str]:
        out: list[str] = []
        if self.granularity:
            out += ["--recompute-granularity", self.granularity]
        if self.method:
            out += ["--recompute-method", self.method, "--recompute-num-layers", str(self.num_layers)]
        if self.modules:
            out += ["--recompute-modules", *self.modules]
        return out


def _megatron_recompute(v: _View, rc: Any) -> _Recompute:
    lay = v.layout
    if rc == "none" or rc == 0:
        return _Recompute()
    if rc == "selective":
        mods = ("core_attn",) + (("moe_act",) if v.shape is not None and v.shape.experts else ())
        if v.shape is None or v.shape.experts == 0 or v.shape.dense_layers:
            v.notes.append("recompute: meshplan's selective policy also recomputes the dense MLP activation; "
                           "Megatron's nearest (recompute modules core_attn) keeps it, using a little more memory")
        return _Recompute(granularity="selective", modules=mods)
    if rc == "full" or (isinstance(rc, int) and rc >= v.layers_per_rank):
        return _Recompute(granularity="full", method="uniform", num_layers=1)
    # N fully recomputed layers per pipeline rank. Megatron's "block" method recomputes the first
    # N layers of every model chunk (each virtual stage), so N is split over the vp chunks.
    per_chunk = -(-rc // lay.vp)
    if per_chunk * lay.vp != rc:
        v.notes.append(f"recompute: {rc} layers per pipeline rank do not split over vp={lay.vp} chunks; "
                       f"{per_chunk} per chunk ({per_chunk * lay.vp} per rank) are recomputed")
    return _Recompute(granularity="full", method="block", num_layers=per_chunk)


def _megatron_dp(v: _View) -> list[str]:
    lay = v.layout
    out: list[str] = []
    if lay.zero == 0:
        return ["--overlap-grad-reduce"] if lay.dp * lay.cp > 1 else []
    if lay.zero == 1:
        out += ["--use-distributed-optimizer"]
    else:
        strategy = "optim_grads_params" if lay.zero == 3 and lay.reshard_after_forward else "optim_grads"
        if lay.zero == 3 and not lay.reshard_after_forward:
            v.notes.append("ZeRO-3 keeping gathered weights after forward is exported as Megatron-FSDP "
                           "'optim_grads' (ZeRO-2): the same weight memory, less all-gather traffic")
        # Megatron-FSDP checkpoints only in its fsdp_dtensor format (validate_args asserts it)
        out += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy,
                "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
        if lay.fsdp_shard:
            v.notes.append(f"HSDP (fsdp_shard={lay.fsdp_shard}): Megatron-FSDP's hybrid mode is set up through "
                           "its outer-DP process-group options, not a single flag; exported as full sharding "
                           "over all data-parallel ranks (less memory, more traffic than planned)")
    if lay.dp * lay.cp > 1:
        # the step-time prediction assumes DP communication overlapped with compute (constants.py)
        out += ["--overlap-grad-reduce", "--overlap-param-gather"]
    return out


def _megatron_model(v: _View, seq_len: int) -> list[str]:
    s = v.shape
    if s is None:
        return []
    out = ["--num-layers", str(s.layers), "--hidden-size", str(s.hidden), "--ffn-hidden-size", str(s.ffn_hidden),
           "--num-attention-heads", str(s.heads)]
    if s.kv_heads != s.heads:
        out += ["--group-query-attention", "--num-query-groups", str(s.kv_heads)]
    if s.head_dim * s.heads != s.hidden:
        out += ["--kv-channels", str(s.head_dim)]
    out += ["--max-position-embeddings", str(seq_len), "--vocab-size", str(s.vocab),
            "--normalization", "RMSNorm" if s.norm == "rmsnorm" else "LayerNorm"]
    if s.gated:
        out.append("--swiglu")
    if s.rope:
        out += ["--position-embedding-type", "rope", "--rotary-base", str(int(s.rope_theta))]
    if not s.bias:
        out.append("--disable-bias-linear")
    if not s.tied:
        out.append("--untie-embeddings-and-output-weights")
    if s.experts:
        out += ["--num-experts", str(s.experts), "--moe-router-topk", str(s.topk),
                "--moe-ffn-hidden-size", str(s.moe_ffn_hidden), "--moe-grouped-gemm"]
        if s.shared_ffn_hidden:
            out += ["--moe-shared-expert-intermediate-size", str(s.shared_ffn_hidden)]
        if s.dense_layers:
            out += ["--moe-layer-freq", f"([0]*{s.dense_layers}+[1]*{s.layers - s.dense_layers})"]
        if s.sigmoid_router:
            out += ["--moe-router-score-function", "sigmoid"]
    return out


def megatron_export(plan: Any, model: Any = None) -> Export:
    """Megatron-LM `pretrain_gpt.py` flags for the plan, with notes on approximations."""
    _check_precision(plan, "Megatron-LM", ("bf16", "fp16", "fp8"))
    v = _view(plan, model)
    lay = v.layout
    _megatron_schedule(v)
    a: list[str] = ["--tensor-model-parallel-size", str(lay.tp), "--pipeline-model-parallel-size", str(lay.pp),
                    "--context-parallel-size", str(lay.cp)]
    if lay.ep > 1 or lay.etp > 1 or (v.shape is not None and v.shape.experts):
        a += ["--expert-model-parallel-size", str(lay.ep), "--expert-tensor-parallel-size", str(lay.etp)]
    if lay.pp > 1:
        sl = v.stage_layers
        if v.even:
            if lay.vp > 1:
                a += ["--num-layers-per-virtual-pipeline-stage", str(sl[0])]
        elif lay.vp == 1 and _uniform_middle(sl):
            a += ["--decoder-first-pipeline-num-layers", str(sl[0]), "--decoder-last-pipeline-num-layers", str(sl[-1])]
        else:
            a += ["--pipeline-model-parallel-layout", _pipeline_layout_string(sl)]
    if lay.tp > 1 and lay.sp:
        a.append("--sequence-parallel")
    if lay.tp_comm_overlap:
        a.append("--tp-comm-overlap")
    a += _megatron_dp(v)
    a += _megatron_recompute(v, lay.recompute).flags()
    a += ["--micro-batch-size", str(lay.mbs), "--global-batch-size", str(plan.global_batch),
          "--seq-length", str(plan.seq_len)]
    a.append("--fp16" if plan.precision == "fp16" else "--bf16")
    if plan.precision == "fp8":
        a += ["--fp8-format", FP8_FORMAT, "--fp8-recipe", FP8_RECIPE]
        lead, tail = _fp8_notes(plan, v, "Megatron-LM")
        if lead or tail:
            a += ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(lead),
                  "--num-layers-at-end-in-bf16", str(tail)]
    a += _megatron_model(v, plan.seq_len)
    env = {}
    if (lay.tp > 1 or lay.cp > 1) and lay.zero < 2:
        # validate_args requires it with TP/CP before Blackwell (kernel ordering for comm overlap);
        # Megatron-FSDP wants it unset, and only warns when combined with TP/CP
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return Export(fmt="megatron", version=VERSIONS["megatron"], args=tuple(a), env=env, notes=tuple(v.notes))


def to_megatron_args(plan: Any, model: Any = None) -> list[str]:
    """Megatron-LM flags, e.g. ['--tensor-model-parallel-size', '8', ...]; see `megatron_export`."""
    return list(megatron_export(plan, model).args)


# ---- torchtitan -----------------------------------------------------------------------------------
def _titan_fqns(sl: tuple[int, ...]) -> list[list[str]]:
    """torchtitan's module names per model chunk (its own model FQNs: tok_embeddings, layers.<i>,
    norm, output), following the plan's layers per virtual stage."""
    out, start = [], 0
    for s, n in enumerate(sl):
        mods = [f"layers.{i}" for i in range(start, start + n)]
        start += n
        if s == 0:
            mods.insert(0, "tok_embeddings")
        if s == len(sl) - 1:
            mods += ["norm", "output"]
        out.append(mods)
    return out


def _titan_ac(v: _View) -> dict[str, Any]:
    rc = v.layout.recompute
    if rc == "none" or rc == 0:
        return {"mode": "none"}
    if rc == "full" or (isinstance(rc, int) and rc >= v.layers_per_rank):
        return {"mode": "full"}
    if rc == "selective":
        # op-level SAC recomputes the cheap ops and keeps matmul outputs: the closest to meshplan's
        # "recompute core attention + activation" policy
        v.notes.append("recompute: meshplan's selective policy maps to torchtitan's op-level SAC "
                       "(selective_ac_option='op'), which chooses the recomputed ops itself")
        return {"mode": "selective", "selective_ac_option": "op"}
    # N of the rank's layers fully recomputed -> torchtitan checkpoints one layer in every k; k is
    # rounded down so at least N layers are recomputed (memory never above the plan's)
    k = max(1, v.layers_per_rank // rc)
    if k == 1:
        v.notes.append(f"recompute: {rc} of {v.layers_per_rank} layers per rank exported as full recompute "
                       "(torchtitan checkpoints one layer in every k)")
        return {"mode": "full"}
    got = -(-v.layers_per_rank // k)
    if got != rc:
        v.notes.append(f"recompute: {rc} fully recomputed layers per rank exported as one layer in every {k} "
                       f"(selective_ac_option='{k}'), i.e. about {got} per rank")
    return {"mode": "selective", "selective_ac_option": str(k)}


def torchtitan_export(plan: Any, model: Any = None) -> Export:
    """A torchtitan v0.2.2 job config (nested dict: TOML sections) for the plan."""
    _check_precision(plan, "torchtitan", ("bf16", "fp8"))
    v = _view(plan, model)
    lay = v.layout
    if lay.pp > 1 and lay.schedule not in _TITAN_SCHEDULES:
        raise ConfigError(f"torchtitan has no single-stage zero-bubble schedule for plan schedule {lay.schedule!r} "
                          f"(ZB-H1); re-plan with fixed schedule='zbv' (ZBVZeroBubble), '1f1b' or 'interleaved'")
    if lay.ep > 1 and lay.etp not in (1, lay.tp):
        raise ConfigError(f"torchtitan supports expert tensor parallelism only as etp=1 or etp=tp={lay.tp}, "
                          f"not etp={lay.etp}; re-plan with fixed etp=1 or etp={lay.tp}")
    par: dict[str, Any] = {}
    if lay.zero == 3:
        shard = lay.fsdp_shard or lay.dp * lay.cp
        if shard % lay.cp:
            raise ConfigError(f"torchtitan shards FSDP over data_parallel_shard x context_parallel ranks, so an "
                              f"HSDP shard group of {lay.fsdp_shard} must be a multiple of cp={lay.cp}; re-plan "
                              f"with fsdp_shard a multiple of {lay.cp} (or 0 for full sharding)")
        par["data_parallel_replicate_degree"] = lay.dp * lay.cp // shard
        par["data_parallel_shard_degree"] = shard // lay.cp
        par["fsdp_reshard_after_forward"] = "default" if lay.reshard_after_forward else "never"
    elif lay.zero in (1, 2):
        # torchtitan has no ZeRO-1/2; FSDP that keeps weights gathered between forward and backward
        # has ZeRO-2's gradient/optimizer sharding and less weight memory than ZeRO-1/2's full copy
        par["data_parallel_replicate_degree"] = 1
        par["data_parallel_shard_degree"] = lay.dp
        par["fsdp_reshard_after_forward"] = "never"
        v.notes.append(f"ZeRO-{lay.zero}: torchtitan has no ZeRO-1/2; exported as FSDP without resharding after "
                       "forward (no more memory; adds the weight all-gathers that ZeRO-1/2 do not need)")
    else:
        par["data_parallel_replicate_degree"] = lay.dp
        par["data_parallel_shard_degree"] = 1
        if lay.cp > 1:
            v.notes.append("DDP with cp > 1: torchtitan still shards weights over the context-parallel ranks (FSDP)")
    par["tensor_parallel_degree"] = lay.tp
    if lay.tp > 1 and not lay.sp:
        v.notes.append("torchtitan v0.2.2 always uses sequence parallelism with TP (the plan does not); "
                       "same communication volume, less activation memory")
    par["enable_async_tensor_parallel"] = bool(lay.tp_comm_overlap and lay.tp > 1)
    par["context_parallel_degree"] = lay.cp
    par["pipeline_parallel_degree"] = lay.pp
    if lay.pp > 1:
        par["pipeline_parallel_schedule"] = _TITAN_SCHEDULES[lay.schedule]
        par["pipeline_parallel_microbatch_size"] = lay.mbs
        if v.even:
            par["pipeline_parallel_layers_per_stage"] = v.stage_layers[0]
        par["pipeline_parallel_first_stage_less_layers"] = 0   # the split below is explicit
        par["pipeline_parallel_last_stage_less_layers"] = 0
        par["module_fqns_per_model_part"] = _titan_fqns(v.stage_layers)
    par["expert_parallel_degree"] = lay.ep
    par["expert_tensor_parallel_degree"] = lay.etp if lay.ep > 1 else 1
    dp_ranks = lay.dp   # torchtitan's batch dimension: replicate x shard (cp splits sequences)
    local = plan.global_batch // dp_ranks
    training = {"seq_len": plan.seq_len, "global_batch_size": plan.global_batch,
                # pp > 1: the whole local batch enters the pipeline, split into micro-batches;
                # pp == 1: one micro-batch per forward, the rest is gradient accumulation
                "local_batch_size": local if lay.pp > 1 else lay.mbs,
                "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32"}
    out: dict[str, Any] = {"training": training, "parallelism": par, "activation_checkpoint": _titan_ac(v)}
    if par["enable_async_tensor_parallel"]:
        out["compile"] = {"enable": True, "components": ["model", "loss"]}   # async TP needs torch.compile
    if plan.precision == "fp8":
        lead, tail = _fp8_notes(plan, v, "torchtitan")
        skip = [f"layers.{i}." for i in list(range(lead)) + list(range(v.num_layers - tail, v.num_layers))]
        fsdp = lay.zero >= 1
        out["model"] = {"converters": ["quantize.linear.float8"]}
        out["quantize"] = {"linear": {"float8": {
            "recipe_name": FP8_RECIPE, "filter_fqns": ["output"] + skip,
            "enable_fsdp_float8_all_gather": fsdp, "precompute_float8_dynamic_scale_for_fsdp": fsdp}}}
    return Export(fmt="torchtitan", version=VERSIONS["torchtitan"], data=out, notes=tuple(v.notes))


def to_torchtitan(plan: Any, model: Any = None) -> dict[str, Any]:
    """torchtitan v0.2.2 job config sections as a nested dict (`to_toml` writes it)."""
    return torchtitan_export(plan, model).data


# ---- NeMo 2 / Megatron-Bridge -----------------------------------------------------------------------
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
    _megatron_schedule(v)   # the same Megatron-Core schedules underneath
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


# ---- text -------------------------------------------------------------------------------------------
def _toml_value(x: Any) -> str:
    if isinstance(x, bool):
        return "true" if x else "false"
    if isinstance(x, (int, float)):
        return repr(x)
    if isinstance(x, str):
        return json.dumps(x)   # a JSON string is a valid TOML basic string
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_toml_value(e) for e in x) + "]"
    raise ConfigError(f"cannot write {type(x).__name__} value {x!r} as TOML")


def to_toml(data: Mapping[str, Any], _prefix: str = "") -> str:
    """A minimal TOML writer for nested dicts of scalars and lists (no None values)."""
    lines, tables = [], []
    for k, val in data.items():
        if isinstance(val, Mapping):
            tables.append((k, val))
        elif val is not None:
            lines.append(f"{k} = {_toml_value(val)}")
    out = []
    if _prefix and lines:
        out.append(f"[{_prefix}]")
    out += lines
    for k, sub in tables:
        block = to_toml(sub, f"{_prefix}.{k}" if _prefix else k)
        if block:
            out += ([""] if out else []) + [block]
    return "\n".join(out)


def _override_value(x: Any, hydra: bool) -> str:
    """A value as NeMo-Run's CLI parser (Python literals) or Hydra's override grammar reads it."""
    if x is None:
        return "null" if hydra else "None"
    if isinstance(x, bool):
        return ("true" if x else "false") if hydra else repr(x)
    if isinstance(x, (int, float)):
        return repr(x)
    if isinstance(x, str):
        return x if re.fullmatch(r"[A-Za-z0-9_.\-]+", x) else json.dumps(x)
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(json.dumps(e) if isinstance(e, str) else _override_value(e, hydra) for e in x) + "]"
    raise ConfigError(f"cannot write {type(x).__name__} value {x!r} as an override")


def _shell_word(w: str) -> str:
    return w if re.fullmatch(r"[A-Za-z0-9_.,=/:+\-]+", w) else "'" + w.replace("'", "'\\''") + "'"


def _header(plan: Any, exp: Export, comment: str) -> list[str]:
    lay = plan.layout
    lines = [f"{comment} meshplan plan for {plan.model} on {plan.world_size} GPUs: {lay.short()}, "
             f"seq {plan.seq_len}, global batch {plan.global_batch}, {plan.precision}",
             f"{comment} names checked against {exp.version}"]
    lines += [f"{comment} NOTE: {n}" for n in exp.notes]
    return lines


def export_text(plan: Any, fmt: str, model: Any = None) -> str:
    """Printable export: `megatron` a shell-ready flag list (one flag per line, `\\` continued),
    `torchtitan` a TOML job config, `nemo` / `megatron-bridge` one `key=value` override per line."""
    if fmt == "megatron":
        exp = megatron_export(plan, model)
        pairs: list[str] = []
        args = list(exp.args)
        i = 0
        while i < len(args):   # a flag and its values on one line
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            pairs.append(" ".join(_shell_word(w) for w in args[i:j]))
            i = j
        env = "".join(f"{k}={val} " for k, val in exp.env.items())
        body = [f"{env}torchrun --nproc-per-node <gpus-per-node> pretrain_gpt.py \\"]
        body += [f"    {p} \\" for p in pairs[:-1]] + [f"    {pairs[-1]}"]
        return "\n".join(_header(plan, exp, "#") + body)
    if fmt == "torchtitan":
        exp = torchtitan_export(plan, model)
        return "\n".join(_header(plan, exp, "#")) + "\n\n" + to_toml(exp.data)
    if fmt in ("nemo", "megatron-bridge"):
        exp = nemo_export(plan, model, flavor=fmt)
        how = ("# pass as overrides: nemo llm pretrain --factory <recipe> key=value ..." if fmt == "nemo" else
               "# pass as Hydra-style overrides to a Megatron-Bridge recipe script: key=value ...")
        lines = _header(plan, exp, "#") + [how]
        lines += [_shell_word(f"{k}={_override_value(val, fmt == 'megatron-bridge')}") for k, val in exp.data.items()]
        return "\n".join(lines)
    raise UnknownNameError("export format", fmt, list(FORMATS))
