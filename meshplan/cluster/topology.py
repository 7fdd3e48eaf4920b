"""Topology: how a deployment of a GPU is laid out, and how collective groups fall onto it.

Rank order is node-major: consecutive ranks share a node, and a scale-up domain is a block of
`scaleup_domain` consecutive ranks (one HGX node, or 18 GB200 trays of 4 in an NVL72 rack).
This module owns the deployment defaults a Cluster derives from its GPU and shape (domain size,
collective latencies per fabric, reserved memory: `_defaults`) and the placement arithmetic behind
`Cluster.placement` (`_placement`): how a communicator of a given shape falls onto those domains.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import lru_cache
from typing import Any

from meshplan.cluster.constants import (
    ALLOCATOR_FRAGMENTATION_FRAC, CPU_LOOPBACK_BASE_US, CPU_LOOPBACK_HOP_US, CPU_NET_HOP_US,
    CPU_PROCESS_RESERVED_GB, CUDA_CONTEXT_GB, NCCL_BASE_LATENCY_US, NCCL_BUFFERS_GB, NCCL_NET_HOP_US,
    NCCL_NVLINK_HOP_US, NCCL_PCIE_HOP_US, RCCL_BASE_LATENCY_US, RCCL_XGMI_HOP_US,
)
from meshplan.cluster.spec import GPUSpec

__all__: list[str] = []   # package-internal helpers of meshplan.cluster.cluster

# The Cluster fields that default from the GPU and shape (see `_defaults`)
_DERIVED = ("scaleup_domain", "nic_gb_s", "net_latency_us", "scaleup_latency_us",
            "base_latency_us", "memory_reserved_gb", "name")


def _defaults(g: GPUSpec, gpus_per_node: int, num_gpus: int) -> dict[str, Any]:
    """Values of the deployment fields a user did not set, for this GPU and shape."""
    if g.scaleup_domain > g.node_gpus:       # rack-scale fabric (NVL72): domains span nodes
        domain = min(g.scaleup_domain, num_gpus)
    else:                                    # board-level fabric: a domain never leaves its node
        domain = min(g.scaleup_domain, gpus_per_node)
    if g.scaleup == "loopback":
        base, hop, net = CPU_LOOPBACK_BASE_US, CPU_LOOPBACK_HOP_US, CPU_NET_HOP_US
        reserved = CPU_PROCESS_RESERVED_GB
    else:
        if g.scaleup == "xgmi":
            base, hop = RCCL_BASE_LATENCY_US, RCCL_XGMI_HOP_US
        elif g.scaleup == "pcie":
            base, hop = NCCL_BASE_LATENCY_US, NCCL_PCIE_HOP_US
        else:
            base, hop = NCCL_BASE_LATENCY_US, NCCL_NVLINK_HOP_US
        net = NCCL_NET_HOP_US
        reserved = round(CUDA_CONTEXT_GB + NCCL_BUFFERS_GB + ALLOCATOR_FRAGMENTATION_FRAC * g.hbm_gb, 3)
    return dict(scaleup_domain=domain, nic_gb_s=g.nic_busbw_gb_s, net_latency_us=net,
                scaleup_latency_us=hop, base_latency_us=base, memory_reserved_gb=reserved,
                name=f"{gpus_per_node}x{g.id}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@lru_cache(maxsize=4096)
def _placement(num_gpus: int, domain: int, group_size: int, stride: int) -> tuple[int, int]:
    if group_size == 1:
        return (1, 1)
    if stride >= domain:                 # consecutive members are >= a domain apart
        return (1, group_size)
    if domain % stride == 0:
        per_domain = domain // stride    # members of one group a domain can hold
        if per_domain % group_size == 0:
            return (group_size, 1)
        if group_size % per_domain == 0:
            return (per_domain, group_size // per_domain)
    # Groups straddle domain boundaries unevenly: enumerate the groups of one period of the
    # pattern (it repeats every lcm(span, domain) ranks).
    span = group_size * stride
    period = min(num_gpus, span * domain // math.gcd(span, domain))
    most_domains, fewest_ranks = 1, group_size
    for start in range(0, period, span):
        for offset in range(stride):
            counts = Counter((start + offset + k * stride) // domain for k in range(group_size))
            most_domains = max(most_domains, len(counts))
            fewest_ranks = min(fewest_ranks, min(counts.values()))
    return (fewest_ranks, most_domains)
