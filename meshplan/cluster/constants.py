"""The sourced and measured hardware figures behind the GPU table and the cluster defaults.

Owns the numbers only: NCCL/RCCL collective latencies, the memory a training process cannot use,
achieved NIC bandwidths, the PCIe GEMM penalty, and this machine's local-cpu measurements. Every
figure comes from meshplan/data/hardware.csv or a cited source (named in the comment
next to it); figures the sources lack are marked "estimate" with the reasoning. Bandwidths follow
the nccl-tests definitions (busbw, GB/s = 1e9 B/s); TFLOPS are dense.
"""

from __future__ import annotations

__all__ = [
    "NCCL_BASE_LATENCY_US", "NCCL_NVLINK_HOP_US", "NCCL_PCIE_HOP_US", "NCCL_NET_HOP_US",
    "RCCL_BASE_LATENCY_US", "RCCL_XGMI_HOP_US", "CUDA_CONTEXT_GB", "NCCL_BUFFERS_GB",
    "ALLOCATOR_FRAGMENTATION_FRAC", "NDR400_BUSBW_GB_S", "EDR100_BUSBW_GB_S", "HDR200_BUSBW_GB_S",
    "XDR800_BUSBW_GB_S",
    "PCIE_MAMF_PENALTY", "CPU_HOST_FP32_TFLOPS", "CPU_HOST_BF16_TFLOPS", "CPU_HOST_MEM_TB_S",
    "CPU_HOST_LOOPBACK_BUSBW_GB_S", "CPU_LOOPBACK_BASE_US", "CPU_LOOPBACK_HOP_US", "CPU_NET_HOP_US",
    "CPU_NIC_GBIT", "CPU_NIC_BUSBW_GB_S", "CPU_PROCESS_RESERVED_GB", "FALLBACK_HOST_RAM_GB",
]

# ---- collective latencies (microseconds) ------------------------------------------------------
# NCCL's own cost model, Ring algorithm, Simple protocol (NVIDIA/nccl src/graph/tuning.cc;
# cost_models.md §7): base per collective, per hop over NVLink / PCIe / the network.
NCCL_BASE_LATENCY_US = 8.4
NCCL_NVLINK_HOP_US = 3.4
NCCL_PCIE_HOP_US = 5.7
NCCL_NET_HOP_US = 14.0
# RCCL's table for the same model (ROCm/rccl src/graph/tuning.cc, Ring/Simple): a higher base,
# a slightly cheaper xGMI hop. The network hop stays NCCL's: it is the same InfiniBand.
RCCL_BASE_LATENCY_US = 27.9
RCCL_XGMI_HOP_US = 2.7

# ---- memory the training process cannot use ----------------------------------------------------
# The CUDA context appears on the first CUDA call: 723 MiB on a PyTorch process
# (discuss.pytorch.org "What is the reason for pytorch's GPU memory floor").
CUDA_CONTEXT_GB = 0.75
# Estimate: NCCL communicators allocate per-channel, per-peer staging buffers (NCCL_BUFFSIZE 4 MiB
# each); a 3-D/4-D layout opens several communicators, which adds up to about 1 GB.
NCCL_BUFFERS_GB = 1.0
# Estimate: the PyTorch caching allocator's reserved-but-unallocated memory at peak, a few % of HBM
# in long training runs. 2% is the largest value for which every published layout in
# data/published_runs.csv still fits by meshplan's memory model (benchmarks/validate_published.py).
ALLOCATOR_FRAGMENTATION_FRAC = 0.02

# ---- achieved network bandwidth per NIC (GB/s, nccl-tests busbw) -------------------------------
NDR400_BUSBW_GB_S = 47.0    # NDR 400 Gb/s: 46-48 GB/s (nccl-tests #290; hardware.csv), midpoint
EDR100_BUSBW_GB_S = 12.2    # 100 Gb/s: 12.2 GB/s (nccl-tests #29)
HDR200_BUSBW_GB_S = 2 * EDR100_BUSBW_GB_S   # hardware.csv A100 row: "~24 (derived: 2x the 12.2)"
# Estimate: no stored nccl-tests figure per 800 Gb/s NIC (ConnectX-8 XDR, as on DGX B300 and
# GB300 NVL72). Twice NDR's, i.e. the same ~94 % of line rate. Cross-check: NVIDIA/nccl #2035 runs
# ring all-reduce over 16 nodes of 8x B300 + 8x CX8 at ~760 GB/s busbw, which ml-engineering's
# per-accelerator conversion (network/README.md: busbw x (k-1)/(n-1)) puts at 760 x 15/127 = 90 GB/s.
XDR800_BUSBW_GB_S = 2 * NDR400_BUSBW_GB_S

# PCIe cards run power-limited clocks: A100 PCIe reaches 81.1 % of peak in the MAMF table where
# A100 SXM reaches 86.9 % (stas00/ml-engineering compute/accelerator/README.md). Used to estimate
# the GEMM efficiency of PCIe parts that have no MAMF entry (H100 PCIe, L40S).
PCIE_MAMF_PENALTY = 81.1 / 86.9

# ---- this machine, for local-cpu (measured 2026-11-22, 2-core AMD EPYC VM, torch 2.13.0 CPU) -----
# 2048^3 matmul, best of 3, torch.set_num_threads(2): fp32 0.106 s = 161 GFLOP/s,
# bf16 0.047 s = 362 GFLOP/s (1 thread: 82 / 188 GFLOP/s). cpu_platform.md §9 agrees at 4096^3
# (fp32 0.89 s = 154, bf16 0.40 s = 344 GFLOP/s). Processes share the host, so each gets 1/nproc.
CPU_HOST_FP32_TFLOPS = 0.161
CPU_HOST_BF16_TFLOPS = 0.362
# 256 MiB tensor copy_, 2 threads: 44 GB/s counting read + write.
CPU_HOST_MEM_TB_S = 0.044
# gloo all_reduce over loopback, one thread per rank, measured with world 2 and 4 on this machine:
# 32 MiB took 34-40 ms (world 2) and 76-87 ms (world 4), i.e. busbw 0.84-0.99 and 0.58-0.66 GB/s.
# cpu_platform.md §2 saw 27 ms on a quieter run. The reduction is CPU work shared by all ranks, so
# the host moves a roughly constant ~2.3 GB/s of busbw in total and each rank gets 1/nproc of it.
CPU_HOST_LOOPBACK_BUSBW_GB_S = 2.3
# A 4-byte all_reduce took 0.33-0.95 ms (world 2) and 1.1-2.2 ms (world 4) between barriers. As
# training meets it (amid compute, 4 processes on the 2 cores, the wall beyond the collective's own
# CPU work; `meshplan calibrate --nproc 4 --quick`, 3 runs at 2026-11-25 04:20 UTC): 1.11-1.20 ms
# over all four ranks and 0.67-1.17 ms within pairs that cross (as TP x DP / EP x DP pair them).
# The wait is mostly the peers' rescheduling, not ring steps: base 850 us + 50 us per hop puts the
# world all-reduce at 1.15 ms (as the earlier 100 + 6 x 175 did) and a pair's at 0.95 ms (it was 0.45).
CPU_LOOPBACK_BASE_US = 850.0
CPU_LOOPBACK_HOP_US = 50.0
# Estimate: gloo between hosts over TCP, per hop (kernel network stack + gloo's own pair protocol).
CPU_NET_HOP_US = 250.0
# Estimate: gloo across hosts over 10 Gb Ethernet (1.25 GB/s line rate, ~90 % achieved), shared by
# the processes of a host.
CPU_NIC_GBIT = 10.0
CPU_NIC_BUSBW_GB_S = 1.1
# Resident memory of a gloo rank after `import torch` + init_process_group: 258 MB (measured).
CPU_PROCESS_RESERVED_GB = 0.3
# Used when os.sysconf cannot report physical memory (non-POSIX hosts).
FALLBACK_HOST_RAM_GB = 16.0
