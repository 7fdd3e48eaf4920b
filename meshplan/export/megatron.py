"""Megatron-LM export: `pretrain_gpt.py` flags for a Plan (`megatron_export`, `to_megatron_args`).

Names checked against NVIDIA/Megatron-LM main d98e8a6 (2026-08-22, megatron-core 0.20.0 dev):
megatron/training/arguments.py plus the dataclass-generated flags of TransformerConfig /
ModelParallelConfig / TrainingConfig. Also the Megatron-Core rules NeMo 2 and Megatron-Bridge
share (meshplan/export/nemo.py): schedules, recompute settings, the pipeline layout string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.errors import ConfigError
from meshplan.ir.precision import Precision
from meshplan.ir.stack import Stack
from meshplan.export.view import (
    FP8_FORMAT, VERSIONS, Export, megatron_fp8_recipe, _check_precision, _fp8_notes, _uniform_middle, _View, _view,
)

__all__ = ["megatron_export", "to_megatron_args"]

# the stack Megatron-LM runs a plan on: which EP overlap and FP8 weight storage its flags turn on
MEGATRON_CORE = Stack.preset("megatron-core")


def _megatron_schedule(v: _View, target: str = "Megatron-LM") -> None:
    """Megatron-Core runs 1F1B (vp = 1) and interleaved 1F1B (vp > 1) and has no zero-bubble flag:
    a 'zb' / 'zbv' plan is refused with what the target runs and what to re-plan with."""
    s = v.layout.schedule
    if s in ("zb", "zbv"):
        kind = "ZB-H1" if s == "zb" else "ZB-V"
        raise ConfigError(
            f"{target} has no zero-bubble pipeline schedule (plan schedule {s!r}, {kind}): Megatron-Core runs "
            "1F1B (vp=1) and interleaved 1F1B (vp > 1) only. Re-plan with fixed={'schedule': '1f1b'} "
            "(`meshplan plan --fix schedule=1f1b`; the same memory as ZB-H1, a larger bubble) or "
            "fixed={'schedule': 'interleaved', 'vp': 2}, or export to torchtitan, which runs 'zb' as "
            "InterleavedZeroBubble and 'zbv' as ZBVZeroBubble")
    if s == "gpipe":
        v.notes.append("schedule: Megatron-LM has no GPipe schedule; its 1F1B (same bubble, fewer micro-batches "
                       "in flight) is used, so memory is at most the plan's")


def _pipeline_layout_string(sl: tuple[int, ...], mtp: int = 0) -> str:
    """Megatron's --pipeline-model-parallel-layout: stages in virtual-stage order, 'E' embedding,
    't' a transformer layer, 'm' a multi-token-prediction depth, 'L' the loss
    (megatron/core/transformer/pipeline_parallel_layer_layout.py); the MTP depths run on the last
    stage, before the loss, as meshplan prices them."""
    parts = []
    for s, n in enumerate(sl):
        body = "" if n == 0 else ("t" if n == 1 else f"t*{n}")
        last = s == len(sl) - 1
        parts.append(("E" if s == 0 else "") + body + ("m" * mtp + "L" if last else ""))
    return "|".join(parts)


@dataclass(frozen=True)
class _Recompute:
    """Megatron-Core's recompute settings (TransformerConfig recompute_* fields)."""

    granularity: str | None = None     # None | "selective" (also "norm_act", "norm_moe") | "full"
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
    if rc == "norm_act":
        # the policy is Megatron-Core's own: re-run the two norms of every layer and the routed
        # experts' activation; "moe_act" is left out for a dense model, where it has nothing to act on
        moe = v.shape is None or v.shape.experts > 0
        return _Recompute(granularity="selective", modules=("layernorm",) + (("moe_act",) if moe else ()))
    if rc == "norm_moe":
        # Megatron-Core's own policy too: re-run the two norms and the whole MoE layer (its token
        # dispatch included), keeping only the MoE layer's input
        if v.shape is not None and v.shape.experts == 0:
            raise ConfigError("recompute 'norm_moe' re-runs the MoE layers, and this model has none; re-plan with "
                              "fixed={'recompute': 'norm_act'} or 'selective'")
        return _Recompute(granularity="selective", modules=("layernorm", "moe"))
    if rc == "mla_up":
        # Megatron-Core's modules: latent attention's up-projections (mla_up_proj) and the dense MLPs
        if v.shape is not None and not v.shape.mla:
            raise ConfigError("recompute 'mla_up' rebuilds latent attention's Q, K and V, and this model has "
                              "no latent attention; re-plan with fixed={'recompute': 'selective'} or 'norm_act'")
        return _Recompute(granularity="selective", modules=("mla_up_proj", "mlp"))
    if isinstance(rc, str) and rc != "full":
        # op_sac is torchtitan's op-level checkpointing: Megatron-Core chooses recomputed modules, not ops
        raise ConfigError(f"Megatron-Core has no recompute setting for the plan's {rc!r} policy; re-plan for the "
                          "megatron-core stack, or with fixed={'recompute': 'selective'} (or 'full', 'none'), or "
                          "export to torchtitan")
    if rc == "full" or (isinstance(rc, int) and rc >= v.layers_per_rank):
        return _Recompute(granularity="full", method="uniform", num_layers=1)
    # N fully recomputed layers per pipeline rank. Megatron's "block" method recomputes the first
    # N layers of every model chunk (each virtual stage), so N is split over the vp chunks.
    per_chunk = -(-rc // lay.vp)
    if per_chunk * lay.vp != rc:
        v.notes.append(f"recompute: {rc} layers per pipeline rank do not split over vp={lay.vp} chunks; "
                       f"{per_chunk} per chunk ({per_chunk * lay.vp} per rank) are recomputed")
    return _Recompute(granularity="full", method="block", num_layers=per_chunk)


def _megatron_offload(v: _View) -> list[str]:
    """Layout.offload_activations -> Megatron-Core's --cpu-offloading (Transformer Engine's
    cpu_offload), which its TransformerConfig allows only without pipeline parallelism and without
    activation recomputation, and for at most num_layers - 1 layers."""
    lay = v.layout
    if not getattr(lay, "offload_activations", False):
        return []
    if lay.pp > 1 or lay.recompute not in ("none", 0):
        raise ConfigError(f"Megatron-Core's --cpu-offloading runs without pipeline parallelism and without activation "
                          f"recomputation (its TransformerConfig refuses both); this plan offloads with pp={lay.pp}, "
                          f"recompute={lay.recompute!r}; re-plan for the megatron-core stack (which offloads only "
                          "at pp=1 without recompute), or run the plan on meshplan's runtime")
    v.notes.append("activation offloading: Megatron offloads at most num_layers - 1 layers (the last layer's "
                   "backward follows its forward at once); the plan priced every layer offloaded")
    return ["--cpu-offloading", "--cpu-offloading-num-layers", str(max(1, v.num_layers - 1))]


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
    if s.mla:
        out += _megatron_mla(s)
    elif s.kv_heads != s.heads:
        out += ["--group-query-attention", "--num-query-groups", str(s.kv_heads)]
    if s.head_dim * s.heads != s.hidden and not s.mla:
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
        if s.group_score_note():
            v.notes.append(s.group_score_note())
        if s.router_groups:
            out += ["--moe-router-num-groups", str(s.router_groups), "--moe-router-group-topk", str(s.router_group_topk)]
        if s.router_scaling is not None:
            out += ["--moe-router-topk-scaling-factor", str(s.router_scaling)]
        for name, value in (s.balancing.megatron_fields() if s.balancing else {}).items():
            flag = "--" + name.replace("_", "-")
            out += [flag] if value is True else [flag, str(value)]
    window = s.megatron_window()
    if window is not None:
        # Megatron-LM's --window-size (left, right) and --window-attn-skip-freq (arguments.py,
        # _add_network_size_args; Megatron-Bridge's GPT-OSS configs set window_size (128, 0), skip 2)
        (left, right), skip = window
        out += ["--window-size", f"{left},{right}"]
        if skip is not None:
            out += ["--window-attn-skip-freq", str(skip) if isinstance(skip, int) else str(skip).replace(" ", "")]
    if s.attention_sinks:
        out += ["--softmax-type", "learnable"]      # a learned per-head offset in the softmax denominator
    if s.mtp_depth:
        # Megatron-Core's MTP (megatron/training/arguments.py, _add_mtp_args): the depths run on the
        # last stage with the output layer; the scaling factor multiplies the MTP losses averaged
        # over the depths, as mtp_loss_weight does (its default differs between releases: always set)
        out += ["--mtp-num-layers", str(s.mtp_depth)]
        if s.mtp_loss_weight is not None:
            out += ["--mtp-loss-scaling-factor", str(s.mtp_loss_weight)]
    return out


def _megatron_mla(s: Any) -> list[str]:
    """Megatron-Core's MLA (MLATransformerConfig; flags of _add_mla_args and TransformerConfig):
    its latent RMSNorms exist only with --qk-layernorm; --qk-head-dim is the non-rotary part.
    MLATransformerConfig defaults to YaRN RoPE (rope_type "yarn", scaling factor 40), which
    changes the frequencies at every position: meshplan's model trains with plain RoPE at the
    pre-training context, so the export asks for it (and Megatron's rope fusion runs YaRN only)."""
    out = ["--multi-latent-attention", "--qk-layernorm"]
    if s.q_lora_rank:
        out += ["--q-lora-rank", str(s.q_lora_rank)]
    return out + ["--kv-lora-rank", str(s.kv_lora_rank), "--qk-head-dim", str(s.qk_nope_head_dim),
                  "--qk-pos-emb-head-dim", str(s.qk_rope_head_dim), "--v-head-dim", str(s.v_head_dim),
                  "--rope-type", "rope", "--no-rope-fusion"]


def megatron_export(plan: Any, model: Any = None) -> Export:
    """Megatron-LM `pretrain_gpt.py` flags for the plan, with notes on approximations."""
    _check_precision(plan, "Megatron-LM", (Precision.BF16, Precision.FP16, Precision.FP8))
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
            a += ["--pipeline-model-parallel-layout",
                  _pipeline_layout_string(sl, v.shape.mtp_depth if v.shape is not None else 0)]
    if lay.tp > 1 and lay.sp:
        a.append("--sequence-parallel")
    if lay.tp_comm_overlap:
        a.append("--tp-comm-overlap")
    if MEGATRON_CORE.runs_ep_overlap(lay):
        a.append("--overlap-moe-expert-parallel-comm")
    a += _megatron_dp(v)
    a += _megatron_recompute(v, lay.recompute).flags()
    a += _megatron_offload(v)
    a += ["--micro-batch-size", str(lay.mbs), "--global-batch-size", str(plan.global_batch),
          "--seq-length", str(plan.seq_len)]
    a.append("--fp16" if plan.precision == Precision.FP16 else "--bf16")
    if plan.precision == Precision.FP8:
        a += ["--fp8-format", FP8_FORMAT, "--fp8-recipe", megatron_fp8_recipe(v.layout, "Megatron-LM")]
        if getattr(v.layout, "fp8_recipe", "tensorwise") in MEGATRON_CORE.fp8_param_gather:
            a.append("--fp8-param-gather")      # priced so: the FP8 weights replace the BF16 copies
        lead, tail = _fp8_notes(plan, v, "Megatron-LM")
        if lead or tail:
            a += ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(lead),
                  "--num-layers-at-end-in-bf16", str(tail)]
    a += _megatron_model(v, plan.seq_len)
    env = {}
    queues = MEGATRON_CORE.kernel_queues(lay, plan.cluster["gpu"]["id"])
    if queues is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(queues)
        if queues > 1 and lay.tp_comm_overlap and lay.tp > 1:
            v.notes.append("CUDA_DEVICE_MAX_CONNECTIONS=32 for the expert all-to-all overlap: before Blackwell "
                           "--tp-comm-overlap then hides nothing (its kernels need one queue), as the plan prices it")
    return Export(fmt="megatron", version=VERSIONS["megatron"], args=tuple(a), env=env, notes=tuple(v.notes))


def to_megatron_args(plan: Any, model: Any = None) -> list[str]:
    """Megatron-LM flags, e.g. ['--tensor-model-parallel-size', '8', ...]; see `megatron_export`."""
    return list(megatron_export(plan, model).args)
