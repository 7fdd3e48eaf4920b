"""meshplan's own ring attention as the cost model prices it (cost_models.cp: meshplan_ring_calls,
meshplan_ring_forward / _backward, the meshplan stack's cp_comm), checked against what
runtime/context_parallel.py's `_RingAttention` runs: its block pairs, its aten ops and their bytes
(counted by a dispatch mode on CPU, plus the CUDA-only ops), and its point-to-point shifts."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshplan.cluster import Cluster
from meshplan.cost_models import constants as K
from meshplan.cost_models.comm import p2p_time
from meshplan.cost_models.compute import attention_time
from meshplan.cost_models.context import Context
from meshplan.cost_models.cp import (
    RingTensors,
    RingWork,
    attention_shape,
    cp_comm,
    meshplan_cp_merge,
    meshplan_ring_backward,
    meshplan_ring_calls,
    meshplan_ring_forward,
    meshplan_ring_tensors,
)
from meshplan.cost_models.flops import attention_fwd_flops_per_token
from meshplan.cost_models.layer import layer_cost
from meshplan.ir.layout import Layout
from meshplan.ir.stack import STACKS
from meshplan.profiling.analytic import profile_from_config
from meshplan.runtime.context_parallel import (
    _blocks,
    _chunks_of,
    _repeat_kv,
    _RingAttention,
    _sum_groups,
)

LLAMA8B = dict(family="llama", layers=2, hidden=4096, heads=32, kv_heads=8, vocab=128256, ffn_hidden=14336)
H100 = Cluster(gpu="h100", num_gpus=8)
MESHPLAN = STACKS["meshplan"]
# ops that allocate or re-view without moving data
_NO_KERNEL = {"split", "select", "unsqueeze", "detach", "view", "expand", "_unsafe_view", "alias", "empty",
              "empty_like", "slice", "t", "transpose"}


def _touched(t: torch.Tensor) -> float:
    """Bytes a kernel addresses in `t`: a broadcast (stride 0) dimension is read once."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) * t.element_size()


class _Ops(TorchDispatchMode):
    """Element-wise kernels and their bytes (inputs read, outputs written), attention calls apart."""

    def __init__(self):
        super().__init__()
        self.work, self.attn, self.names = RingWork(), 0, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if "scaled_dot_product" in name:
            self.attn += 1
        elif name not in _NO_KERNEL:
            flat = [x for a in args for x in (a if isinstance(a, (list, tuple)) else (a,))]   # stack's list
            ins = [a for a in flat if isinstance(a, torch.Tensor)]
            ins += [v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k != "out"]
            outs = out if isinstance(out, (tuple, list)) else (out,)
            nbytes = sum(map(_touched, ins)) + sum(_touched(o) for o in outs if isinstance(o, torch.Tensor))
            self.work = self.work + RingWork(nbytes, 1)
            self.names[name] += 1
        return out


class _LoopRing:
    """A ring of `size` ranks seen from `rank`, its shifts recorded instead of sent (the block kinds
    depend on the ranks, not on the data)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.sent = rank, size, []

    def start_shift(self, t, tag):
        self.sent.append((tag, t.dtype, t.numel()))
        return t, None

    @staticmethod
    def finish(pending):
        return pending[0]


def _run(cp: int, heads: int, kv_heads: int, *, rank: int = 1, causal: bool = True, tokens: int = 32, d: int = 16):
    """One rank's ring forward and backward in bf16 on CPU: (forward ops, backward ops, ring, tensors)."""
    q = torch.randn(1, heads, tokens, d, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kv_heads, tokens, d, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kv_heads, tokens, d, dtype=torch.bfloat16, requires_grad=True)
    ring = _LoopRing(rank, cp)
    with _Ops() as fwd:
        out = _RingAttention.apply(q, k, v, ring, causal, d ** -0.5)
    grad = torch.randn_like(out)
    with _Ops() as bwd:
        out.backward(grad)
    t = RingTensors(out=q.numel(), q=q.numel(), k=k.numel(), v=v.numel(), lse=heads * tokens)
    return fwd, bwd, ring, t


@pytest.mark.parametrize("causal", [True, False])
def test_calls_are_the_runtimes_block_pairs(causal):
    """Every rank runs 2cp+1 chunk-pair calls (4cp without a causal mask), two of them diagonal."""
    for cp in (2, 3, 4, 8):
        shape = meshplan_ring_calls(1024 * cp, 8.0, cp, causal=causal)
        diag = sum(c.count for c in shape.calls if c.causal)
        for rank in range(cp):
            kinds = Counter(kind for s in range(cp)
                            for _, _, kind in _blocks(_chunks_of(rank, cp), (rank - s) % cp, cp, causal))
            assert sum(kinds.values()) == shape.kernels and kinds["diagonal"] == diag
        assert all(c.q_len == c.k_len == 1024 / 2 for c in shape.calls)
    with pytest.raises(ValueError, match="cp >= 2"):
        meshplan_ring_calls(1024, 8.0, 1, causal=True)


@pytest.mark.parametrize("cp", [2, 3])
def test_forward_work_is_the_runtimes_ops(cp):
    """The forward's kernels and bytes beside the flash calls are the runtime's own, op for op;
    the attention itself is a fused kernel per call: nothing materialises a score matrix."""
    fwd, _, _, t = _run(cp, heads=4, kv_heads=4)
    assert fwd.attn == meshplan_ring_calls(64.0 * cp, 4.0, cp, causal=True).kernels == 2 * cp + 1
    model = meshplan_ring_forward(t, cp)
    assert fwd.work.kernels == model.kernels and fwd.work.nbytes == pytest.approx(model.nbytes, rel=1e-12)
    assert not {"bmm", "matmul", "_softmax", "softmax"} & set(fwd.names)


@pytest.mark.parametrize("cp", [2, 3])
def test_backward_work_is_the_runtimes_ops(cp):
    """The backward's kernels and bytes: the CPU run's, plus the one op only CUDA runs per call
    (the LSE half made contiguous for the flash backward)."""
    _, bwd, _, t = _run(cp, heads=4, kv_heads=4)
    calls = 2 * cp + 1
    lse_copy = RingWork(2 * K.FP32 * t.lse / 2, 1).times(calls)
    model = meshplan_ring_backward(t, cp)
    assert bwd.attn == calls
    assert bwd.work.kernels + lse_copy.kernels == model.kernels
    assert bwd.work.nbytes + lse_copy.nbytes == pytest.approx(model.nbytes, rel=1e-12)


def test_gqa_adds_the_cuda_repeats_and_group_sums():
    """With fewer K/V heads CUDA repeats K and V to the query heads before each call and sums dK/dV
    back after it (the CPU kernel takes GQA as is): the model is the CPU run plus those ops, each
    measured on the runtime's own helpers."""
    cp, heads, kv_heads, tokens, d = 2, 8, 2, 32, 16
    fwd, bwd, _, t = _run(cp, heads, kv_heads, tokens=tokens, d=d)
    g = heads // kv_heads
    half = torch.zeros(1, kv_heads, tokens // 2, d, dtype=torch.bfloat16)
    grad = torch.zeros(1, heads, tokens // 2, d, dtype=torch.bfloat16)
    with _Ops() as rep:
        _repeat_kv(half, g), _repeat_kv(half, g)
    with _Ops() as sums:
        _sum_groups(grad, g), _sum_groups(grad, g)
    calls = 2 * cp + 1
    lse_copy = RingWork(2 * K.FP32 * t.lse / 2, 1)
    f_model, b_model = meshplan_ring_forward(t, cp), meshplan_ring_backward(t, cp)
    f_meas = fwd.work + rep.work.times(calls)
    b_meas = bwd.work + (rep.work + sums.work + lse_copy).times(calls)
    assert f_meas.kernels == f_model.kernels and f_meas.nbytes == pytest.approx(f_model.nbytes, rel=1e-12)
    assert b_meas.kernels == b_model.kernels and b_meas.nbytes == pytest.approx(b_model.nbytes, rel=1e-12)


def test_communication_is_the_runtimes_shifts():
    """cp-1 bf16 K/V shifts forward; backward the same plus cp fp32 dK/dV shifts, each waited for
    at once (exposed whole), at the key/value heads (GQA: no repeat on the wire)."""
    cp = 3
    fwd_ring = _LoopRing(1, cp)
    q = torch.randn(1, 8, 32, 16, dtype=torch.bfloat16, requires_grad=True)
    kv = [torch.randn(1, 2, 32, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    out = _RingAttention.apply(q, *kv, fwd_ring, True, 0.25)
    sent_fwd = list(fwd_ring.sent)
    out.sum().backward()
    sent_bwd = fwd_ring.sent[len(sent_fwd):]
    kv_elems = 2 * kv[0].numel()
    assert sent_fwd == [(0, torch.bfloat16, kv_elems)] * (cp - 1)
    assert Counter(sent_bwd) == Counter({(0, torch.bfloat16, kv_elems): cp - 1, (1, torch.float32, kv_elems): cp})

    b = next(x for x in profile_from_config(LLAMA8B).blocks if x.heads)
    c = Context.build(H100, Layout(cp=4, dp=2), 65536, False, stack=MESHPLAN)
    t = meshplan_ring_tensors(b, c)
    assert t.k == t.v == c.tokens * b.kv_dim and t.q == c.tokens * b.q_dim
    kv_t = p2p_time(K.BF16 * (t.k + t.v), H100, cross_domain=False)
    dkv_t = p2p_time(K.FP32 * (t.k + t.v), H100, cross_domain=False)
    f, fx, bw, bx = cp_comm(b, c, 1e3, 1e3)        # attention far longer than any transfer
    assert f == pytest.approx(3 * kv_t) and fx == 0.0
    assert bw == pytest.approx(3 * kv_t + 4 * dkv_t) and bx == pytest.approx(4 * dkv_t)
    f, fx, bw, bx = cp_comm(b, c, 0.0, 0.0)        # nothing to hide behind
    assert fx == pytest.approx(f) and bx == pytest.approx(bw)


def test_layer_cost_prices_the_rings_calls_and_merges():
    """For the meshplan stack a layer's attention is the ring's 2cp+1 chunk-pair calls plus its
    element-wise work, against the same layer priced as Transformer Engine's ring (cp steps)."""
    b = next(x for x in profile_from_config(LLAMA8B).blocks if x.heads)
    seq, cp = 131072, 4
    c = Context.build(H100, Layout(cp=cp, dp=2), seq, False, stack=MESHPLAN)
    te = dataclasses.replace(c, stack=MESHPLAN.replace(cp_impl="te"))
    shape, te_shape = attention_shape(b, c), attention_shape(b, te)
    assert shape == meshplan_ring_calls(seq, b.heads, cp, causal=True, head_dim=b.head_dim)
    assert shape.kernels == 2 * cp + 1 and te_shape.kernels == cp
    flops = attention_fwd_flops_per_token(b, seq) * c.tokens

    def attn(s, backward):
        return attention_time(flops, H100, backward=backward, kernel=c.attn_kernel, shape=s, fitted=c.fitted)

    m_f, m_b = meshplan_cp_merge(b, c)
    assert m_f > 0 and m_b > 0
    extra = (attn(shape, False) - attn(te_shape, False) + attn(shape, True) - attn(te_shape, True)) + m_f + m_b
    assert layer_cost(b, c, policy="none").compute_s - layer_cost(b, te, policy="none").compute_s == \
        pytest.approx(extra, rel=1e-9)
    # CPU processes: host.cp_host_time prices the ring's per-call ops from their measured cost
    cpu = Context.build(Cluster(gpu="cpu", num_gpus=8), Layout(cp=cp, dp=2), 4096, False, stack=MESHPLAN)
    assert meshplan_cp_merge(b, cpu) == (0.0, 0.0)
