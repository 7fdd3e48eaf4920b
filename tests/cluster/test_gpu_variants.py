"""The GPU variants published training runs were measured on: the torchtitan paper's power-capped
H100 96GB HBM2e (Meta Grand Teton), DeepSeek-V3's H800, and Blackwell Ultra (B300, GB300 NVL72);
and GH200 Grace Hopper, four to a node without an NVSwitch (CSCS Alps).
Each resolves by the names runs use, carries its sources, relates to its base part as the sources
say, agrees with its row in hardware.csv, and builds its preset."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from meshplan import cluster as mc
from meshplan.cluster import GPUS, Cluster, gpu

HARDWARE_CSV = Path(__file__).resolve().parents[2] / "meshplan" / "data" / "hardware.csv"

ALIASES = {
    "h100-sxm-96gb-500w": ("H100 SXM 96GB HBM2e @500W", "H100 SXM 96GB HBM2e @500W (Grand Teton)",
                           "h100-96gb-500w", "grand-teton-h100"),
    "h800": ("H800", "h800-sxm", "H800 SXM5", "h800_80gb"),
    "b300": ("B300", "b300-sxm", "HGX B300", "DGX_B300"),
    "gb300": ("GB300", "gb300-nvl72", "GB300 NVL72"),
    "gh200": ("GH200", "gh200-96gb", "Grace Hopper", "GH200 superchip"),
}
CSV_ROWS = {
    "h100-sxm-96gb-500w": "NVIDIA H100 SXM 96GB HBM2e (500 W limit, Grand Teton)",
    "h800": "NVIDIA H800 SXM5 80GB",
    "b300": "NVIDIA B300 (HGX/DGX B300, Blackwell Ultra)",
    "gb300": "NVIDIA GB300 (NVL72, per GPU)",
    "gh200": "NVIDIA GH200 Grace Hopper 96GB (4 per node)",
}
from test_cluster import CSV_COLUMNS  # noqa: E402 - the CSV column -> spec map the GPU table tests share


def _achieved(spec, fp8: bool = False) -> float:
    return spec.fp8_tflops * spec.fp8_gemm_efficiency if fp8 else spec.bf16_tflops * spec.gemm_efficiency


@pytest.mark.parametrize("gpu_id", sorted(ALIASES))
def test_variant_resolves_by_its_aliases_and_carries_sources(gpu_id):
    spec = GPUS[gpu_id]
    assert gpu(gpu_id) is spec
    for alias in ALIASES[gpu_id]:
        assert gpu(alias) is spec, alias
    assert len(spec.sources) > 80 and spec.price_source
    assert spec.to_dict() == GPUS[gpu_id].from_dict(spec.to_dict()).to_dict()


def test_500w_h100_is_h100_silicon_with_hbm2e_and_a_lower_gemm_rate():
    capped, h100 = GPUS["h100-sxm-96gb-500w"], GPUS["h100-sxm"]
    # torchtitan: 96GB HBM2e at 2.4 TB/s, a 500 W limit, 8 NVLinked GPUs per host, 400 Gb/s per GPU
    assert (capped.hbm_gb, capped.hbm_tb_s, capped.tdp_w) == (96.0, 2.4, 500.0)
    assert capped.hbm_gb > h100.hbm_gb and capped.hbm_tb_s < h100.hbm_tb_s
    assert (capped.scaleup, capped.scaleup_domain, capped.node_gpus, capped.nic_gbit) == ("nvswitch", 8, 8, 400.0)
    # nominal peaks are the SXM datasheet's (torchtitan computes MFU against them) ...
    assert (capped.bf16_tflops, capped.fp8_tflops) == (h100.bf16_tflops, h100.fp8_tflops)
    # ... and the achieved GEMM rate sits below the 700 W part's, above the H100 NVL's rated peak
    # share: between NVL (835.5 / 989 of SXM at 400 W) and SXM, as the torchtitan footnote says
    for fp8 in (False, True):
        ratio = _achieved(capped, fp8) / _achieved(h100, fp8)
        assert 835.5 / 989 < ratio < 1.0
        assert ratio == pytest.approx((835.5 + (989 - 835.5) / 3) / 989)   # the documented estimate
    assert 700 < _achieved(capped) < 725


def test_h800_is_h100_compute_with_cut_nvlink():
    h800, h100 = GPUS["h800"], GPUS["h100-sxm"]
    for name in ("bf16_tflops", "fp8_tflops", "hbm_gb", "hbm_tb_s", "gemm_efficiency", "fp8_gemm_efficiency"):
        assert getattr(h800, name) == getattr(h100, name), name
    assert h800.scaleup_gb_s == pytest.approx(400.0 / 2)        # 400 GB/s bidirectional (arXiv 2505.09343)
    assert h800.scaleup_gb_s < h100.scaleup_gb_s and h800.scaleup_busbw_gb_s < h100.scaleup_busbw_gb_s
    assert h800.nvls_busbw_gb_s < h100.nvls_busbw_gb_s
    assert 150 < h800.scaleup_busbw_gb_s < 170                   # DeepSeek-V3 §3.2.2: ~160 GB/s NVLink
    assert h800.nic_gbit == 400.0 and h800.nic_busbw_gb_s <= 50.0   # 400G IB CX7, "IB (50 GB/s)"
    assert "2505.09343" in h800.sources and "2412.19437" in h800.sources


def test_b300_is_blackwell_ultra_on_hgx():
    b300, b200 = GPUS["b300"], GPUS["b200"]
    assert (b300.hbm_gb, b300.hbm_tb_s) == (288.0, 8.0)
    assert b300.hbm_gb > b200.hbm_gb
    # dense BF16/FP8 and the NVLink5 line rate are B200's; the MAMF is B300's own measurement
    assert (b300.bf16_tflops, b300.fp8_tflops, b300.scaleup_gb_s) == (2250.0, 4500.0, 900.0)
    assert (b300.bf16_tflops, b300.fp8_tflops) == (b200.bf16_tflops, b200.fp8_tflops)
    assert _achieved(b300) == pytest.approx(1769.0) and _achieved(b300, fp8=True) == pytest.approx(3353.3)
    # measured on 8x B300 (nccl #2140), the figures B200/GB200 borrow as a proxy
    assert (b300.scaleup_busbw_gb_s, b300.nvls_busbw_gb_s) == (695.0, 845.0)
    assert (b300.scaleup_domain, b300.node_gpus) == (8, 8)
    # DGX B300: one 800 Gb/s ConnectX-8 per GPU, twice B200's 400G
    assert b300.nic_gbit == 800.0 and b300.nic_busbw_gb_s == pytest.approx(2 * b200.nic_busbw_gb_s)
    assert b300.nic_busbw_gb_s == mc.XDR800_BUSBW_GB_S


def test_gb300_is_gb200_compute_with_more_memory_and_faster_nics():
    gb300, gb200, b300 = GPUS["gb300"], GPUS["gb200"], GPUS["b300"]
    assert (gb300.bf16_tflops, gb300.fp8_tflops) == (gb200.bf16_tflops, gb200.fp8_tflops) == (2500.0, 5000.0)
    assert (gb300.hbm_gb, gb300.hbm_tb_s, gb300.tdp_w) == (288.0, 8.0, 1400.0)
    assert gb300.hbm_gb > gb200.hbm_gb and gb300.tdp_w > gb200.tdp_w
    assert (gb300.scaleup_domain, gb300.node_gpus, gb300.scaleup_gb_s) == (72, 4, 900.0)
    assert gb300.nic_gbit == 2 * gb200.nic_gbit == 800.0
    # estimate: B300's MAMF times the GB200/B200 uplift: above B300, within a few % of GB200 (the
    # same rated peaks; B300 measured 1.4 % above B200 in BF16 and 2.3 % below in FP8)
    for fp8 in (False, True):
        assert _achieved(gb300, fp8) > _achieved(b300, fp8)
        assert _achieved(gb300, fp8) == pytest.approx(_achieved(gb200, fp8), rel=0.05)
    assert _achieved(gb300) == pytest.approx(1769.0 * 1822.0 / 1745.0)


def test_gh200_is_h100_compute_on_a_four_gpu_nvlink_mesh():
    """CSCS's Alps node: H100 compute with 96 GB of HBM3 at 4 TB/s, four GPUs all-to-all on NVLink
    (150 GB/s per direction to each peer, no NVSwitch, so no NVLS), one 200 Gb/s NIC each. A pair of
    GPUs has one peer link; four use all three, and a collective over two nodes leaves the node on
    the NICs."""
    from meshplan.cost_models.comm import intra_busbw, p2p_time
    gh, h100 = GPUS["gh200"], GPUS["h100-sxm"]
    for name in ("bf16_tflops", "fp8_tflops", "gemm_efficiency", "fp8_gemm_efficiency"):
        assert getattr(gh, name) == getattr(h100, name), name
    assert (gh.hbm_gb, gh.hbm_tb_s) == (96.0, 4.0) and gh.hbm_tb_s > h100.hbm_tb_s
    assert (gh.scaleup, gh.scaleup_domain, gh.node_gpus, gh.per_peer_gb_s) == ("nvlink-mesh", 4, 4, 150.0)
    assert gh.scaleup_gb_s == 3 * gh.per_peer_gb_s and gh.nvls_busbw_gb_s is None
    assert gh.nic_gbit == 200.0 and gh.nic_busbw_gb_s * 8 < 200.0
    node = Cluster.preset("gh200-4", nodes=2)
    assert intra_busbw(node, 2, "all_gather") == pytest.approx(intra_busbw(node, 4, "all_gather") / 3)
    assert intra_busbw(node, 4, "all_reduce") == pytest.approx(gh.scaleup_busbw_gb_s)   # no NVLS
    # one peer link for a point-to-point transfer inside the node, the NIC across nodes
    inside, across = (p2p_time(1e9, node, cross_domain=c) for c in (False, True))
    assert inside < across and across == pytest.approx(1e9 / (gh.nic_busbw_gb_s * 1e9), rel=0.01)
    assert "cscs-docs" in gh.sources


@pytest.mark.parametrize("gpu_id", sorted(CSV_ROWS))
def test_variant_agrees_with_its_hardware_csv_row(gpu_id):
    rows = {r["gpu"]: r for r in csv.DictReader(HARDWARE_CSV.open(newline=""))}
    row, spec = rows[CSV_ROWS[gpu_id]], GPUS[gpu_id]
    assert f"meshplan id {gpu_id}." in row["notes"]
    assert row["spec_sources"] and row["measurement_sources"]
    checked = 0
    for column, read in CSV_COLUMNS.items():
        cell = row[column].strip()
        try:
            value = float(cell)
        except ValueError:       # annotated cells ("~712 (estimate: ...)") are read by people
            continue
        rel = 2e-3 if column.startswith("achieved") else 1e-9
        assert read(spec) == pytest.approx(value, rel=rel), (gpu_id, column)
        checked += 1
    assert checked >= 5
    for column in ("achieved_bf16_gemm_tflops", "achieved_fp8_gemm_tflops"):   # estimates say so
        if "estimate" in row[column]:
            approx = float(row[column].lstrip("~").split()[0])
            assert read_achieved(spec, column) == pytest.approx(approx, rel=2e-3)


def read_achieved(spec, column: str) -> float:
    return _achieved(spec, fp8=column == "achieved_fp8_gemm_tflops")


@pytest.mark.parametrize("name, gpu_id, gpn, nodes, domain", [
    ("grand-teton-h100", "h100-sxm-96gb-500w", 8, 1, 8),
    ("dgx-h800", "h800", 8, 1, 8),
    ("dgx-b300", "b300", 8, 1, 8),
    ("gb300-nvl72", "gb300", 4, 18, 72),
    ("gh200-4", "gh200", 4, 1, 4),
])
def test_variant_presets(name, gpu_id, gpn, nodes, domain):
    c = Cluster.preset(name)
    assert c.gpu is GPUS[gpu_id] and c.name == name
    assert (c.gpus_per_node, c.nodes, c.scaleup_domain) == (gpn, nodes, domain)
    assert c.nic_gb_s == GPUS[gpu_id].nic_busbw_gb_s
    assert Cluster.from_json(c.to_json()) == c
    assert 0 < c.usable_memory_gb < GPUS[gpu_id].hbm_gb


def test_dgx_h800_is_the_h800_8_server_and_gb300_racks_tile_like_gb200():
    assert Cluster.preset("dgx-h800", nodes=4).replace(name="h800-8") == Cluster.preset("h800-8", nodes=4)
    two = Cluster.preset("gb300-nvl72", nodes=36)
    assert (two.num_gpus, two.scaleup_domain, two.num_domains) == (144, 72, 2)
    part = Cluster.preset("gb300-nvl72", nodes=4)
    assert (part.num_gpus, part.scaleup_domain, part.num_domains) == (16, 16, 1)
    teton = Cluster.preset("grand-teton-h100", nodes=64)      # torchtitan's 512-GPU runs
    assert (teton.num_gpus, teton.num_domains) == (512, 64)
