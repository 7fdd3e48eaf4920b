"""The sourced figures the GPU table (gpus.py) is built from: measured bus bandwidths and the
ratios that carry them to parts nobody measured, host links and memory, and the source strings
the entries cite. Estimates say so, with their reasoning."""

from __future__ import annotations

__all__ = [
    "ALPS", "BLACKWELL_LINK_RATIO", "C2C_PER_GPU_GB_S", "CW", "DGX_A100_HOST_GB",
    "DGX_H100_HOST_GB", "GB300_BF16_MAMF", "GB300_FP8_MAMF", "GH200_MESH_BUSBW", "GH200_PEER_GB_S",
    "GRACE_LPDDR_GB", "GRAND_TETON", "H100_500W_PEAK_RATIO", "H100_NVLS_BUSBW",
    "H100_NVL_BF16_DENSE", "H100_PCIE_BUSBW", "H100_RING_BUSBW", "H800_LINK_RATIO", "LAMBDA",
    "MAMF", "MI300X_HOST_GB", "ML_ENG_SPECS", "PCIE4_HOST_GB_S", "PCIE5_HOST_GB_S",
]

ML_ENG_SPECS = "stas00/ml-engineering compute/accelerator/README.md (TFLOPS + memory tables)"
MAMF = "stas00/ml-engineering compute/accelerator/README.md (Maximum Achievable Matmul FLOPS table)"
CW = "coreweave.com/pricing read 2026-09-20 via api-evangelist/coreweave"
LAMBDA = "lambda.ai/instances read 2026-09-20 via api-evangelist/lambda-labs"

# H100-class NVLink4 + NVSwitch all-reduce busbw on 8 GPUs (nccl #1455, nccl-tests #212).
H100_RING_BUSBW = 370.0
H100_NVLS_BUSBW = 480.0
# H800 is an H100 SXM with NVLink cut to 400 GB/s bidirectional = 200 unidirectional per GPU
# (H100: 900 / 450): "the NVLink bandwidth in H800 SXM nodes is reduced from 900 GB/s to 400 GB/s"
# (DeepSeek, "Insights into DeepSeek-V3", arXiv 2505.09343 §4.1, which also gives eight 400G IB CX7
# NICs per 8-GPU node and a reduced FP64 rate). Achieved busbw scales with line rate:
# 370 x 200/450 = 164 GB/s ring, which matches the ~160 GB/s NVLink the DeepSeek-V3 report gives
# for its H800s (arXiv 2412.19437 §3.2.2: "NVLink offers a bandwidth of 160 GB/s, roughly 3.2 times
# that of IB (50 GB/s)"; §3.1: 2048 H800s, 8 per node on NVLink + NVSwitch, IB between nodes).
H800_LINK_RATIO = 200.0 / 450.0
# H100 SXM 96GB HBM2e run at a 500 W power limit (Meta Grand Teton hosts; pytorch/torchtitan
# benchmarks/llama3_h100_202412_torchtitan.md, the torchtitan paper's tables: "96GB HBM2e with
# 2.4 TB/sec", "the default 500W power limit", 8 GPUs per host on NVLink, 400 Gb/s RDMA per GPU).
# Its footnote: "the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact
# value". No source measures its GEMM rate. Estimate: interpolate NVIDIA's rated dense BF16 peak
# linearly in board power between the two GH100 parts NVIDIA rates: H100 NVL, 1,671 sparse = 835.5
# dense TFLOPS at up to 400 W (nvidia.com/en-us/data-center/h100, quoted in KellerJordan/
# modded-nanogpt #116; 350-400 W in ml-engineering's power table), and H100 SXM, 989 at 700 W:
# 835.5 + (989 - 835.5) x (500 - 400)/(700 - 400) = 886.7 TFLOPS at 500 W, 0.897 of 989. (Power
# rising as clock^3 from the NVL point instead gives 835.5 x (500/400)^(1/3) = 900, 0.910: the
# two agree within 1.5 %.) The measured H100 SXM MAMF (794.5 BF16 / 1402.6 FP8) is scaled by that
# ratio, i.e. the cap is taken to cost clock, not matmul efficiency at a given clock.
H100_NVL_BF16_DENSE = 1671.0 / 2
H100_500W_PEAK_RATIO = (H100_NVL_BF16_DENSE + (989.0 - H100_NVL_BF16_DENSE) * (500 - 400) / (700 - 400)) / 989.0
GRAND_TETON = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Grand Teton hardware; the "
                 "torchtitan paper arXiv 2410.06511's tables)")
# GB300 (Grace + Blackwell Ultra, NVL72) has no MAMF entry. Estimate: the B300 MAMF times the uplift
# the Grace-Blackwell packaging measured one generation earlier (GB200 / B200 MAMF: 1822.0 / 1745.0
# BF16, 3615.6 / 3432.5 FP8), the same relation GB300 bears to B300 (higher rated peak, 1400 W).
GB300_BF16_MAMF = 1769.0 * 1822.0 / 1745.0      # = 1847.1 of 2500
GB300_FP8_MAMF = 3353.3 * 3615.6 / 3432.5       # = 3532.2 of 5000
# B200/GB200 NVLink5 busbw is not measured in any stored source. The 8x B300 proxy (nccl #2140:
# 695 ring / 845 NVLS) has the same 900 GB/s NVLink5 line rate, so the scale factor is 900/900 = 1.
BLACKWELL_LINK_RATIO = 900.0 / 900.0
# 8x H100 PCIe (no NVSwitch) all-reduce: 35-45 GB/s busbw (hardware.csv, alayanew nccl-tests blog).
H100_PCIE_BUSBW = 40.0
# Host side, for activation offloading (cost_models/offload.py). PCIe Gen5 x16 runs 64 GB/s per
# direction raw (63 GB/s in ml-engineering network/README.md's intra-node table); pinned-memory
# copies reach about 50-55 GB/s per direction on H100 SXM hosts: the low end is taken (judgement:
# a DGX H100's GPUs share their PCIe switches with the NICs). Gen4 x16 (A100, L40S): 31.5 GB/s raw,
# the same achieved fraction.
PCIE5_HOST_GB_S = 50.0
PCIE4_HOST_GB_S = 25.0
# NVLink-C2C: 900 GB/s bidirectional, 450 per direction, per Grace superchip (NVIDIA GH200 and GB200
# NVL72 datasheets). A GB200 / GB300 Grace serves two Blackwell GPUs: each is taken to get half when
# both offload at once (estimate; GH200, one GPU per Grace, would get all 450).
C2C_PER_GPU_GB_S = 450.0 / 2
# Host DRAM per server: DGX H100 datasheet "System Memory 2TB" (DGX H200, B200 and B300 datasheets:
# 2 TB standard, up to 4 TB); DGX A100 datasheet: 1 TB (2 TB optional on the 640 GB model); GB200 NVL72
# datasheet: up to 17 TB LPDDR5X over 36 Grace CPUs, 480 GB each; MI300X platforms: estimate 2 TB
# (Azure ND MI300X v5 VMs expose 1.85 TB).
DGX_H100_HOST_GB = 2048.0
DGX_A100_HOST_GB = 1024.0
GRACE_LPDDR_GB = 480.0
MI300X_HOST_GB = 2048.0

# GH200 Grace Hopper, the 96 GB HBM3 part (CSCS Alps' 10,752): an H100 die with 96 GB of HBM3 at
# 4 TB/s (NVIDIA's GH200 announcement, Aug 2023: "96GB HBM3 @4TB/s"; the HBM3e part, 141-144 GB at
# ~5 TB/s, came later), tied to a 72-core Grace CPU by NVLink-C2C. Deployed four to a node without an
# NVSwitch (HPE Cray EX254n: Alps, Isambard-AI; Eviden XH3000: JUPITER). CSCS's node schematic
# (eth-cscs/cscs-docs docs/images/alps/gh200-schematic.svg) draws the four GPUs all-to-all on NVLink,
# 3 x 6 links: 150 GB/s per direction to each peer, 450 per GPU; NVLink-C2C 450 GB/s per direction
# to the GPU's own Grace, ~120 GB of LPDDR5X each (~477 GB per node); one Slingshot-11 NIC at
# 200 Gb/s (25 GB/s) per module; ~94 GB of the HBM3 visible per GPU.
GH200_PEER_GB_S = 150.0
# No NCCL busbw on a 4-GH200 node is stored. Estimate: the three peer links at the fraction AMD's
# xGMI full mesh achieves (cost_models.constants.XGMI_EFF, 0.72 measured on MI300X), 3 x 150 x 0.72.
GH200_MESH_BUSBW = 3 * GH200_PEER_GB_S * 0.72
ALPS = "eth-cscs/cscs-docs docs/alps/hardware.md and docs/images/alps/gh200-schematic.svg (Alps GH200 node)"
