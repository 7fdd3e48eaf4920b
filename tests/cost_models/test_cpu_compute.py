"""CPU processes are charged the compute a GPU roofline misses (issue #16 part 3): PyTorch's CPU
SDPA (backward ~6x forward), bf16 element-wise ops below copy bandwidth, per-op host overhead; all
scaled by the process's own matmul rate, so a calibrated (slower or faster) host moves them too."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from meshplan.cluster import Cluster
from meshplan.cost_models import constants as K
from meshplan.cost_models.compute import (attention_time, cpu_op_overhead, cpu_speed, cpu_thread_share,
                                          elementwise_time, is_cpu)


def _cpu(nproc=4):
    return Cluster.preset("local-cpu").replace(gpus_per_node=nproc, scaleup_domain=nproc)


def test_cpu_attention_uses_measured_sdpa_rates():
    cl = _cpu()
    assert is_cpu(cl) and not is_cpu(Cluster(gpu="h100-sxm", num_gpus=8, gpus_per_node=8))
    f = 1e9
    fwd, bwd = attention_time(f, cl, backward=False), attention_time(f, cl, backward=True)
    assert bwd / fwd == pytest.approx(K.CPU_SDPA_FWD_GFLOPS_1T / K.CPU_SDPA_BWD_GFLOPS_1T)
    # 4 processes on 2 cores: half a core each, at local-cpu's matmul rate relative to the micro-benchmark's
    assert cpu_thread_share(cl) == pytest.approx(0.5)
    assert fwd == pytest.approx(f / (K.CPU_SDPA_FWD_GFLOPS_1T * 1e9 * 0.5 * cpu_speed(cl)))


def test_cpu_elementwise_below_copy_bandwidth_and_gpu_unchanged():
    cl = _cpu()
    nbytes = 1e8
    assert elementwise_time(nbytes, cl) > nbytes / (cl.gpu.hbm_tb_s * 1e12)
    h100 = Cluster(gpu="h100-sxm", num_gpus=8, gpus_per_node=8)
    assert elementwise_time(nbytes, h100) == pytest.approx(nbytes / (h100.gpu.hbm_tb_s * 1e12 * K.HBM_EFF))


def test_slower_calibrated_host_slows_every_cpu_mechanism_alike():
    cl = _cpu()
    slow = dataclasses.replace(cl, gpu=dataclasses.replace(cl.gpu, bf16_tflops=cl.gpu.bf16_tflops / 3))
    for fn in (lambda c: attention_time(1e9, c, backward=True), lambda c: elementwise_time(1e8, c)):
        assert fn(slow) / fn(cl) == pytest.approx(3.0)
    ops = [SimpleNamespace(kind="view")] * 10 + [SimpleNamespace(kind="linear")] * 5
    f, b = cpu_op_overhead(ops, cl)
    f3, b3 = cpu_op_overhead(ops, slow)
    assert f3 / f == pytest.approx(3.0) and b > f > 0


def test_default_job_estimate_charges_cpu_compute():
    import meshplan as mp
    cl = _cpu()
    m = mp.models.build("tiny-llama", device="meta")
    est = mp.estimate(m, cl, {"dp": 4, "mbs": 4, "recompute": "none"}, seq_len=128, global_batch=16)
    # SDPA backward, element-wise and dispatch put compute well above the matmul FLOPs alone
    flops_time = est.model_tflops_per_gpu * est.step_time_s * 1e12 / (cl.gpu.bf16_tflops * 1e12)
    assert est.time_s["compute"] > 3 * flops_time
