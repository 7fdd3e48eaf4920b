"""benchmarks/kernels.py --cpu-smoke runs end to end under the Triton interpreter."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import sys

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


def load_script():
    name = "meshplan_benchmarks_kernels"
    if name not in sys.modules:  # dataclasses need their module registered
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_cpu_smoke_writes_a_table_and_json(tmp_path, capsys):
    bench = load_script()
    from meshplan.kernels import use_backend

    with use_backend("auto"):  # main() selects triton itself; restore the choice afterwards
        assert bench.main(["--cpu-smoke", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| rms_norm | smoke |" in out and "fused_linear_cross_entropy" in out
    (md,) = tmp_path.glob("kernels-*-cpu-triton-interpreter.md")
    report = json.loads(md.with_suffix(".json").read_text())
    kernels = {r["kernel"] for r in report["rows"]}
    assert kernels == {"rms_norm", "rms_norm_residual", "swiglu_packed", "rope",
                       "moe_permute_unpermute", "fused_linear_cross_entropy"}
    for r in report["rows"]:
        assert r["fused_fwd_ms"] > 0 and r["eager_bwd_ms"] > 0


def test_without_cuda_the_full_run_skips_with_a_message(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the full run would benchmark")
    bench = load_script()
    assert bench.main([]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
