"""PyTorch context parallelism's per-ring-step element-wise work (cost_models.cp: torch_cp_merge,
torch_ring_forward / torch_ring_backward): its shape in tokens and in cp, its size against one HBM
pass, eager against compiled, the stacks that pay it, and its agreement with the H200 probe."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.cluster import Cluster
from meshplan.cost_models import constants as K
from meshplan.cost_models.context import Context
from meshplan.cost_models.cp import (
    RingTensors,
    RingWork,
    ring_tensors,
    ring_work_time,
    torch_cp_merge,
    torch_ring_backward,
    torch_ring_forward,
)
from meshplan.cost_models.layer import layer_cost
from meshplan.ir.layout import Layout
from meshplan.ir.stack import STACKS
from meshplan.profiling.analytic import profile_from_config

LLAMA8B = dict(family="llama", layers=2, hidden=4096, heads=32, kv_heads=8, vocab=128256, ffn_hidden=14336)
H200 = Cluster(gpu="h200", num_gpus=8)
EAGER = STACKS["torchtitan"].replace(compile=False)


@pytest.fixture(scope="module")
def block():
    return next(b for b in profile_from_config(LLAMA8B).blocks if b.heads)


def _ctx(seq: int, cp: int, stack=EAGER, tp: int = 1) -> Context:
    return Context.build(H200, Layout(tp=tp, cp=cp, dp=8 // (cp * tp), mbs=1, cp_comm_type="all_gather"),
                         seq, False, stack=stack)


def _tensors(tokens: float, heads: int = 16, dim: int = 128) -> RingTensors:
    e = tokens * heads * dim
    return RingTensors(out=e, q=e, k=e, v=e, lse=tokens * heads)


def _fixed(w: RingWork) -> float:
    return w.kernels * K.HOST_LAUNCH_S


@pytest.mark.parametrize("stack", [EAGER, STACKS["torchtitan"]], ids=["eager", "compiled"])
def test_cost_is_linear_in_tokens_per_rank(block, stack):
    """Doubling the tokens each rank holds doubles the bytes and keeps the kernel count: the time
    above the kernels' fixed costs doubles."""
    for cp in (2, 4, 8):
        one, two = _ctx(8192 * cp, cp, stack), _ctx(2 * 8192 * cp, cp, stack)
        t1, t2 = ring_tensors(block, one), ring_tensors(block, two)
        compiled = stack.compile
        f1, f2 = torch_ring_forward(t1, cp, compiled=compiled), torch_ring_forward(t2, cp, compiled=compiled)
        b1, b2 = torch_ring_backward(t1, cp, compiled=compiled), torch_ring_backward(t2, cp, compiled=compiled)
        assert (f1.kernels, b1.kernels) == (f2.kernels, b2.kernels)
        (mf1, mb1), (mf2, mb2) = torch_cp_merge(block, one), torch_cp_merge(block, two)
        assert mf1 > _fixed(f1) > 0 and mb1 > _fixed(b1) > 0
        assert mf2 - _fixed(f2) == pytest.approx(2 * (mf1 - _fixed(f1)), rel=1e-12)
        assert mb2 - _fixed(b2) == pytest.approx(2 * (mb1 - _fixed(b1)), rel=1e-12)


@pytest.mark.parametrize("compiled", [False, True])
def test_each_ring_step_after_the_first_pays_the_same_work(compiled):
    """At fixed tokens per rank the forward and the backward grow by one step's work per extra rank:
    cp-1 merges (and K/V packs) in the forward, cp-1 accumulation steps after the first in the backward."""
    t = _tensors(8192)
    for fn in (torch_ring_forward, torch_ring_backward):
        w = {cp: fn(t, cp, compiled=compiled) for cp in range(1, 10)}
        assert w[1] == RingWork()
        step = RingWork(w[3].nbytes - w[2].nbytes, w[3].kernels - w[2].kernels)
        assert step.nbytes > 0 and step.kernels > 0
        for cp in range(3, 10):
            assert w[cp].kernels == w[2].kernels + (cp - 2) * step.kernels
            assert w[cp].nbytes == pytest.approx(w[2].nbytes + (cp - 2) * step.nbytes, rel=1e-12)
        # the first merge / accumulation costs at least one step (it carries the per-layer work too)
        assert w[2].nbytes >= step.nbytes


def test_eager_step_moves_several_output_passes_and_launches_nine_merge_kernels():
    """An eager merge step is torch's op list, not one fused pass: the block's fp32 copy, the
    difference, the broadcast product, the subtraction (38 bytes per output element against the
    10 of one read-read-write pass), 9 kernels with the LSE's; compiled, one pass per output."""
    t = _tensors(4096)
    one_pass = (K.FP32 + K.BF16 + K.FP32) * t.out
    eager = RingWork(torch_ring_forward(t, 3, compiled=False).nbytes - torch_ring_forward(t, 2, compiled=False).nbytes,
                     torch_ring_forward(t, 3, compiled=False).kernels - torch_ring_forward(t, 2, compiled=False).kernels)
    compiled = RingWork(torch_ring_forward(t, 3, compiled=True).nbytes - torch_ring_forward(t, 2, compiled=True).nbytes,
                        torch_ring_forward(t, 3, compiled=True).kernels - torch_ring_forward(t, 2, compiled=True).kernels)
    assert eager.nbytes > 3.5 * one_pass                  # the merge (38) and the dropped K/V pack (8)
    assert eager.kernels >= 9 + 1
    assert one_pass <= compiled.nbytes < 1.1 * one_pass
    assert compiled.kernels == 2
    # the backward's per-step accumulators: fp32 dQ/dK/dV read and written, dK/dV packed for the all-to-all
    bwd = torch_ring_backward(t, 3, compiled=False).nbytes - torch_ring_backward(t, 2, compiled=False).nbytes
    assert bwd > 2 * K.FP32 * (t.q + t.k + t.v)


def test_compiled_ring_is_cheaper_and_follows_the_stack(block):
    """torch.compile traces the ring into the block's graph: the torchtitan stack with compile pays
    less than without, and both more than nothing."""
    f_e, b_e = torch_cp_merge(block, _ctx(65536, 4, EAGER))
    f_c, b_c = torch_cp_merge(block, _ctx(65536, 4, STACKS["torchtitan"]))
    assert 0 < f_c < f_e / 2 and 0 < b_c < b_e / 2


def test_only_pytorch_context_parallel_pays_it(block):
    """layer_cost adds the ring's work to attention for the stacks whose CP is PyTorch's; the same
    stack with Transformer Engine's CP (Megatron-Core's fused kernels) and a run without CP pay none."""
    for stack in (EAGER, STACKS["torchtitan"]):
        c = _ctx(65536, 4, stack)
        te = dataclasses.replace(c, stack=stack.replace(cp_impl="te"))
        m_f, m_b = torch_cp_merge(block, c)
        assert m_f > 0 and m_b > 0
        torch_cost, te_cost = layer_cost(block, c, policy="none"), layer_cost(block, te, policy="none")
        # compute only: the two CP implementations also communicate differently (cp.torch_cp_comm)
        assert torch_cost.compute_s - te_cost.compute_s == pytest.approx(m_f + m_b, rel=1e-9)
    assert torch_cp_merge(block, _ctx(16384, 1)) == (0.0, 0.0)


def test_tp_divides_the_ring_work(block):
    """TP splits the heads, so each rank's ring tensors and bytes shrink by tp."""
    t1, t2 = ring_tensors(block, _ctx(65536, 4)), ring_tensors(block, _ctx(65536, 4, tp=2))
    assert t2.out == t1.out / 2 and t2.k == t1.k / 2 and t2.lse == t1.lse / 2
    assert t1.k == t1.q                  # K/V at the query heads (torchtitan repeats them before SDPA)


@pytest.mark.parametrize("tokens, measured_ms", [(16384, 0.450)])
def test_eager_merge_step_agrees_with_the_h200_probe(tokens, measured_ms):
    """One eager whole-query merge step (`_SDPAMerger.step`) timed on an H200, 16 heads x 128, where
    the GPU (not the host) sets its time: 0.448-0.452 ms in three runs on two machines
    (benchmarks/results/cp_merge_probe-2026-11-27-h200.md); the count predicts it within 15%."""
    t = _tensors(tokens)
    step = RingWork((K.BF16 + K.FP32) * t.out + 8 * K.FP32 * t.out + K.FP32 * t.lse + 13 * K.FP32 * t.lse, 9)
    pred = ring_work_time(step, Cluster(gpu="h200", num_gpus=1))
    assert pred == pytest.approx(measured_ms * 1e-3, rel=0.15)
    # the same step is what the forward charges per extra rank, less the dropped K/V pack
    fwd = torch_ring_forward(t, 3, compiled=False).nbytes - torch_ring_forward(t, 2, compiled=False).nbytes
    assert fwd == pytest.approx(step.nbytes + 2 * K.BF16 * (t.k + t.v), rel=1e-12)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="cp must be >= 1"):
        torch_ring_forward(_tensors(128), 0, compiled=False)
    with pytest.raises(ValueError, match="cp must be >= 1"):
        torch_ring_backward(_tensors(128), -2, compiled=True)
    with pytest.raises(ValueError, match="element counts must be >= 0"):
        RingTensors(out=-1, q=0, k=0, v=0, lse=0)
