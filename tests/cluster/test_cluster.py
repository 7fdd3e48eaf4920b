"""Tests for meshplan.cluster: GPU table, presets, constructors, JSON, placement()."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan import cluster as mc
from meshplan.cluster import GPUS, Cluster, GPUSpec, cpu_gpu_spec, gpu
from meshplan.errors import ConfigError, LayoutError, MeshplanError, UnknownNameError

HARDWARE_CSV = Path(__file__).resolve().parents[2] / "meshplan" / "data" / "hardware.csv"

REQUIRED_GPUS = ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h800", "h200", "b200", "gb200",
                 "mi300x", "mi325x", "l40s", "cpu")
REQUIRED_PRESETS = ("dgx-a100", "dgx-h100", "hgx-h200", "dgx-b200", "gb200-nvl72", "mi300x-8",
                    "h800-8", "l40s-8", "local-cpu")

# hardware.csv `gpu` column -> our id
CSV_IDS = {
    "NVIDIA H100 SXM5 80GB": "h100-sxm",
    "NVIDIA H100 PCIe 80GB": "h100-pcie",
    "NVIDIA H200 SXM 141GB": "h200",
    "NVIDIA A100 SXM4 40GB": "a100-40gb",
    "NVIDIA A100 SXM4 80GB": "a100-80gb",
    "NVIDIA B200 (HGX/DGX, 1000 W)": "b200",
    "NVIDIA GB200 (NVL72, per GPU)": "gb200",
    "AMD Instinct MI300X": "mi300x",
    "AMD Instinct MI325X": "mi325x",
    "NVIDIA L40S": "l40s",
}
# CSV column -> function of a spec giving the same quantity
CSV_COLUMNS = {
    "bf16_dense_tflops": lambda s: s.bf16_tflops,
    "fp8_dense_tflops": lambda s: s.fp8_tflops,
    "hbm_gb": lambda s: s.hbm_gb,
    "hbm_tb_s": lambda s: s.hbm_tb_s,
    "tdp_w": lambda s: s.tdp_w,
    "scaleup_gb_s_per_gpu_unidir": lambda s: s.scaleup_gb_s,
    "scaleup_domain_gpus": lambda s: s.scaleup_domain,
    "internode_nic_gbit_per_gpu_typical": lambda s: s.nic_gbit,
    "achieved_bf16_gemm_tflops": lambda s: s.gemm_efficiency * s.bf16_tflops,
    "achieved_bf16_gemm_frac_peak": lambda s: s.gemm_efficiency,
    "achieved_fp8_gemm_tflops": lambda s: s.fp8_gemm_efficiency * s.fp8_tflops,
    "achieved_intranode_allreduce_busbw_gb_s": lambda s: s.scaleup_busbw_gb_s,
    "achieved_internode_busbw_per_nic_gb_s": lambda s: s.nic_busbw_gb_s,
    "price_usd_per_gpu_hr_ondemand": lambda s: s.price_usd_per_hour,
}
# Deliberate departures from a plain CSV number, each explained in cluster.py.
CSV_EXCEPTIONS = {
    # PCIe cards: the server's PCIe tree is modelled as the scale-up domain (CSV: 1, no NVLink).
    ("l40s", "scaleup_domain_gpus"),
}


def _plain_number(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


# ---- the GPU table ------------------------------------------------------------------------------
def test_required_gpu_ids_present():
    assert set(REQUIRED_GPUS) <= set(GPUS)
    for key, spec in GPUS.items():
        assert spec.id == key
        assert gpu(key) is spec


@pytest.mark.parametrize("gpu_id", sorted(GPUS))
def test_every_gpu_is_sane_and_builds_a_cluster(gpu_id):
    spec = GPUS[gpu_id]
    assert 0 < spec.gemm_efficiency <= 1
    assert spec.scaleup in mc.SCALEUP_KINDS
    assert (spec.fp8_tflops is None) == (spec.fp8_gemm_efficiency is None)
    if spec.fp8_tflops is not None:
        assert spec.fp8_tflops > spec.bf16_tflops
    # achieved all-reduce cannot beat what a ring over the line rate could carry in-switch
    assert spec.scaleup_busbw_gb_s <= 2 * spec.scaleup_gb_s
    assert spec.nic_busbw_gb_s * 8 <= spec.nic_gbit     # achieved below line rate
    assert spec.sources
    c = Cluster(gpu=gpu_id)
    assert c.gpu is spec or gpu_id == "cpu"
    assert c.num_gpus == c.nodes * c.gpus_per_node
    assert 0 < c.usable_memory_gb < spec.hbm_gb


def test_mfu_relevant_efficiencies_match_the_mamf_table():
    assert GPUS["h100-sxm"].gemm_efficiency == pytest.approx(0.803, abs=5e-4)
    assert GPUS["b200"].gemm_efficiency == pytest.approx(0.776, abs=5e-4)
    assert GPUS["gb200"].gemm_efficiency == pytest.approx(0.729, abs=5e-4)
    assert GPUS["mi300x"].gemm_efficiency == pytest.approx(0.511, abs=5e-3)
    # FP8 GEMM is ~1.77x BF16 on H100 (cost_models.md §9)
    h = GPUS["h100-sxm"]
    ratio = h.fp8_tflops * h.fp8_gemm_efficiency / (h.bf16_tflops * h.gemm_efficiency)
    assert ratio == pytest.approx(1402.6 / 794.5)


def test_h800_is_h100_with_cut_nvlink():
    h800, h100 = GPUS["h800"], GPUS["h100-sxm"]
    for name in ("bf16_tflops", "fp8_tflops", "hbm_gb", "hbm_tb_s", "gemm_efficiency", "scaleup_domain"):
        assert getattr(h800, name) == getattr(h100, name)
    assert h800.scaleup_gb_s == pytest.approx(200.0)          # 400 GB/s bidirectional
    assert h800.scaleup_busbw_gb_s == pytest.approx(370 * 200 / 450)
    assert h800.nvls_busbw_gb_s == pytest.approx(480 * 200 / 450)
    assert 155 < h800.scaleup_busbw_gb_s < 170               # DeepSeek-V3: ~160 GB/s NVLink


def test_blackwell_busbw_estimates_use_the_b300_proxy():
    for gpu_id in ("b200", "gb200"):
        assert GPUS[gpu_id].scaleup_busbw_gb_s == pytest.approx(695)
        assert GPUS[gpu_id].nvls_busbw_gb_s == pytest.approx(845)
    assert GPUS["gb200"].scaleup_domain == 72 and GPUS["gb200"].node_gpus == 4


def test_values_agree_with_hardware_csv_plain_numbers():
    rows = {r["gpu"]: r for r in csv.DictReader(HARDWARE_CSV.open())}
    assert set(CSV_IDS) <= set(rows), "a CSV row was renamed; update CSV_IDS"
    checked = 0
    for csv_name, gpu_id in CSV_IDS.items():
        spec = GPUS[gpu_id]
        for column, read in CSV_COLUMNS.items():
            value = _plain_number(rows[csv_name][column].strip())
            if value is None or (gpu_id, column) in CSV_EXCEPTIONS:
                continue
            ours = read(spec)
            assert ours is not None, (gpu_id, column)
            rel = 2e-3 if column.startswith("achieved") else 1e-9
            assert ours == pytest.approx(value, rel=rel), (gpu_id, column, ours, value)
            checked += 1
    assert checked > 70


@pytest.mark.parametrize("gpu_id, column, cell_text, attr, lo, hi", [
    ("a100-80gb", "achieved_intranode_allreduce_busbw_gb_s", "230-250", "scaleup_busbw_gb_s", 230, 250),
    ("h100-sxm", "achieved_intranode_allreduce_busbw_gb_s", "~370 ring", "scaleup_busbw_gb_s", 370, 370),
    ("h100-sxm", "achieved_intranode_allreduce_busbw_gb_s", "~480 NVLS", "nvls_busbw_gb_s", 480, 480),
    ("h100-sxm", "achieved_internode_busbw_per_nic_gb_s", "46-48", "nic_busbw_gb_s", 46, 48),
    ("h200", "achieved_intranode_allreduce_busbw_gb_s", "~475 (NVLS", "nvls_busbw_gb_s", 475, 475),
    ("h100-pcie", "achieved_intranode_allreduce_busbw_gb_s", "35-45", "scaleup_busbw_gb_s", 35, 45),
    ("mi300x", "achieved_intranode_allreduce_busbw_gb_s", "312.9 (8 GPUs)", "scaleup_busbw_gb_s", 312.9, 312.9),
    ("mi300x", "scaleup_interconnect", "64 GB/s per peer", "per_peer_gb_s", 64, 64),
    ("mi300x", "scaleup_gb_s_per_gpu_unidir", "448 aggregate", "scaleup_gb_s", 448, 448),
    ("a100-40gb", "achieved_internode_busbw_per_nic_gb_s", "~24", "nic_busbw_gb_s", 24, 24.5),
    ("b200", "hbm_gb", "180 (192 physical)", "hbm_gb", 180, 180),
    ("gb200", "tdp_w", "~1200", "tdp_w", 1200, 1200),
])
def test_values_agree_with_hardware_csv_annotated_cells(gpu_id, column, cell_text, attr, lo, hi):
    rows = {CSV_IDS.get(r["gpu"]): r for r in csv.DictReader(HARDWARE_CSV.open())}
    assert cell_text in rows[gpu_id][column]          # the cell still says what we read from it
    assert lo <= getattr(GPUS[gpu_id], attr) <= hi


def test_gpu_aliases_and_unknown_names():
    assert gpu("H100") is GPUS["h100-sxm"]
    assert gpu("h100") is GPUS["h100-sxm"]
    assert gpu(" H100_SXM ") is GPUS["h100-sxm"]
    assert gpu("a100") is GPUS["a100-80gb"]
    assert gpu("MI300X") is GPUS["mi300x"]
    assert gpu(GPUS["b200"]) is GPUS["b200"]
    with pytest.raises(UnknownNameError) as info:
        gpu("h300")
    err = info.value
    assert isinstance(err, KeyError) and isinstance(err, ValueError)
    assert err.kind == "GPU" and err.name == "h300"
    assert set(err.known) == set(GPUS)                    # canonical ids, not aliases
    assert "h100-sxm" in str(err) and "a100-80gb" in str(err) and "'h100'" not in str(err)
    with pytest.raises(ConfigError):
        gpu(42)


def test_gpuspec_validation():
    base = GPUS["h100-sxm"]
    for bad in (dict(gemm_efficiency=1.2), dict(gemm_efficiency=0.0), dict(scaleup="infiniband"),
                dict(bf16_tflops=-1.0), dict(hbm_gb=float("nan")), dict(scaleup_domain=0),
                dict(fp8_tflops=None), dict(id=""), dict(price_usd_per_hour=-2.0), dict(node_gpus=2.5)):
        with pytest.raises(ConfigError):
            dataclasses.replace(base, **bad)
    no_fp8 = dataclasses.replace(base, id="x", fp8_tflops=None, fp8_gemm_efficiency=None)
    assert no_fp8.fp8_tflops is None


# ---- presets ------------------------------------------------------------------------------------
def test_required_presets_present():
    assert set(REQUIRED_PRESETS) <= set(Cluster.presets())
    assert Cluster.presets() == sorted(Cluster.presets())


@pytest.mark.parametrize("name", Cluster.presets())
def test_every_preset_builds_and_round_trips(name):
    c = Cluster.preset(name)
    assert c.name == name
    assert c.num_gpus % c.scaleup_domain == 0 and c.num_domains >= 1
    assert Cluster.from_json(c.to_json()) == c
    assert len(c.fingerprint()) == 12 and c.fingerprint() == Cluster.from_json(c.to_json()).fingerprint()
    text = c.describe()
    assert name in text and str(c.num_gpus) in text


def test_preset_shapes():
    h = Cluster.preset("dgx-h100", nodes=16)
    assert (h.num_gpus, h.gpus_per_node, h.scaleup_domain, h.num_domains) == (128, 8, 8, 16)
    assert h.gpu is GPUS["h100-sxm"] and h.nic_gb_s == GPUS["h100-sxm"].nic_busbw_gb_s
    assert (h.net_latency_us, h.scaleup_latency_us, h.base_latency_us) == (14.0, 3.4, 8.4)
    assert h.price_usd_per_hour == pytest.approx(128 * 6.16)
    assert Cluster.preset("dgx-h100", num_gpus=64).nodes == 8
    assert Cluster.preset("DGX_H100", nodes=2) == Cluster.preset("dgx-h100", nodes=2)
    assert Cluster.preset("dgx-a100").gpu is GPUS["a100-80gb"]
    assert Cluster.preset("mi300x-8").base_latency_us == mc.RCCL_BASE_LATENCY_US
    assert Cluster.preset("l40s-8").scaleup_latency_us == mc.NCCL_PCIE_HOP_US
    assert Cluster.preset("h800-8", nodes=4).gpu is GPUS["h800"]


def test_gb200_nvl72_domains_span_trays():
    rack = Cluster.preset("gb200-nvl72")
    assert (rack.nodes, rack.gpus_per_node, rack.num_gpus, rack.scaleup_domain) == (18, 4, 72, 72)
    two = Cluster.preset("gb200-nvl72", nodes=36)
    assert (two.num_gpus, two.scaleup_domain, two.num_domains) == (144, 72, 2)
    small = Cluster.preset("gb200-nvl72", nodes=4)           # part of one rack: all NVLinked
    assert (small.num_gpus, small.scaleup_domain, small.num_domains) == (16, 16, 1)
    with pytest.raises(ConfigError, match="multiple of 18 nodes") as info:
        Cluster.preset("gb200-nvl72", nodes=20)
    assert "[4, 8, 16, 20, 40]" in str(info.value)
    # 16 trays used per rack (2 spares): say so with scaleup_domain
    spares = Cluster.preset("gb200-nvl72", nodes=32, scaleup_domain=64)
    assert spares.num_domains == 2


def test_local_cpu_preset():
    c = Cluster.preset("local-cpu")
    assert (c.nodes, c.gpus_per_node, c.scaleup_domain) == (1, 4, 4)
    assert c.gpu.id == "cpu" and c.gpu.scaleup == "loopback" and c.gpu.fp8_tflops is None
    two = Cluster.preset("local-cpu", nproc=2)
    assert two.gpus_per_node == 2 and two.num_gpus == 2
    assert two.gpu.bf16_tflops == pytest.approx(mc.CPU_HOST_BF16_TFLOPS / 2)
    assert two.gpu.fp32_tflops == pytest.approx(mc.CPU_HOST_FP32_TFLOPS / 2)
    assert two.gpu.scaleup_busbw_gb_s == pytest.approx(2 * c.gpu.scaleup_busbw_gb_s)
    if hasattr(os, "sysconf"):
        ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        assert two.gpu.hbm_gb == pytest.approx(ram_gb / 2)
    # the 4-byte all-reduce amid compute: ~1.15 ms over 4 ranks, ~0.95 ms within a pair
    assert 0 <= c.scaleup_latency_us < 500 and 100 <= c.base_latency_us < 2000
    assert 800 <= c.base_latency_us + 6 * c.scaleup_latency_us <= 1500
    assert Cluster.preset("local-cpu", num_gpus=2) == two
    # Cluster(gpu="cpu") sizes the per-process spec to the node
    assert Cluster(gpu="cpu", gpus_per_node=2).gpu == two.gpu
    two_hosts = Cluster(gpu="cpu", num_gpus=16, nodes=2)
    assert two_hosts.gpus_per_node == 8 and two_hosts.gpu == cpu_gpu_spec(8)
    assert two_hosts.net_latency_us == mc.CPU_NET_HOP_US and two_hosts.num_domains == 2
    assert two.replace(gpus_per_node=3).gpu == cpu_gpu_spec(3)
    with pytest.raises(ConfigError, match="one machine"):
        Cluster.preset("local-cpu", nodes=2)
    with pytest.raises(ConfigError, match="disagree"):
        Cluster.preset("local-cpu", nproc=2, num_gpus=4)
    with pytest.raises(ConfigError):
        cpu_gpu_spec(0)


def test_unknown_preset_and_bad_options():
    with pytest.raises(UnknownNameError) as info:
        Cluster.preset("dgx-h300")
    assert set(info.value.known) == set(Cluster.presets())
    assert "dgx-h100" in str(info.value) and "gb200-nvl72" in str(info.value)
    with pytest.raises(ConfigError, match="nproc"):
        Cluster.preset("dgx-h100", nproc=2)
    with pytest.raises(ConfigError, match="gpu"):
        Cluster.preset("dgx-h100", gpu="b200")


# ---- constructors and validation ----------------------------------------------------------------
def test_constructors_agree():
    a = Cluster(gpu="h100-sxm", num_gpus=16, gpus_per_node=8)
    b = Cluster(gpu=GPUS["h100-sxm"], nodes=2, gpus_per_node=8)
    c = Cluster(gpu="H100", nodes=2)                          # gpus_per_node from the GPU
    assert a == b == c
    assert (a.nodes, a.num_gpus, a.scaleup_domain, a.name) == (2, 16, 8, "8xh100-sxm")
    assert a.memory_reserved_gb == pytest.approx(
        mc.CUDA_CONTEXT_GB + mc.NCCL_BUFFERS_GB + mc.ALLOCATOR_FRAGMENTATION_FRAC * 80)
    assert a.usable_memory_gb == pytest.approx(80 - a.memory_reserved_gb)
    part = Cluster(gpu="h100-sxm", num_gpus=4)                # part of one server
    assert (part.nodes, part.gpus_per_node, part.scaleup_domain) == (1, 4, 4)
    assert Cluster(gpu="h100-sxm", num_gpus=16, nodes=2) == a
    assert [f.name for f in dataclasses.fields(Cluster)] == [
        "gpu", "nodes", "gpus_per_node", "scaleup_domain", "nic_gb_s", "net_latency_us",
        "scaleup_latency_us", "base_latency_us", "memory_reserved_gb", "name"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.nodes = 3  # type: ignore[misc]
    assert hash(a) == hash(b)


def test_explicit_fields_override_defaults():
    c = Cluster(gpu="h100-sxm", nodes=4, nic_gb_s=23.5, net_latency_us=20.0, scaleup_domain=4,
                memory_reserved_gb=2.0, name="half-rail")
    assert (c.nic_gb_s, c.net_latency_us, c.scaleup_domain, c.num_domains) == (23.5, 20.0, 4, 8)
    assert c.usable_memory_gb == pytest.approx(78.0) and c.name == "half-rail"


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_gpus=12, gpus_per_node=8), "use num_gpus=8 or 16"),
    (dict(num_gpus=12, gpus_per_node=8), r"\[1, 2, 3, 4, 6, 12\]"),
    (dict(num_gpus=4, gpus_per_node=8, nodes=1), "not a whole number of 8-GPU nodes"),
    (dict(nodes=2, num_gpus=24, gpus_per_node=8), "give one of them"),
    (dict(nodes=0), "nodes must be a positive whole number"),
    (dict(nodes=True), "nodes must be a positive whole number"),
    (dict(gpus_per_node=2.5), "gpus_per_node"),
    (dict(scaleup_domain=3), r"do not tile a 8-GPU node; use scaleup_domain in \[1, 2, 4, 8\]"),
    (dict(scaleup_domain=16, nodes=2), "exceeds the 8-GPU nvswitch domain"),
    (dict(gpus_per_node=4, scaleup_domain=8, nodes=2), "cannot span nodes"),
    (dict(nic_gb_s=0.0), "nic_gb_s must be a positive number"),
    (dict(net_latency_us=-1.0), "net_latency_us"),
    (dict(memory_reserved_gb=80.0), "leaves nothing"),
    (dict(name=""), "name"),
])
def test_bad_counts_raise_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Cluster(gpu="h100-sxm", **kwargs)


def test_errors_are_meshplan_errors():
    with pytest.raises(MeshplanError):
        Cluster(gpu="nope")
    with pytest.raises(ConfigError):
        Cluster(gpu=3.0)  # type: ignore[arg-type]


def test_replace():
    c = Cluster.preset("dgx-h100", nodes=16)
    assert dataclasses.replace(c, nodes=4).num_gpus == 32
    assert c.replace(num_gpus=64).nodes == 8
    assert c.replace(nodes=2) == Cluster.preset("dgx-h100", nodes=2)
    b = c.replace(gpu="b200")                                 # defaults follow the new GPU
    assert b.gpu is GPUS["b200"] and b.memory_reserved_gb == Cluster(gpu="b200").memory_reserved_gb
    assert b.name == "8xb200"
    amd = c.replace(gpu="mi300x")
    assert amd.base_latency_us == mc.RCCL_BASE_LATENCY_US and amd.scaleup_latency_us == mc.RCCL_XGMI_HOP_US
    custom = c.replace(nic_gb_s=20.0).replace(gpu="b200")     # a value the user set is kept
    assert custom.nic_gb_s == 20.0
    nvl = Cluster.preset("gb200-nvl72").replace(nodes=36)     # the domain default re-derives
    assert nvl.scaleup_domain == 72 and nvl.num_domains == 2
    assert Cluster.preset("gb200-nvl72", nodes=2).replace(nodes=8).scaleup_domain == 32


# ---- JSON -----------------------------------------------------------------------------------------
def test_json_round_trip_custom_gpu(tmp_path):
    mine = dataclasses.replace(GPUS["h100-sxm"], id="h100-96gb-lab", name="Lab H100 96GB",
                               hbm_gb=96.0, price_usd_per_hour=None, nvls_busbw_gb_s=None)
    c = Cluster(gpu=mine, nodes=3, nic_gb_s=23.0, name="lab")
    text = c.to_json()
    doc = json.loads(text)
    assert doc["version"] == mc.CLUSTER_JSON_VERSION == 1
    assert doc["cluster"]["gpu"]["hbm_gb"] == 96.0 and doc["cluster"]["gpu"]["id"] == "h100-96gb-lab"
    back = Cluster.from_json(text)
    assert back == c and back.gpu == mine
    path = tmp_path / "lab.json"
    c.save(path)
    assert Cluster.load(path) == c
    assert Cluster.load(str(path)).fingerprint() == c.fingerprint()


def test_json_errors():
    good = json.loads(Cluster.preset("dgx-h100").to_json())
    with pytest.raises(ConfigError, match="does not parse"):
        Cluster.from_json("{nope")
    with pytest.raises(ConfigError, match="version 2"):
        Cluster.from_json(json.dumps(dict(good, version=2)))
    bad = json.loads(json.dumps(good))
    bad["cluster"]["gpu"]["warp_speed"] = 9
    with pytest.raises(ConfigError, match="warp_speed"):
        Cluster.from_json(json.dumps(bad))
    bad = json.loads(json.dumps(good))
    del bad["cluster"]["gpu"]["hbm_gb"]
    with pytest.raises(ConfigError, match="hbm_gb"):
        Cluster.from_json(json.dumps(bad))
    bad = json.loads(json.dumps(good))
    bad["cluster"]["nodes"] = -1
    with pytest.raises(ConfigError, match="nodes"):
        Cluster.from_json(json.dumps(bad))
    with pytest.raises(ConfigError):
        Cluster.from_json("[1, 2]")


def test_fingerprint_tracks_performance_not_names():
    c = Cluster.preset("dgx-h100", nodes=2)
    assert c.fingerprint() == c.replace(name="renamed").fingerprint()
    assert c.fingerprint() != c.replace(nic_gb_s=23.0).fingerprint()
    assert c.fingerprint() != c.replace(nodes=4).fingerprint()
    assert c.fingerprint() != Cluster.preset("h800-8", nodes=2).fingerprint()


def test_import_is_light_and_fingerprint_is_stable_across_processes():
    code = ("import sys, meshplan.cluster as m; assert 'torch' not in sys.modules, 'torch imported'; "
            "print(m.Cluster.preset('dgx-h100', nodes=2).fingerprint())")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == Cluster.preset("dgx-h100", nodes=2).fingerprint()


def test_package_modules_have_one_job_each():
    """meshplan/cluster/ is split along its jobs: each module says what it owns and stays small,
    and the package keeps every public name (plus the figures, e.g. mc.NCCL_PCIE_HOP_US)."""
    pkg = Path(mc.__file__).parent
    for path in sorted(pkg.glob("*.py")):
        text = path.read_text()
        assert text.lstrip().startswith('"""'), f"{path.name} has no docstring"
        assert len(text.splitlines()) <= 400, f"{path.name} is over 400 lines"
    for name in mc.__all__:
        assert hasattr(mc, name), name
    assert mc.PRESETS["dgx-h100"]().gpu is mc.GPUS["h100-sxm"]


# ---- placement ------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset, nodes, group, stride, expected", [
    ("dgx-h100", 16, 8, 1, (8, 1)),
    ("dgx-h100", 16, 16, 1, (8, 2)),
    ("dgx-h100", 16, 4, 8, (1, 4)),
    ("dgx-h100", 16, 4, 2, (4, 1)),
    ("dgx-h100", 16, 1, 1, (1, 1)),
    ("dgx-h100", 16, 128, 1, (8, 16)),
    ("dgx-h100", 16, 16, 8, (1, 16)),
    ("dgx-h100", 16, 2, 4, (2, 1)),
    ("dgx-h100", 16, 4, 4, (2, 2)),          # ranks 0,4 | 8,12
    ("dgx-h100", 16, 8, 16, (1, 8)),
    ("dgx-h100", 3, 3, 1, (1, 2)),           # groups 6,7 | 8 straddle: worst case
    ("dgx-h100", 3, 3, 8, (1, 3)),
    ("gb200-nvl72", 36, 8, 1, (8, 1)),       # TP inside a tray pair, inside one rack
    ("gb200-nvl72", 36, 72, 1, (72, 1)),     # the whole rack
    ("gb200-nvl72", 36, 144, 1, (72, 2)),
    ("gb200-nvl72", 36, 2, 72, (1, 2)),      # one rank in each rack
    ("gb200-nvl72", 36, 16, 9, (8, 2)),
    ("gb200-nvl72", 36, 18, 4, (18, 1)),     # stride crosses trays but stays in the rack
    ("gb200-nvl72", 36, 16, 1, (8, 2)),      # ranks 64..79 straddle the racks 8 | 8
    ("local-cpu", 1, 4, 1, (4, 1)),
    ("local-cpu", 1, 2, 2, (2, 1)),
])
def test_placement_cases(preset, nodes, group, stride, expected):
    c = Cluster.preset(preset) if preset == "local-cpu" else Cluster.preset(preset, nodes=nodes)
    assert c.placement(group, stride) == expected


def test_placement_rejects_bad_groups():
    c = Cluster.preset("dgx-h100", nodes=2)
    with pytest.raises(LayoutError, match=r"does not divide the 16 GPUs"):
        c.placement(3, 1)
    with pytest.raises(LayoutError, match="does not divide"):
        c.placement(4, 8)
    with pytest.raises(LayoutError, match="group_size"):
        c.placement(0, 1)
    with pytest.raises(LayoutError, match="stride"):
        c.placement(2, True)


def _oracle(num_gpus: int, domain: int, group: int, stride: int) -> tuple[int, int]:
    """Enumerate every group of the tiled world and apply placement()'s worst-case definition."""
    most, fewest = 0, group
    for base in range(num_gpus):
        if (base // stride) % group:
            continue                                         # not the first member of a group
        counts = Counter((base + k * stride) // domain for k in range(group))
        most, fewest = max(most, len(counts)), min(fewest, min(counts.values()))
    return fewest, most


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _cluster_and_group(draw):
    kind = draw(st.sampled_from(["h100-sxm", "gb200", "mi300x", "h100-pcie"]))
    if kind == "gb200":
        gpn = 4
        nodes = draw(st.sampled_from([1, 2, 3, 5, 9, 18, 36, 54]))
        domain = min(72, nodes * gpn) if nodes <= 18 or nodes % 18 == 0 else None
        choices = [d for d in _divisors(nodes * gpn) if d <= 72 and (d % gpn == 0 or gpn % d == 0)]
        if domain is None or draw(st.booleans()):
            domain = draw(st.sampled_from(choices))
    else:
        gpn = draw(st.sampled_from([1, 2, 4, 6, 8]))
        nodes = draw(st.integers(1, 12))
        domain = draw(st.sampled_from([d for d in _divisors(gpn) if d <= 8]))
    c = Cluster(gpu=kind, nodes=nodes, gpus_per_node=gpn, scaleup_domain=domain)
    stride = draw(st.sampled_from(_divisors(c.num_gpus)))
    group = draw(st.sampled_from(_divisors(c.num_gpus // stride)))
    return c, group, stride


@settings(max_examples=300, deadline=None)
@given(_cluster_and_group())
def test_placement_properties(args):
    c, group, stride = args
    per_domain, spanned = c.placement(group, stride)
    assert (per_domain, spanned) == _oracle(c.num_gpus, c.scaleup_domain, group, stride)
    assert 1 <= per_domain <= min(group, c.scaleup_domain)
    assert 1 <= spanned <= min(group, c.num_domains)
    assert per_domain * spanned <= group
    assert spanned >= math.ceil(group / c.scaleup_domain)   # a domain holds at most D ranks
    aligned = (stride % c.scaleup_domain == 0 or c.scaleup_domain % (group * stride) == 0
               or (c.scaleup_domain % stride == 0 and (group * stride) % c.scaleup_domain == 0))
    if aligned:
        assert per_domain * spanned == group
    if group * stride <= c.scaleup_domain and c.scaleup_domain % (group * stride) == 0:
        assert (per_domain, spanned) == (group, 1)
    if stride >= c.scaleup_domain:
        assert (per_domain, spanned) == (1, group)
