"""Shape dependence of flash attention on GPUs: what fraction of the kernel's plateau rate one
attention call reaches, from its query/key lengths, causal mask, batch x heads and the GPU's SMs
. compute.attention_time multiplies the time at the plateau rate by `shape_penalty`.

Mechanism (FlashAttention-2/3 structure: Dao 2023, arXiv 2307.08691, §3; Shah et al. 2024, arXiv
2407.08608, §3). A call on (batch*heads) x (q_len x k_len) is cut into ATTN_TILE x ATTN_TILE tiles of
the score matrix; one CTA owns one query tile (forward; one key tile in backward, whose loop runs
over the query tiles) of one (sequence, head) and loops over its key tiles.
  - tile quantisation: every tile the mask touches is computed whole. For a causal call of length n
    the kernel computes nt(nt+1)/2 tiles, nt = ceil(n/T), against the n^2/2 masked score entries the
    FLOP count charges: (1 + T/n) x the work. Ragged last tiles are padded likewise.
  - per-CTA fixed work: loading the Q tile, writing O and the softmax statistics (backward: dQ/dK/dV
    epilogues), filling and draining the software pipeline cost about ATTN_CTA_FIXED_TILES_* inner
    iterations per CTA; a CTA with few key tiles (short keys, or the short rows near the causal
    diagonal) spends a large share of its time there.
  - wave quantisation: CTAs run one per SM (FA3's hd128 tiles use most of the SM's shared memory) on
    the GPU's GPU_SM_COUNT SMs. Equal CTAs (no causal mask) take ceil(CTAs/SMs) waves; causal CTAs
    differ in length. FA3's persistent tile scheduler issues the longest first, so its step takes
    max(total work / SMs, longest CTA): the bound a greedy schedule reaches when the CTAs far
    outnumber the SMs. FA2 and cuDNN launch a causal forward's CTAs in grid order, the longest rows of
    the last (sequence, head) last: those run their whole length after the rest, total / SMs +
    longest (constants.ATTN_LPT_KERNELS; measured on an H200). Their backward CTAs (one per key
    tile) start longest first within each (sequence, head), which a greedy schedule balances.
  - a fixed cost per kernel launch (compute.attention_time: ATTN_KERNEL_FIXED_S, backward runs
    ATTN_BWD_KERNELS kernels).
  - the head dim: at 64 a tile holds half the FLOPs of 128 for much the same per-tile overheads
    (head_dim_rate; constants.ATTN_HEAD_DIM_64_RATE, measured).
What remains is the plateau efficiency of the kernel on long calls: constants.ATTN_FWD_EFF /
ATTN_BWD_EFF (FlashAttention-2, measured) times the kernel's rate (constants.ATTN_KERNEL_RATE).

Sliding-window attention (a causal band of w keys, `AttnCall.window`): FlashAttention's local mode
(window_size=(w-1, 0); Transformer Engine's and cuDNN's sliding window) skips the key tiles wholly
outside the band, so a query tile row computes the min(row + 1, 1 + ceil((w-1)/T)) tiles the band
touches: work linear in the sequence, with the band's ragged edges as the tile waste.

How context parallelism splits the work (`layer_calls`): the calls one GPU runs for one layer and
micro-batch. Each is a separate kernel with its own diagonal waste, CTA overheads and launch, so
the same masked FLOPs cost more as short CP chunks than as one long call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.cost_models import constants as K
from meshplan.ir.gpu_arch import gpu_generation   # the generation an attention kernel is written for

__all__ = ["AttnCall", "AttnShape", "layer_calls", "shape_penalty", "call_efficiency", "sm_count", "gpu_generation",
           "generation_rate", "head_dim_rate"]


@dataclass(frozen=True)
class AttnCall:
    """`count` flash-attention kernel calls of q_len queries against k_len keys. A causal call's mask
    is aligned to the bottom-right corner (query i sees keys up to k_len - q_len + i), as FA2 >= 2.1
    and cuDNN align it; q_len <= k_len."""

    q_len: float
    k_len: float
    causal: bool
    count: float = 1.0
    window: float = 0.0     # causal band: each query sees its last `window` keys; 0 = the whole prefix


@dataclass(frozen=True)
class AttnShape:
    """The attention one GPU runs for one layer and micro-batch: `batch_heads` (sequences x query
    heads on this GPU) in each of `calls`, heads of `head_dim`."""

    batch_heads: float
    calls: tuple[AttnCall, ...]
    head_dim: float = 128.0

    @property
    def kernels(self) -> float:
        return sum(c.count for c in self.calls)


def generation_rate(gpu_id: str, *, backward: bool) -> float:
    """How much more (or less) of the GEMM rate an FA2-class attention kernel reaches on `gpu_id`'s
    generation than on Hopper, where ATTN_FWD_EFF / ATTN_BWD_EFF are set (constants.ATTN_GENERATION_RATE)."""
    return K.ATTN_GENERATION_RATE[gpu_generation(gpu_id)][1 if backward else 0]


def sm_count(cluster) -> int:
    """SMs (AMD: compute units) of the cluster's GPU (constants.GPU_SM_COUNT)."""
    return K.GPU_SM_COUNT.get(cluster.gpu.id, K.GPU_SM_COUNT_DEFAULT)


def layer_calls(seq_len: float, batch_heads: float, *, causal: bool, cp: int = 1,
                cp_kind: str = "p2p", window: float = 0, head_dim: float = 128.0) -> AttnShape:
    """Flash-attention calls of one layer on one GPU, for a micro-batch of `batch_heads`
    (sequences x local query heads; under a2a CP before its head split), by CP implementation:
      - no CP: one call over the whole sequence.
      - "p2p" (ring; Megatron-Core / Transformer Engine AttnFuncWithCPAndKVP2P with the load-balanced
        split into 2cp chunks of c = seq/(2cp), two per rank): step 0 attends the rank's own 2c
        queries to its own 2c keys under the causal mask; each of the cp-1 other steps is unmasked,
        either all 2c local queries against the first half (c) of the arriving K/V (the source rank
        precedes this one) or the second local query chunk (c) against all 2c arriving keys (it
        follows): half of each on average. These are host.ring_blocks(cp, causal) chunk pairs,
        2cp + 1 = 3 + 2(cp - 1). Without a causal mask every step is a 2c x 2c call.
      - "all_gather" (Llama 3, AttnFuncWithCPAndKVAllGather): each of the rank's two query chunks (c)
        attends, causally, the gathered keys up to its end: positions r and 2cp-1-r give key lengths
        (r+1)c and (2cp-r)c, whose sum (2cp+1)c does not depend on r; rank 0's pair is taken.
      - "a2a" (Ulysses): after the all-to-all a rank holds the whole sequence for heads/cp heads.
    A sliding `window` (causal only) is one banded call; under CP it is priced as a2a's split (the
    whole sequence for heads/cp heads) whatever the kind: a ring's remote steps outside the band are
    skipped, so the band's work divides evenly, and the small per-step calls are not modelled.
    """
    s = float(seq_len)
    w = float(window) if causal and window and window < s else 0.0
    if cp <= 1:
        return AttnShape(batch_heads, (AttnCall(s, s, causal, window=w),), head_dim)
    if cp_kind == "a2a" or w:
        return AttnShape(batch_heads / cp, (AttnCall(s, s, causal, window=w),), head_dim)
    c = s / (2 * cp)
    if not causal:
        return AttnShape(batch_heads, (AttnCall(2 * c, 2 * c, False, float(cp)),), head_dim)
    if cp_kind == "all_gather":
        return AttnShape(batch_heads, (AttnCall(c, c, True), AttnCall(c, s, True)), head_dim)
    half = (cp - 1) / 2.0
    return AttnShape(batch_heads, (AttnCall(2 * c, 2 * c, True),
                                   AttnCall(c, 2 * c, False, half), AttnCall(2 * c, c, False, half)), head_dim)


def _band_sum(n: float, m: float) -> float:
    """sum of min(r + 1, m) over r = 0..n-1: what a causal band of m keeps in n rows."""
    if n <= m:
        return n * (n + 1) / 2.0
    return m * (m + 1) / 2.0 + (n - m) * m


def _masked_pairs(call: AttnCall) -> float:
    """(query, key) pairs the mask keeps: what the FLOP count charges (flops.py halves causal)."""
    q, k = call.q_len, call.k_len
    if call.causal and call.window:     # query p (of k - q .. k - 1) keeps min(p + 1, window) keys
        return _band_sum(k, call.window) - _band_sum(k - q, call.window)
    return q * k - q * q / 2.0 if call.causal else q * k


def _call_cost(call: AttnCall, batch_heads: float, sms: int, *, backward: bool, kernel: str) -> float:
    """SM-seconds of one call in units of one tile iteration (T x T scores at the plateau rate):
    SMs x the time the call occupies the GPU."""
    T = K.ATTN_TILE
    fixed = K.ATTN_CTA_FIXED_TILES[kernel][1 if backward else 0]
    in_order = kernel not in K.ATTN_LPT_KERNELS
    q, k = call.q_len, call.k_len
    n_q, n_k = math.ceil(q / T), math.ceil(k / T)
    band = 0
    if call.causal:
        off = math.ceil(max(0.0, k - q) / T)           # key tiles left of the diagonal band
        tiles = n_q * off + n_q * (n_q + 1) / 2.0       # whole tiles touched by the mask
        if call.window:     # a tile row r of the band touches min(r + 1, band) key tiles
            band = 1 + math.ceil((call.window - 1) / T)
            tiles = _band_sum(off + n_q, band) - _band_sum(off, band)
    else:
        tiles = float(n_q * n_k)
    # forward: a CTA per query tile looping over keys; backward: per key tile looping over queries
    ctas_per_bh = n_k if backward else n_q
    longest = (tiles / ctas_per_bh if not call.causal else
               (n_q if backward else off + n_q)) + fixed
    if band:
        longest = min(longest, band + fixed)
    work = batch_heads * (tiles + ctas_per_bh * fixed)
    ctas = batch_heads * ctas_per_bh
    if call.causal and in_order and not backward:
        # unequal CTAs issued in grid order, the longest rows of the last sequence-head last: they
        # start when the SMs free up and run their whole length after (Graham's bound for list
        # scheduling, attained when the longest job comes last)
        makespan = work / sms + longest * (1 - 1 / sms)
    elif call.causal:   # unequal CTAs, issued longest first
        makespan = max(work / sms, longest)
    else:               # equal CTAs in whole waves
        makespan = math.ceil(ctas / sms - 1e-9) * longest
    return makespan * sms


def shape_penalty(shape: AttnShape, sms: int, *, backward: bool, kernel: str = "fa3") -> float:
    """Time of `shape`'s calls over the time of their masked FLOPs at `kernel`'s plateau rate
    (>= 1 up to the plateau's own tile/CTA overheads, which the plateau efficiency absorbs: see
    call_efficiency). `kernel` sets the per-CTA overheads and the causal launch order
    (constants.ATTN_CTA_FIXED_TILES, ATTN_LPT_KERNELS); the default is FA3, whose published curves
    the tests reproduce."""
    T2 = float(K.ATTN_TILE) ** 2
    cost = masked = 0.0
    for call in shape.calls:
        if call.count <= 0 or call.q_len <= 0 or call.k_len <= 0:
            continue
        cost += call.count * _call_cost(call, shape.batch_heads, sms, backward=backward, kernel=kernel) * T2
        masked += call.count * shape.batch_heads * _masked_pairs(call)
    if masked <= 0:
        return 1.0
    return cost / masked


def call_efficiency(shape: AttnShape, sms: int, *, backward: bool, kernel: str = "fa3") -> float:
    """Fraction of the kernel's plateau rate `shape` reaches: 1 / shape_penalty."""
    return 1.0 / shape_penalty(shape, sms, backward=backward, kernel=kernel)


def head_dim_rate(kernel: str, head_dim: float, *, backward: bool) -> float:
    """`kernel`'s plateau at `head_dim` over its plateau at 128 (constants.ATTN_HEAD_DIM_64_RATE,
    interpolated in log2(head dim) between 64 and 128; held outside)."""
    at64 = K.ATTN_HEAD_DIM_64_RATE[kernel][1 if backward else 0]
    x = min(1.0, max(0.0, math.log2(max(head_dim, 1.0) / 64.0)))
    return at64 + (1.0 - at64) * x
