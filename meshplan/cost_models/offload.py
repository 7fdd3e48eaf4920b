"""Activation offloading (`Layout.offload_activations`): GPU memory, host memory and time.

What runs (meshplan's runtime/offload.py; Megatron-Core --cpu-offloading, Transformer Engine's
cpu_offload.py, works the same way): each transformer block's tensors saved for backward (what its
recompute policy keeps: all of them with "none", the block input with "full") are copied to pinned
host memory on a side stream as forward produces them, and copied back in backward, one block ahead
of the block that needs them. The embedding's and the output layer's activations stay on the GPU.

GPU memory. At any moment a rank holds on the GPU the saved tensors of at most
OFFLOAD_WORKING_BLOCKS blocks: in forward, the block being computed (its tensors are produced before
their copy can finish) and the previous one (its copies still in flight); in backward, the block
being differentiated and the one being prefetched. So the activations a rank keeps on the GPU are
OFFLOAD_WORKING_BLOCKS x its largest block's saved bytes (of the micro-batch being computed), plus
what never moves (a fully recomputed block rebuilt in backward, the embedding and head activations),
instead of (micro-batches in flight) x (all its blocks' saved bytes). Under pipeline parallelism the
in-flight micro-batches' activations, the bulk of the first stage's memory, all live on the host.

Host memory. The offloaded bytes of every micro-batch in flight sit in the host's DRAM. A server's
DRAM (GPUSpec.host_mem_gb) is shared by its GPUs; each GPU is taken to hold the peak rank's bytes
(ranks of one node often hold the same pipeline stage), and HOST_USABLE_FRACTION of the DRAM is
available (the rest: the OS, data loading, checkpoint staging, and CUDA's pinned host allocator,
which rounds blocks up to powers of two). Over that, the layout does not fit.

Time. Each micro-batch moves its saved bytes device -> host in forward and host -> device in
backward over the GPU's host link (GPUSpec.host_link_gb_s, per direction). The copies run on the copy
engines beside the kernels and take a small share of HBM bandwidth (50 GB/s of an H100's 3,350), so
up to OFFLOAD_OVERLAP_EFF of the pass's own compute time hides them; the rest is exposed and charged.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OffloadRank", "offload_rank", "offload_ranks", "offload_memory", "frees_device_memory", "host_link_gb_s",
           "host_capacity_gb", "HOST_CATEGORY", "OFFLOAD_OVERLAP_EFF", "OFFLOAD_WORKING_BLOCKS", "HOST_USABLE_FRACTION"]

# The memory category of Estimate.memory_gb that holds host bytes (never counted against the GPU).
HOST_CATEGORY = "host_offload"
# Blocks whose saved tensors are on the GPU at once: the one computing and the one in transfer
# (the runtime prefetches exactly one block ahead in backward; see the module docstring).
OFFLOAD_WORKING_BLOCKS = 2
# Fraction of a pass's compute time that can hide its copies (judgement, not fitted: no published run
# measures it). Copies on a side stream overlap kernels almost entirely; what is lost is the first
# block's forward copy and the first block's backward prefetch, which have no earlier compute to
# hide behind, and the copies' share of HBM bandwidth.
OFFLOAD_OVERLAP_EFF = 0.9
# Share of a server's DRAM that offloaded activations may take (judgement; see the module docstring).
HOST_USABLE_FRACTION = 0.75
# Where the GPU spec does not say: PCIe Gen5 x16's achieved rate and a DGX H100's DRAM per GPU
# (meshplan/cluster/gpus.py gives the sources).
FALLBACK_HOST_LINK_GB_S = 50.0
FALLBACK_HOST_MEM_GB_PER_GPU = 2048.0 / 8


@dataclass(frozen=True)
class OffloadRank:
    """One pipeline rank with offloading. Bytes at its peak; seconds per micro-batch."""

    gpu_bytes: float        # offloaded blocks' activations still on the GPU (the working set)
    host_bytes: float       # bytes in host memory at the peak (what the GPU held without offloading)
    fwd_s: float            # exposed copy time in forward
    bwd_s: float            # exposed copy time in backward
    transfer_s: float       # one direction's copy time (hidden + exposed)


def host_link_gb_s(gpu) -> float:
    """Achieved host <-> GPU copy rate per direction, GB/s."""
    return getattr(gpu, "host_link_gb_s", None) or FALLBACK_HOST_LINK_GB_S


def host_capacity_gb(cluster) -> float:
    """Host DRAM (GiB) offloaded activations may use per GPU: its server's DRAM over its GPUs,
    times HOST_USABLE_FRACTION. (GB in the spec are vendor gigabytes, reported here in GiB.)"""
    g = cluster.gpu
    total = getattr(g, "host_mem_gb", None)
    per_gpu = total / g.node_gpus if total else FALLBACK_HOST_MEM_GB_PER_GPU
    return per_gpu * 1e9 / 2 ** 30 * HOST_USABLE_FRACTION


def offload_rank(*, saved_bytes: float, largest_block_bytes: float, held: float, t_f: float, t_b: float,
                 link_gb_s: float, overlap: float) -> OffloadRank:
    """Pure: a rank whose blocks save `saved_bytes` per micro-batch (its largest block
    `largest_block_bytes`), `held` micro-batches in flight at its peak, `t_f` / `t_b` seconds of
    forward / backward (+ recompute) work per micro-batch, copies at `link_gb_s` per direction, of
    which `overlap` x the pass's work hides."""
    transfer = saved_bytes / (link_gb_s * 1e9)
    return OffloadRank(
        gpu_bytes=min(saved_bytes, OFFLOAD_WORKING_BLOCKS * largest_block_bytes),
        host_bytes=saved_bytes * held,
        fwd_s=max(0.0, transfer - overlap * t_f),
        bwd_s=max(0.0, transfer - overlap * t_b),
        transfer_s=transfer,
    )


def offload_ranks(ranks: list, table, layout, cluster, m: int) -> list[OffloadRank]:
    """Offloading on every pipeline rank of an estimate (`ranks`: cost_models.ranks.RankWork, one
    micro-batch each; `table`: their LayerTable; `m` micro-batches a step). Adds each rank's exposed
    copy time to its forward / backward, so the pipeline schedule and bubble see it."""
    from meshplan.cost_models.pipeline import in_flight
    L = layout
    link = host_link_gb_s(cluster.gpu)
    # CPU processes copy on the cores that compute: nothing overlaps (GPUSpec.comm_overlap)
    eta = OFFLOAD_OVERLAP_EFF if cluster.gpu.comm_overlap else 0.0
    out = []
    for r, w in enumerate(ranks):
        # the transformer blocks' saved bytes (what the runtime offloads: not the embedding, the head
        # or anything else the rank's activations hold)
        acts = [table.act(i, L.recompute_policy(j)) for j, i in enumerate(w.layers)]
        o = offload_rank(saved_bytes=sum(acts), largest_block_bytes=max(acts, default=0.0),
                         held=in_flight(L.schedule, m, L.pp, L.vp, r), t_f=w.t_f, t_b=w.t_b,
                         link_gb_s=link, overlap=eta)
        w.t_f += o.fwd_s
        w.t_b += o.bwd_s
        w.fb += o.fwd_s + o.bwd_s
        out.append(o)
    return out


def frees_device_memory(cluster) -> bool:
    """Whether offloading frees the device's memory: not for CPU processes, whose "device" memory is
    the host's (the copy lands in the same RAM; the runtime still runs it, for tests)."""
    return cluster.gpu.scaleup != "loopback"


def offload_memory(mem_stages: list[dict[str, float]], off: list[OffloadRank], gib: float,
                   frees_device: bool = True) -> None:
    """Move each rank's offloaded activations from its "activations" category to HOST_CATEGORY
    (in `gib` bytes), leaving the working set on the GPU. Where the host is the device
    (frees_device False) nothing moves."""
    if not frees_device:
        return
    for s, o in zip(mem_stages, off):
        s["activations"] += (o.gpu_bytes - o.host_bytes) / gib
        s[HOST_CATEGORY] = o.host_bytes / gib
