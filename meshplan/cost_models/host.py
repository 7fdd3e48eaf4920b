"""Host (Python / dispatch / gloo) time of CPU processes that a GPU-oriented model does not charge
(the CPU closing loop: benchmarks/cpu_closing_loop.py).

On local CPU processes the host is the device: every DTensor dispatch, every collective's
loopback work and every per-parameter optimizer op takes the same cores the GEMMs run on, so it
adds to the step instead of hiding behind kernels. Each term here is a measured per-event host
cost (constants.CPU_*, in CPU seconds at the reference matmul rate CPU_MICRO_MATMUL_GFLOPS_1T)
times a count derived from the traced block and the layout, slowed by the process's core share
and speed (cpu_rate_scale). `CpuHostDevice` is this module's side of the device seam
(cost_models.device): the estimate reaches these terms only through it, so no GPU formula
carries a CPU branch.

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

from meshplan.cluster import CPU_HOST_BF16_TFLOPS
from meshplan.cost_models import constants as K
from meshplan.cost_models.comm import collective_time, group
from meshplan.cost_models.roofline import gemm_roofline
from meshplan.ir.profile import EXPERT_ROLES
from meshplan.ir.support import runs_as_ddp

__all__ = ["CpuHostDevice", "CPU_HOST", "cpu_thread_share", "cpu_speed", "cpu_rate_scale", "cpu_op_overhead",
           "host_slowdown", "dtensor_op_counts", "tp_host_time", "ep_host_time", "cp_host_time",
           "pp_host_time", "param_tensors", "partial_grad_reduces", "step_host_time",
           "tp_collectives_per_layer", "tp_edge_host_time",
           "ring_blocks", "moe_loop_host_time", "fsdp_collectives", "fsdp_units", "routing_stat_reduces"]


def cpu_thread_share(cluster) -> float:
    """Fraction of one core each process gets: local-cpu's matmul rate is the host's (all cores)
    divided among the processes, so processes x rate / host rate recovers the host's cores."""
    return min(1.0, K.CPU_HOST_CORES * cluster.gpu.bf16_tflops / CPU_HOST_BF16_TFLOPS)


def cpu_speed(cluster) -> float:
    """This process's CPU speed relative to the host the CPU_* rates were measured on: its matmul
    rate per core (local-cpu's constant or a calibrated one) over the matmul rate measured alongside
    them (constants.CPU_MICRO_MATMUL_GFLOPS_1T)."""
    per_core = cluster.gpu.bf16_tflops * 1e12 / cpu_thread_share(cluster)
    return per_core / (K.CPU_MICRO_MATMUL_GFLOPS_1T * 1e9)


def cpu_rate_scale(cluster) -> float:
    """This process's rate for CPU work measured on one reference thread (the CPU_* constants):
    its share of a core times its speed relative to the reference host.

    A calibrated profile that measured the host's small-op time (GPUSpec.cpu_op_us: chains of
    autograd muls, the op CPU_OP_FWD_S is defined by, run in every process at once) scales the
    preset's rate by how much slower or faster that op runs than on the quiet reference host
    (CPU_QUIET_OP_US_1T per op on a core of its own): the host work this scales (dispatch,
    autograd, gloo's loopback work, small element-wise kernels) follows the host's small-op speed,
    and the CPU_* constants hold for the quiet host at the preset's rate. (Scaling them by the
    calibrated matmul rate instead predicted the default job 15% fast on the quiet host: 4
    one-thread processes sustain 109 GFLOP/s of 512^3 bf16 matmul each there, 1.2x the preset's
    2-thread 2048^3 rate split 4 ways, while its step matched the preset's prediction, dp4 0.133 s
    measured against 0.132 predicted.) Otherwise: the matmul-derived share x speed."""
    op_us = getattr(cluster.gpu, "cpu_op_us", None)
    if op_us:
        # preset share x preset speed x (the quiet op time at that share, CPU_QUIET_OP_US_1T / share,
        # over the measured one): the share cancels, the measurement already holds it
        preset_speed = CPU_HOST_BF16_TFLOPS / K.CPU_HOST_CORES * 1e3 / K.CPU_MICRO_MATMUL_GFLOPS_1T
        return preset_speed * K.CPU_QUIET_OP_US_1T / op_us
    return cpu_thread_share(cluster) * cpu_speed(cluster)


def cpu_op_overhead(ops, cluster) -> tuple[float, float]:
    """(forward, backward) seconds of host overhead for a traced op list on a CPU process: views and
    compute ops each pay their measured dispatch + autograd cost, slowed by the core share."""
    if not ops:
        return 0.0, 0.0
    views = sum(1 for o in ops if getattr(o, "kind", "") == "view")
    other = len(ops) - views
    slow = 1.0 / cpu_rate_scale(cluster)
    return ((views * K.CPU_VIEW_FWD_S + other * K.CPU_OP_FWD_S) * slow,
            (views * K.CPU_VIEW_BWD_S + other * K.CPU_OP_BWD_S) * slow)


def host_slowdown(cluster) -> float:
    """Wall seconds per reference CPU-second of host work on this process: 1 / (core share x speed),
    as for cpu_op_overhead."""
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
            if o.role != "router" and o.role not in EXPERT_ROLES:
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
    if layout.tp <= 1:
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
    if layout.tp <= 1:
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
    if layout.ep <= 1 or not b.is_moe:
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
    micro-batch: the K/V shifts (cp-1 forward; backward cp-1 K/V and cp dK/dV shifts, the last one
    bringing each block's gradient home: context_parallel._RingAttention.backward), each a gloo
    send/receive pair, and the ring's per-block ops besides the fused kernel the attention time
    prices (context_parallel._RingAttention: per block pair the flash kernel and the online-softmax
    merge, 5 ops and 1 view forward; the kernel's backward and 3 accumulating adds, 4 ops)."""
    if layout.cp <= 1 or not b.heads:
        return 0.0, 0.0
    s = host_slowdown(cluster)
    steps = layout.cp - 1
    n = ring_blocks(layout.cp, getattr(b, "causal", True))
    ops_f = n * (5 * K.CPU_OP_FWD_S + 1 * K.CPU_VIEW_FWD_S)
    ops_b = n * (4 * K.CPU_OP_FWD_S)
    return (steps * K.CPU_COLLECTIVE_HOST_S + ops_f) * s, ((2 * steps + 1) * K.CPU_COLLECTIVE_HOST_S + ops_b) * s


def moe_loop_host_time(b, layout, cluster) -> tuple[float, float]:
    """(forward, backward) host seconds of the grouped expert GEMMs on a CPU process, one micro-batch
    (models/grouped_mm.py: torch._grouped_mm runs only on Hopper-class GPUs; elsewhere the
    `meshplan::grouped_mm` custom op, a Python function behind torch.library, loops over the local
    experts: each expert's rows are sliced, multiplied and written back, 2 ops and 3 views
    forward, 4 ops and 6 views backward). The traced block sees one grouped op per expert linear;
    the custom op's own Python (dispatch, bounds check, output allocation; its autograd wrapper
    in backward) is CPU_PY_CUSTOM_OP_S per call."""
    if not b.is_moe:
        return 0.0, 0.0
    grouped = [li for li in b.linears if li.is_expert]
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
    if layout.pp <= 1:
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
    and `sync_s` (the loss and norm all-reduces, priced by the caller with comm.py)."""
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


class CpuHostDevice:
    """Pricing of local CPU processes (the `local-cpu` cluster and its calibrated profiles): the
    host is the device, so besides the roofline every traced op, DTensor dispatch, gloo
    collective, pipeline action and per-parameter optimizer op is charged at its measured host
    cost (constants.CPU_*), and attention and element-wise work run at PyTorch's CPU kernels'
    measured rates. Stateless: every method takes the cluster it prices."""

    kind = "cpu-host"
    # validated by the CPU closing loop (benchmarks/cpu_closing_loop.py), not the published runs
    validated_by_published_runs = False
    ring_ops_on_host = True          # cp_host_time prices the ring's per-call ops

    def runs_compile(self, stack) -> bool:
        """The runtime compiles on CUDA only: CPU processes run the model as traced."""
        return False

    # -- kernels ----------------------------------------------------------------------------
    def gemm_fixed_s(self, cluster, fp8: bool) -> float:
        """The GEMM library's per-call work (CPU_GEMM_CALL_S) at this process's share and speed."""
        return K.CPU_GEMM_CALL_S / cpu_rate_scale(cluster)

    def grouped_gemm_time(self, rows: float, n: float, k: float, cluster, *, groups: float, fp8: bool,
                          recipe: str, fitted: K.Fitted) -> float:
        """No grouped kernel on CPU: meshplan::grouped_mm loops over the groups, one BF16 GEMM call
        each (models/grouped_mm.py), each with its own fixed cost (its Python: moe_loop_host_time)."""
        return groups * (gemm_roofline(rows, n, k, cluster, fitted=fitted) + self.gemm_fixed_s(cluster, False))

    def attention_time(self, flops_fwd: float, cluster, *, backward: bool, kernel: str, shape,
                       fitted: K.Fitted) -> float:
        """PyTorch's CPU flash-attention kernel at its measured rates (constants.CPU_SDPA_*)."""
        rate = (K.CPU_SDPA_BWD_GFLOPS_1T if backward else K.CPU_SDPA_FWD_GFLOPS_1T) * 1e9 * cpu_rate_scale(cluster)
        return flops_fwd / rate

    def fsdp_copy_time(self, nbytes: float, cluster) -> float:
        """None apart: CPU_FSDP_UNIT_HOST_S, measured per FSDP unit, holds the copies already."""
        return 0.0

    def elementwise_time(self, nbytes: float, cluster) -> float:
        """bf16 element-wise ops on CPU cores run far below the copy bandwidth."""
        return nbytes / (K.CPU_ELEMENTWISE_GB_S_1T * 1e9 * cpu_rate_scale(cluster))

    def permute_time(self, nbytes: float, cluster) -> float:
        """The eager index_select / mul / index_add of a MoE permutation (CPU_PERMUTE_GB_S_1T)."""
        return nbytes / (K.CPU_PERMUTE_GB_S_1T * 1e9 * cpu_rate_scale(cluster))

    # -- host work per layer and per step ----------------------------------------------------
    def op_overhead(self, ops, cluster, fitted: K.Fitted) -> tuple[float, float]:
        """Every traced op's dispatch + autograd cost; the fitted per-layer constant for a layer
        priced from a config (no traced ops)."""
        if not ops:
            return fitted.layer_overhead_s, fitted.layer_overhead_s
        return cpu_op_overhead(ops, cluster)

    def layer_host(self, b, layout, cluster, policy: str) -> dict[str, tuple[float, float]]:
        """Per-dimension (forward, backward + recompute) host seconds of one layer beyond its ops:
        DTensor dispatch and collectives of TP, EP and CP, the grouped-GEMM loop."""
        out = {"tp": tp_host_time(b, layout, cluster), "ep": ep_host_time(b, layout, cluster),
               "cp": cp_host_time(b, layout, cluster), "compute": moe_loop_host_time(b, layout, cluster)}
        if policy == "full":        # the recomputed forward dispatches and communicates again
            out = {k: (f, bk + f) for k, (f, bk) in out.items()}
        return out

    def moe_host_wait(self, b, layout, stack, fp8_recipe: str | None = None) -> tuple[float, float]:
        """None apart: on CPU processes every op's host time is charged already (op_overhead)."""
        return 0.0, 0.0

    def edge_host(self, profile, layout, cluster, *, first: bool, last: bool) -> tuple[float, float]:
        return tp_edge_host_time(profile, layout, cluster, first=first, last=last)

    def expert_fsdp_units(self, n_moe_layers: int, layout) -> int:
        """The runtime's ZeRO-1/2 units (fsdp_units) gather and reduce-scatter one at a time, each
        MoE layer's experts apart under EP, so each unit pays its own latency."""
        return n_moe_layers if layout.ep > 1 else 1

    def pipeline_bubble(self, cluster, layout, busy: float, bubble: float) -> float:
        """The pipeline bubble a CPU process's step shows when the processes outnumber the cores.

        A rank idling in the fill or drain blocks in a receive and the OS gives its core to ranks
        with work, so nothing idles while any rank can run: the step is bounded below by the
        processes' work over the cores (the rank's `busy` time, priced at its core share), and by
        the schedule's critical path run at full speed, share x (busy + bubble), each rank on a
        core of its own while the others wait. The bubble left is what the second bound adds to the
        first. On 2 cores with pp2 x dp2 (share 0.5) and m = 2 micro-batches the 1F1B bubble, half
        the busy time, is hidden entirely: the measured step equalled dp4's (0.147 s against
        0.133 s, benchmarks/cpu_closing_loop.py) and the processes' CPU time equalled dp4's."""
        if layout.pp <= 1:
            return bubble
        return max(0.0, cpu_thread_share(cluster) * (busy + bubble) - busy)

    def pipeline_lower_bound(self, layout, m: int, total_fb: float) -> float:
        """A lower bound on the step's busy + bubble time: the busiest rank's work, m x sum / pp
        (pipeline_bubble may hide the whole bubble on a CPU)."""
        return m * total_fb / max(layout.pp, 1)

    def pp_host_time(self, layout, cluster, m: int) -> float:
        return pp_host_time(layout, cluster, m)

    def step_overhead(self, profile, cluster, layout, ranks, stack) -> float:
        """The slowest pipeline rank's measured host pieces per step (step_host_time): the
        optimizer's and the gradient norm's per-parameter loops, Partial-gradient all-reduces, the
        FSDP units, and the loss and norm all-reduces over every rank (data loading is outside the
        measured step)."""
        L = layout
        sync = 2 * collective_time("all_reduce", 8, group(cluster, L.world, 1), cluster)
        p = L.pp
        blocks = profile.layer_blocks()

        def rank_host(r: int, w) -> float:
            moe, last = sum(1 for i in w.layers if blocks[i].is_moe), r == p - 1
            experts = sum(1 for i in w.layers for li in blocks[i].linears if li.is_expert)
            return step_host_time(param_tensors(profile, w.layers, first=r == 0, last=last), L, cluster, sync_s=sync,
                                  partial_reduces=partial_grad_reduces(profile, w.layers, L, last=last),
                                  collectives=fsdp_collectives(L, moe, len(w.layers)) + routing_stat_reduces(L, moe),
                                  fsdp_units=fsdp_units(L, moe, len(w.layers)), expert_params=experts)
        return max(rank_host(r, w) for r, w in enumerate(ranks))


CPU_HOST = CpuHostDevice()
