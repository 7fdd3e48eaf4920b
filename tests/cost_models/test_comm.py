"""Collective and point-to-point times against nccl-tests formulas computed here from the
cluster's own fields (cost_models.md §7)."""

from __future__ import annotations

import math

import pytest

from meshplan.cluster import Cluster
from meshplan.cost_models.comm import Group, collective_time, group, intra_busbw, p2p_time

S = 256e6   # 256 MB: bandwidth-dominated
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@pytest.fixture(scope="module")
def h100():
    return Cluster.preset("dgx-h100", nodes=4)


@pytest.fixture(scope="module")
def mi300x():
    return Cluster.preset("mi300x-8")


def _lat(cl, steps: int) -> float:
    return (cl.base_latency_us + steps * cl.scaleup_latency_us) * 1e-6


@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_reduce_one_domain_matches_ring_formula(h100, n):
    g = h100.gpu
    busbw = g.nvls_busbw_gb_s if n >= 5 else g.scaleup_busbw_gb_s
    want = _lat(h100, 2 * (n - 1)) + 2 * (n - 1) / n * S / (busbw * 1e9)
    got = collective_time("all_reduce", S, Group(n, n, 1), h100)
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_gather_reduce_scatter_factor(h100, kind, n):
    want = _lat(h100, n - 1) + (n - 1) / n * S / (h100.gpu.scaleup_busbw_gb_s * 1e9)
    assert collective_time(kind, S, Group(n, n, 1), h100) == pytest.approx(want, rel=1e-12)


def test_nvls_only_for_all_reduce_at_five_or_more(h100):
    g = h100.gpu
    assert g.nvls_busbw_gb_s and g.nvls_busbw_gb_s > g.scaleup_busbw_gb_s
    assert intra_busbw(h100, 4, "all_reduce") == g.scaleup_busbw_gb_s
    assert intra_busbw(h100, 5, "all_reduce") == g.nvls_busbw_gb_s
    assert intra_busbw(h100, 8, "all_reduce") == g.nvls_busbw_gb_s
    assert intra_busbw(h100, 8, "all_gather") == g.scaleup_busbw_gb_s
    # NVLS makes the 8-GPU all-reduce faster per byte than a 4-GPU one even though
    # the ring factor grows from 1.5 to 1.75
    t4 = collective_time("all_reduce", S, Group(4, 4, 1), h100)
    t8 = collective_time("all_reduce", S, Group(8, 8, 1), h100)
    assert t8 < t4


def test_no_nvls_on_a100():
    a100 = Cluster.preset("dgx-a100")
    assert a100.gpu.nvls_busbw_gb_s is None
    assert intra_busbw(a100, 8, "all_reduce") == a100.gpu.scaleup_busbw_gb_s


def test_xgmi_busbw_grows_with_group_size(mi300x):
    bws = [intra_busbw(mi300x, n, "all_reduce") for n in (2, 4, 8)]
    assert bws[0] < bws[1] < bws[2]
    assert bws[0] < bws[2] / 4                          # 2 GPUs use one 64 GB/s link
    assert bws[0] == pytest.approx(47.7, rel=0.1)       # measured 2-GPU busbw (cost_models.md §7)
    assert bws[2] == pytest.approx(312.9, rel=0.1)      # measured 8-GPU busbw
    t2 = collective_time("all_reduce", S, Group(2, 2, 1), mi300x)
    t8 = collective_time("all_reduce", S, Group(8, 8, 1), mi300x)
    assert t2 > 3 * t8


@pytest.mark.parametrize("kind", KINDS)
def test_spanning_domains_slower_than_inside_one(h100, kind):
    inside = collective_time(kind, S, group(h100, 8, 1), h100)
    across = collective_time(kind, S, group(h100, 8, 4), h100)    # 2 ranks in each of 4 nodes
    assert group(h100, 8, 4).domains > 1
    assert across > inside
    two_nodes = collective_time(kind, S, group(h100, 16, 1), h100)
    assert group(h100, 16, 1) == Group(16, 8, 2)
    assert two_nodes > inside


def _two_level(h100, S):
    # 16 ranks = 8 per node x 2 nodes: intra ring on 8 + inter ring on 2 over S/8 per NIC
    g = h100.gpu
    return (2 * 7 / 8 * S / (g.nvls_busbw_gb_s * 1e9) + _lat(h100, 14)
            + 2 * 1 / 2 * (S / 8) / (h100.nic_gb_s * 1e9)
            + (h100.base_latency_us + 2 * h100.net_latency_us) * 1e-6)


def _flat_ring(h100, kind, S, n, per, D):
    bw = min(h100.gpu.scaleup_busbw_gb_s, per * h100.nic_gb_s) * 1e9
    steps, inter = (2 * (n - 1), 2 * (D - 1)) if kind == "all_reduce" else (n - 1, D - 1)
    lat = h100.base_latency_us + (steps - inter) * h100.scaleup_latency_us + inter * h100.net_latency_us
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return factor * S / bw + lat * 1e-6


def test_all_reduce_across_nodes_takes_the_faster_of_two_level_and_flat_ring(h100):
    got = collective_time("all_reduce", S, Group(16, 8, 2), h100)
    assert got == pytest.approx(min(_two_level(h100, S), _flat_ring(h100, "all_reduce", S, 16, 8, 2)), rel=1e-12)
    # small buffers: latency decides, and the two-level form's fewer ring steps win
    small = 4096.0
    assert collective_time("all_reduce", small, Group(16, 8, 2), h100) == pytest.approx(
        min(_two_level(h100, small), _flat_ring(h100, "all_reduce", small, 16, 8, 2)), rel=1e-12)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce"])
def test_flat_ring_across_nodes_runs_nvlink_and_nics_side_by_side(h100, kind):
    # FSDP over 4 nodes of 8: NCCL's ring channels cross each node boundary on their own NIC, so the
    # 8 NICs together match NVLink and the buffer moves at the slower of the two, not their sum
    cl = Cluster.preset("dgx-h100", nodes=8)
    g = group(cl, 64, 1)
    assert g == Group(64, 8, 8)
    big = 10 * S                        # a 13B model's bf16 weights: bandwidth-bound
    got = collective_time(kind, big, g, cl)
    assert got == pytest.approx(_flat_ring(cl, kind, big, 64, 8, 8), rel=1e-12)
    factor = 2 * 63 / 64 if kind == "all_reduce" else 63 / 64
    busbw = factor * big / got / 1e9
    assert busbw > 0.9 * min(cl.gpu.scaleup_busbw_gb_s, 8 * cl.nic_gb_s)
    # one rank per node: every hop crosses the network, nothing runs side by side (the two-level
    # form alone, its inter-node ring on the whole buffer per NIC)
    lat = (cl.base_latency_us + (14 if kind == "all_reduce" else 7) * cl.net_latency_us) * 1e-6
    want = (2 * 7 / 8 if kind == "all_reduce" else 7 / 8) * S / (cl.nic_gb_s * 1e9) + lat
    assert collective_time(kind, S, Group(8, 1, 8), cl) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("geom", [(8, 8, 1), (16, 8, 2), (4, 1, 4), (2, 2, 1)])
def test_more_bytes_more_time(h100, kind, geom):
    g = Group(*geom)
    times = [collective_time(kind, s, g, h100) for s in (1e3, 1e6, 1e8, 1e10)]
    assert all(a < b for a, b in zip(times, times[1:]))
    assert all(math.isfinite(t) and t > 0 for t in times)


@pytest.mark.parametrize("kind", KINDS)
def test_zero_bytes_or_single_rank_is_free(h100, kind):
    assert collective_time(kind, 0, Group(8, 8, 1), h100) == 0.0
    assert collective_time(kind, S, Group(1, 1, 1), h100) == 0.0
    assert collective_time(kind, S, group(h100, 1, 8), h100) == 0.0
    assert p2p_time(0, h100, cross_domain=True) == 0.0


def test_unknown_collective_rejected(h100):
    with pytest.raises(ValueError, match="all_reduce"):
        collective_time("allreduce", S, Group(8, 8, 1), h100)


def test_p2p_cross_domain_slower(h100):
    intra = p2p_time(S, h100, cross_domain=False)
    inter = p2p_time(S, h100, cross_domain=True)
    assert inter > intra
    assert inter == pytest.approx(h100.net_latency_us * 1e-6 + S / (h100.nic_gb_s * 1e9), rel=1e-12)
    # small messages: latency dominates, still slower across nodes
    assert p2p_time(64, h100, cross_domain=True) > p2p_time(64, h100, cross_domain=False)


def test_group_geometry_follows_rank_order(h100):
    assert group(h100, 8, 1) == Group(8, 8, 1)       # TP inside a node
    assert group(h100, 4, 8) == Group(4, 1, 4)       # one rank per node
    assert group(h100, 4, 2) == Group(4, 4, 1)


# ---- deduplicating MoE dispatch (DeepEP) --------------------------------------------------------
from meshplan.cost_models.comm import dedup_all_to_all_time, dedup_copies  # noqa: E402


def test_dedup_copies_match_alltoall_with_one_expert_per_token():
    """With top-1 routing nothing can be deduplicated: the expected copies leaving a GPU equal the
    all-to-all's (n-1)/n of the token, and (D-1)/D of it crosses domains."""
    g = Group(32, 8, 4)
    gpus, doms = dedup_copies(64, 1, g)
    assert gpus == pytest.approx(31 / 32)
    assert doms == pytest.approx(3 / 4)


def test_dedup_copies_hand_count_and_saving():
    """E=128, k=8 over 32 GPUs in 4 nodes: P(a node holds none of the 8) = C(96,8)/C(128,8)."""
    g = Group(32, 8, 4)
    gpus, doms = dedup_copies(128, 8, g)
    p_node = math.comb(96, 8) / math.comb(128, 8)
    p_gpu = math.comb(124, 8) / math.comb(128, 8)
    assert doms == pytest.approx(3 * (1 - p_node))
    assert gpus == pytest.approx(31 * (1 - p_gpu))
    assert doms < 8 * 24 / 32 / 2          # less than half the all-to-all's cross-node copies
    assert dedup_copies(128, 8, Group(8, 8, 1))[1] == 0.0


def test_dedup_dispatch_faster_than_alltoall_across_nodes(h100):
    g = group(h100, 32, 1)
    tok_bytes = 64e6                         # one copy of every local token (bandwidth-bound)
    gpus, doms = dedup_copies(128, 8, g)
    t_dedup = dedup_all_to_all_time(tok_bytes * gpus, tok_bytes * doms, g, h100)
    t_a2a = collective_time("all_to_all", 8 * tok_bytes, g, h100)
    assert 0 < t_dedup < 0.6 * t_a2a
    assert dedup_all_to_all_time(0.0, 0.0, g, h100) == 0.0
