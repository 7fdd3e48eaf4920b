"""Public API: estimate() on configs / profiles, the analytic profile, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import pickle
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
    assert est.layout.dp == 4
    assert abs(sum(est.time_s.values()) - est.step_time_s) < 1e-9


def test_estimate_fills_dp():
    cl = mp.Cluster.preset("dgx-h100", nodes=2)
    est = mp.estimate(LLAMA8B, cl, {"tp": 4}, seq_len=4096, global_batch=64)
    assert est.layout.dp == 4


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


def test_estimate_layout_is_the_layout_priced_and_a_plan_file_round_trips(tmp_path):
    cl = mp.Cluster.preset("dgx-h100", nodes=1)
    lay = mp.Layout(tp=2, pp=2, dp=2, mbs=2, recompute="selective", stage_layers=(15, 17))
    est = mp.estimate(LLAMA8B, cl, lay, seq_len=2048, global_batch=32)
    assert isinstance(est.layout, mp.Layout) and est.layout == lay
    assert est.layout.pp == 2 and est.layout.stage_layers == (15, 17)
    # asked for by the layout's dict, the estimate carries the same Layout
    assert mp.estimate(LLAMA8B, cl, lay.to_dict(), seq_len=2048, global_batch=32).layout == lay
    # written out it is the layout's dict (stage_layers a JSON list); read back, or sent to another
    # process (the what-if workers pickle), it is the Layout again
    d = json.loads(est.to_json())
    assert d["layout"] == json.loads(json.dumps(lay.to_dict())) and d["layout"]["stage_layers"] == [15, 17]
    assert mp.Estimate.from_dict(d).layout == lay and mp.Estimate.from_dict(d) == est
    assert pickle.loads(pickle.dumps(est)) == est
    with pytest.raises(TypeError, match="Estimate.layout must be a Layout"):
        dataclasses.replace(est, layout=lay.to_dict())

    # a plan (pp=2: the stage ILP's uneven split goes into the layout): the estimate prices the
    # plan's own layout, and a saved plan loads back to the same Plan and saves to the same bytes
    pl = mp.plan(LLAMA8B, cl, seq_len=2048, global_batch=32, fixed={"pp": 2, "tp": 1}, top_k=3)
    assert pl.estimate.layout == pl.layout and pl.runner_ups
    path = tmp_path / "plan.json"
    pl.save(path)
    text = path.read_text()
    assert json.loads(text)["estimate"]["layout"] == json.loads(text)["layout"]
    back = mp.Plan.load(path)
    assert back == pl and isinstance(back.estimate.layout, mp.Layout)
    back.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == text


def test_cli_estimate_and_lists(capsys):
    assert cli_main(["clusters"]) == 0
    assert "dgx-h100" in capsys.readouterr().out
    assert cli_main(["estimate", "--layout", "tp=3", "--model", "llama3-8b"]) == 2
    assert "tp=3" in capsys.readouterr().err
