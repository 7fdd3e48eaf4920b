"""CPU processes are charged the compute a GPU roofline misses: PyTorch's CPU
SDPA (backward ~6x forward), bf16 element-wise ops below copy bandwidth, per-op host overhead; all
scaled by the process's own matmul rate, so a calibrated (slower or faster) host moves them too."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from meshplan.cluster import Cluster
from meshplan.cost_models import constants as K
from meshplan.cost_models.compute import attention_time, elementwise_time
from meshplan.cost_models.device import is_cpu
from meshplan.cost_models.host import cpu_op_overhead, cpu_speed, cpu_thread_share


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


def test_cpu_gemm_pays_its_call_cost_and_grouped_gemm_is_a_loop_of_calls():
    from meshplan.cost_models.compute import gemm_time, grouped_gemm_time, matmul_rate
    from meshplan.cost_models.host import cpu_rate_scale
    cl = _cpu()
    call = K.CPU_GEMM_CALL_S / cpu_rate_scale(cl)
    # a CPU GEMM is its FLOPs at the matmul rate plus the library's fixed work per call
    t = gemm_time(256, 96, 128, cl)
    assert t == pytest.approx(2 * 256 * 96 * 128 / matmul_rate(cl, False) + call)
    # so the small expert GEMMs run well below the large ones' rate, as measured (~145 vs ~220 GFLOP/s)
    big = gemm_time(512, 512, 512, cl)
    small_eff = (2 * 256 * 96 * 128 / t) / (2 * 512 ** 3 / big)
    assert 0.55 < small_eff < 0.8
    # meshplan::grouped_mm loops over the experts on CPU: one call each, no row tiles
    assert grouped_gemm_time(256, 96, 128, cl, groups=4) == pytest.approx(4 * t)
    assert grouped_gemm_time(200, 96, 128, cl, groups=4) < grouped_gemm_time(256, 96, 128, cl, groups=4)
    # a GPU's grouped kernel still pays its fixed cost once and pads rows to tiles
    h100 = Cluster(gpu="h100-sxm", num_gpus=8, gpus_per_node=8)
    assert grouped_gemm_time(1000, 4096, 4096, h100, groups=4) == pytest.approx(
        grouped_gemm_time(1024, 4096, 4096, h100, groups=4), rel=1e-3)


def test_moe_permutation_runs_at_its_own_cpu_rate_and_gpu_unchanged():
    from meshplan.cost_models.compute import permute_time
    from meshplan.cost_models.host import cpu_rate_scale
    cl = _cpu()
    nbytes = 1e6
    assert permute_time(nbytes, cl) == pytest.approx(nbytes / (K.CPU_PERMUTE_GB_S_1T * 1e9 * cpu_rate_scale(cl)))
    h100 = Cluster(gpu="h100-sxm", num_gpus=8, gpus_per_node=8)
    assert permute_time(nbytes, h100) == elementwise_time(nbytes, h100)
    assert permute_time(0, cl) == 0.0
