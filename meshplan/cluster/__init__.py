"""GPUs and clusters: the hardware facts the cost model reads.

A `GPUSpec` is one accelerator: dense peaks, memory, measured GEMM efficiency, its scale-up
fabric (NVSwitch, xGMI, PCIe, loopback) with a measured all-reduce bus bandwidth, its typical NIC,
power and price. A `Cluster` is `nodes` x `gpus_per_node` of one GPU plus the few numbers that
depend on the deployment (scale-up domain size, achieved NIC bandwidth, latencies, memory reserve).

The package, one job per module:

- constants.py: the sourced / measured figures (latencies, reserved memory, NIC busbw, local CPU);
- spec.py: `GPUSpec`, the fields of one accelerator and their checks;
- gpus.py: the sourced GPU table `GPUS`, `cpu_gpu_spec`, lookup by id or alias (`gpu`);
- topology.py: deployment defaults per GPU and shape, and collective-group placement arithmetic;
- cluster.py: the `Cluster` class (construction, placement, replace, JSON, fingerprint);
- presets.py: the named clusters (`PRESETS`, `Cluster.preset`).

Every figure comes from meshplan/data/hardware.csv (columns named in the comments) or
reference/cost_models.md; figures the CSV lacks are derived and marked "estimate" with the
reasoning. Bandwidths follow the nccl-tests definitions (busbw, GB/s = 1e9 B/s); TFLOPS are dense.

Importing this package is cheap: no torch, no measurements; the local-cpu numbers are constants
measured once and written down in constants.py. It imports nothing of meshplan but meshplan.errors.
"""

from __future__ import annotations

from meshplan.cluster.constants import *  # noqa: F403  (the figures, read as meshplan.cluster.X)
from meshplan.cluster.gpus import GPUS, SCALEUP_KINDS, GPUSpec, cpu_gpu_spec, gpu
from meshplan.cluster.cluster import CLUSTER_JSON_VERSION, Cluster
from meshplan.cluster.presets import PRESETS

__all__ = [
    "GPUSpec", "Cluster", "GPUS", "PRESETS", "gpu", "cpu_gpu_spec",
    "SCALEUP_KINDS", "CLUSTER_JSON_VERSION",
]
