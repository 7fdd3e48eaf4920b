"""Named clusters: `PRESETS` maps a preset name to a plain function building its `Cluster`
(one server or rack type per entry, plus `local-cpu`, this machine's CPU processes).

`Cluster.preset(name, nodes=..., **options)` checks the options and calls these.
"""

from __future__ import annotations

from typing import Any, Callable

from meshplan.cluster.cluster import Cluster
from meshplan.cluster.gpus import cpu_gpu_spec
from meshplan.errors import ConfigError

__all__ = ["PRESETS"]


def _server_preset(preset: str, gpu_id: str, gpus_per_node: int, default_nodes: int,
                   doc: str) -> Callable[..., Cluster]:
    def build(*, nodes: int | None = None, num_gpus: int | None = None, **fields: Any) -> Cluster:
        if nodes is None and num_gpus is None:
            nodes = default_nodes
        kwargs: dict[str, Any] = dict(gpus_per_node=gpus_per_node, name=preset)
        kwargs.update(fields)
        return Cluster(gpu=gpu_id, nodes=nodes, num_gpus=num_gpus, **kwargs)

    build.__name__ = build.__qualname__ = preset.replace("-", "_")
    build.__doc__ = doc
    return build


def _local_cpu(*, nodes: int | None = None, num_gpus: int | None = None, nproc: int | None = None,
               **fields: Any) -> Cluster:
    """This machine's CPU: `nproc` gloo processes (default 4) on one host."""
    if nodes not in (None, 1):
        raise ConfigError("local-cpu describes this one machine (nodes=1); for several hosts use "
                          "Cluster(gpu='cpu', nodes=..., gpus_per_node=...)")
    if nproc is not None and num_gpus is not None and nproc != num_gpus:
        raise ConfigError(f"local-cpu: nproc={nproc} and num_gpus={num_gpus} disagree; give one")
    n = nproc if nproc is not None else (num_gpus if num_gpus is not None else 4)
    kwargs: dict[str, Any] = dict(name="local-cpu")
    kwargs.update(fields)
    return Cluster(gpu=cpu_gpu_spec(n), nodes=1, gpus_per_node=n, **kwargs)


PRESETS: dict[str, Callable[..., Cluster]] = {
    "dgx-a100": _server_preset("dgx-a100", "a100-80gb", 8, 1, "DGX A100: 8x A100 80GB, NVSwitch, 8x 200G HDR."),
    "hgx-a100-40gb": _server_preset("hgx-a100-40gb", "a100-40gb", 8, 1, "HGX A100 40GB (AWS p4d): 8 GPUs, NVSwitch."),
    "dgx-h100": _server_preset("dgx-h100", "h100-sxm", 8, 1, "DGX/HGX H100: 8x H100 SXM, NVSwitch, 8x 400G NDR."),
    "grand-teton-h100": _server_preset("grand-teton-h100", "h100-sxm-96gb-500w", 8, 1,
                                       "Meta Grand Teton: 8x H100 SXM 96GB HBM2e at a 500 W limit, NVSwitch, "
                                       "400G RDMA per GPU (the torchtitan paper's hosts)."),
    "h100-pcie-8": _server_preset("h100-pcie-8", "h100-pcie", 8, 1, "8x H100 PCIe in one server, no NVLink."),
    "h800-8": _server_preset("h800-8", "h800", 8, 1, "HGX H800: 8x H800 (NVLink cut to 400 GB/s), 400G IB."),
    "dgx-h800": _server_preset("dgx-h800", "h800", 8, 1,
                               "DGX/HGX H800 (DeepSeek-V3's nodes): 8x H800 (NVLink cut to 400 GB/s), 8x 400G IB."),
    "hgx-h200": _server_preset("hgx-h200", "h200", 8, 1, "HGX H200: 8x H200, NVSwitch, 8x 400G NDR."),
    "gh200-4": _server_preset("gh200-4", "gh200", 4, 1,
                              "4x GH200 Grace Hopper per node, NVLink all-to-all (no NVSwitch), one 200 Gb/s "
                              "Slingshot-11 NIC per GPU (HPE Cray EX254n: CSCS Alps)."),
    "dgx-b200": _server_preset("dgx-b200", "b200", 8, 1, "DGX/HGX B200: 8x B200, NVLink5 NVSwitch."),
    "dgx-b300": _server_preset("dgx-b300", "b300", 8, 1,
                               "DGX/HGX B300: 8x B300 (Blackwell Ultra), NVLink5 NVSwitch, 8x 800G ConnectX-8."),
    "gb200-nvl72": _server_preset("gb200-nvl72", "gb200", 4, 18,
                                  "GB200 NVL72: trays of 4 GPUs, 18 trays per 72-GPU NVLink domain; nodes = trays."),
    "gb300-nvl72": _server_preset("gb300-nvl72", "gb300", 4, 18,
                                  "GB300 NVL72: trays of 4 Blackwell Ultra GPUs, 18 trays per 72-GPU NVLink domain; "
                                  "nodes = trays; 800G ConnectX-8 per GPU."),
    "mi300x-8": _server_preset("mi300x-8", "mi300x", 8, 1, "8x MI300X on xGMI full mesh, 8x 400G NDR."),
    "mi325x-8": _server_preset("mi325x-8", "mi325x", 8, 1, "8x MI325X on xGMI full mesh."),
    "l40s-8": _server_preset("l40s-8", "l40s", 8, 1, "8x L40S PCIe, no NVLink."),
    "local-cpu": _local_cpu,
}
