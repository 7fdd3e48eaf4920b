"""Which clusters may hide communication behind compute (GPUSpec.comm_overlap).

On GPUs, NCCL runs beside the compute kernels, so DP gradient reduction hides behind backward.
CPU processes reduce with gloo on the same cores that compute, so nothing is hidden: the
local-cpu cluster's DP (and FSDP) time is exposed in full.
"""

from __future__ import annotations

import dataclasses

import pytest

import meshplan as mp
from meshplan.errors import ConfigError

SEQ, BATCH = 128, 16


@pytest.fixture(scope="module")
def model():
    return mp.models.build("tiny-llama", seq_len=SEQ, device="meta")


def _dp_times(model, cluster, **layout):
    e = mp.estimate(model, cluster, dict(tp=1, pp=1, mbs=4, **layout), seq_len=SEQ, global_batch=BATCH)
    return e.time_s["dp"], e.comm_s["dp"]


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_cpu_processes_expose_all_dp_communication(model, zero):
    cpu = mp.Cluster.preset("local-cpu")
    assert cpu.gpu.comm_overlap is False
    exposed, total = _dp_times(model, cpu, dp=4, zero=zero)
    assert total > 0 and exposed == pytest.approx(total, rel=1e-9)


def test_same_cluster_with_overlap_hides_part_of_it(model):
    cpu = mp.Cluster.preset("local-cpu")
    overlapping = dataclasses.replace(cpu, gpu=dataclasses.replace(cpu.gpu, comm_overlap=True))
    exposed, total = _dp_times(model, overlapping, dp=4, zero=1)
    assert exposed < total
    slow = mp.estimate(model, cpu, dict(tp=1, pp=1, dp=4, zero=1, mbs=4), seq_len=SEQ, global_batch=BATCH)
    fast = mp.estimate(model, overlapping, dict(tp=1, pp=1, dp=4, zero=1, mbs=4), seq_len=SEQ, global_batch=BATCH)
    assert slow.step_time_s - fast.step_time_s == pytest.approx(total - exposed, rel=1e-6)


def test_gpus_overlap_by_default_and_flag_is_validated():
    assert mp.Cluster.preset("dgx-h100").gpu.comm_overlap is True
    spec = mp.Cluster.preset("dgx-h100").gpu.to_dict()
    spec["comm_overlap"] = "yes"
    with pytest.raises(ConfigError, match="comm_overlap"):
        type(mp.Cluster.preset("dgx-h100").gpu).from_dict(spec)
