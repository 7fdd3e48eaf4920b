"""Context parallelism (CP): each CP rank holds a share of every sequence; attention runs as a
ring over the CP group.

Load-balanced causal split. A sequence of S tokens is cut into 2*cp equal chunks; CP rank r
holds chunks r and 2*cp-1-r (one early, one late), so under a causal mask every rank does the
same amount of attention work (a contiguous split would leave rank 0 almost idle and the last
rank with most of the work). `load_balanced_positions` gives the global positions of a rank's
tokens; `shard_sequence` cuts a (B, S, ...) tensor to them.

Ring attention (`ring_attention`). Each rank keeps its queries; keys and values travel around
the ring (send to r+1, receive from r-1; cp-1 shifts). Each (query chunk, key chunk) pair is one
call of a fused attention kernel that returns the block's output and log-sum-exp (LSE) without
materialising its scores (CPU: aten's _scaled_dot_product_flash_attention_for_cpu, which takes
GQA as is; CUDA: FlashAttention for fp16/bf16, else the memory-efficient kernel, with the key/value
heads repeated; the CUDA path is not exercised by the CPU-only tests), and the blocks are merged
with the online-softmax rule (out = sum_i exp(lse_i - lse) out_i, lse = logsumexp_i lse_i) into an
fp32 running output and LSE. So memory is O(local tokens): no rank holds a score block, let
alone the S x S scores. Causal masking is decided per pair from the global chunk indices: an
earlier key chunk is attended fully (is_causal=False), the same chunk with the causal triangle
(is_causal=True), a later chunk not at all (skipped: no compute). One autograd Function covers
the whole ring: its backward runs the kernel's backward per pair, given the FINAL merged output
and LSE (so each block's probabilities are its share of the softmax over the whole sequence and
the block gradients add up to the full ones), accumulates dQ locally in fp32, and sends K/V around
once more together with the fp32 dK/dV accumulated for them, which end on the rank that owns them
after cp shifts. Because it is a single graph node, every rank runs the same sends and receives
in backward whatever blocks it skipped (a ring of per-shift autograd nodes would drop unused
shifts from the backward of some ranks and deadlock the ring). The kernels read the input dtype
and accumulate in fp32; a block's output and gradients come back in the input dtype.

How a model uses it without changes (`apply_context_parallel`):
- the model's attention calls `F.scaled_dot_product_attention`; the stage's forward and every
  block's forward run under `RingAttentionMode`, a TorchFunctionMode that replaces those calls
  with `ring_attention` over the CP group. The block wrappers are installed before activation
  recompute wraps the blocks, so a block recomputed during backward re-enters the mode (a mode
  entered only around the forward call would be gone by then). Calls it cannot serve (explicit
  attn_mask, dropout, different query and key lengths) raise LayoutError.
- positions: a rank's tokens are not positions 0..S/cp-1. Non-persistent buffers whose first
  dimension is the plan's seq_len (rotary tables, meshplan's `positions`) are permuted into the
  local tokens' order, so the model's `table[:T]` reads the right rows; rotary modules of
  Hugging Face models (forward(x, position_ids)) get the local tokens' global position ids.
  Supported models: meshplan's Transformer and Hugging Face models using the "sdpa" attention
  implementation with rotary position embeddings; others are refused (their positions or
  attention could silently be wrong).
- multi-token prediction (meshplan.models.mtp): depth k looks up token i + k at position i, which
  at the end of a chunk lies in the next chunk, held by another CP rank. `mtp_shifted_ids` has
  the shifted lookups read the ids gathered over the CP group (B x T int64, forward only: ids have
  no gradient), shifted whole and cut to this rank's chunks; the labels are shifted before the
  split (runtime/model.py). The MTP blocks run the ring like the main blocks.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from meshplan.errors import ConfigError, LayoutError
from meshplan.models.mtp import mtp_input_ids
from meshplan.models.transformer import Transformer
from meshplan.runtime.mtp_parallel import mtp_depth

__all__ = ["load_balanced_positions", "shard_sequence", "unshard_sequence", "ring_attention",
           "RingAttentionMode", "apply_context_parallel", "check_sequence_length", "mtp_shifted_ids"]

_REPLAN = "re-plan with cp=1"
_KV_TAG, _DKV_TAG = 0, 1        # two messages can be in flight between the same peers in backward
_FULL, _DIAGONAL, _MASKED = "full", "diagonal", "masked"


# ---- the load-balanced split ------------------------------------------------------------------
def check_sequence_length(seq_len: int, cp: int) -> None:
    if cp < 1:
        raise ConfigError(f"cp={cp}: the context-parallel degree must be >= 1")
    if seq_len % (2 * cp):
        raise ConfigError(f"a sequence of {seq_len} tokens cannot be split for cp={cp}: the load-balanced "
                          f"causal split cuts it into 2*cp = {2 * cp} equal chunks; use a seq_len divisible "
                          f"by {2 * cp}, or {_REPLAN}")


def _chunks_of(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def load_balanced_positions(seq_len: int, cp: int, rank: int, *, device=None) -> Tensor:
    """Global positions (int64, length seq_len/cp) of the tokens CP rank `rank` holds."""
    check_sequence_length(seq_len, cp)
    if not 0 <= rank < cp:
        raise ConfigError(f"CP rank {rank} is outside 0..{cp - 1}")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in _chunks_of(rank, cp)])


def shard_sequence(x: Tensor, cp: int, rank: int, *, dim: int = 1) -> Tensor:
    """This CP rank's part of `x` along `dim` (the sequence): chunks rank and 2*cp-1-rank."""
    if cp == 1:
        return x
    S = x.shape[dim]
    check_sequence_length(S, cp)
    c = S // (2 * cp)
    return torch.cat([x.narrow(dim, i * c, c) for i in _chunks_of(rank, cp)], dim=dim)


def unshard_sequence(parts: list[Tensor], *, dim: int = 1) -> Tensor:
    """The whole sequence from every CP rank's part (`shard_sequence` of rank 0, 1, ...)."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    halves = [p.chunk(2, dim=dim) for p in parts]        # rank r: chunks r and 2*cp-1-r
    return torch.cat([halves[i][0] for i in range(cp)] + [halves[i][1] for i in reversed(range(cp))], dim=dim)


# ---- ring communication -----------------------------------------------------------------------
class _Ring:
    """Neighbours of this rank in the CP group (global ranks, as point-to-point ops need)."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start_shift(self, t: Tensor, tag: int):
        """Send `t` to the next rank, receive the previous rank's; returns (buffer, works)."""
        t = t.contiguous()
        recv = torch.empty_like(t)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, self.next, self.group, tag),
                                        dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)])
        return recv, works

    @staticmethod
    def finish(pending) -> Tensor:
        recv, works = pending
        for w in works:
            w.wait()
        return recv


# ---- block kernels ---------------------------------------------------------------------------
def _pair_kind(q_chunk: int, k_chunk: int, causal: bool) -> str:
    if not causal or q_chunk > k_chunk:
        return _FULL
    return _DIAGONAL if q_chunk == k_chunk else _MASKED


def _blocks(q_chunks, kv_src: int, cp: int, causal: bool):
    """(query half, key half, kind) of the unmasked pairs between local queries and the K/V of `kv_src`."""
    for a, qc in enumerate(q_chunks):
        for b, kc in enumerate(_chunks_of(kv_src, cp)):
            kind = _pair_kind(qc, kc, causal)
            if kind != _MASKED:
                yield a, b, kind


def _cuda_flash_ok(q: Tensor) -> bool:
    # FlashAttention-2 takes half precision and head dims up to 256 in multiples of 8; anything
    # else (fp32 above all) goes to the memory-efficient kernel, which also returns the LSE
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


def _repeat_kv(t: Tensor, groups: int) -> Tensor:
    # the CUDA kernels want as many key/value heads as query heads (the CPU kernel takes GQA as is)
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_groups(t: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return t
    B, H, L, d = t.shape
    return t.reshape(B, H // groups, groups, L, d).sum(2)


def _block_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, tuple]:
    """Fused attention of one block: (output in q's dtype, LSE (B, H, Lq) fp32, the kernel's RNG state
    for its backward); no score matrix is held.

    q (B, H, Lq, d), k/v (B, Hkv, Lk, d). `causal` is the top-left triangle, which is the
    diagonal block's mask because its query and key chunks are the same tokens.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    g = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, g), _repeat_kv(v, g)
    if _cuda_flash_ok(q):
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (seed, offset)
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                                                    causal, scale=scale)
    return out, lse[..., :q.shape[2]], (seed, offset)   # the kernel pads the LSE's length to its tile size


def _block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                    scale: float, rng: tuple) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one block, given the FINAL merged output and LSE of these queries.

    The block's probabilities are exp(s - lse) with the merged lse, i.e. this block's share of the
    softmax over all keys, and the kernel's rowsum(dout * out) is the merged softmax's term, so
    the per-block gradients add up to those of attention over the whole sequence.
    """
    if q.device.type == "cpu":
        return tuple(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale))
    g = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, g), _repeat_kv(v, g)
    if _cuda_flash_ok(q):
        # None: undefined cumulative lengths, i.e. dense (not variable-length) batches
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, *rng,
            scale=scale)
    else:
        # the kernel reads the LSE at the tile-padded length its forward returned; padded rows
        # belong to no query
        lse_p = F.pad(lse, (0, (-q.shape[2]) % 32), value=float("inf")).contiguous()
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse_p, *rng, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, _sum_groups(dk, g), _sum_groups(dv, g)


class _RingAttention(torch.autograd.Function):
    """The whole ring as one autograd node (see the module docstring). The query, output, LSE and
    gradient halves are views taken once per call (the K/V halves once per ring step), so a block
    pair costs the kernel plus a handful of element-wise ops on the host."""

    @staticmethod
    def forward(ctx, q, k, v, ring, causal, scale):
        B, H, S, d = q.shape
        # the running output and LSE are fp32 whatever the input dtype: each merge rescales them
        out = torch.zeros(B, H, S, d, dtype=torch.float32, device=q.device)
        lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
        q_h, out_h, lse_h = q.chunk(2, dim=2), out.chunk(2, dim=2), lse.chunk(2, dim=-1)
        mine = _chunks_of(ring.rank, ring.size)
        kv = torch.stack([k, v])
        rng: tuple = ()
        for step in range(ring.size):
            pending = ring.start_shift(kv, _KV_TAG) if step < ring.size - 1 else None
            k_h, v_h = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            for a, b, kind in _blocks(mine, (ring.rank - step) % ring.size, ring.size, causal):
                bout, blse, rng = _block_forward(q_h[a], k_h[b], v_h[b], kind == _DIAGONAL, scale)
                # online-softmax merge, out = sum_i exp(lse_i - lse) out_i with lse = logsumexp_i lse_i,
                # one block at a time: the new block's weight is exp(blse - new) = sigmoid(blse - old)
                # (1 for the first block, whose old lse is -inf), and out moves that far towards it
                w = torch.sigmoid(blse - lse_h[a]).unsqueeze(-1)
                out_h[a].lerp_(bout.float(), w)
                torch.logaddexp(lse_h[a], blse, out=lse_h[a])
            if pending is not None:
                kv = ring.finish(pending)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        # without dropout the CUDA kernels' RNG state is the same (unused) for every block
        ctx.ring, ctx.causal, ctx.scale, ctx.rng = ring, causal, scale, rng
        return result

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, causal, scale = ctx.ring, ctx.causal, ctx.scale
        B, H, S, d = q.shape
        Hkv = k.shape[1]
        # the kernels want grad_out in the dtype of q and out (autograd may hand it in another one)
        grad_out = grad_out.to(q.dtype)
        dq = torch.zeros(B, H, S, d, dtype=torch.float32, device=q.device)
        q_h, out_h, lse_h = q.chunk(2, dim=2), out.chunk(2, dim=2), lse.chunk(2, dim=-1)
        do_h, dq_h = grad_out.chunk(2, dim=2), dq.chunk(2, dim=2)
        mine = _chunks_of(ring.rank, ring.size)
        kv = torch.stack([k, v])
        dkv = torch.zeros(2, B, Hkv, S, d, dtype=torch.float32, device=q.device)   # travels with kv
        for step in range(ring.size):
            pending = ring.start_shift(kv, _KV_TAG) if step < ring.size - 1 else None
            k_h, v_h = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            dk_h, dv_h = dkv[0].chunk(2, dim=2), dkv[1].chunk(2, dim=2)
            for a, b, kind in _blocks(mine, (ring.rank - step) % ring.size, ring.size, causal):
                bdq, bdk, bdv = _block_backward(do_h[a], q_h[a], k_h[b], v_h[b], out_h[a], lse_h[a],
                                                kind == _DIAGONAL, scale, ctx.rng)
                # fp32 accumulators: half-precision block gradients are summed without rounding
                dq_h[a].add_(bdq)
                dk_h[b].add_(bdk)
                dv_h[b].add_(bdv)
            if ring.size > 1:
                # the gradient of the block just used moves on with it; after the last step it
                # arrives at the rank that owns the block
                dkv = ring.finish(ring.start_shift(dkv, _DKV_TAG))
            if pending is not None:
                kv = ring.finish(pending)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group, *, is_causal: bool = True,
                   scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """Attention of the local queries over the whole (CP-sharded) sequence.

    q: (B, heads, S/cp, hd); k, v: (B, kv_heads, S/cp, hd) (v may have its own head size, as in
    multi-head latent attention; the output then has v's), each rank's tokens in the load-balanced
    order (`shard_sequence`). kv_heads < heads needs `enable_gqa` (query head h uses kv head
    h // (heads / kv_heads), as F.scaled_dot_product_attention does). Returns (B, heads, S/cp, hd)
    in q's dtype. Collective over `group`: every rank of it must call with the same shapes.
    """
    from torch.distributed.tensor import DTensor
    if any(isinstance(t, DTensor) for t in (q, k, v)):
        raise LayoutError("context-parallel attention got DTensor query/key/value; it works on local "
                          f"tensors (tensor parallelism must hand attention local heads); {_REPLAN}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise LayoutError(f"context-parallel attention needs 4-D (batch, heads, seq, head_dim) query/key/value, "
                          f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}; {_REPLAN}")
    if k.shape[:-1] != v.shape[:-1] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise LayoutError(f"context-parallel attention needs matching batch and head size of query "
                          f"{tuple(q.shape)}, key {tuple(k.shape)} and value {tuple(v.shape)}; {_REPLAN}")
    if q.shape[2] != k.shape[2]:
        raise LayoutError(f"context-parallel attention needs as many keys as queries (self-attention over "
                          f"the sequence); got {q.shape[2]} queries and {k.shape[2]} keys; {_REPLAN}")
    if q.shape[1] != k.shape[1] and (not enable_gqa or q.shape[1] % k.shape[1]):
        raise LayoutError(f"{q.shape[1]} query heads and {k.shape[1]} key/value heads need enable_gqa=True "
                          "and a head count divisible by the key/value head count")
    if q.device.type not in ("cpu", "cuda"):
        raise LayoutError(f"context-parallel attention runs fused attention kernels on CPU and CUDA only, got "
                          f"tensors on {q.device}; {_REPLAN}")
    if q.shape[2] % 2:
        raise ConfigError(f"a local sequence of {q.shape[2]} tokens cannot hold the two chunks of the "
                          f"load-balanced split; use a seq_len divisible by 2*cp")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    dqk, dv = q.shape[-1], v.shape[-1]
    if dqk != dv:
        # values narrower or wider than queries/keys (multi-head latent attention: 192 vs 128): the
        # kernels and the ring's stacked K/V want one head size, so the narrower side is padded with
        # zeros, which add nothing to the scores (q, k) or to the output columns kept (v), and get
        # no gradient that reaches the caller
        width = max(dqk, dv)
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        out = _RingAttention.apply(q, k, v, _Ring(group), bool(is_causal), float(scale))
        return out[..., :dv]
    return _RingAttention.apply(q, k, v, _Ring(group), bool(is_causal), float(scale))


# ---- SDPA replacement -----------------------------------------------------------------------------
def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class RingAttentionMode(TorchFunctionMode):
    """Replaces F.scaled_dot_product_attention with `ring_attention` over `group`; counts the calls."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_args(*args, **kwargs)
        if mask is not None:
            raise LayoutError("the model calls scaled_dot_product_attention with an explicit attn_mask "
                              f"({tuple(mask.shape)}), which context-parallel ring attention cannot shard "
                              f"(it builds the causal mask from global positions); use is_causal=True, or {_REPLAN}")
        if dropout_p:
            raise LayoutError(f"the model calls scaled_dot_product_attention with dropout_p={dropout_p}, which "
                              f"context-parallel ring attention does not support; set attention dropout to 0 or {_REPLAN}")
        self.calls += 1
        return ring_attention(q, k, v, self.group, is_causal=is_causal, scale=scale, enable_gqa=gqa)


_active = threading.local()


def _under_mode(fn, mode: RingAttentionMode):
    """`fn` run inside `mode` unless a ring mode is already active on this thread (no double entry)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if getattr(_active, "depth", 0):
            return fn(*args, **kwargs)
        _active.depth = 1
        try:
            with mode:
                return fn(*args, **kwargs)
        finally:
            _active.depth = 0
    return wrapped


def _checked_stage_forward(fn, mode: RingAttentionMode, has_blocks: bool):
    @functools.wraps(fn)
    def forward(*args, **kwargs):
        before = mode.calls
        out = fn(*args, **kwargs)
        if has_blocks and mode.calls == before:
            raise LayoutError("context parallelism found no call to torch.nn.functional.scaled_dot_product_"
                              "attention in this model's forward, so its attention would only see the local "
                              "part of each sequence; use SDPA attention (Hugging Face: "
                              f"attn_implementation='sdpa'), or {_REPLAN}")
        return out
    return forward


# ---- positions ------------------------------------------------------------------------------------
def _rotary_modules(stage: nn.Module) -> dict[str, nn.Module]:
    """Hugging Face style rotary embeddings: forward(x, position_ids) computing cos/sin on the fly."""
    out = {}
    for name, m in stage.named_modules():
        if "rotary" not in type(m).__name__.lower():
            continue
        try:
            params = inspect.signature(m.forward).parameters
        except (TypeError, ValueError):
            continue
        if "position_ids" in params:
            out[name] = m
    return out


def _position_ids_hook(positions: Tensor):
    """Forward pre-hook: the model's position ids 0..T-1 index the local tokens; map to global positions."""
    def hook(module, args, kwargs):
        if "position_ids" in kwargs:
            return args, {**kwargs, "position_ids": positions.to(kwargs["position_ids"].device)[kwargs["position_ids"]]}
        if len(args) >= 2:
            return (args[0], positions.to(args[1].device)[args[1]]) + tuple(args[2:]), kwargs
        raise LayoutError(f"{type(module).__name__} was called without position_ids; context parallelism "
                          f"cannot give it the local tokens' positions; {_REPLAN}")
    return hook


def _permute_position_buffers(stage: nn.Module, positions: Tensor, seq_len: int, skip: set[str]) -> list[str]:
    done = []
    for mod_name, m in stage.named_modules():
        if any(mod_name == s or mod_name.startswith(s + ".") for s in skip):
            continue
        for name, buf in list(m._buffers.items()):
            if buf is None or buf.dim() == 0 or buf.shape[0] != seq_len:
                continue
            fqn = f"{mod_name}.{name}" if mod_name else name
            if name not in m._non_persistent_buffers_set:
                # a persistent buffer is model state: permuting it would change what checkpoints hold
                continue
            if buf.dim() >= 2 and buf.shape[1] == seq_len:
                raise LayoutError(f"buffer {fqn!r} {tuple(buf.shape)} looks like a (seq_len x seq_len) mask, which "
                                  f"context parallelism cannot shard; use SDPA with is_causal=True, or {_REPLAN}")
            m._buffers[name] = buf.index_select(0, positions.to(buf.device))
            done.append(fqn)
    return done


def _model_kind(stage: nn.Module) -> str:
    if isinstance(stage, Transformer):
        return "meshplan"
    # a Hugging Face model means transformers is imported already (importing it costs seconds)
    hf = sys.modules.get("transformers")
    if hf is not None and isinstance(stage, hf.PreTrainedModel):
        impl = getattr(stage.config, "_attn_implementation", None)
        if impl != "sdpa":
            raise LayoutError(f"context parallelism replaces SDPA attention, but this model uses "
                              f"attn_implementation={impl!r}; load it with attn_implementation='sdpa', or {_REPLAN}")
        if not _rotary_modules(stage):
            raise LayoutError(f"context parallelism supports Hugging Face models with rotary position embeddings "
                              f"(forward(x, position_ids)); {type(stage).__name__} has none, so its positions "
                              f"would be wrong on CP ranks; {_REPLAN}")
        return "hf"
    raise LayoutError(f"context parallelism supports meshplan's Transformer and Hugging Face models with SDPA "
                      f"attention and rotary positions; {type(stage).__name__} is neither, so the runtime cannot "
                      f"check that its positions and attention follow the sequence split; {_REPLAN}")


def apply_context_parallel(stage: nn.Module, *, group, seq_len: int, blocks: list[str]) -> dict:
    """Make `stage` (a model or pipeline stage) run on this CP rank's tokens; `blocks`: its block FQNs.

    Call after tensor parallelism and before activation recompute and FSDP (see the module
    docstring). Returns what was done: {"buffers": [...], "rotary": [...], "blocks": n}.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    check_sequence_length(seq_len, cp)
    kind = _model_kind(stage)
    positions = load_balanced_positions(seq_len, cp, rank)
    rotary = _rotary_modules(stage) if kind == "hf" else {}
    for m in rotary.values():
        m.register_forward_pre_hook(_position_ids_hook(positions), with_kwargs=True)
    if kind == "meshplan":
        # a model built for longer sequences than planned: its forward reads rows [:T] only, so
        # the first seq_len rows are all it needs (and then the per-position rule below applies)
        for name in ("rope_cos", "rope_sin", "positions"):
            buf = stage._buffers.get(name)
            if buf is not None and buf.shape[0] > seq_len:
                stage._buffers[name] = buf[:seq_len]
    buffers = _permute_position_buffers(stage, positions, seq_len, skip=set(rotary))
    mode = RingAttentionMode(group)
    for fqn in blocks:
        block = stage.get_submodule(fqn)
        block.forward = _under_mode(block.forward, mode)
    # the instance attribute shadows the class's forward (as pipeline.py and recompute.py do)
    stage.forward = _checked_stage_forward(_under_mode(stage.forward, mode), mode, bool(blocks))
    shifted = mtp_shifted_ids(stage, group) if kind == "meshplan" else False
    return {"buffers": buffers, "rotary": sorted(rotary), "blocks": len(blocks), "mtp_ids": shifted}


# ---- multi-token prediction's shifted lookups ------------------------------------------------------
class _ShiftedIds:
    """Forward pre-hooks serving the model's MTP lookups under CP. Transformer.forward looks the
    tokens up first, then the tokens shifted by 1 .. D: the stage's pre-hook marks the start of a
    forward, the embedding's sees the lookups in that order."""

    def __init__(self, group, depth: int):
        self.group, self.depth = group, depth
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.lookups = 0
        self.shifted: list[Tensor] = []

    def start(self, module, args, kwargs):
        self.lookups, self.shifted = 0, []

    def lookup(self, module, args):
        i, self.lookups = self.lookups, self.lookups + 1
        if i == 0:
            if module.training:
                ids = args[0].contiguous()
                parts = [torch.empty_like(ids) for _ in range(self.cp)]
                dist.all_gather(parts, ids, group=self.group)
                whole = unshard_sequence(parts, dim=1)
                self.shifted = [shard_sequence(mtp_input_ids(whole, k), self.cp, self.rank, dim=1)
                                for k in range(1, self.depth + 1)]
            return None
        if i > len(self.shifted):
            raise LayoutError(f"the model looked its token embedding up {i + 1} times in one forward; with "
                              f"mtp_depth={self.depth} the runtime expects the tokens, then the tokens shifted by "
                              "1 .. mtp_depth (models/transformer.py), and cannot shift others across the "
                              f"context-parallel chunks; {_REPLAN}")
        return (self.shifted[i - 1],) + tuple(args[1:])


def mtp_shifted_ids(stage: nn.Module, group) -> bool:
    """Under CP, make the MTP lookups of `stage` (a meshplan model, or the pipeline stage of one
    that holds the embedding) read the ids shifted over the whole sequence (module docstring).
    Returns whether it did (a stage without the embedding, or a model without MTP, needs nothing).
    The hooks run before tensor parallelism's own on the embedding, which then sees these ids."""
    depth = mtp_depth(stage)
    emb = getattr(stage, "tok_embeddings", None)
    if not depth or not isinstance(emb, nn.Embedding):
        return False
    hooks = _ShiftedIds(group, depth)
    stage.register_forward_pre_hook(hooks.start, with_kwargs=True, prepend=True)
    emb.register_forward_pre_hook(hooks.lookup, prepend=True)
    return True
