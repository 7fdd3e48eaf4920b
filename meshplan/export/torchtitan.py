"""torchtitan export: a v0.2.2 TOML job config for a Plan (`torchtitan_export`, `to_torchtitan`).

Names checked against torchtitan v0.2.2 (2026-02-20; torchtitan/config/job_config.py), the last
release that reads TOML; schedule names are torch.distributed.pipelining's `get_schedule_class`
names, which torchtitan passes through.
"""

from __future__ import annotations

from typing import Any

from meshplan.errors import ConfigError
from meshplan.export.view import FP8_RECIPE, VERSIONS, Export, _check_precision, _fp8_notes, _View, _view

__all__ = ["torchtitan_export", "to_torchtitan"]

# torchtitan (v0.2.2) and torch.distributed.pipelining schedule names (get_schedule_class). ZB-H1
# ("zb") is InterleavedZeroBubble given one stage per rank: torch's ZB1P schedule then runs each
# rank's F, I (input grad) and deferred W (weight grad) in ZB-H1's order.
_TITAN_SCHEDULES = {"1f1b": "1F1B", "interleaved": "Interleaved1F1B", "gpipe": "GPipe",
                    "zb": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble"}


def _titan_zb(plan: Any, v: _View) -> None:
    """Check and note the ZB-H1 export (InterleavedZeroBubble, one stage per rank)."""
    lay = v.layout
    n = plan.global_batch // lay.dp // lay.mbs      # torchtitan: local batch / micro-batch size
    rounds = max(1, n // lay.pp)
    if n % rounds:
        # ScheduleInterleavedZeroBubble.__init__ raises on it (torch.distributed.pipelining)
        raise ConfigError(f"torchtitan's InterleavedZeroBubble, which runs the plan's ZB-H1 schedule, needs the "
                          f"micro-batches per step ({n}) to be a multiple of max(1, {n} // pp={lay.pp}) = {rounds}; "
                          f"re-plan with a global batch giving a multiple of pp={lay.pp} micro-batches per "
                          "data-parallel rank, or with fixed={'schedule': '1f1b'}")
    v.notes.append("schedule: ZB-H1 ('zb') exported as InterleavedZeroBubble with one stage per rank "
                   "(module_fqns_per_model_part has pp parts); pipeline_parallel_layers_per_stage is left out "
                   "because torchtitan then requires at least 2 stages per rank for that schedule class")


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
    if rc == "norm_act":
        # torchtitan's checkpointing wraps whole layers (full, every k-th, or op-level SAC over the
        # layer); none of its modes stores everything but the norms' and the experts' activation outputs
        raise ConfigError(
            "torchtitan has no recompute mode that re-runs only the norms and the MoE activation (plan "
            "recompute 'norm_act', Megatron-Core's --recompute-modules layernorm moe_act): its activation "
            "checkpointing is 'none', 'full' or 'selective' (op-level SAC, or every k-th layer). Re-plan with "
            "fixed={'recompute': 'selective'} (`meshplan plan --fix recompute=selective`: less memory, attention "
            "recomputed) or fixed={'recompute': 'none'} if it fits, or export this plan to Megatron-LM or NeMo, "
            "which run it as is")
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
    if lay.pp > 1 and lay.schedule == "zb":
        _titan_zb(plan, v)
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
        if v.even and lay.schedule != "zb":
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
