"""`meshplan calibrate` (meshplan/cost_models/calibrate.py): the mapping of measurements onto a
Cluster (pure, synthetic numbers), the profile JSON, and one real --quick run on 2 gloo processes."""

from __future__ import annotations

import dataclasses

import json
import math
import time

import pytest

import meshplan as mp
from meshplan import models
from meshplan.cluster import Cluster
from meshplan.cost_models import calibrate as cb
from meshplan.cost_models.constants import HBM_EFF
from meshplan.errors import ConfigError, UnknownNameError

TINY = mp.profile_from_config(models.config("tiny-llama"), seq_len=256)
LAYOUT = {"tp": 1, "pp": 1, "dp": 2, "mbs": 2}


def _cal(*, device="cpu", nproc=2, bf16=0.8, fp32=0.3, fp8=None, copy=88.0, ar_busbw=3.0, ag_busbw=2.0,
         small_us=500.0) -> cb.Calibration:
    mm = [cb.MatmulResult(dtype="bfloat16", m=2048, n=2048, k=2048, seconds=0.01, tflops=bf16 / 2),
          cb.MatmulResult(dtype="bfloat16", m=4096, n=4096, k=4096, seconds=0.1, tflops=bf16)]
    if fp32:
        mm.append(cb.MatmulResult(dtype="float32", m=2048, n=2048, k=2048, seconds=0.05, tflops=fp32))
    if fp8:
        mm.append(cb.MatmulResult(dtype="float8_e4m3fn", m=8192, n=8192, k=8192, seconds=0.001, tflops=fp8))
    big = 16 << 20
    colls = [cb.CollectiveResult(op="all_reduce", nbytes=4, world=nproc, seconds=small_us * 1e-6,
                                 algbw_gb_s=0.0, busbw_gb_s=0.0),
             cb.CollectiveResult(op="all_reduce", nbytes=big, world=nproc, seconds=1.0, algbw_gb_s=1.0,
                                 busbw_gb_s=ar_busbw),
             cb.CollectiveResult(op="all_gather", nbytes=big, world=nproc, seconds=1.0, algbw_gb_s=1.0,
                                 busbw_gb_s=ag_busbw)]
    return cb.Calibration(device=device, backend="gloo" if device == "cpu" else "nccl", nproc=nproc, threads=2,
                          quick=True, matmul=tuple(mm), copy_gb_s=copy, collectives=tuple(colls),
                          torch_version="test", host="test", date="2026-01-01")


def test_cpu_mapping_follows_the_local_cpu_convention():
    base = Cluster.preset("local-cpu", nproc=2, base_latency_us=100.0, scaleup_latency_us=175.0)
    c = cb.calibrated_cluster(base, _cal())
    g = c.gpu
    assert g.bf16_tflops == pytest.approx(0.8 / 2) and g.fp32_tflops == pytest.approx(0.3 / 2)
    assert g.gemm_efficiency == 1.0
    assert g.hbm_tb_s == pytest.approx(88.0 / 1000 / 2) and g.scaleup_gb_s == pytest.approx(44.0)
    assert g.scaleup_busbw_gb_s == pytest.approx(3.0)
    # 500 us on 2 ranks = base 100 us (kept) + 2 ring steps of 200 us
    assert c.base_latency_us == base.base_latency_us == 100.0 and c.scaleup_latency_us == pytest.approx(200.0)
    assert (c.num_gpus, c.nic_gb_s, c.memory_reserved_gb) == (2, base.nic_gb_s, base.memory_reserved_gb)
    assert "calibrate" in g.sources and c.name == "local-cpu-calibrated"
    fast = cb.calibrated_cluster(base, _cal(small_us=40.0))       # below the base latency
    assert fast.base_latency_us + 2 * fast.scaleup_latency_us == pytest.approx(40.0)


def _with_pair(cal: cb.Calibration, world_us: float, pair_us: float) -> cb.Calibration:
    rows = [r for r in cal.collectives if r.nbytes != 4] + [
        cb.CollectiveResult(op="all_reduce_amid_compute", nbytes=4, world=cal.nproc, seconds=world_us * 1e-6,
                            algbw_gb_s=0.0, busbw_gb_s=0.0),
        cb.CollectiveResult(op="pair_all_reduce_amid_compute", nbytes=4, world=2, seconds=pair_us * 1e-6,
                            algbw_gb_s=0.0, busbw_gb_s=0.0)]
    return dataclasses.replace(cal, collectives=tuple(rows))


def test_cpu_latency_is_fitted_to_the_world_and_the_crossing_pairs():
    """With 4 ranks, calibrate also measures an all-reduce within pairs that cross amid compute;
    base + 2 hops is the pair's time and base + 6 hops the world's. A pair no faster than the
    world (the host's rescheduling wait dominates) gives one base and no hop. The preset base is
    not kept: a pair costs ~0.9 ms on the 2-core host with 4 processes, not 0.45."""
    base = Cluster.preset("local-cpu", nproc=4)
    c = cb.calibrated_cluster(base, _with_pair(_cal(nproc=4), world_us=1200.0, pair_us=900.0))
    assert c.base_latency_us + 2 * c.scaleup_latency_us == pytest.approx(900.0)
    assert c.base_latency_us + 6 * c.scaleup_latency_us == pytest.approx(1200.0)
    assert c.scaleup_latency_us == pytest.approx(75.0)
    flat = cb.calibrated_cluster(base, _with_pair(_cal(nproc=4), world_us=1100.0, pair_us=1300.0))
    assert flat.scaleup_latency_us == 0.0 and flat.base_latency_us == pytest.approx(1200.0)
    # a gloo send/recv (CP ring, PP) waits for the base as well on CPU; on GPUs only the hop
    from meshplan.cost_models.comm import p2p_time
    assert p2p_time(4, c, cross_domain=False) == pytest.approx((c.base_latency_us + c.scaleup_latency_us) * 1e-6, rel=1e-3)
    h100 = Cluster.preset("dgx-h100")
    assert p2p_time(4, h100, cross_domain=False) == pytest.approx(h100.scaleup_latency_us * 1e-6, rel=1e-2)


def test_estimate_uses_the_measured_numbers():
    base = Cluster.preset("local-cpu", nproc=2)
    kw = dict(seq_len=256, global_batch=8)
    preset = mp.estimate(TINY, base, LAYOUT, **kw)
    faster = mp.estimate(TINY, cb.calibrated_cluster(base, _cal(bf16=4 * 0.362, copy=4 * 44.0)), LAYOUT, **kw)
    slower = mp.estimate(TINY, cb.calibrated_cluster(base, _cal(bf16=0.362 / 4, copy=44.0 / 4)), LAYOUT, **kw)
    for e in (preset, faster, slower):
        assert math.isfinite(e.step_time_s) and e.step_time_s > 0
    assert faster.step_time_s < preset.step_time_s < slower.step_time_s
    # only the collective bandwidth differs: the exposed DP gradient reduction changes
    comm_fast = mp.estimate(TINY, cb.calibrated_cluster(base, _cal(bf16=0.362, copy=44.0, ar_busbw=50.0)), LAYOUT, **kw)
    comm_slow = mp.estimate(TINY, cb.calibrated_cluster(base, _cal(bf16=0.362, copy=44.0, ar_busbw=0.05)), LAYOUT, **kw)
    assert comm_fast.step_time_s < comm_slow.step_time_s


def test_gpu_mapping_keeps_peaks_and_sets_efficiencies():
    base = Cluster.preset("dgx-h100")
    c = cb.calibrated_cluster(base, _cal(device="NVIDIA H100 80GB HBM3", nproc=8, bf16=700.0, fp32=None,
                                         fp8=1200.0, copy=2900.0, ar_busbw=470.0, ag_busbw=360.0, small_us=30.0))
    g = c.gpu
    assert g.bf16_tflops == 989.0 and g.gemm_efficiency == pytest.approx(700 / 989)
    assert g.fp8_gemm_efficiency == pytest.approx(1200 / 1979)
    assert g.hbm_tb_s * HBM_EFF == pytest.approx(2.9)              # the model's achieved rate = measured
    assert (g.nvls_busbw_gb_s, g.scaleup_busbw_gb_s) == (470.0, 360.0)   # NVLS at 8 GPUs
    two = cb.calibrated_cluster(base, _cal(device="NVIDIA H100", nproc=2, fp32=None, ar_busbw=360.0))
    assert two.gpu.scaleup_busbw_gb_s == 360.0 and two.gpu.nvls_busbw_gb_s == base.gpu.nvls_busbw_gb_s
    with pytest.raises(ConfigError, match="local-cpu"):
        cb.calibrated_cluster(base, _cal())                         # CPU numbers onto an H100 spec


def test_profile_json_round_trip(tmp_path):
    cal = _cal()
    c = cb.calibrated_cluster(Cluster.preset("local-cpu", nproc=2), cal)
    path = tmp_path / "p.json"
    cb.save_profile(c, cal, path)
    loaded = Cluster.load(path)
    assert loaded == c and loaded.fingerprint() == c.fingerprint()
    assert cb.load_calibration(path) == cal
    assert json.loads(path.read_text())["calibration"]["matmul"][1]["tflops"] == 0.8
    bad = cal.to_dict() | {"version": 99}
    with pytest.raises(ConfigError, match="version"):
        cb.Calibration.from_dict(bad)


def test_bad_input():
    with pytest.raises(ConfigError, match="nproc"):
        cb.measure(nproc=0)
    with pytest.raises(UnknownNameError):
        cb.base_cluster("no-such-cluster", 2)
    with pytest.raises(ConfigError, match="--nproc 2"):
        cb.calibrated_cluster(Cluster.preset("local-cpu", nproc=2), _cal(nproc=4))
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            cb.run_calibration("dgx-h100", 2, quick=True)


def test_cli_quick_on_two_gloo_processes(tmp_path, capsys):
    from meshplan import cli
    out = tmp_path / "cluster-profile.json"
    t0 = time.perf_counter()
    assert cli.main(["calibrate", "--quick", "--nproc", "2", "--out", str(out)]) == 0
    elapsed = time.perf_counter() - t0
    captured = capsys.readouterr()
    assert "matmul" in captured.err and "all_reduce" in captured.err and "busbw" in captured.err
    assert "local-cpu-calibrated" in captured.out
    cluster = Cluster.load(out)
    cal = cb.load_calibration(out)
    assert cal.nproc == 2 and cal.backend == "gloo" and elapsed < 60
    assert {r.op for r in cal.collectives} == {"all_reduce", "all_gather", "all_reduce_amid_compute"}
    # the latency the cluster gets is the all-reduce amid compute (how training meets it on CPU)
    assert cal.training_latency_us() == cal.small_latency_us("all_reduce_amid_compute")
    hops = 2 * (cal.nproc - 1)
    t0 = cal.training_latency_us()
    assert cluster.base_latency_us + hops * cluster.scaleup_latency_us == pytest.approx(t0, rel=1e-6)
    for r in cal.collectives:
        if r.op == "all_reduce_amid_compute":
            continue
        assert r.seconds > 0 and r.busbw_gb_s == pytest.approx(
            r.nbytes / r.seconds / 1e9 * (1.0 if r.op == "all_reduce" else 0.5))
    assert cluster.gpu.bf16_tflops == pytest.approx(cal.best_tflops("bfloat16") / 2)
    est = mp.estimate(TINY, cluster, LAYOUT, seq_len=256, global_batch=8)
    ref = mp.estimate(TINY, Cluster.preset("local-cpu", nproc=2), LAYOUT, seq_len=256, global_batch=8)
    assert math.isfinite(est.step_time_s) and est.step_time_s > 0
    assert est.step_time_s != ref.step_time_s      # measured numbers never equal the preset's constants
