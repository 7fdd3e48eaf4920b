"""Time to train with a batch-size ramp-up: the ramp's smaller steps run below full speed."""

from __future__ import annotations

import pytest

import meshplan as mp
from meshplan.errors import ConfigError
from meshplan.profiling.analytic import profile_from_config
from meshplan.reports.whatif import WhatIf, rampup_seconds, whatif

SEQ, GB = 8192, 128


def _sweep(**kw):
    return whatif(profile_from_config(mp.models.config("llama3-8b"), seq_len=SEQ), tokens="1T", seq_len=SEQ,
                  global_batch=GB, gpus="b200", counts=(64,), progress=False, **kw)


def test_rampup_lengthens_time_to_train_by_its_slower_steps():
    plain, ramped = _sweep(), _sweep(rampup=(32, 32, 2_000_000))
    a, b = plain.rows[0], ramped.rows[0]
    assert b.days > a.days
    est = ramped.plan.estimate
    ramp_s, ramp_tokens = rampup_seconds(est, global_batch=GB, seq_len=SEQ, rampup=(32, 32, 2_000_000), tokens=1e12)
    assert ramp_tokens == pytest.approx(2_000_000 * SEQ, rel=0.01)
    # the ramp costs at most what its steps would cost at full-batch step time, at least their share
    full_speed = ramp_tokens / a.tokens_per_s
    steps = sum(n - f for (f, _, _), (n, _, _) in zip(_phases(), _phases()[1:]))
    assert full_speed <= ramp_s * (1 + 1e-12) and ramp_s <= steps * est.step_time_s   # equal when no fixed overhead
    assert b.days * 86400 == pytest.approx(ramp_s + (1e12 - ramp_tokens) / a.tokens_per_s, rel=1e-9)
    assert WhatIf.from_json(ramped.to_json()).rampup == (32, 32, 2_000_000)


def _phases():
    from meshplan.ir.rampup import BatchRampup
    return BatchRampup(32, 32, 2_000_000, final=GB).phases


def test_bad_rampup_is_refused_before_planning():
    with pytest.raises(ConfigError, match="increment"):
        _sweep(rampup=(32, 40, 1000))
    with pytest.raises(ConfigError, match="below the global batch"):
        _sweep(rampup=(256, 32, 1000))
