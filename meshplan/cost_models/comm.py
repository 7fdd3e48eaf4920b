"""Collective communication time over a hierarchical topology (scale-up domain + network).

Pure functions: (collective, bytes, group geometry, cluster) -> seconds. Model (cost_models.md §7):

- Inside one scale-up domain a ring collective of total size S on n ranks takes
  `latency + factor(n) * S / busbw`, with nccl-tests factors 2(n-1)/n (all-reduce) and
  (n-1)/n (all-gather, reduce-scatter, all-to-all), busbw the domain's achieved ring busbw
  (NVLS busbw for all-reduce on >= 5 GPUs where the switch supports it; per-link bandwidth
  times n-1 on full-mesh fabrics like xGMI, where small groups get less).
- A group spanning D domains with g ranks in each is done hierarchically (derived, §7):
  the intra-domain part as above on g ranks, and the inter-domain part on S/g bytes per NIC
  over D "nodes" at the per-GPU network busbw (rail-optimised: one NIC per GPU, g NICs work in
  parallel). All-to-all sends the fraction (n-g)/n of its bytes over the network.
- Latency: alpha-beta with NCCL's ring step counts: base + steps * per-hop latency.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.cost_models.constants import NVLS_MIN_GPUS, P2P_EFF, XGMI_EFF

__all__ = ["Group", "group", "collective_time", "flat_ring_time", "p2p_time", "intra_busbw", "dedup_copies", "dedup_all_to_all_time"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Group:
    """A communicator: `size` ranks, `per_domain` of them in each of `domains` scale-up domains."""

    size: int
    per_domain: int
    domains: int


def group(cluster, size: int, stride: int) -> Group:
    """Geometry of a group of `size` ranks spaced `stride` apart in (node-major) rank order."""
    if size <= 1:
        return Group(1, 1, 1)
    per, dom = cluster.placement(size, stride)
    return Group(size, per, dom)


def intra_busbw(cluster, n: int, kind: str) -> float:
    """Achieved busbw (GB/s) of a collective on n ranks inside one scale-up domain."""
    gpu = cluster.gpu
    if gpu.per_peer_gb_s:                      # full mesh: only n-1 of the links are used
        bw = gpu.per_peer_gb_s * (n - 1) * XGMI_EFF
        return min(bw, gpu.scaleup_busbw_gb_s) if gpu.scaleup_busbw_gb_s else bw
    if kind == "all_reduce" and gpu.nvls_busbw_gb_s and n >= NVLS_MIN_GPUS:
        return gpu.nvls_busbw_gb_s
    return gpu.scaleup_busbw_gb_s


def _as_run(kind: str, cluster) -> str:
    """The collective that actually runs. Over gloo (local CPU processes, scaleup "loopback") a
    reduce-scatter costs what an all-reduce of the same buffer costs: measured 2026-11-24 on the
    2-core CI host, 4 MB over 4 processes, all-reduce 12-14 ms, reduce-scatter 13-18 ms,
    all-gather 6.5-8 ms (gloo reduces the whole buffer and keeps a slice). So ZeRO-1's
    reduce-scatter + all-gather costs 1.5x DDP's all-reduce there, not 0.75x as on NCCL rings."""
    if kind == "reduce_scatter" and getattr(cluster.gpu, "scaleup", "") == "loopback":
        return "all_reduce"
    return kind


def _factor(kind: str, n: int) -> float:
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n


def _latency(cluster, kind: str, n: int, hop_us: float) -> float:
    steps = 2 * (n - 1) if kind == "all_reduce" else (n - 1)
    return (cluster.base_latency_us + steps * hop_us) * 1e-6


def collective_time(kind: str, nbytes: float, g: Group, cluster) -> float:
    """Seconds for one collective whose total buffer is `nbytes` (nccl-tests' S: the all-reduce
    buffer, the all-gather OUTPUT, the reduce-scatter INPUT, an all-to-all's send buffer)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; known: {KINDS}")
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    kind = _as_run(kind, cluster)
    GB = 1e9
    t = 0.0
    if g.per_domain > 1:
        n = g.per_domain
        bw = intra_busbw(cluster, n, kind) * GB
        if kind == "all_to_all":
            # the share of the send buffer addressed to peers inside this domain
            t_intra = nbytes * (n - 1) / g.size / bw
        else:
            t_intra = _factor(kind, n) * nbytes / bw
        t += t_intra + _latency(cluster, kind, n, cluster.scaleup_latency_us)
    if g.domains > 1:
        D = g.domains
        nic = cluster.nic_gb_s * GB
        if kind == "all_to_all":
            off = nbytes * (g.size - g.per_domain) / g.size        # bytes this GPU sends off-domain
            t_inter = off / nic
            # intra and inter legs of an all-to-all run concurrently: the slower one dominates
            t = max(t, t_inter) + _latency(cluster, kind, D, cluster.net_latency_us)
            return t
        per_nic = nbytes / g.per_domain                            # each NIC carries its rail's share
        t += _factor(kind, D) * per_nic / nic + _latency(cluster, kind, D, cluster.net_latency_us)
        if g.per_domain > 1:                   # NCCL's tuner runs whichever algorithm is faster
            t = min(t, flat_ring_time(kind, nbytes, g, cluster))
    return t


def flat_ring_time(kind: str, nbytes: float, g: Group, cluster) -> float:
    """Seconds for a ring collective through every rank of a group spanning domains, as NCCL runs
    it. Each channel's ring enters and leaves a domain through one NIC and the g = per_domain
    channels use the g NICs side by side, so every scale-up link and every NIC carry the same
    share of the buffer at once: busbw = min(the domain's ring busbw, g x B_nic) (cost_models.md
    §7: for 2 nodes of 8 H100 with 8x400G, ~470 GB/s busbw expected, NVIDIA/nccl #2409 citing
    nccl-tests #309). The two-level sum in collective_time is slower whenever neither leg limits
    alone. Latency as NCCL's tuning model counts it: every step of the ring, the ones crossing the
    network at the network's per-hop latency (src/graph/tuning.cc)."""
    kind = _as_run(kind, cluster)
    n, D = g.size, g.domains
    bw = min(intra_busbw(cluster, g.per_domain, "ring"), g.per_domain * cluster.nic_gb_s) * 1e9
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    inter = 2 * (D - 1) if kind == "all_reduce" else D - 1
    lat = cluster.base_latency_us + (steps - inter) * cluster.scaleup_latency_us + inter * cluster.net_latency_us
    return _factor(kind, n) * nbytes / bw + lat * 1e-6


def p2p_time(nbytes: float, cluster, *, cross_domain: bool) -> float:
    """One send/recv of `nbytes` between two ranks."""
    if nbytes <= 0:
        return 0.0
    if cross_domain:
        return cluster.net_latency_us * 1e-6 + nbytes / (cluster.nic_gb_s * 1e9)
    gpu = cluster.gpu
    link = (gpu.per_peer_gb_s or gpu.scaleup_gb_s) * P2P_EFF
    # gloo between CPU processes: a send/recv waits for its peer to be scheduled again like any
    # collective (the base latency, calibrate._fit_latency), not only a hop's transfer
    base = cluster.base_latency_us if getattr(gpu, "scaleup", "") == "loopback" else 0.0
    return (base + cluster.scaleup_latency_us) * 1e-6 + nbytes / (link * 1e9)


def _p_none(experts: int, topk: int, held: float) -> float:
    """Probability that none of a token's `topk` distinct experts (drawn uniformly from `experts`)
    is among `held` given experts: C(E - held, k) / C(E, k)."""
    p = 1.0
    for i in range(topk):
        p *= max(0.0, experts - held - i) / (experts - i)
    return p


def dedup_copies(experts: int, topk: int, g: Group) -> tuple[float, float]:
    """Copies of one token a node-deduplicating dispatcher (DeepEP) sends, in expectation, with
    experts spread evenly over the `g.size` EP ranks and routing uniform (forced balance):
    (to other GPUs over the scale-up fabric, to other scale-up domains over the network).

    A token goes once to each destination GPU however many of its experts that GPU holds, and
    once to each destination domain over the network, where it is forwarded over NVLink (DeepEP
    normal kernels; DeepSeek-V3 report §3.2.2). The alltoall dispatcher instead sends `topk` copies.
    Derived: E[distinct holders] = n * (1 - C(E - E/n, k) / C(E, k)).
    """
    n, dom = g.size, g.domains
    per_gpu, per_dom = experts / n, experts / dom
    # every remote-domain copy is also forwarded once over NVLink on arrival
    gpus = (n - 1) * (1.0 - _p_none(experts, topk, per_gpu))
    domains = (dom - 1) * (1.0 - _p_none(experts, topk, per_dom)) if dom > 1 else 0.0
    return gpus, domains


def dedup_all_to_all_time(intra_bytes: float, inter_bytes: float, g: Group, cluster) -> float:
    """Seconds for a deduplicated dispatch or combine: `intra_bytes` leave each GPU over the
    scale-up fabric, `inter_bytes` over its NIC; the two legs run concurrently."""
    if g.size <= 1 or intra_bytes + inter_bytes <= 0:
        return 0.0
    t = 0.0
    if g.per_domain > 1:
        n = g.per_domain
        t = intra_bytes / (intra_busbw(cluster, n, "all_to_all") * 1e9) + \
            _latency(cluster, "all_to_all", n, cluster.scaleup_latency_us)
    if g.domains > 1:
        t_inter = inter_bytes / (cluster.nic_gb_s * 1e9)
        t = max(t, t_inter) + _latency(cluster, "all_to_all", g.domains, cluster.net_latency_us)
    return t
