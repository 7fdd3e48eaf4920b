"""Context parallelism inside a layer: the attention calls each CP implementation runs on one GPU,
their communication (total and exposed), the element-wise work PyTorch's and meshplan's rings run
around the kernels, and the K/V a gathering implementation keeps."""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.cost_models import constants as K
from meshplan.cost_models.attention import AttnCall, AttnShape, layer_calls
from meshplan.cost_models.comm import collective_time, p2p_time
from meshplan.cost_models.compute import elementwise_time
from meshplan.cost_models.context import Context
from meshplan.cost_models.device import device_of
from meshplan.ir.profile import BlockProfile

__all__ = [
    "RingTensors",
    "RingWork",
    "attention_shape",
    "cp_comm",
    "cp_comm_type",
    "cp_kv_gathered_bytes",
    "cp_ring_work",
    "meshplan_cp_merge",
    "meshplan_ring_backward",
    "meshplan_ring_calls",
    "meshplan_ring_forward",
    "meshplan_ring_tensors",
    "ring_tensors",
    "merge_step",
    "ring_work_time",
    "torch_cp_comm",
    "torch_cp_merge",
    "torch_ring_backward",
    "torch_ring_forward",
]


def cp_comm_type(layout) -> str:
    """The layout's CP attention implementation (Layout.cp_comm_type; Megatron-Core --cp-comm-type,
    Transformer Engine's AttnFuncWithCPAndKVP2P / ...KVAllGather / ...QKVOA2A)."""
    return layout.cp_comm_type


def _cp_ring(b: BlockProfile, c: Context, t_attn_fwd: float, t_attn_bwd: float) -> tuple[float, float, float, float]:
    """Ring attention (Liu et al. 2023, arXiv 2310.01889; Megatron-Core cp_comm_type "p2p"): cp-1 steps,
    each sending one K/V chunk to the next rank while attention runs on the chunk in hand; with the
    load-balanced (zig-zag) split every step carries 1/cp of the rank's attention. A step's transfer
    is exposed only where it outlasts that step's attention; backward sends K/V and dK/dV."""
    L = c.layout
    kv = 2 * K.BF16 * c.tokens * b.kv_dim / L.tp          # one chunk's K and V
    step = p2p_time(kv, c.cluster, cross_domain=c.cp.domains > 1)
    steps = L.cp - 1
    if not c.cluster.gpu.comm_overlap:                   # the ring's transfers cannot hide behind compute
        t_attn_fwd = t_attn_bwd = 0.0
    fwd_exp = steps * max(0.0, step - t_attn_fwd / L.cp)
    bwd_exp = steps * max(0.0, 2 * step - t_attn_bwd / L.cp)
    return steps * step, fwd_exp, 2 * steps * step, bwd_exp


def _cp_all_gather(b: BlockProfile, c: Context) -> tuple[float, float, float, float]:
    """All-gather CP as Llama 3 ran it (Dubey et al. 2024, arXiv 2407.21783, §3.3.2): all-gather the
    full-sequence K and V, then attend with the local (load-balanced) Q chunk. The gather is not
    overlapped ("the all-gather communication latency is exposed in the critical path"), which is
    cheap with GQA: K/V are kv_heads/heads the size of Q. Backward reduce-scatters dK/dV (the
    gather's transpose), also exposed; the gathered K/V are kept for it (activation_bytes)."""
    kv_full = 2 * K.BF16 * c.tokens * c.layout.cp * b.kv_dim / c.layout.tp
    ag = collective_time("all_gather", kv_full, c.cp, c.cluster)
    rs = collective_time("reduce_scatter", kv_full, c.cp, c.cluster)
    return ag, ag, rs, rs


def _cp_a2a(b: BlockProfile, c: Context) -> tuple[float, float, float, float]:
    """Ulysses-style CP (Jacobs et al. 2023, arXiv 2309.14509; Megatron-Core cp_comm_type "a2a"): an
    all-to-all turns the sequence split of Q, K, V into a head split before attention and one turns
    the output back after it; backward runs the same four on the gradients. Each all-to-all sends the
    rank's local tensor, (cp-1)/cp of it off-GPU; none overlaps attention (it needs the whole input)."""
    t_local = c.tokens / c.layout.tp
    size = K.BF16 * t_local * (b.q_dim + b.kv_dim + b.v_dim + b.o_dim)   # q + k + v in, attention output back
    t = collective_time("all_to_all", size, c.cp, c.cluster)
    return t, t, t, t


def cp_comm(b: BlockProfile, c: Context, t_attn_fwd: float, t_attn_bwd: float,
            kind: str | None = None) -> tuple[float, float, float, float]:
    """Context-parallel attention communication of one layer: (fwd total, fwd exposed, bwd total,
    bwd exposed) seconds. Stacks that bring their own CP code are priced as that code runs
    (Stack.cp_impl "torch": torch_cp_comm; "meshplan": the runtime's ring); otherwise, or when `kind`
    is given, by kind (Transformer Engine's implementations), `kind` defaulting to the layout's."""
    if c.layout.cp == 1 or not b.heads:
        return 0.0, 0.0, 0.0, 0.0
    if kind is None and c.stack.cp_impl == "torch":
        return torch_cp_comm(b, c, t_attn_fwd, t_attn_bwd)
    if kind is None and c.stack.cp_impl == "meshplan" and not runs_dense_band(b, c):
        return _meshplan_ring_comm(b, c, t_attn_fwd, t_attn_bwd)
    kind = kind or cp_comm_type(c.layout)
    if kind == "all_gather":
        return _cp_all_gather(b, c)
    if kind == "a2a":
        return _cp_a2a(b, c)
    return _cp_ring(b, c, t_attn_fwd, t_attn_bwd)


def cp_kv_gathered_bytes(b: BlockProfile, c: Context) -> float:
    """Activation bytes all-gather CP keeps beyond the local chunk: the other ranks' K and V.
    PyTorch's ring keeps none: autograd saves the local query, key and value of the SDPA call it
    replaces, and its backward all-gathers K/V again (torch_cp_comm)."""
    if c.layout.cp == 1 or not b.heads or cp_comm_type(c.layout) != "all_gather" or c.stack.cp_impl == "torch":
        return 0.0
    return 2 * K.BF16 * c.tokens * (c.layout.cp - 1) * b.kv_dim / c.layout.tp


def attention_shape(b: BlockProfile, c: Context) -> AttnShape:
    """The flash-attention calls one GPU runs for one layer and micro-batch: mbs sequences x the
    query heads of this TP rank, split by the layout's CP implementation (attention.layer_calls)."""
    L = c.layout
    hd = b.head_dim or 128
    if L.cp > 1 and c.stack.cp_impl == "meshplan" and not runs_dense_band(b, c):
        return meshplan_ring_calls(c.seq_len, L.mbs * b.heads / L.tp, L.cp, causal=b.causal,
                                   head_dim=max(hd, b.v_head_dim or hd))
    if runs_dense_band(b, c):
        return layer_calls(c.seq_len, L.mbs * b.heads / L.tp, causal=False, cp=L.cp, cp_kind=cp_comm_type(L),
                           head_dim=hd)
    return layer_calls(c.seq_len, L.mbs * b.heads / L.tp, causal=b.causal, cp=L.cp, cp_kind=cp_comm_type(L),
                       window=b.attn_window, head_dim=hd)


def runs_dense_band(b: BlockProfile, c: Context) -> bool:
    """meshplan's runtime applies a sliding window as an SDPA mask (models/banded.py), and a masked
    kernel computes every tile (no causal or band skipping): its windowed layers cost full attention.
    The other stacks run FlashAttention's / cuDNN's window mode (attention.py)."""
    return bool(b.attn_window) and c.stack.runtime_checks


# ---- PyTorch's ring attention (torch.distributed.tensor.experimental.context_parallel) ------------
# What the torch stack's CP runs around its attention calls, counted from torch's source
# (torch/distributed/tensor/experimental/_context_parallel/_attention.py, torch 2.11-2.13):
# `_templated_ring_attention` (forward), `_templated_ring_attention_backward`, `_SDPAMerger`
# (`step`, `_merge_one`, `results`) and `_partial_update`. Each torch op there is one element-wise
# kernel when it runs eagerly. Under torch.compile (the stack's `compile`) the ring is traced into the
# block's graph: torchtitan compiles each block with fullgraph=True (apply_compile), which admits no
# graph break, and the ring's DTensor dispatch and functional collectives trace; Inductor fuses each
# step's chain into one pass per output and drops the copies whose result is unused. Counts are for the rank that finishes last. A rank r of the load-balanced ring
# takes the whole-query branch (`i <= rank`: all its queries against the first half of the K/V
# chunk) at r of its steps and the half-query branch (`_partial_update` of the second half of its
# output, two torch.cat) at the others; a layer's forward has no per-step synchronisation (the
# default rotater all-gathers K/V once), so the last rank to finish is rank cp-1 or rank 0 and pays
# the costlier branch at every step; the backward exchanges dK/dV by an all-to-all at every step, so
# each step costs the costlier branch too. `RingWork.most` takes the larger bytes and the larger
# kernel count of the two branches (the whole-query one has more bytes, the half-query one 2 more
# kernels), at most 2 kernels per step above either branch.
#
# Checked on an H200 (torch 2.11, 16 heads x 128, one step of torch's own code on flash-shaped blocks,
# CUDA events, median of 20; benchmarks/cp_merge_probe.py, three runs on two machines in
# benchmarks/results/cp_merge_probe-2026-11-27-h200.md). Kernel counts match the profiler's: 9 per
# whole-query merge, 11 per half-query merge, 7 per whole-query backward step, 2 per compiled merge.
# GPU-bound (16k tokens per rank, every run; 8k and 4k on the first machine), the whole-query merge
# measured 0.451 / 0.246 / 0.146 ms at 16k / 8k / 4k, predicted 0.399 / 0.231 / 0.147 (-12% / -6% /
# +1%); a line through those points gives 3.17 TB/s for the 38.4 bytes per output element and 4.8 us
# per kernel. On the second machine the 8k and 4k steps were host-bound (0.28 / 0.23-0.26 ms: ~25 us
# per op of Python and launch), which the fixed 7 us per kernel does not reach; training shapes (32k
# tokens per rank x 4096 wide is 8x the 16k row) keep the GPU busy. Half-query merge at 16k: 0.395-0.416
# measured, 0.315 predicted (its torch.cat of strided halves streams slower). Backward step at 16k:
# 0.841-0.865 measured, 0.573 predicted (-33%: flash returns dK/dV as transposed views, and their adds
# into the contiguous fp32 accumulators read across strides). Compiled merge at 16k: 0.130-0.209 ms
# measured (one compiled call per step: Inductor's wrapper host time included), 0.102 predicted.
# gpu_rates' own merge (benchmarks/gpu_rates.py `_lse_merge`, its "merge per step" column:
# 0.467 / 0.265 / 0.165 ms) is a cousin of torch's, not the same code: 34 bytes per output element in
# 9 kernels (sigmoid weight, fp32 copy of the block, two broadcast multiplies by the [.., tokens, 1]
# weight, an add, logaddexp) against torch's 38 in 9 (fp32 copy, difference, one broadcast multiply,
# subtraction); the same formula gives it 0.364 / 0.213 / 0.138 ms (-22% / -19% / -16%): its second
# broadcast multiply runs below the streaming rate that torch's contiguous differences reach.


@dataclass(frozen=True)
class RingTensors:
    """Elements of the tensors of one layer and micro-batch on one rank that PyTorch's ring touches.
    K and V are at the query heads: torchtitan repeats the K/V heads before SDPA (repeat_kv in its
    Llama attention), and the ring and its gradients see those repeated tensors."""

    out: float       # attention output (and its gradient): tokens x heads x v_head_dim
    q: float         # query (and dQ)
    k: float         # keys as SDPA gets them (and dK)
    v: float         # values (and dV)
    lse: float       # log-sum-exp rows: tokens x heads

    def __post_init__(self):
        bad = {f: getattr(self, f) for f in ("out", "q", "k", "v", "lse") if getattr(self, f) < 0}
        if bad:
            raise ValueError(f"RingTensors element counts must be >= 0, got {bad}")


@dataclass(frozen=True)
class RingWork:
    """Element-wise work beside the attention kernels: HBM bytes read + written, kernels launched."""

    nbytes: float = 0.0
    kernels: int = 0

    def __add__(self, other: RingWork) -> RingWork:
        return RingWork(self.nbytes + other.nbytes, self.kernels + other.kernels)

    def times(self, n: int) -> RingWork:
        return RingWork(self.nbytes * n, self.kernels * n)

    def most(self, other: RingWork) -> RingWork:
        """The larger of two branches, bytes and kernels each (ranks taking either wait for both)."""
        return RingWork(max(self.nbytes, other.nbytes), max(self.kernels, other.kernels))


_F, _H = K.FP32, K.BF16
_ACC = _F + _H + _F          # fp32 accumulator += bf16 block: read both, write the fp32


def merge_step(t: RingTensors, compiled: bool) -> RingWork:
    """`_SDPAMerger.step` on a block of t.out output elements: `out.to(float32)`, then
    out = out - sigmoid(block_lse - lse) * (out - block_out); lse = lse - logsigmoid(lse - block_lse)
    (the block's fp32 copy; the difference, the broadcast product and the subtraction over the output;
    two differences, a sigmoid, a logsigmoid and a subtraction over the LSE rows)."""
    if compiled:     # one pass over the output (read running fp32 + bf16 block, write fp32), one over the LSE
        return RingWork((_F + _H + _F) * t.out + 3 * _F * t.lse, 2)
    out = (_H + _F) * t.out + 3 * _F * t.out + (2 * _F * t.out + _F * t.lse) + 3 * _F * t.out
    lse = (3 * 3 + 2 * 2) * _F * t.lse
    return RingWork(out + lse, 9)


def torch_ring_forward(t: RingTensors, cp: int, *, compiled: bool) -> RingWork:
    """Element-wise work of one layer's ring-attention forward on the last rank to finish."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    if cp == 1:
        return RingWork()
    kv_copy = RingWork(2 * _H * (t.k + t.v), 1)       # K/V made contiguous / packed for the all-gather
    if compiled:     # casts fused into the merges, dead packs dropped (the half-query branch: 9 bytes of the 10)
        return kv_copy + merge_step(t, compiled).times(cp - 1)
    half = RingTensors(out=t.out / 2, q=t.q / 2, k=t.k, v=t.v, lse=t.lse / 2)
    # the half-query branch merges half the rows, then torch.cat rebuilds the fp32 output and the LSE
    rebuild = RingWork(2 * _F * (t.out + t.lse), 2)
    merges = merge_step(t, compiled).most(merge_step(half, compiled) + rebuild).times(cp - 1)
    contiguous = RingWork(2 * _H * (t.k + t.v), 2)     # key.contiguous(), value.contiguous()
    casts = RingWork(2 * (_H + _F) * t.out, 2)         # step 0's output to fp32; results() back to bf16
    # torch.cat([key.flatten(), value.flatten()]) at every step but the last: the all-gather rotater
    # sends only the first, the later ones are built and dropped
    packs = RingWork(2 * _H * (t.k + t.v), 1).times(cp - 1)
    return contiguous + casts + packs + merges


def torch_ring_backward(t: RingTensors, cp: int, *, compiled: bool) -> RingWork:
    """Element-wise work of one layer's ring-attention backward: fp32 dQ/dK/dV accumulators, the
    per-step dK/dV packing for the all-to-all, the load-balance halves (`_partial_update`: an
    in-place add on one half, then a torch.cat of both halves), the final casts to bf16."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    if cp == 1:
        return RingWork()
    kv, q = t.k + t.v, t.q
    if compiled:
        once = RingWork(2 * _H * kv, 1) + RingWork((_F + _H) * kv, 1)       # K/V copy; received dK/dV to bf16
        first = RingWork((_H + _F) * (q + kv), 2)                          # accumulators born from the bf16 grads
        # i <= rank: received dK/dV + the block's first half, written into the send buffer; dQ +=
        whole_q = RingWork((2 * _F + _H / 2) * kv + _ACC * q, 2)
        # i > rank: dK/dV += into the send buffer; dQ's second half updated, first half copied; lse half
        half_q = RingWork((2 * _F + _H) * kv + (_F + _ACC / 2) * q + 2 * _F * t.lse / 2, 3)
        return once + first + whole_q.most(half_q).times(cp - 1)
    zeros = RingWork(_F * (q + kv), 3)                                    # zeros_like in fp32, x3
    contiguous = RingWork(2 * _H * kv, 2)
    casts = RingWork((_F + _H) * (q + kv), 2)                              # dQ and the last dK/dV to bf16
    packs = RingWork(2 * _H * kv, 1).times(cp - 1)                         # K/V cat, as in the forward
    send = RingWork(2 * _F * kv, 1)                                        # cat of fp32 dK, dV every step
    first = RingWork(_ACC * (kv + q), 3) + send
    half_add = _ACC / 2 + 2 * _F                                           # add into one half, cat both
    whole_q = RingWork(half_add * kv, 4) + RingWork(_ACC * q, 1) + send
    half_q = RingWork(_ACC * kv, 2) + RingWork(half_add * q, 2) + RingWork(2 * _F * t.lse / 2, 1) + send
    return zeros + contiguous + casts + packs + first + whole_q.most(half_q).times(cp - 1)


def ring_tensors(b: BlockProfile, c: Context) -> RingTensors:
    """The ring's tensors for block `b` on one rank (c.tokens: mbs x seq / cp), this TP rank's heads."""
    n = c.tokens / c.layout.tp
    return RingTensors(out=n * b.o_dim, q=n * b.q_dim, k=n * b.q_dim, v=n * b.o_dim, lse=n * b.heads)


def ring_work_time(w: RingWork, cluster) -> float:
    """Seconds of element-wise ring work: its bytes at the streaming rate plus each kernel's fixed
    cost (constants.HOST_LAUNCH_S: the merge probe's intercept is 4.8 us per kernel for torch's merge
    and 7.1 us for gpu_rates' one; gpu_rates "Host costs" reads 11 us of host per eager launch, which
    a busy GPU hides behind the attention kernels)."""
    return elementwise_time(w.nbytes, cluster) + w.kernels * K.HOST_LAUNCH_S


def torch_cp_merge(b: BlockProfile, c: Context) -> tuple[float, float]:
    """(forward, backward) seconds PyTorch's context_parallel adds to one layer's attention on one
    rank beyond the attention kernels: the log-sum-exp merges, the fp32 gradient accumulators and
    the copies of the load-balanced ring (torch_ring_forward / torch_ring_backward), eager or
    compiled as the stack runs the model."""
    if c.layout.cp == 1 or not b.heads:
        return 0.0, 0.0
    t = ring_tensors(b, c)
    compiled = device_of(c.cluster).runs_compile(c.stack)
    fwd = torch_ring_forward(t, c.layout.cp, compiled=compiled)
    bwd = torch_ring_backward(t, c.layout.cp, compiled=compiled)
    return ring_work_time(fwd, c.cluster), ring_work_time(bwd, c.cluster)


def torch_cp_comm(b: BlockProfile, c: Context, t_attn_fwd: float, t_attn_bwd: float) -> tuple[float, float, float, float]:
    """PyTorch context_parallel's communication for one layer on one rank (fwd total, fwd exposed,
    bwd total, bwd exposed), with the all-gather rotater, torch's default (`_cp_options.rotate_method`)
    and torchtitan's (`context_parallel_rotate_method = "allgather"`). Counted from
    `_templated_ring_attention`, `_templated_ring_attention_backward` and the rotater classes:

    - the K/V it moves are those SDPA gets: torchtitan repeats the K/V heads to the query heads
      before SDPA (repeat_kv in its Llama attention), so K and V are each as large as Q (ring_tensors);
    - forward: one all-gather of the packed bf16 K/V (`_AllGatherRotater`: `all_gather_single` at
      step 0, waited for at step 1), overlapping step 0's attention (the local chunk, 1/cp of the
      rank's attention);
    - backward: the same all-gather again (nothing was kept), overlapping step 0's attention
      backward; and at each of the cp steps the accumulated fp32 dK/dV sent to the next rank
      (`_AllToAllRotater`, forced for the gradients: `permute_tensor`, an all-to-all in which each
      rank sends its whole buffer to one peer: a point-to-point transfer). Step i's gradients are
      waited for after step i+1's attention backward, which hides them up to that step's length; the
      last step's are waited for after the loop, behind nothing. The all-gather and the all-to-alls
      run in order on the group's one stream, so a step pays what its transfer outlasts its attention."""
    L = c.layout
    t = ring_tensors(b, c)
    kv = t.k + t.v
    gather = collective_time("all_gather", L.cp * K.BF16 * kv, c.cp, c.cluster)
    dkv = p2p_time(K.FP32 * kv, c.cluster, cross_domain=c.cp.domains > 1)
    if not c.cluster.gpu.comm_overlap:
        t_attn_fwd = t_attn_bwd = 0.0
    step_f, step_b = t_attn_fwd / L.cp, t_attn_bwd / L.cp
    fwd_exp = max(0.0, gather - step_f)
    bwd_exp = max(0.0, gather - step_b) + (L.cp - 1) * max(0.0, dkv - step_b) + dkv
    return gather, fwd_exp, gather + L.cp * dkv, bwd_exp


def cp_ring_work(b: BlockProfile, c: Context) -> tuple[float, float]:
    """(forward, backward) seconds of element-wise work the stack's CP implementation runs beside
    the attention kernels of one layer on one rank: PyTorch's ring (torch_cp_merge) or meshplan's
    (meshplan_cp_merge); Transformer Engine's merges run inside its own CP kernels (0 here)."""
    if c.stack.cp_impl == "torch":
        return torch_cp_merge(b, c)
    if c.stack.cp_impl == "meshplan":
        return meshplan_cp_merge(b, c)
    return 0.0, 0.0


# ---- meshplan's ring attention (meshplan/runtime/context_parallel.py, `_RingAttention`) -------------
# Each rank holds chunks r and 2cp-1-r of c = seq/(2cp) tokens. Step s works on the K/V of rank
# r - s, one flash-attention call per unmasked (query chunk, key chunk) pair (`_blocks`): at step 0
# two diagonal (causal) c x c calls and one full one, at every other step two full c x c calls, so
# 2cp + 1 calls of c x c (4cp without a causal mask), against Transformer Engine's one call per step.
# The kernel is FlashAttention-2 for bf16/fp16 (the memory-efficient kernel otherwise): no score
# block is held, the kernel returns each block's output and LSE. Around each call, eagerly: under
# torch.compile the ring's point-to-point sends break the graph ("P2P compilation disabled"), a break
# inside its step loop leaves the loop to run eagerly, and only the per-call kernel helper is
# compiled, alone (torch._dynamo.explain on ring_attention over a fake 2-rank group, torch 2.13):
#   forward, per call: K and V repeated to the query heads (repeat_interleave: one copy each, GQA
#     only); sigmoid(block_lse - lse) (2 kernels over the half's LSE rows); the block output cast
#     to fp32; lerp_ of the fp32 running output towards it; logaddexp into the LSE: 5 kernels;
#     once: the fp32 running output and LSE (zeros, full), torch.stack([k, v]), the final cast.
#   backward, per call: the repeats; the LSE half made contiguous; the kernel's backward; dK/dV
#     summed back over the head groups (GQA only); three fp32 += of dQ, dK, dV;
#     once: fp32 dQ and dK/dV zeros, torch.stack([k, v]), the three final casts.
#   communication: K/V (kv heads, bf16) shifted to the next rank at each of cp-1 steps, started
#     before the step's calls and waited for after them; in backward also the fp32 dK/dV, sent after
#     the step's calls and waited for at once (`ring.finish(ring.start_shift(dkv, ...))`), at all
#     cp steps: nothing overlaps those.
# A rank's query half a and key half b are tokens/2 each: a call's tensors are half the rank's.


def meshplan_ring_calls(seq_len: float, batch_heads: float, cp: int, *, causal: bool,
                        head_dim: float = 128.0) -> AttnShape:
    """The flash-attention calls one rank runs for one layer of meshplan's ring (see above)."""
    if cp < 2:
        raise ValueError(f"meshplan's ring needs cp >= 2, got {cp}")
    c = float(seq_len) / (2 * cp)
    if not causal:
        return AttnShape(batch_heads, (AttnCall(c, c, False, 4.0 * cp),), head_dim)
    return AttnShape(batch_heads, (AttnCall(c, c, True, 2.0), AttnCall(c, c, False, 2.0 * cp - 1)), head_dim)


def meshplan_ring_tensors(b: BlockProfile, c: Context) -> RingTensors:
    """The ring's tensors for block `b` on one rank, K and V at the key/value heads as the runtime
    keeps and sends them; heads of unequal query and value widths (MLA) are padded to the wider."""
    n = c.tokens / c.layout.tp
    w = max(b.head_dim, b.v_head_dim or b.head_dim)
    return RingTensors(out=n * b.heads * w, q=n * b.heads * w, k=n * b.kv_heads * w, v=n * b.kv_heads * w,
                       lse=n * b.heads)


def _ring_calls(cp: int, causal: bool) -> int:
    return 2 * cp + 1 if causal else 4 * cp


def _repeats(t: RingTensors, calls: int) -> RingWork:
    """K and V halves repeated to the query heads before each call (GQA on CUDA)."""
    if t.k >= t.q:
        return RingWork()
    one = K.BF16 * (t.k + t.v) / 2 + K.BF16 * 2 * t.q / 2     # read the kv-head halves, write query-head ones
    return RingWork(one, 2).times(calls)


def meshplan_ring_forward(t: RingTensors, cp: int, *, causal: bool = True) -> RingWork:
    """Element-wise work of one layer's forward through meshplan's ring on one rank."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    if cp == 1:
        return RingWork()
    n = _ring_calls(cp, causal)
    o, l = t.out / 2, t.lse / 2                  # one call's output elements and LSE rows
    # the block output to fp32, lerp_ of the running output (reading the [.., 1] weight); over the
    # LSE rows a difference, a sigmoid and a logaddexp
    merge = RingWork((_H + _F) * o + 3 * _F * o + _F * l, 2) + RingWork((3 + 2 + 3) * _F * l, 3)
    once = RingWork(_F * (t.out + t.lse), 2) + RingWork(2 * _H * (t.k + t.v), 1) + RingWork((_F + _H) * t.out, 1)
    return once + (merge + _repeats(t, 1)).times(n)


def meshplan_ring_backward(t: RingTensors, cp: int, *, causal: bool = True) -> RingWork:
    """Element-wise work of one layer's backward through meshplan's ring on one rank."""
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    if cp == 1:
        return RingWork()
    n = _ring_calls(cp, causal)
    q, kv, l = t.q / 2, (t.k + t.v) / 2, t.lse / 2
    per_call = RingWork(2 * _F * l, 1) + RingWork(_ACC * (q + kv), 3)
    if t.k < t.q:                                 # dK, dV summed from the query heads to the kv heads
        per_call = per_call + _repeats(t, 1) + RingWork(_H * (2 * q + kv), 2)   # read dK, dV at q heads
    once = (RingWork(_F * (t.q + t.k + t.v), 2) + RingWork(2 * _H * (t.k + t.v), 1)
            + RingWork((_F + _H) * (t.q + t.k + t.v), 3))
    return once + per_call.times(n)


def meshplan_cp_merge(b: BlockProfile, c: Context) -> tuple[float, float]:
    """(forward, backward) seconds meshplan's ring adds to one layer's attention on one GPU beyond
    the flash kernels. Where the device prices those ops as host work (CPU processes:
    host.cp_host_time, by their measured cost), nothing more."""
    if c.layout.cp == 1 or not b.heads or device_of(c.cluster).ring_ops_on_host:
        return 0.0, 0.0
    t = meshplan_ring_tensors(b, c)
    fwd = meshplan_ring_forward(t, c.layout.cp, causal=b.causal)
    bwd = meshplan_ring_backward(t, c.layout.cp, causal=b.causal)
    return ring_work_time(fwd, c.cluster), ring_work_time(bwd, c.cluster)


def _meshplan_ring_comm(b: BlockProfile, c: Context, t_attn_fwd: float,
                        t_attn_bwd: float) -> tuple[float, float, float, float]:
    """meshplan's ring's communication for one layer (fwd total, fwd exposed, bwd total, bwd exposed):
    cp-1 bf16 K/V shifts each way, hidden behind their step's calls; in backward also cp fp32 dK/dV
    shifts, each waited for as soon as it is sent (exposed whole)."""
    L = c.layout
    t = meshplan_ring_tensors(b, c)
    cross = c.cp.domains > 1
    kv = p2p_time(K.BF16 * (t.k + t.v), c.cluster, cross_domain=cross)
    dkv = p2p_time(K.FP32 * (t.k + t.v), c.cluster, cross_domain=cross)
    if not c.cluster.gpu.comm_overlap:
        t_attn_fwd = t_attn_bwd = 0.0
    steps = L.cp - 1
    fwd_exp = steps * max(0.0, kv - t_attn_fwd / L.cp)
    bwd_exp = steps * max(0.0, kv - t_attn_bwd / L.cp) + L.cp * dkv
    return steps * kv, fwd_exp, steps * kv + L.cp * dkv, bwd_exp
