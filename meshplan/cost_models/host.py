"""Host (Python / dispatch / gloo) time of CPU processes that a GPU-oriented model does not charge
(the CPU closing loop: benchmarks/cpu_closing_loop.py).

On local CPU processes the host is the device: every DTensor dispatch, every collective's
loopback work and every per-parameter optimizer op takes the same cores the GEMMs run on, so it
adds to the step instead of hiding behind kernels. Each term here is a measured per-event host
cost (constants.CPU_*, in CPU seconds at the reference matmul rate CPU_MICRO_MATMUL_GFLOPS_1T)
times a count derived from the traced block and the layout, slowed by the process's core share
and speed like compute.cpu_op_overhead. All functions return 0 on GPU clusters (compute.is_cpu),
so GPU predictions are unchanged.

Counts (what the runtime does, meshplan/runtime):
- TP (tensor_parallel.py): the sharded linears run on DTensors; under sequence parallelism the
  residual stream is a Shard(1) DTensor, so the block's norms and residual adds do too. Each such
  traced op pays its DTensor host cost (sharding propagation + dispatch, ~8-10x a plain op).
  Each TP collective is a DTensor redistribution (PrepareModuleInput gather, row-parallel
  reduce-scatter / all-reduce, their transposes in backward) through a functional collective over
  gloo: CPU_TP_COLLECTIVE_HOST_S each, on top of comm.py's alpha-beta time. Under SP the norm
  weights' gradients come back Partial and are all-reduced one parameter at a time
  (ParallelModel._finalise_grads): one gloo collective per norm weight per step.
- EP (expert_parallel.py): per MoE layer and micro-batch, an all-to-all of the token counts
  before the rows move (forward only), besides the 2 + 2 row all-to-alls comm.py charges; each
  of the five is a gloo collective with its host cost.
- CP (context_parallel.py, ring attention): per layer and micro-batch, cp-1 K/V exchanges
  forward and 2(cp-1) (K/V and dK/dV) backward, each a gloo send/recv pair.
- PP (pipelining): per micro-batch and stage boundary, an activation send/recv forward and a
  gradient send/recv backward on each side.
- Per step (estimate.py): the optimizer's per-parameter loop (torch AdamW on CPU runs its
  single-tensor path: ~10 ops per parameter, DTensor ops where the parameters are FSDP / TP / EP
  shards), the gradient-norm's per-parameter ops, and the loss and norm all-reduces. These
  replace constants.STEP_OVERHEAD_S on CPU (data loading is outside the measured step).
"""

from __future__ import annotations

from meshplan.cost_models import constants as K
from meshplan.cost_models.compute import cpu_rate_scale, is_cpu
from meshplan.ir.support import runs_as_ddp

__all__ = ["host_slowdown", "dtensor_op_counts", "tp_host_time", "ep_host_time", "cp_host_time",
           "pp_host_time", "param_tensors", "partial_grad_reduces", "step_host_time",
           "tp_collectives_per_layer", "tp_edge_host_time",
           "ring_blocks", "moe_loop_host_time", "fsdp_collectives", "fsdp_units", "routing_stat_reduces"]


def host_slowdown(cluster) -> float:
    """Wall seconds per reference CPU-second of host work on this process: 1 / (core share x speed),
    as for compute.cpu_op_overhead."""
    return 1.0 / cpu_rate_scale(cluster)


def _instance(b) -> str:
    return b.instances[0] if getattr(b, "instances", None) else ""


def dtensor_op_counts(b, layout) -> dict[str, int]:
    """Traced ops of one layer that run on DTensors under `layout`'s TP: {"linear", "norm", "other"}.

    The TP-sharded linears (not the router / routed experts, which TP leaves to EP); with sequence
    parallelism also the norms and the block-level ops on the sequence-sharded residual stream
    (the residual adds: ops whose module is the block itself)."""
    out = {"linear": 0, "norm": 0, "other": 0}
    if layout.tp <= 1:
        return out
    inst = _instance(b)
    for o in b.ops:
        if o.kind == "linear":
            if o.role not in ("router", "expert_in", "expert_out"):
                out["linear"] += 1
        elif layout.sp and o.kind == "norm":
            out["norm"] += 1
        elif layout.sp and o.module == inst and o.kind in ("elementwise", "view"):
            out["other"] += 1
    return out


def tp_collectives_per_layer(b, layout) -> int:
    """TP collectives of one layer forward (backward issues as many): per sub-module (attention,
    feed-forward) an all-gather + reduce-scatter under SP, one all-reduce without (layer._tp_comm)."""
    if layout.tp <= 1:
        return 0
    n_sub = (1 if b.heads else 0) + (1 if (b.ffn_hidden or b.shared_ffn_hidden) else 0)
    return n_sub * (2 if layout.sp else 1)


def tp_host_time(b, layout, cluster) -> tuple[float, float]:
    """(forward, backward) host seconds of one layer's TP on a CPU process, one micro-batch."""
    if not is_cpu(cluster) or layout.tp <= 1:
        return 0.0, 0.0
    n = dtensor_op_counts(b, layout)
    fwd = n["linear"] * K.CPU_DTENSOR_LINEAR_S[0] + n["norm"] * K.CPU_DTENSOR_NORM_S[0] + \
        n["other"] * K.CPU_DTENSOR_OP_S[0]
    bwd = n["linear"] * K.CPU_DTENSOR_LINEAR_S[1] + n["norm"] * K.CPU_DTENSOR_NORM_S[1] + \
        n["other"] * K.CPU_DTENSOR_OP_S[1]
    coll = tp_collectives_per_layer(b, layout) * K.CPU_COLLECTIVE_HOST_S
    s = host_slowdown(cluster)
    return (fwd + coll) * s, (bwd + coll) * s


def tp_edge_host_time(profile, layout, cluster, *, first: bool, last: bool) -> tuple[float, float]:
    """(forward, backward) host seconds of TP outside the blocks on a CPU process, one micro-batch:
    the vocabulary-parallel embedding (first rank) and the output layer (+ the final norm under SP)
    on the last, each a DTensor op with one redistribution each way."""
    if not is_cpu(cluster) or layout.tp <= 1:
        return 0.0, 0.0
    ops = (list(profile.pre_ops) if first else []) + (list(profile.post_ops) if last else [])
    lin = sum(1 for o in ops if o.kind in ("linear", "embedding"))
    norm = sum(1 for o in ops if o.kind == "norm") if layout.sp else 0
    coll = (1 if first else 0) + (1 if last else 0)
    fwd = lin * K.CPU_DTENSOR_LINEAR_S[0] + norm * K.CPU_DTENSOR_NORM_S[0] + coll * K.CPU_COLLECTIVE_HOST_S
    bwd = lin * K.CPU_DTENSOR_LINEAR_S[1] + norm * K.CPU_DTENSOR_NORM_S[1] + coll * K.CPU_COLLECTIVE_HOST_S
    s = host_slowdown(cluster)
    return fwd * s, bwd * s


def ep_host_time(b, layout, cluster) -> tuple[float, float]:
    """(forward, backward) host seconds of one MoE layer's EP dispatch on a CPU process: the counts
    all-to-all and the two row all-to-alls forward, the two row all-to-alls backward."""
    if not is_cpu(cluster) or layout.ep <= 1 or not b.is_moe:
        return 0.0, 0.0
    s = host_slowdown(cluster) * K.CPU_COLLECTIVE_HOST_S
    return 3 * s, 2 * s


def ring_blocks(cp: int, causal: bool) -> int:
    """(query chunk, key chunk) pairs one CP rank computes per layer in the load-balanced ring
    (context_parallel.py: 2cp chunks, two per rank, masked pairs skipped): of the (2cp)^2 pairs
    causal attention keeps the 2cp(2cp+1)/2 on or below the diagonal, spread evenly over the cp ranks."""
    return 2 * cp + 1 if causal else 4 * cp


def cp_host_time(b, layout, cluster) -> tuple[float, float]:
    """(forward, backward) host seconds of one layer's ring attention on a CPU process, one
    micro-batch: the K/V shifts (cp-1 forward; K/V and dK/dV, 2(cp-1), backward), each a gloo
    send/receive pair, and the ring's eager per-block ops (context_parallel._RingAttention: per
    block pair 28 ops forward, 16 of them views, and 36 backward, 18 views), where a flash kernel
    would run one op."""
    if not is_cpu(cluster) or layout.cp <= 1 or not b.heads:
        return 0.0, 0.0
    s = host_slowdown(cluster)
    steps = layout.cp - 1
    n = ring_blocks(layout.cp, getattr(b, "causal", True))
    ops_f = n * (12 * K.CPU_OP_FWD_S + 16 * K.CPU_VIEW_FWD_S)
    ops_b = n * (18 * K.CPU_OP_FWD_S + 18 * K.CPU_VIEW_FWD_S)
    return (steps * K.CPU_COLLECTIVE_HOST_S + ops_f) * s, (2 * steps * K.CPU_COLLECTIVE_HOST_S + ops_b) * s


def moe_loop_host_time(b, layout, cluster) -> tuple[float, float]:
    """(forward, backward) host seconds of the grouped expert GEMMs on a CPU process, one micro-batch
    (models/grouped_mm.py: torch._grouped_mm runs only on Hopper-class GPUs; elsewhere the
    `meshplan::grouped_mm` custom op, a Python function behind torch.library, loops over the local
    experts: each expert's rows are sliced, multiplied and written back, 2 ops and 3 views
    forward, 4 ops and 6 views backward). The traced block sees one grouped op per expert linear;
    the custom op's own Python (dispatch, bounds check, output allocation; its autograd wrapper
    in backward) is CPU_PY_CUSTOM_OP_S per call."""
    if not is_cpu(cluster) or not b.is_moe:
        return 0.0, 0.0
    grouped = [li for li in b.linears if li.role in ("expert_in", "expert_out")]
    local = sum(max(1.0, li.count / layout.ep) for li in grouped)
    s = host_slowdown(cluster)
    calls = len(grouped)
    return (local * (2 * K.CPU_OP_FWD_S + 3 * K.CPU_VIEW_FWD_S) + calls * K.CPU_PY_CUSTOM_OP_S[0]) * s, \
        (local * (4 * K.CPU_OP_FWD_S + 6 * K.CPU_VIEW_FWD_S) + calls * K.CPU_PY_CUSTOM_OP_S[1]) * s


def pp_host_time(layout, cluster, m: int) -> float:
    """Host seconds per step of a pipeline rank's schedule on a CPU process: each of the m
    micro-batches enters and leaves each of the rank's v stages forward and backward (a send or a
    receive on each side, the pipeline's first and last stage have one side fewer), and each
    (stage, micro-batch) forward and backward is one action of torch.distributed.pipelining's
    schedule (CPU_PP_ACTION_HOST_S: its Python, the stage's input/output buffers, the per-stage
    autograd.backward and FSDP's per-call hooks)."""
    if not is_cpu(cluster) or layout.pp <= 1:
        return 0.0
    v = layout.vp
    p2p = m * 2 * (2 * v - 1) * K.CPU_COLLECTIVE_HOST_S
    actions = m * v * 2 * K.CPU_PP_ACTION_HOST_S
    return (p2p + actions) * host_slowdown(cluster)


def param_tensors(profile, layers, *, first: bool, last: bool) -> int:
    """Parameter tensors a pipeline rank holds: those the traced ops of its layers read, plus the
    embedding (first rank) and the final norm and output layer (last rank)."""
    blocks = profile.layer_blocks()
    n = 0
    for i in layers:
        n += len({p for o in blocks[i].ops for p in o.params}) or len(blocks[i].linears)
    if first:
        n += len({p for o in profile.pre_ops for p in o.params}) or 1
    if last:
        n += len({p for o in profile.post_ops for p in o.params}) or 2
    return n


def partial_grad_reduces(profile, layers, layout, *, last: bool) -> int:
    """Gradient all-reduces ParallelModel._finalise_grads issues one parameter at a time: under TP
    with SP the norm weights (replicated, used on sequence shards) get Partial gradients."""
    if layout.tp <= 1 or not layout.sp:
        return 0
    blocks = profile.layer_blocks()
    n = sum(1 for i in layers for o in blocks[i].ops if o.kind == "norm" and o.params)
    if last:
        n += sum(1 for o in profile.post_ops if o.kind == "norm" and o.params)
    return n


def fsdp_units(layout, n_moe_layers: int, n_layers: int = 0) -> int:
    """FSDP units a CPU process runs per step: under ZeRO-1/2 the runtime makes each rank's dense
    part one unit on CPU and, with EP, each MoE layer's experts a unit of their own
    (fsdp.apply_fsdp); under ZeRO-3 every one of the rank's `n_layers` blocks is a unit too, besides
    the stage's root unit (embedding, final norm, output layer). None without ZeRO or data parallelism."""
    if layout.zero < 1 or layout.dp * layout.cp <= 1:
        return 0
    experts = n_moe_layers if layout.ep > 1 else 0
    return 1 + experts + (n_layers if layout.zero >= 3 else 0)


def fsdp_collectives(layout, n_moe_layers: int, n_layers: int = 0) -> int:
    """Per-step gloo collectives of the FSDP units (fsdp_units), each with its host work: an
    all-gather and a reduce-scatter per unit, and one more all-gather in backward per ZeRO-3 unit
    that reshards after forward. comm.py prices the same collectives' wire time."""
    units = fsdp_units(layout, n_moe_layers, n_layers)
    return units * (3 if layout.zero >= 3 and layout.reshard_after_forward else 2)


def routing_stat_reduces(layout, n_moe_layers: int) -> int:
    """Per-step all-reduces of the MoE layers' routing statistics over the data-parallel x
    context-parallel ranks (models/moe.py RoutingWindow: when no loss needs them in the forward, as
    in the default job, the balancer reads them after the optimizer step, all of a stage's layers
    in one all-reduce, models/moe.flush_windows)."""
    return 1 if n_moe_layers and layout.dp * layout.cp > 1 else 0


def step_host_time(n_params: int, layout, cluster, *, sync_s: float, partial_reduces: int = 0,
                   collectives: int = 0, fsdp_units: int = 0, expert_params: int = 0) -> float:
    """Per-step host seconds of a CPU process outside forward/backward: AdamW's per-parameter loop
    (DTensor ops where the parameters are sharded), the gradient norm's per-parameter ops, the
    per-parameter Partial-gradient all-reduces, `collectives` more gloo collectives (fsdp_collectives),
    the FSDP units' own host work (`fsdp_units` of them, CPU_FSDP_UNIT_HOST_S each),
    and `sync_s` (the loss and norm all-reduces, priced by the caller with comm.py). Other clusters:
    constants.STEP_OVERHEAD_S."""
    if not is_cpu(cluster):
        return K.STEP_OVERHEAD_S
    plain = K.CPU_ADAMW_PARAM_S + K.CPU_GRAD_NORM_PARAM_S
    dtensor = K.CPU_ADAMW_DTENSOR_PARAM_S + K.CPU_GRAD_NORM_DTENSOR_PARAM_S
    if layout.ep > 1 and runs_as_ddp(zero=layout.zero, dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp,
                                     ep=layout.ep, etp=layout.etp):
        # DDP with expert parallelism (ir.support.runs_as_ddp): only the `expert_params` EP shards
        # are DTensors, the dense weights plain replicated tensors
        params = (n_params - expert_params) * plain + expert_params * dtensor
    else:
        sharded = layout.tp > 1 or layout.ep > 1 or (layout.zero >= 1 and layout.dp * layout.cp > 1)
        params = n_params * (dtensor if sharded else plain)
    host = params + (partial_reduces + collectives) * K.CPU_COLLECTIVE_HOST_S + \
        fsdp_units * K.CPU_FSDP_UNIT_HOST_S
    return host * host_slowdown(cluster) + sync_s
