"""The planning policy (meshplan.planner.policy): what a precision name searches, the FP8 plan
of a device that only emulates FP8, and `api.plan` as a thin wrapper over `plan_profile`."""

from __future__ import annotations

import warnings

import pytest

import meshplan as mp
from meshplan.errors import ConfigError
from meshplan.ir.stack import resolve_stack
from meshplan.models.presets import config
from meshplan.ir.precision import Precision
from meshplan.planner.policy import ResolvedPrecision as Resolved, plan_profile, resolve_precision
from meshplan.profiling.analytic import profile_from_config

H100 = mp.Cluster.preset("dgx-h100", nodes=1)
A100 = mp.Cluster.preset("dgx-a100", nodes=1)
CPU = mp.Cluster.preset("local-cpu")
# profiles from presets' configs: no tracing, so the tests time the policy, not torch


def _profile(name: str, seq_len: int):
    return profile_from_config(config(name), seq_len=seq_len)


def test_precision_names():
    P = Precision
    assert resolve_precision("auto", H100) == Resolved((P.BF16, P.FP8))
    assert resolve_precision("auto", A100) == Resolved((P.BF16,))
    assert resolve_precision("fp16", A100) == Resolved((P.FP16,))
    assert resolve_precision(P.FP8, H100) == Resolved((P.FP8,))
    with pytest.warns(UserWarning, match="planned with BF16 costs"):
        assert resolve_precision("fp32", H100) == Resolved((P.BF16,), P.FP32)
    with pytest.warns(UserWarning, match="FP8 is emulated"):
        assert resolve_precision("fp8", CPU) == Resolved((P.BF16,), P.FP8)
    # the names resolve to the Precision type, not strings that merely compare equal
    res = resolve_precision("auto", H100)
    assert all(type(p) is P for p in res.search)
    with pytest.raises(ConfigError, match=r"no FP8 matrix units; use precision='bf16'"):
        resolve_precision("fp8", A100)
    with pytest.raises(ConfigError, match=r"precision 'int4': use one of fp32, bf16, fp16, fp8, auto"):
        resolve_precision("int4", H100)


def test_api_plan_warns_at_the_callers_line_and_fails_before_tracing():
    with pytest.warns(UserWarning, match="planned with BF16 costs") as rec:
        pl = mp.plan(_profile("tiny-llama", 64), CPU, seq_len=64, global_batch=8, precision="fp32")
    assert pl.precision == "fp32" and isinstance(pl, mp.Plan)
    assert any(w.filename == __file__ for w in rec), [w.filename for w in rec]
    # a bad precision is refused before the model is looked at
    with pytest.raises(ConfigError, match="precision 'int4'"):
        mp.plan(object(), H100, seq_len=4096, global_batch=64, precision="int4")


def test_api_plan_is_plan_profile_of_the_profile():
    prof = _profile("llama3-8b", 4096)
    kw = dict(seq_len=4096, global_batch=64, fixed={"tp": 2})
    direct = plan_profile(prof, H100, precision=resolve_precision("auto", H100), stack=resolve_stack(None), **kw)
    via_api = mp.plan(prof, H100, precision="auto", **kw)
    assert direct.layout == via_api.layout and direct.precision == via_api.precision
    assert direct.fp8_modules == via_api.fp8_modules and direct.placements == via_api.placements
    assert direct.estimate.step_time_s == via_api.estimate.step_time_s


def test_emulated_fp8_keeps_the_bf16_layout_and_chooses_modules():
    prof = _profile("tiny-llama", 64)
    stack = resolve_stack(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp8 = plan_profile(prof, CPU, seq_len=64, global_batch=8, precision=resolve_precision("fp8", CPU),
                           stack=stack)
    bf16 = plan_profile(prof, CPU, seq_len=64, global_batch=8, precision=resolve_precision("bf16", CPU), stack=stack)
    assert fp8.precision == "fp8" and fp8.notes.fp8_emulated and bf16.precision == "bf16"
    assert fp8.layout == bf16.layout and fp8.estimate.step_time_s == bf16.estimate.step_time_s
    # the placement ILP's own choice: some linears in FP8, the first and last blocks kept in BF16
    assert fp8.fp8_modules and not bf16.fp8_modules
    first, last = prof.blocks[prof.layers[0]].instances[0], prof.blocks[prof.layers[-1]].instances[-1]
    assert not any(m.startswith((first + ".", last + ".")) for m in fp8.fp8_modules)
