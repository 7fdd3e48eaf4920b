"""torchtitan export: a v0.2.2 TOML job config for a Plan (`torchtitan_export`, `to_torchtitan`), and
the layout constraints torchtitan puts on a model (`torchtitan_constraints`).

Names checked against torchtitan v0.2.2 (2026-02-20): torchtitan/config/job_config.py (sections and
fields), torchtitan/models/{llama3,deepseek_v3,qwen3}/__init__.py (model names and flavors),
torchtitan/distributed/pipeline_parallel.py (how stages are built), parallel_dims.py (mesh rules),
models/*/infra/parallelize.py (DDP, CP, FP8 TP limits), components/quantization/float8.py (FP8
recipe rules). Schedule names are torch.distributed.pipelining's `get_schedule_class` names, which
torchtitan passes through.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from meshplan.errors import ConfigError, MeshplanError
from meshplan.export.shape import ModelShape, model_shape
from meshplan.export.view import VERSIONS, Export, _check_precision, _fp8_notes, _View, _view
from meshplan.ir.precision import AUTO, Precision
from meshplan.ir.stack import STACKS

__all__ = ["torchtitan_export", "to_torchtitan", "torchtitan_constraints", "TITAN_FLAVORS"]

# torchtitan (v0.2.2) and torch.distributed.pipelining schedule names (get_schedule_class). ZB-H1
# ("zb") is InterleavedZeroBubble given one stage per rank: torch's ZB1P schedule then runs each
# rank's F, I (input grad) and deferred W (weight grad) in ZB-H1's order.
_TITAN_SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B", "gpipe": "GPipe",
                    "zb": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble"}
# torch's zero-bubble schedule classes refuse stages holding a torch.compile'd module
# (schedules._check_torch_compile_compatibility; pytorch/pytorch#161904), and torchtitan compiles
# each block
_NO_COMPILE_SCHEDULES = ("zb", "zbv")


@dataclass(frozen=True, kw_only=True)
class _Flavor:
    """One model flavor torchtitan v0.2.2 ships, by the shape fields meshplan's ModelShape holds."""

    name: str                    # [model] name (the train spec)
    flavor: str                  # [model] flavor
    layers: int
    hidden: int
    heads: int
    kv_heads: int | None         # None: multi-head latent attention (no K/V head count to match)
    head_dim: int | None
    ffn_hidden: int | None       # None: every layer is MoE, the dense size is unused
    vocab: int
    experts: int = 0
    topk: int = 0
    moe_ffn_hidden: int = 0
    shared_ffn_hidden: int = 0
    dense_layers: int = 0
    flex_attention: bool = False     # attn_type "flex": torchtitan's context parallelism refuses it
    # MLA (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim) and routing
    # (num_expert_groups, num_limited_groups, route_scale) of the deepseek_v3 flavors
    mla: tuple[int, int, int, int, int] | None = None
    groups: tuple[int, int, float] | None = None

    def matches(self, s: ModelShape) -> bool:
        got = (s.layers, s.hidden, s.heads, s.vocab, s.experts, s.topk)
        want = (self.layers, self.hidden, self.heads, self.vocab, self.experts, self.topk)
        if got != want:
            return False
        if self.kv_heads is not None and (s.kv_heads, s.head_dim) != (self.kv_heads, self.head_dim):
            return False
        if self.mla is not None and s.mla and \
                (s.q_lora_rank, s.kv_lora_rank, s.qk_nope_head_dim, s.qk_rope_head_dim, s.v_head_dim) != self.mla:
            return False
        # routing groups and scale are known where the shape came from a config (a profile records
        # neither; its balancing is None)
        if self.groups is not None and s.balancing is not None and \
                (s.router_groups or 1, s.router_group_topk or 1, s.router_scaling or 1.0) != self.groups:
            return False
        if self.ffn_hidden is not None and (self.experts == 0 or self.dense_layers) and s.ffn_hidden != self.ffn_hidden:
            return False
        return not self.experts or (s.moe_ffn_hidden, s.shared_ffn_hidden, s.dense_layers) == \
            (self.moe_ffn_hidden, self.shared_ffn_hidden, self.dense_layers)


def _llama3(flavor: str, layers: int, hidden: int, heads: int, ffn: int) -> _Flavor:
    return _Flavor(name="llama3", flavor=flavor, layers=layers, hidden=hidden, heads=heads, kv_heads=8,
                   head_dim=hidden // heads, ffn_hidden=ffn, vocab=128256)


def _qwen3(flavor: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, **moe: int) -> _Flavor:
    return _Flavor(name="qwen3", flavor=flavor, layers=layers, hidden=hidden, heads=heads, kv_heads=kv,
                   head_dim=128, ffn_hidden=None if moe else ffn, vocab=151936, **moe)


def _deepseek(flavor: str, layers: int, hidden: int, heads: int, ffn: int, vocab: int, experts: int, topk: int,
              moe_ffn: int, shared: int, dense: int, q_lora: int, groups: tuple[int, int, float]) -> _Flavor:
    # every flavor: kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128
    return _Flavor(name="deepseek_v3", flavor=flavor, layers=layers, hidden=hidden, heads=heads, kv_heads=None,
                   head_dim=None, ffn_hidden=ffn, vocab=vocab, experts=experts, topk=topk, moe_ffn_hidden=moe_ffn,
                   shared_ffn_hidden=shared * moe_ffn, dense_layers=dense, flex_attention=True,
                   mla=(q_lora, 512, 128, 64, 128), groups=groups)


# The flavors of torchtitan v0.2.2 (torchtitan/models/<name>/__init__.py), the debug models left out.
# llama3's FFN size is its own rule: multiple_of * ceil(ffn_dim_multiplier * int(8 * dim / 3) / multiple_of).
TITAN_FLAVORS: tuple[_Flavor, ...] = (
    _llama3("8B", 32, 4096, 32, 14336), _llama3("70B", 80, 8192, 64, 28672), _llama3("405B", 126, 16384, 128, 53248),
    _deepseek("16B", 27, 2048, 16, 10944, 102400, 64, 6, 1408, 2, 1, 0, (1, 1, 1.0)),
    _deepseek("236B", 60, 5120, 128, 12288, 102400, 160, 6, 1536, 2, 1, 1536, (8, 3, 16.0)),
    _deepseek("671B", 61, 7168, 128, 18432, 129280, 256, 8, 2048, 1, 3, 1536, (8, 4, 2.5)),
    _qwen3("0.6B", 28, 1024, 16, 8, 3072), _qwen3("1.7B", 28, 2048, 16, 8, 6144), _qwen3("4B", 36, 2560, 32, 8, 9728),
    _qwen3("8B", 36, 4096, 32, 8, 12288), _qwen3("14B", 40, 5120, 40, 8, 17408), _qwen3("32B", 64, 5120, 64, 8, 25600),
    _qwen3("30B-A3B", 48, 2048, 32, 4, 0, experts=128, topk=8, moe_ffn_hidden=768),
    _qwen3("235B-A22B", 94, 4096, 64, 4, 0, experts=128, topk=8, moe_ffn_hidden=1536),
)


def _flavor_list() -> str:
    by_name: dict[str, list[str]] = {}
    for f in TITAN_FLAVORS:
        by_name.setdefault(f.name, []).append(f.flavor)
    return "; ".join(f"{name} {', '.join(fl)}" for name, fl in by_name.items())


def _titan_flavor(shape: ModelShape | None) -> _Flavor | None:
    if shape is None:
        return None
    return next((f for f in TITAN_FLAVORS if f.matches(shape)), None)


def _titan_model(plan: Any, v: _View, fl: _Flavor | None) -> dict[str, Any]:
    """The [model] section naming the flavor; without one, torchtitan would silently train its
    default llama3 debugmodel, so that case is warned about and noted in the TOML."""
    if v.shape is not None and v.shape.mtp_depth:
        v.notes.append(f"model: torchtitan's models have no multi-token prediction; the run trains without the "
                       f"plan's {v.shape.mtp_depth} MTP depth(s), whose work the plan priced on the last stage")
    if fl is not None:
        if fl.kv_heads is None and not v.shape.mla:
            v.notes.append(f"model: torchtitan's {fl.name} {fl.flavor} uses multi-head latent attention, which "
                           f"the plan's model shape ({v.shape.source}) does not record")
        elif fl.mla is not None and plan.seq_len > 4096:
            v.notes.append(f"model: torchtitan's {fl.name} applies YaRN (rope_factor 40, softmax mscale) to "
                           f"sequences longer than its original_seq_len 4096, as at the plan's {plan.seq_len}; the "
                           "plan priced meshplan's model, which keeps plain RoPE (the same FLOPs)")
        return {"name": fl.name, "flavor": fl.flavor}
    what = v.shape.source if v.shape is not None else f"model {plan.model!r}"
    msg = (f"{what} is not a model torchtitan v0.2.2 ships (it ships {_flavor_list()}), so [model] name and "
           "flavor are left out and torchtitan would train its default llama3 debugmodel: set them to a model "
           "registered with this shape (a TrainSpec of your own, loaded through job.custom_config_module or "
           "experimental.custom_import)")
    v.notes.append(msg)
    warnings.warn(f"torchtitan export: {msg}", UserWarning, stacklevel=4)
    return {}


def torchtitan_constraints(model: Any,
                           precision: Precision | str = Precision.BF16) -> tuple[dict[str, Any], list[str]]:
    """Layout keys torchtitan fixes for `model` (a meshplan preset name, ModelConfig, ModelProfile
    or ModelShape): `meshplan plan --export torchtitan` plans with them unless --fix sets them.
    Returns (fixed layout keys, one reason per key)."""
    try:
        shape = model_shape(None, model) if model is not None else None
    except MeshplanError:      # not a preset (a file or a config.json): nothing known to fix
        return {}, []
    fl = _titan_flavor(shape)
    fixed: dict[str, Any] = {}
    why: list[str] = []
    if fl is not None and fl.flex_attention:
        fixed["cp"] = 1
        why.append(f"cp=1: torchtitan's {fl.name} {fl.flavor} uses FlexAttention, and torchtitan's context "
                   "parallelism runs SDPA only")
    if fl is not None and fl.name == "deepseek_v3" and precision in (Precision.FP8, AUTO):
        fixed["fp8_recipe"] = "rowwise"
        why.append("fp8_recipe=rowwise: torchtitan refuses tensorwise FP8 with tensor parallelism for "
                   "deepseek_v3 (NotImplementedError)")
    return fixed, why


def _titan_zb(v: _View) -> None:
    """Note the ZB-H1 export (InterleavedZeroBubble, one stage per rank)."""
    v.notes.append("schedule: ZB-H1 ('zb') exported as InterleavedZeroBubble with one stage per rank "
                   "(module_fqns_per_model_part has pp parts)")


def _titan_microbatches(plan: Any, v: _View) -> None:
    """The checks torch.distributed.pipelining's schedule classes make on the micro-batch count."""
    lay = v.layout
    n = plan.global_batch // lay.dp // lay.mbs      # torchtitan: local batch / micro-batch size
    cls = _TITAN_SCHEDULES[lay.schedule]
    if lay.schedule in ("interleaved", "zb"):
        rounds = max(1, n // lay.pp)
        if n % rounds:
            # ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble.__init__ raise on it
            raise ConfigError(f"torchtitan's {cls}, which runs the plan's {lay.schedule!r} schedule, needs the "
                              f"micro-batches per step ({n}) to be a multiple of max(1, {n} // pp={lay.pp}) = "
                              f"{rounds}; re-plan with a global batch giving a multiple of pp={lay.pp} micro-batches "
                              "per data-parallel rank, or with fixed={'schedule': '1f1b'}")
    elif lay.schedule == "1f1b" and n < lay.pp:
        # Schedule1F1B.__init__ raises on it
        raise ConfigError(f"torchtitan's 1F1B needs at least pp={lay.pp} micro-batches per step, the plan has {n}; "
                          f"re-plan with a global batch of at least {lay.pp * lay.mbs * lay.dp} or with a smaller pp")


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
    if getattr(v.layout, "offload_activations", False):
        # (its GraphTrainer's offload pass, pytorch/torchtitan#3064, is experimental and not the trainer exported to)
        raise ConfigError("torchtitan's trainer does not offload activations to host memory, which this plan does "
                          "(offload_activations=True); re-plan for the torchtitan stack (meshplan plan --export "
                          "torchtitan never offloads), or export to Megatron-LM (pp=1, no recompute)")
    if rc == "none" or rc == 0:
        return {"mode": "none"}
    if rc == "full" or (isinstance(rc, int) and rc >= v.layers_per_rank):
        return {"mode": "full"}
    if rc == "op_sac":
        # the plan's policy is torchtitan's own op-level selective checkpointing
        return {"mode": "selective", "selective_ac_option": "op"}
    if rc in ("norm_act", "norm_moe", "mla_up"):
        # torchtitan's checkpointing wraps whole layers (full, every k-th, or op-level SAC over the
        # layer); none of its modes re-runs just these modules
        what = {"norm_act": "re-runs only the norms and the MoE activation (plan recompute 'norm_act', "
                            "Megatron-Core's --recompute-modules layernorm moe_act)",
                "norm_moe": "re-runs only the norms and the MoE layer (plan recompute 'norm_moe', Megatron-Core's "
                            "--recompute-modules layernorm moe)",
                "mla_up": "re-runs only latent attention's up-projections and the dense MLPs (plan recompute "
                          "'mla_up', Megatron-Core's --recompute-modules mla_up_proj mlp)"}[rc]
        raise ConfigError(
            f"torchtitan has no recompute mode that {what}: its activation checkpointing is 'none', 'full' or "
            "'selective' (op-level SAC, or every k-th layer). Re-plan for the torchtitan stack, or with "
            "fixed={'recompute': 'op_sac'} (`meshplan plan --fix recompute=op_sac`: torchtitan's op-level "
            "selective checkpointing) or fixed={'recompute': 'none'} if it fits, or export this plan to "
            "Megatron-LM or NeMo, which run it as is")
    if rc == "selective":
        # op-level SAC recomputes the cheap ops and keeps matmul outputs: the closest to meshplan's
        # "recompute core attention + activation" policy
        v.notes.append("recompute: meshplan's selective policy maps to torchtitan's op-level SAC "
                       "(selective_ac_option='op'), which chooses the recomputed ops itself")
        return {"mode": "selective", "selective_ac_option": "op"}
    if not isinstance(rc, int):
        raise ConfigError(f"torchtitan export: recompute {rc!r} has no torchtitan counterpart; re-plan with "
                          "fixed={'recompute': 'op_sac'}, 'full' or 'none'")
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


def _titan_dp(v: _View) -> dict[str, Any]:
    """The data-parallel degrees: FSDP (data_parallel_shard_degree) or, for plain data parallelism
    only, DDP (data_parallel_replicate_degree)."""
    lay = v.layout
    par: dict[str, Any] = {}
    other = (lay.tp, lay.pp, lay.cp, lay.ep)
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
    elif all(d == 1 for d in other):
        par["data_parallel_replicate_degree"] = lay.dp
        par["data_parallel_shard_degree"] = 1
    else:
        # torchtitan's DDP is 1-D only (parallelize.py: "DDP has not supported > 1D parallelism"), and
        # with cp or ep > 1 it applies FSDP anyway. FSDP that keeps weights gathered after forward moves
        # the same bytes as DDP's all-reduce (reduce-scatter + all-gather) and holds less memory.
        par["data_parallel_replicate_degree"] = 1
        par["data_parallel_shard_degree"] = lay.dp
        par["fsdp_reshard_after_forward"] = "never"
        v.notes.append("DDP (zero=0): torchtitan runs DDP only without tp/pp/cp/ep; exported as FSDP over the "
                       "data-parallel ranks without resharding after forward (same traffic as DDP's all-reduce, "
                       "less memory)")
    return par


def torchtitan_export(plan: Any, model: Any = None) -> Export:
    """A torchtitan v0.2.2 job config (nested dict: TOML sections) for the plan."""
    _check_precision(plan, "torchtitan", (Precision.BF16, Precision.FP8))
    v = _view(plan, model)
    lay = v.layout
    ac = _titan_ac(v)
    fl = _titan_flavor(v.shape)
    if v.shape is not None and (v.shape.layer_windows or v.shape.attention_sinks):
        missing = " and ".join(x for x, on in (("sliding-window attention", bool(v.shape.layer_windows)),
                                                ("attention sinks", v.shape.attention_sinks)) if on)
        raise ConfigError(f"torchtitan export: the model ({v.shape.source}) has {missing}, which none of the "
                          f"torchtitan flavors this export writes ({_flavor_list()}) computes; export to Megatron-LM "
                          "or Megatron-Bridge (window_size / window_attn_skip_freq / softmax_type), or register "
                          "a torchtitan model of your own")
    if lay.pp > 1:
        if lay.schedule == "zb":
            _titan_zb(v)
        _titan_microbatches(plan, v)
    if lay.ep > 1 and lay.etp not in (1, lay.tp):
        raise ConfigError(f"torchtitan supports expert tensor parallelism only as etp=1 or etp=tp={lay.tp}, "
                          f"not etp={lay.etp}; re-plan with fixed etp=1 or etp={lay.tp}")
    if lay.cp > 1 and fl is not None and fl.flex_attention:
        raise ConfigError(f"torchtitan's {fl.name} {fl.flavor} uses FlexAttention, and torchtitan v0.2.2's context "
                          f"parallelism runs SDPA only (parallelize.py raises NotImplementedError), so cp={lay.cp} "
                          "cannot run there; re-plan with fixed={'cp': 1} (`meshplan plan --export torchtitan` "
                          "does so for this model), or export to Megatron-LM, NeMo 2 or Megatron-Bridge")
    div = lay.tp * 2 * lay.cp
    if plan.seq_len % div:
        raise ConfigError(f"torchtitan needs the sequence length ({plan.seq_len}) divisible by tp x 2 x cp = {div} "
                          "(sequence parallelism and load-balanced context parallelism); re-plan with a sequence "
                          f"length that is a multiple of {div}")
    par = _titan_dp(v)
    if lay.ep > 1:
        # parallel_dims.py: the expert mesh is carved out of dp_shard x cp x tp (efsdp = that / (ep x etp))
        pool = par["data_parallel_shard_degree"] * lay.cp * lay.tp
        if pool % (lay.ep * lay.etp):
            raise ConfigError(f"torchtitan takes expert-parallel ranks from data_parallel_shard x cp x tp = "
                              f"{par['data_parallel_shard_degree']} x {lay.cp} x {lay.tp} = {pool} ranks, which "
                              f"ep={lay.ep} x etp={lay.etp} does not divide (HSDP replicas cannot hold experts); "
                              "re-plan with fsdp_shard=0 (full sharding) or a smaller ep")
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
        # The stages are listed explicitly, so the split is the plan's. pipeline_parallel_layers_per_stage
        # (and the first/last-stage weights) only generate a split when none is listed; set, torchtitan
        # also checks them against its own layer count and stages per rank, so they are left out.
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
    out: dict[str, Any] = {"model": _titan_model(plan, v, fl), "training": training, "parallelism": par,
                           "activation_checkpoint": ac}
    out["compile"] = _titan_compile(plan, v, par["enable_async_tensor_parallel"])
    if plan.precision == Precision.FP8:
        out["model"]["converters"] = ["quantize.linear.float8"]
        out["quantize"] = {"linear": {"float8": _titan_float8(plan, v, fl, par)}}
    if not out["model"]:
        del out["model"]
    target = f"[model] {fl.name} {fl.flavor}" if fl is not None else ""
    return Export(fmt="torchtitan", version=VERSIONS["torchtitan"], data=out, notes=tuple(v.notes), target=target)


def _titan_compile(plan: Any, v: _View, async_tp: bool) -> dict[str, Any]:
    """[compile]: on where the plan was priced with torch.compile'd blocks (the stack's `compile`),
    or where async TP needs it; off under the zero-bubble schedules, which refuse compiled stages."""
    stack = STACKS.get(plan.stack)
    priced_compiled = stack is not None and stack.compile
    if v.layout.pp > 1 and v.layout.schedule in _NO_COMPILE_SCHEDULES:
        if async_tp:
            raise ConfigError(f"async TP needs torch.compile, which torch.distributed.pipelining's "
                              f"{_TITAN_SCHEDULES[v.layout.schedule]} refuses (compiled stages); re-plan with "
                              "fixed={'tp_comm_overlap': False} or fixed={'schedule': 'interleaved'}")
        if priced_compiled:
            v.notes.append(f"compile: the plan was priced with torch.compile'd blocks, which "
                           f"{_TITAN_SCHEDULES[v.layout.schedule]} refuses; the blocks run eager (slower "
                           "element-wise work than planned)")
        return {"enable": False}
    if async_tp or priced_compiled:
        return {"enable": True, "components": ["model", "loss"]}
    return {"enable": False}


def _titan_float8(plan: Any, v: _View, fl: _Flavor | None, par: dict[str, Any]) -> dict[str, Any]:
    """[quantize.linear.float8]. torchtitan's float8 converter takes either the tensorwise default
    (no recipe_name; FSDP may all-gather weights in float8) or a named recipe (recipe_name, and then
    no FSDP float8 all-gather: it asserts the two are not set together)."""
    lay = v.layout
    recipe = getattr(lay, "fp8_recipe", "tensorwise")
    if recipe not in ("tensorwise", "rowwise"):
        raise ConfigError(f"torchtitan's float8 linear converter runs the 'tensorwise' and 'rowwise' recipes, not "
                          f"{recipe!r}; re-plan with fixed={{'fp8_recipe': 'tensorwise'}} (or 'rowwise')")
    if recipe == "tensorwise" and lay.tp > 1 and fl is not None and fl.name == "deepseek_v3":
        raise ConfigError("torchtitan v0.2.2 refuses tensorwise FP8 with tensor parallelism for deepseek_v3 "
                          "(NotImplementedError in its parallelize.py); re-plan with fixed={'fp8_recipe': 'rowwise'} "
                          "or tp=1")
    lead, tail = _fp8_notes(plan, v, "torchtitan")
    skip = [f"layers.{i}." for i in list(range(lead)) + list(range(v.num_layers - tail, v.num_layers))]
    # the output layer and the MoE routers stay BF16 in the plan (torchtitan's MoE router is router.gate)
    keep = ["output"] + (["router.gate"] if v.shape is not None and v.shape.experts else []) + skip
    f8: dict[str, Any] = {"filter_fqns": keep}
    if recipe == "rowwise":
        f8["recipe_name"] = "rowwise"
    else:
        # FSDP's float8 weight all-gather applies where weights are sharded (dp_shard > 1)
        sharded = par.get("data_parallel_shard_degree", 1) > 1
        f8["enable_fsdp_float8_all_gather"] = sharded
        f8["precompute_float8_dynamic_scale_for_fsdp"] = sharded
    return f8


def to_torchtitan(plan: Any, model: Any = None) -> dict[str, Any]:
    """torchtitan v0.2.2 job config sections as a nested dict (`to_toml` writes it)."""
    return torchtitan_export(plan, model).data
