"""PyTorch context parallelism's communication as the torch stack (torchtitan) runs it
(cost_models.cp.torch_cp_comm): what torch's own ring sends, recorded by running its
`_templated_ring_attention` / `_templated_ring_attention_backward` on one CPU process with the
collectives captured, and the bytes, counts and overlap the cost model charges for it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel import _attention as A

from meshplan.cluster import Cluster
from meshplan.cost_models import constants as K
from meshplan.cost_models.comm import collective_time, p2p_time
from meshplan.cost_models.context import Context
from meshplan.cost_models.cp import (
    cp_comm,
    cp_kv_gathered_bytes,
    ring_tensors,
    torch_cp_comm,
)
from meshplan.cost_models.layer import layer_cost
from meshplan.ir.layout import Layout
from meshplan.ir.stack import STACKS
from meshplan.profiling.analytic import profile_from_config

LLAMA8B = dict(family="llama", layers=2, hidden=4096, heads=32, kv_heads=8, vocab=128256, ffn_hidden=14336)
H100 = Cluster(gpu="h100", num_gpus=8)
TITAN = STACKS["torchtitan"]


@pytest.fixture(scope="module")
def block():
    return next(b for b in profile_from_config(LLAMA8B).blocks if b.heads)


def _ctx(cp: int, seq: int = 131072, stack=TITAN, cluster=H100) -> Context:
    return Context.build(cluster, Layout(cp=cp, dp=cluster.num_gpus // cp, cp_comm_type="all_gather"), seq, False,
                         stack=stack)


# ---- what torch's ring sends -----------------------------------------------------------------------
def _sdpa(q, k, v, is_causal, **_):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal)
    return out, lse


def _sdpa_backward(query, key, value, out, logsumexp, is_causal, grad_out, **_):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal)


def _torch_ring_sends(monkeypatch, rank: int, size: int):
    """The collectives of one rank's ring forward and backward in torch's code, as
    (forward, backward) lists of (collective, dtype, elements sent)."""
    sent: list[tuple[str, torch.dtype, int]] = []

    def all_gather_single(buf, gather_dim, group):
        sent.append(("all_gather", buf.dtype, buf.numel()))
        return torch.cat([buf] * size, dim=gather_dim)       # every rank holds the same K/V here

    def permute_tensor(buf, dsts, group):
        sent.append(("all_to_all", buf.dtype, buf.numel()))
        return buf.clone()

    monkeypatch.setattr(A.ft_c, "all_gather_single", all_gather_single)
    monkeypatch.setattr(A.ft_c, "permute_tensor", permute_tensor)
    monkeypatch.setattr(A.dist, "get_rank", lambda group=None: rank)
    pg = dist.ProcessGroup(dist.HashStore(), rank, size)
    heads, tokens, d = 4, 16, 8
    q, k, v = (torch.randn(1, heads, tokens, d, dtype=torch.bfloat16) for _ in range(3))
    out, lse, *_ = A._templated_ring_attention(pg, 2, _sdpa, q, k, v, is_causal=True)
    fwd = list(sent)
    sent.clear()
    A._templated_ring_attention_backward(pg, 2, _sdpa_backward, torch.randn_like(out), "grad_out", q, k, v, out,
                                         lse, is_causal=True)
    return fwd, sent, q.numel()


@pytest.mark.parametrize("rank", [0, 2])
def test_torch_ring_sends_what_the_model_charges(monkeypatch, rank):
    """Forward: one all-gather of the packed bf16 K/V. Backward: the all-gather again and an
    all-to-all of fp32 dK/dV at every one of the cp steps (the defaults torchtitan runs with)."""
    assert A._cp_options.rotate_method == A._RotateMethod.ALL_GATHER and A._cp_options.convert_to_f32
    cp = 4
    fwd, bwd, e = _torch_ring_sends(monkeypatch, rank, cp)
    assert fwd == [("all_gather", torch.bfloat16, 2 * e)]
    assert bwd == [("all_gather", torch.bfloat16, 2 * e)] + [("all_to_all", torch.float32, 2 * e)] * cp


# ---- what the cost model charges ---------------------------------------------------------------------
def test_kv_moves_at_the_query_heads_and_dkv_in_fp32(block):
    """torchtitan repeats K/V to the query heads before SDPA, so the ring's K/V are each the size of
    Q (4x Llama-3 8B's 8 K/V heads); the gradients travel in fp32, one point-to-point per step."""
    cp = 4
    c = _ctx(cp)
    t = ring_tensors(block, c)
    assert t.k == t.q == 4 * c.tokens * block.kv_dim
    gather = collective_time("all_gather", cp * K.BF16 * (t.k + t.v), c.cp, H100)
    dkv = p2p_time(K.FP32 * (t.k + t.v), H100, cross_domain=False)
    f, fx, bw, bx = torch_cp_comm(block, c, 1e3, 1e3)      # attention outlasts every transfer
    assert f == pytest.approx(gather) and bw == pytest.approx(gather + cp * dkv)
    assert fx == 0.0 and bx == pytest.approx(dkv)          # the last step's dK/dV hide behind nothing
    f, fx, bw, bx = torch_cp_comm(block, c, 0.0, 0.0)
    assert fx == pytest.approx(f) and bx == pytest.approx(bw)
    step = dkv / 2                                         # a step's attention backward shorter than a transfer
    _, _, _, bx = torch_cp_comm(block, c, 0.0, cp * step)
    assert bx == pytest.approx(max(0.0, gather - step) + (cp - 1) * (dkv - step) + dkv)


def test_only_the_torch_stack_takes_it(block):
    """The torch stack's layouts go through torch_cp_comm; the same all-gather layout on Megatron-Core
    keeps Llama 3's all-gather / reduce-scatter of the unrepeated K/V."""
    c = _ctx(4)
    assert cp_comm(block, c, 0.01, 0.02) == torch_cp_comm(block, c, 0.01, 0.02)
    mc = _ctx(4, stack=STACKS["megatron-core"])
    full = 2 * K.BF16 * 131072 * block.kv_dim
    ag, rs = collective_time("all_gather", full, mc.cp, H100), collective_time("reduce_scatter", full, mc.cp, H100)
    assert cp_comm(block, mc, 0.01, 0.02) == pytest.approx((ag, ag, rs, rs))


def test_torch_keeps_no_gathered_kv(block):
    """Autograd saves the local Q/K/V of the SDPA call torch replaces; its backward gathers again."""
    assert cp_kv_gathered_bytes(block, _ctx(4)) == 0.0
    assert cp_kv_gathered_bytes(block, _ctx(4, stack=STACKS["megatron-core"])) > 0.0


def test_layer_cost_counts_the_recomputed_gather(block):
    """A layer's CP traffic: the forward all-gather, the backward's all-gather and cp dK/dV sends; full
    recompute re-runs the forward and its all-gather."""
    cp = 8
    c = _ctx(cp, seq=262144)
    f, _, bw, _ = torch_cp_comm(block, c, 0.0, 0.0)
    assert layer_cost(block, c, policy="none").comm_s["cp"] == pytest.approx(f + bw)
    assert layer_cost(block, c, policy="full").comm_s["cp"] == pytest.approx(2 * f + bw)
    # across nodes (CP over ranks 8 apart on 16 GPUs, 8 per node) the sends leave on the NIC
    two_nodes = Context.build(Cluster(gpu="h100", num_gpus=16), Layout(tp=8, cp=2, dp=1, cp_comm_type="all_gather"),
                              65536, False, stack=TITAN)
    assert two_nodes.cp.domains == 2
    t = ring_tensors(block, two_nodes)
    _, _, bw2, _ = torch_cp_comm(block, two_nodes, 0.0, 0.0)
    gather = collective_time("all_gather", 2 * K.BF16 * (t.k + t.v), two_nodes.cp, two_nodes.cluster)
    assert bw2 == pytest.approx(gather + 2 * p2p_time(K.FP32 * (t.k + t.v), two_nodes.cluster, cross_domain=True))
