"""Context parallelism inside a layer: the attention calls each CP implementation runs on one GPU,
their communication (total and exposed) and the K/V a gathering implementation keeps."""

from __future__ import annotations

from meshplan.cost_models import constants as K
from meshplan.cost_models.attention import AttnShape, layer_calls
from meshplan.cost_models.comm import collective_time, p2p_time
from meshplan.cost_models.compute import elementwise_time
from meshplan.cost_models.context import Context
from meshplan.ir.profile import BlockProfile

__all__ = ["cp_comm_type", "cp_comm", "cp_kv_gathered_bytes", "attention_shape", "torch_cp_merge"]


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
    bwd exposed) seconds. `kind` defaults to the layout's (cp_comm_type)."""
    if c.layout.cp == 1 or not b.heads:
        return 0.0, 0.0, 0.0, 0.0
    kind = kind or cp_comm_type(c.layout)
    if kind == "all_gather":
        return _cp_all_gather(b, c)
    if kind == "a2a":
        return _cp_a2a(b, c)
    return _cp_ring(b, c, t_attn_fwd, t_attn_bwd)


def cp_kv_gathered_bytes(b: BlockProfile, c: Context) -> float:
    """Activation bytes all-gather CP keeps beyond the local chunk: the other ranks' K and V."""
    if c.layout.cp == 1 or not b.heads or cp_comm_type(c.layout) != "all_gather":
        return 0.0
    return 2 * K.BF16 * c.tokens * (c.layout.cp - 1) * b.kv_dim / c.layout.tp


def attention_shape(b: BlockProfile, c: Context) -> AttnShape:
    """The flash-attention calls one GPU runs for one layer and micro-batch: mbs sequences x the
    query heads of this TP rank, split by the layout's CP implementation (attention.layer_calls)."""
    L = c.layout
    if runs_dense_band(b, c):
        return layer_calls(c.seq_len, L.mbs * b.heads / L.tp, causal=False, cp=L.cp, cp_kind=cp_comm_type(L))
    return layer_calls(c.seq_len, L.mbs * b.heads / L.tp, causal=b.causal, cp=L.cp, cp_kind=cp_comm_type(L),
                       window=b.attn_window)


def runs_dense_band(b: BlockProfile, c: Context) -> bool:
    """meshplan's runtime applies a sliding window as an SDPA mask (models/banded.py), and a masked
    kernel computes every tile (no causal or band skipping): its windowed layers cost full attention.
    The other stacks run FlashAttention's / cuDNN's window mode (attention.py)."""
    return bool(b.attn_window) and c.stack.runtime_checks


def torch_cp_merge(b: BlockProfile, c: Context) -> tuple[float, float]:
    """PyTorch's context_parallel merges each chunk pair's SDPA output into the running output with
    the log-sum-exp rule in separate element-wise kernels (torch.distributed.tensor.experimental.
    _attention, _SDPAMerger: fp32 output and log-sum-exp read, the block's bf16 output read, fp32
    output written), once per ring step, and its backward accumulates dQ / dK / dV per step the same
    way: (forward, backward) seconds for the cp steps of one layer (derived)."""
    L = c.layout
    per_step = (K.FP32 + K.BF16 + K.FP32) * b.q_dim / L.tp * c.tokens + 2 * K.FP32 * b.heads / L.tp * c.tokens
    fwd = L.cp * elementwise_time(per_step, c.cluster)
    grads = (2 * K.FP32) * (b.q_dim + 2 * b.kv_dim) / L.tp * c.tokens     # read + write the fp32 accumulators
    return fwd, L.cp * elementwise_time(grads, c.cluster)

