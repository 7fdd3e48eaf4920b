"""The GPU table: the sourced specs of each GPU meshplan knows (`GPUS`), the per-process spec of
this machine's CPU (`cpu_gpu_spec`), and name lookup (`gpu`, aliases).

Each entry is a `GPUSpec` (spec.py): dense peaks, memory, measured GEMM efficiency, its scale-up
fabric (NVSwitch, xGMI, PCIe, loopback) with a measured all-reduce bus bandwidth, its typical NIC,
power and price. The figures' sources are in the comments next to them and in each entry's
`sources` (constants in meshplan/cluster/constants.py and gpu_figures.py); figures no source gives are marked
"estimate" with the reasoning.
"""

from __future__ import annotations

import os

from meshplan.cluster.constants import (
    CPU_HOST_BF16_TFLOPS, CPU_HOST_FP32_TFLOPS, CPU_HOST_LOOPBACK_BUSBW_GB_S, CPU_HOST_MEM_TB_S,
    CPU_NIC_BUSBW_GB_S, CPU_NIC_GBIT, EDR100_BUSBW_GB_S, FALLBACK_HOST_RAM_GB, HDR200_BUSBW_GB_S,
    NDR400_BUSBW_GB_S, PCIE_MAMF_PENALTY, XDR800_BUSBW_GB_S,
)
from meshplan.cluster.gpu_figures import (
    ALPS, BLACKWELL_LINK_RATIO, C2C_PER_GPU_GB_S, CW, DGX_A100_HOST_GB, DGX_H100_HOST_GB,
    GB300_BF16_MAMF, GB300_FP8_MAMF, GH200_MESH_BUSBW, GH200_PEER_GB_S, GRACE_LPDDR_GB, GRAND_TETON,
    H100_500W_PEAK_RATIO, H100_NVLS_BUSBW, H100_NVL_BF16_DENSE, H100_PCIE_BUSBW, H100_RING_BUSBW,
    H800_LINK_RATIO, LAMBDA, MAMF, MI300X_HOST_GB, ML_ENG_SPECS, PCIE4_HOST_GB_S, PCIE5_HOST_GB_S,
)
from meshplan.cluster.spec import SCALEUP_KINDS, GPUSpec, _check_int
from meshplan.errors import ConfigError, UnknownNameError

__all__ = ["GPUSpec", "GPUS", "SCALEUP_KINDS", "gpu", "cpu_gpu_spec"]

# ---- the GPU table ------------------------------------------------------------------------------
_GPU_LIST: tuple[GPUSpec, ...] = (
    GPUSpec(
        id="a100-40gb", name="NVIDIA A100 SXM4 40GB",
        host_link_gb_s=PCIE4_HOST_GB_S, host_mem_gb=DGX_A100_HOST_GB,
        bf16_tflops=312.0, fp8_tflops=None, hbm_gb=40.0, hbm_tb_s=1.555,
        gemm_efficiency=271.2 / 312.0, fp8_gemm_efficiency=None,   # MAMF 271.2 (A100 SXM)
        scaleup="nvswitch", scaleup_gb_s=300.0, scaleup_domain=8,
        scaleup_busbw_gb_s=240.0,         # "230-250 (8 GPUs)": midpoint
        nvls_busbw_gb_s=None,             # NVSwitch gen2 has no in-switch reduction
        per_peer_gb_s=None, nic_gbit=200.0, nic_busbw_gb_s=HDR200_BUSBW_GB_S,
        tdp_w=400.0, price_usd_per_hour=1.99, price_source=f"Lambda 8x A100 SXM 40GB ({LAMBDA})",
        sources=f"{ML_ENG_SPECS}; {MAMF}; ml-engineering network/README.md; nccl-tests #29",
    ),
    GPUSpec(
        id="a100-80gb", name="NVIDIA A100 SXM4 80GB",
        host_link_gb_s=PCIE4_HOST_GB_S, host_mem_gb=DGX_A100_HOST_GB,
        bf16_tflops=312.0, fp8_tflops=None, hbm_gb=80.0, hbm_tb_s=2.039,
        gemm_efficiency=271.2 / 312.0, fp8_gemm_efficiency=None,
        scaleup="nvswitch", scaleup_gb_s=300.0, scaleup_domain=8,
        scaleup_busbw_gb_s=240.0, nvls_busbw_gb_s=None, per_peer_gb_s=None,
        nic_gbit=200.0, nic_busbw_gb_s=HDR200_BUSBW_GB_S,   # DGX A100: 8x 200Gb HDR per node
        tdp_w=400.0, price_usd_per_hour=2.7, price_source=f"CoreWeave A100 $21.60/8 ({CW})",
        sources=f"{ML_ENG_SPECS}; {MAMF}; ml-engineering network/README.md; nccl-tests #29",
    ),
    GPUSpec(
        id="h100-sxm", name="NVIDIA H100 SXM5 80GB",
        host_link_gb_s=PCIE5_HOST_GB_S, host_mem_gb=DGX_H100_HOST_GB,
        bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gb=80.0, hbm_tb_s=3.35,
        gemm_efficiency=794.5 / 989.0, fp8_gemm_efficiency=1402.6 / 1979.0,
        scaleup="nvswitch", scaleup_gb_s=450.0, scaleup_domain=8,
        scaleup_busbw_gb_s=H100_RING_BUSBW, nvls_busbw_gb_s=H100_NVLS_BUSBW, per_peer_gb_s=None,
        nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,
        tdp_w=700.0, price_usd_per_hour=6.16, price_source=f"CoreWeave HGX H100 $49.24/8 ({CW})",
        sources=f"{ML_ENG_SPECS}; {MAMF}; nccl #1455, nccl-tests #212, nccl-tests #290",
    ),
    GPUSpec(
        id="h100-sxm-96gb-500w", name="NVIDIA H100 SXM 96GB HBM2e (500 W limit, Grand Teton)",
        host_link_gb_s=PCIE5_HOST_GB_S, host_mem_gb=DGX_H100_HOST_GB,   # estimate: Grand Teton not published
        # The same GH100 silicon: nominal peaks stay the H100 SXM datasheet's, so MFU reads as
        # torchtitan reports it ("we use the peak number of SXM directly"). The 500 W cap is in the
        # efficiencies (estimate, see H100_500W_PEAK_RATIO): ~712 BF16 / ~1257 FP8 TFLOPS achieved.
        bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gb=96.0, hbm_tb_s=2.4,   # HBM2e
        gemm_efficiency=794.5 / 989.0 * H100_500W_PEAK_RATIO,
        fp8_gemm_efficiency=1402.6 / 1979.0 * H100_500W_PEAK_RATIO,
        # 8 GPUs per host "fully connected with NVLink": NVLink4 + NVSwitch as on HGX H100
        scaleup="nvswitch", scaleup_gb_s=450.0, scaleup_domain=8,
        scaleup_busbw_gb_s=H100_RING_BUSBW,   # estimate: not measured at 500 W; H100 SXM's NVLink4
        nvls_busbw_gb_s=H100_NVLS_BUSBW,      # estimate, likewise
        per_peer_gb_s=None,
        # "400 Gb/s per GPU" backend RDMA (RoCE on Meta's clusters); busbw estimate: NDR 400G's
        nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,
        tdp_w=500.0,                           # the power limit the runs used, not the 700 W TDP
        price_usd_per_hour=None, price_source="not rented on demand (Meta in-house Grand Teton hosts)",
        sources=f"{GRAND_TETON}: 96GB HBM2e, 2.4 TB/s, 500 W, 8 GPUs/host on NVLink, 400 Gb/s RDMA "
                "per GPU, footnote 2 (peak between SXM and NVL); arXiv 2604.11391 (H100 HBM2e: 2.41 TB/s); "
                f"{ML_ENG_SPECS}; {MAMF} (H100 SXM); nvidia.com/en-us/data-center/h100 (H100 NVL "
                "1,671 sparse BF16 TFLOPS, 350-400 W; via KellerJordan/modded-nanogpt #116)",
    ),
    GPUSpec(
        id="h100-pcie", name="NVIDIA H100 PCIe 80GB",
        host_link_gb_s=PCIE5_HOST_GB_S, host_mem_gb=1024.0,   # estimate: a PCIe server, 1 TB
        bf16_tflops=756.0, fp8_tflops=1513.0, hbm_gb=80.0, hbm_tb_s=2.0,
        # estimate: no MAMF entry; H100 SXM efficiency x the PCIe penalty seen on A100
        gemm_efficiency=794.5 / 989.0 * PCIE_MAMF_PENALTY,
        fp8_gemm_efficiency=1402.6 / 1979.0 * PCIE_MAMF_PENALTY,
        # The CSV's scale-up domain is 1 (no NVLink without a bridge). We model the server's PCIe
        # tree as the domain instead: GPUs of one 8-GPU box all-reduce at a measured 35-45 GB/s
        # without touching the NIC, which a domain of 1 would wrongly send over the network.
        scaleup="pcie", scaleup_gb_s=63.0, scaleup_domain=8,
        scaleup_busbw_gb_s=H100_PCIE_BUSBW, nvls_busbw_gb_s=None, per_peer_gb_s=None,
        # estimate: the CSV says "deployment-specific"; one 200G NIC per GPU, as on A100 HGX
        nic_gbit=200.0, nic_busbw_gb_s=HDR200_BUSBW_GB_S,
        tdp_w=350.0, price_usd_per_hour=3.29, price_source=f"Lambda 1x H100 PCIe ({LAMBDA})",
        sources=f"{ML_ENG_SPECS}; ml-engineering network/README.md (PCIe5 63 GB/s); NVIDIA "
                "PB-11133-001 (350 W); docs.alayanew.com nccl-tests blog (35-45 GB/s busbw)",
    ),
    GPUSpec(
        id="h800", name="NVIDIA H800 SXM5 80GB",
        host_link_gb_s=PCIE5_HOST_GB_S, host_mem_gb=DGX_H100_HOST_GB,   # estimate: an HGX H100 host
        bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gb=80.0, hbm_tb_s=3.35,   # H100 SXM silicon
        gemm_efficiency=794.5 / 989.0, fp8_gemm_efficiency=1402.6 / 1979.0,
        scaleup="nvswitch", scaleup_gb_s=450.0 * H800_LINK_RATIO, scaleup_domain=8,
        scaleup_busbw_gb_s=H100_RING_BUSBW * H800_LINK_RATIO,   # estimate, see H800_LINK_RATIO
        nvls_busbw_gb_s=H100_NVLS_BUSBW * H800_LINK_RATIO,      # estimate, same scaling
        per_peer_gb_s=None,
        # DeepSeek-V3's H800 cluster: one 400G IB NIC per GPU, ~50 GB/s achieved (§3.2.2)
        nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,
        tdp_w=700.0, price_usd_per_hour=None, price_source="no on-demand list price (export-market part)",
        sources=f"{ML_ENG_SPECS} (H100 SXM); DeepSeek arXiv 2505.09343 §4.1 (H800 SXM NVLink 900 -> "
                "400 GB/s, 8x 400G IB CX7 per node); DeepSeek-V3 report arXiv 2412.19437 §3.1 (2048 H800, "
                "8 per node, NVLink + NVSwitch, IB) and §3.2.2 (NVLink 160 GB/s, IB 50 GB/s achieved); "
                "deepseek-ai/DeepEP README (EP8 dispatch/combine 153/158 GB/s over NVLink on H800)",
    ),
    GPUSpec(
        id="h200", name="NVIDIA H200 SXM 141GB",
        host_link_gb_s=PCIE5_HOST_GB_S, host_mem_gb=DGX_H100_HOST_GB,   # DGX H200: 2 TB
        bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gb=141.0, hbm_tb_s=4.8,
        gemm_efficiency=794.5 / 989.0,    # MAMF table: "H200 is the same" as H100
        fp8_gemm_efficiency=1453.4 / 1979.0,
        scaleup="nvswitch", scaleup_gb_s=450.0, scaleup_domain=8,
        scaleup_busbw_gb_s=H100_RING_BUSBW,   # no ring figure stored; same NVLink4 as H100
        nvls_busbw_gb_s=475.0,                 # nccl-tests #272
        per_peer_gb_s=None, nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,
        tdp_w=700.0, price_usd_per_hour=6.31, price_source=f"CoreWeave HGX H200 $50.44/8 ({CW})",
        sources=f"{ML_ENG_SPECS}; {MAMF}; nccl-tests #272, nccl-tests #290",
    ),
    GPUSpec(
        id="gh200", name="NVIDIA GH200 Grace Hopper 96GB (4 per node)",
        host_link_gb_s=450.0, host_mem_gb=4 * 120.0,     # NVLink-C2C to its own Grace; 4 Grace per node
        bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gb=96.0, hbm_tb_s=4.0,   # H100 silicon, HBM3 at 4 TB/s
        # estimate: no MAMF is stored for GH200; the H100 SXM's (its module's power limit, up to
        # 1000 W for CPU + GPU + memory, is not shown to raise the matmul clock)
        gemm_efficiency=794.5 / 989.0, fp8_gemm_efficiency=1402.6 / 1979.0,
        scaleup="nvlink-mesh", scaleup_gb_s=3 * GH200_PEER_GB_S, scaleup_domain=4, node_gpus=4,
        scaleup_busbw_gb_s=GH200_MESH_BUSBW,   # estimate, see GH200_MESH_BUSBW
        nvls_busbw_gb_s=None,                   # no NVSwitch: no in-switch reduction
        per_peer_gb_s=GH200_PEER_GB_S,
        # one 200 Gb/s Slingshot-11 NIC per GPU (Alps); busbw estimate: HDR 200's, the same line rate
        nic_gbit=200.0, nic_busbw_gb_s=HDR200_BUSBW_GB_S,
        tdp_w=1000.0,                           # the module's configurable limit (CPU + GPU + memory)
        price_usd_per_hour=2.29, price_source=f"Lambda 1x GH200 ({LAMBDA})",
        sources=f"{ALPS}; NVIDIA GH200 announcement Aug 2023 (96GB HBM3 @4TB/s, HBM3e variant; via "
                f"nishikiout.net 2023-08-09); spheron.network blog nvidia-gh200-guide (96 GB HBM3, 480 GB "
                f"LPDDR5X, NVLink-C2C 900 GB/s bidirectional); {MAMF} (H100 SXM, for the estimate)",
    ),
    GPUSpec(
        id="b200", name="NVIDIA B200 (HGX/DGX, 1000 W)",
        host_link_gb_s=PCIE5_HOST_GB_S, host_mem_gb=DGX_H100_HOST_GB,   # DGX B200: 2 TB (to 4 TB)
        bf16_tflops=2250.0, fp8_tflops=4500.0, hbm_gb=180.0, hbm_tb_s=8.0,   # 180 usable of 192
        gemm_efficiency=1745.0 / 2250.0, fp8_gemm_efficiency=3432.5 / 4500.0,
        scaleup="nvswitch", scaleup_gb_s=900.0, scaleup_domain=8,
        scaleup_busbw_gb_s=695.0 * BLACKWELL_LINK_RATIO,   # estimate from the B300 proxy
        nvls_busbw_gb_s=845.0 * BLACKWELL_LINK_RATIO,      # estimate from the B300 proxy
        per_peer_gb_s=None, nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,
        tdp_w=1000.0, price_usd_per_hour=8.6, price_source=f"CoreWeave HGX B200 $68.80/8 ({CW})",
        sources=f"{ML_ENG_SPECS} (DGX B200 datasheet); glennklockwood.com B200; {MAMF}; "
                "nccl #2140 (B300 busbw proxy)",
    ),
    GPUSpec(
        id="gb200", name="NVIDIA GB200 (NVL72, per GPU)",
        host_link_gb_s=C2C_PER_GPU_GB_S, host_mem_gb=2 * GRACE_LPDDR_GB,   # 4 GPUs, 2 Grace per tray
        bf16_tflops=2500.0, fp8_tflops=5000.0, hbm_gb=186.0, hbm_tb_s=8.0,
        gemm_efficiency=1822.0 / 2500.0, fp8_gemm_efficiency=3615.6 / 5000.0,
        scaleup="nvswitch", scaleup_gb_s=900.0, scaleup_domain=72, node_gpus=4,
        # estimate: nothing measured on NVL72. A switched ring's busbw does not fall with the
        # number of GPUs, so the 8-GPU B300 proxy stands in for the 72-GPU domain.
        scaleup_busbw_gb_s=695.0 * BLACKWELL_LINK_RATIO,
        nvls_busbw_gb_s=845.0 * BLACKWELL_LINK_RATIO,
        per_peer_gb_s=None,
        # estimate: CSV "deployment-specific"; one 400G ConnectX-7 per GPU (4 per tray)
        nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,
        tdp_w=1200.0,                     # "~1200 (GPU config)"
        price_usd_per_hour=10.5, price_source=f"CoreWeave GB200 NVL72 $42.00 per 4-GPU tray ({CW})",
        sources=f"{ML_ENG_SPECS} (GB200 NVL72 spec); glennklockwood.com B200 (1200 W); {MAMF}",
    ),
    GPUSpec(
        id="b300", name="NVIDIA B300 (HGX/DGX B300, Blackwell Ultra)",
        host_link_gb_s=PCIE5_HOST_GB_S, host_mem_gb=DGX_H100_HOST_GB,   # DGX B300: 2 TB, Gen5 hosts
        # Dense BF16/FP8 as B200's (DGX B300 datasheet); Blackwell Ultra raised dense FP4 (B200 9 PF
        # -> 12.6-14 PF, by source) and cut FP64 (37 -> 1.25 TF, glennklockwood.com B300), neither
        # of which the cost model prices. 288 GB per the datasheet (DGX B300: 2.3 TB per 8 GPUs);
        # usable capacity may be lower, as on B200 (180 of 192): NVIDIA's HGX page gives 2.1 TB
        # per 8 (ml-engineering), verda.com lists 270 GB. Not adopted: no one NVIDIA per-GPU figure.
        bf16_tflops=2250.0, fp8_tflops=4500.0, hbm_gb=288.0, hbm_tb_s=8.0,
        gemm_efficiency=1769.0 / 2250.0, fp8_gemm_efficiency=3353.3 / 4500.0,   # MAMF (B300 SXM)
        scaleup="nvswitch", scaleup_gb_s=900.0, scaleup_domain=8,   # NVLink5: 1.8 TB/s bidirectional
        scaleup_busbw_gb_s=695.0, nvls_busbw_gb_s=845.0,           # measured on 8x B300 (nccl #2140)
        per_peer_gb_s=None,
        # DGX B300: eight ConnectX-8 at 800 Gb/s, one per GPU; busbw estimate (constants.py)
        nic_gbit=800.0, nic_busbw_gb_s=XDR800_BUSBW_GB_S,
        tdp_w=1000.0,   # DGX B300 power-capping guide: 1000 W max TGP (ml-engineering; verda.com: 1.1 kW)
        price_usd_per_hour=None,
        price_source=f"CoreWeave HGX B300 on-demand: 'Contact sales' (spot $35.84 per 8 GPUs) ({CW})",
        sources=f"{ML_ENG_SPECS} (DGX B300 datasheet; 288 GB HBM3e, 8 TB/s; power table); {MAMF} "
                "(B300 1769.0 BF16, 3353.3 FP8); NVIDIA/nccl #2140 (8x B300 busbw 695 ring / 845 NVLS); "
                "ml-engineering network/README.md (NVLink 5 900 GB/s per direction; DGX B300 8x CX8 "
                "800 Gb/s); glennklockwood.com garden/processors/B300 (FP4 up, FP64 down)",
    ),
    GPUSpec(
        id="gb300", name="NVIDIA GB300 (NVL72, per GPU)",
        host_link_gb_s=C2C_PER_GPU_GB_S, host_mem_gb=2 * GRACE_LPDDR_GB,   # estimate: GB200's Grace
        # Per GPU of the NVL72 rack: 180 PF BF16 / 360 PF FP8 dense, 20 TB HBM3e at 576 TB/s, 130 TB/s
        # NVLink over 72 GPUs. Dense BF16/FP8 as GB200's; FP4 raised (10 -> 15 PF).
        bf16_tflops=2500.0, fp8_tflops=5000.0, hbm_gb=288.0, hbm_tb_s=8.0,
        gemm_efficiency=GB300_BF16_MAMF / 2500.0,      # estimate, see GB300_BF16_MAMF
        fp8_gemm_efficiency=GB300_FP8_MAMF / 5000.0,   # estimate, likewise
        scaleup="nvswitch", scaleup_gb_s=900.0, scaleup_domain=72, node_gpus=4,
        # estimate: the 8x B300 measurement (same NVLink5 line rate, a switched ring's busbw does not
        # fall with the number of GPUs), as for gb200. NVIDIA's NVLink SHARP slide for NVL72 shows
        # 680 ring / 850 NVLS (ml-engineering network/README.md): within 2 %.
        scaleup_busbw_gb_s=695.0 * BLACKWELL_LINK_RATIO,
        nvls_busbw_gb_s=845.0 * BLACKWELL_LINK_RATIO,
        per_peer_gb_s=None,
        # 72 ConnectX-8 per rack, one 800 Gb/s SuperNIC per GPU; busbw estimate (constants.py)
        nic_gbit=800.0, nic_busbw_gb_s=XDR800_BUSBW_GB_S,
        tdp_w=1400.0,   # per-GPU maximum power (NVIDIA Mission Control FAQ via ml-engineering)
        price_usd_per_hour=None, price_source=f"CoreWeave GB300 NVL72 on-demand: 'Contact sales' ({CW})",
        sources=f"{ML_ENG_SPECS} (GB300 NVL72 spec: 2500 BF16 / 5000 FP8 dense; power table 1400 W); "
                "glennklockwood.com garden/processors/B300 (GB300 NVL72: 360 PF FP8, 20 TB HBM at "
                "576 TB/s, 130 TB/s NVLink, 72 ConnectX-8; B300 288 GB HBM3e); verda.com blog "
                f"gb300-nvl72-architecture (per-GPU table); {MAMF} (B300, GB200, B200, for the estimate)",
    ),
    GPUSpec(
        id="mi300x", name="AMD Instinct MI300X",
        host_link_gb_s=PCIE5_HOST_GB_S, host_mem_gb=MI300X_HOST_GB,
        bf16_tflops=1307.4, fp8_tflops=2614.9, hbm_gb=192.0, hbm_tb_s=5.3,
        gemm_efficiency=668.4 / 1307.4,   # community MAMF (AMD's own MAF: 708, i.e. 0.54)
        fp8_gemm_efficiency=1273.0 / 2614.9,   # AMD MAF table; no community FP8 figure
        scaleup="xgmi", scaleup_gb_s=448.0, scaleup_domain=8,   # 7 peers x 64 GB/s
        scaleup_busbw_gb_s=312.9,         # 8 GPUs; only 47.7 for 2 (one 64 GB/s peer link)
        nvls_busbw_gb_s=None, per_peer_gb_s=64.0,
        # Azure ND MI300X v5: 8x 400 Gb NDR per VM; busbw not stored, taken as NDR's 46-48 GB/s
        nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,
        tdp_w=750.0, price_usd_per_hour=2.59,
        price_source="DigitalOcean 1x MI300X list price (HF dataset tokenwatt/gpu-cloud-prices, 2026-10-07)",
        sources=f"{ML_ENG_SPECS}; {MAMF}; ROCm/rocm-blogs measuring-max-achievable-flops-part2 "
                "(AMD MAF); ml-engineering network/README.md (all_reduce_bench busbw)",
    ),
    GPUSpec(
        id="mi325x", name="AMD Instinct MI325X",
        host_link_gb_s=PCIE5_HOST_GB_S, host_mem_gb=MI300X_HOST_GB,   # estimate: as MI300X platforms
        bf16_tflops=1307.4, fp8_tflops=2614.9, hbm_gb=256.0, hbm_tb_s=6.0,
        gemm_efficiency=784.9 / 1307.4, fp8_gemm_efficiency=1519.0 / 2614.9,
        scaleup="xgmi", scaleup_gb_s=448.0, scaleup_domain=8,
        scaleup_busbw_gb_s=312.9,         # estimate: not measured; same xGMI mesh as MI300X
        nvls_busbw_gb_s=None, per_peer_gb_s=64.0,
        nic_gbit=400.0, nic_busbw_gb_s=NDR400_BUSBW_GB_S,   # CSV "400 typical"; busbw estimate
        tdp_w=1000.0, price_usd_per_hour=None, price_source="no reputable stored on-demand price found",
        sources=f"{ML_ENG_SPECS}; {MAMF}; ROCm/rocm-blogs measuring-max-achievable-flops-part2",
    ),
    GPUSpec(
        id="l40s", name="NVIDIA L40S",
        host_link_gb_s=PCIE4_HOST_GB_S, host_mem_gb=1024.0,   # estimate: inference servers, 1 TB
        bf16_tflops=362.0, fp8_tflops=733.0, hbm_gb=48.0, hbm_tb_s=0.864,   # GDDR6
        # estimate: no MAMF entry; H100 SXM efficiency x the PCIe penalty seen on A100
        gemm_efficiency=794.5 / 989.0 * PCIE_MAMF_PENALTY,
        fp8_gemm_efficiency=1402.6 / 1979.0 * PCIE_MAMF_PENALTY,
        # PCIe tree of the 8-GPU server as the domain (see h100-pcie); busbw estimate: the H100
        # PCIe figure scaled by line rate, Gen4 31 / Gen5 63 GB/s
        scaleup="pcie", scaleup_gb_s=31.0, scaleup_domain=8,
        scaleup_busbw_gb_s=H100_PCIE_BUSBW * 31.0 / 63.0, nvls_busbw_gb_s=None, per_peer_gb_s=None,
        # estimate: CSV "deployment-specific"; L40S servers are built for inference, 100G per GPU
        nic_gbit=100.0, nic_busbw_gb_s=EDR100_BUSBW_GB_S,
        tdp_w=350.0, price_usd_per_hour=2.25, price_source=f"CoreWeave L40S $18.00/8 ({CW})",
        sources=f"{ML_ENG_SPECS} (NVIDIA L40S spec); ml-engineering network/README.md (PCIe4 31 GB/s)",
    ),
)


def _host_ram_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (AttributeError, ValueError, OSError):
        return FALLBACK_HOST_RAM_GB


def cpu_gpu_spec(nproc: int = 4) -> GPUSpec:
    """One of `nproc` CPU training processes sharing this host (gloo over loopback).

    Throughput, memory and loopback bandwidth are the host's, divided by `nproc`. RAM is read
    from the OS now; the compute and bandwidth figures are the constants measured above.
    """
    _check_int("local-cpu", "nproc", nproc)
    return GPUSpec(
        id="cpu", name=f"CPU process (1 of {nproc} on this host)",
        # offloading on CPU processes copies within the same RAM: a memcpy at the host's share of
        # bandwidth, into the RAM the processes already share (tests exercise the mechanism, nothing is saved)
        host_link_gb_s=CPU_HOST_MEM_TB_S * 1000.0 / nproc, host_mem_gb=_host_ram_gb(),
        bf16_tflops=CPU_HOST_BF16_TFLOPS / nproc, fp8_tflops=None,   # FP8 is emulated, no speed-up
        fp32_tflops=CPU_HOST_FP32_TFLOPS / nproc,
        hbm_gb=_host_ram_gb() / nproc, hbm_tb_s=CPU_HOST_MEM_TB_S / nproc,
        # The peaks above are measured matmul rates, so the achieved fraction is 1 by definition.
        gemm_efficiency=1.0, fp8_gemm_efficiency=None,
        scaleup="loopback", scaleup_gb_s=CPU_HOST_MEM_TB_S * 1000.0 / nproc, scaleup_domain=nproc,
        scaleup_busbw_gb_s=CPU_HOST_LOOPBACK_BUSBW_GB_S / nproc, nvls_busbw_gb_s=None,
        per_peer_gb_s=None, nic_gbit=CPU_NIC_GBIT, nic_busbw_gb_s=CPU_NIC_BUSBW_GB_S / nproc,
        tdp_w=None, price_usd_per_hour=None, price_source="local machine", node_gpus=nproc, comm_overlap=False,
        sources="measured 2026-11-22 on a 2-core AMD EPYC VM (meshplan/cluster.py constants); "
                "reference/cpu_platform.md",
    )


GPUS: dict[str, GPUSpec] = {spec.id: spec for spec in _GPU_LIST}
GPUS["cpu"] = cpu_gpu_spec()

_GPU_ALIASES = {
    "h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h100-80gb": "h100-sxm", "h100-sxm-80gb": "h100-sxm",
    "a100": "a100-80gb", "a100-80g": "a100-80gb", "a100-sxm": "a100-80gb", "a100-40g": "a100-40gb",
    "h200-sxm": "h200", "h200-141gb": "h200", "b200-sxm": "b200", "gb200-nvl72": "gb200",
    "mi300": "mi300x", "mi325": "mi325x", "h800-sxm": "h800", "h100pcie": "h100-pcie",
    "h800-sxm5": "h800", "h800-80gb": "h800", "b300-sxm": "b300", "hgx-b300": "b300", "dgx-b300": "b300",
    "gb300-nvl72": "gb300", "blackwell-ultra": "b300",
    "gh200-96gb": "gh200", "grace-hopper": "gh200", "gh200-superchip": "gh200",
    # the H100 SXM 96GB HBM2e at 500 W of the torchtitan paper (Meta Grand Teton), as published runs name it
    "h100-sxm-96gb-hbm2e-@500w": "h100-sxm-96gb-500w", "h100-sxm-96gb-hbm2e-@500w-(grand-teton)": "h100-sxm-96gb-500w",
    "h100-sxm-96gb-hbm2e-500w": "h100-sxm-96gb-500w", "h100-96gb-500w": "h100-sxm-96gb-500w",
    "h100-hbm2e-500w": "h100-sxm-96gb-500w", "grand-teton-h100": "h100-sxm-96gb-500w",
}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def gpu(name: str | GPUSpec) -> GPUSpec:
    """The GPUSpec for an id ("h100-sxm") or alias ("H100", "a100"); a GPUSpec passes through."""
    if isinstance(name, GPUSpec):
        return name
    if not isinstance(name, str):
        raise ConfigError(f"a GPU is named by a string id or given as a GPUSpec, got {name!r}")
    key = _norm(name)
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise UnknownNameError("GPU", name, list(GPUS))
    return GPUS[key]
