"""Public API: estimate() on configs / profiles, the analytic profile, and the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

import meshplan as mp
from meshplan.cli import main as cli_main
from meshplan.errors import ConfigError, LayoutError, UnknownNameError
from meshplan.profiling.analytic import profile_from_config

LLAMA8B = dict(layers=32, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, vocab=128256)


def test_import_is_light():
    code = ("import time,sys; t=time.time(); import meshplan, meshplan.cluster, meshplan.cost_models, "
            "meshplan.profiling.analytic; print(time.time()-t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert float(out[0]) < 2.0
    assert out[1] == "False"          # planning imports no torch


def test_analytic_profile_counts_llama3_8b():
    p = profile_from_config(LLAMA8B)
    assert abs(p.total_params - 8.03e9) / 8.03e9 < 0.01
    assert p.num_layers == 32 and p.blocks[0].kv_heads == 8 and p.blocks[0].gated


def test_analytic_moe_profile_counts_mixtral():
    p = profile_from_config(dict(layers=32, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, vocab=32000,
                                 experts=8, topk=2, moe_ffn_hidden=14336))
    assert abs(p.total_params - 46.7e9) / 46.7e9 < 0.01
    assert abs(p.active_params - 12.9e9) / 12.9e9 < 0.02


def test_estimate_on_config_mapping():
    cl = mp.Cluster.preset("dgx-h100", nodes=1)
    est = mp.estimate(LLAMA8B, cl, {"tp": 2, "dp": 4}, seq_len=8192, global_batch=64)
    assert est.fits and 0.2 < est.mfu < 0.7
    assert est.layout["dp"] == 4
    assert abs(sum(est.time_s.values()) - est.step_time_s) < 1e-9


def test_estimate_fills_dp():
    cl = mp.Cluster.preset("dgx-h100", nodes=2)
    est = mp.estimate(LLAMA8B, cl, {"tp": 4}, seq_len=4096, global_batch=64)
    assert est.layout["dp"] == 4


def test_fp8_faster_than_bf16_on_h100():
    cl = mp.Cluster.preset("dgx-h100", nodes=1)
    a = mp.estimate(LLAMA8B, cl, {"tp": 1, "dp": 8}, seq_len=4096, global_batch=64, precision="bf16")
    b = mp.estimate(LLAMA8B, cl, {"tp": 1, "dp": 8}, seq_len=4096, global_batch=64, precision="fp8")
    assert b.step_time_s < a.step_time_s


def test_bad_inputs_raise_meshplan_errors():
    cl = mp.Cluster.preset("dgx-h100", nodes=1)
    with pytest.raises(LayoutError, match="GPUs"):
        mp.estimate(LLAMA8B, cl, {"tp": 2, "dp": 2}, seq_len=4096, global_batch=64)
    with pytest.raises(ConfigError, match="precision"):
        mp.estimate(LLAMA8B, cl, {"dp": 8}, seq_len=4096, global_batch=64, precision="int4")
    with pytest.raises(UnknownNameError, match="dgx-h100"):
        mp.estimate(LLAMA8B, "dgx-h9000", {"dp": 8}, seq_len=4096, global_batch=64)
    with pytest.raises(ConfigError, match="unknown model config"):
        profile_from_config(dict(LLAMA8B, hiden=3))


def test_estimate_json_round_trip():
    cl = mp.Cluster.preset("dgx-h100", nodes=1)
    est = mp.estimate(LLAMA8B, cl, {"tp": 2, "dp": 4}, seq_len=2048, global_batch=32)
    again = mp.Estimate.from_dict(__import__("json").loads(est.to_json()))
    assert again == est


def test_cli_estimate_and_lists(capsys):
    assert cli_main(["clusters"]) == 0
    assert "dgx-h100" in capsys.readouterr().out
    assert cli_main(["estimate", "--layout", "tp=3", "--model", "llama3-8b"]) == 2
    assert "tp=3" in capsys.readouterr().err
