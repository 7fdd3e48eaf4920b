"""Numerical equivalence at 8 ranks (see test_parallel_numerics.py for what each case compares):
the one dense case that needs 8, PP x FSDP x TP, and test_ep_folding.py's MoE folding layouts that
need 8. Eight ranks on two cores start slowly, so every 8-rank case of the suite runs in this one
spawned group."""

from __future__ import annotations

import pytest

import test_ep_folding
from test_parallel_numerics import CASES_8, _cases, _check


@pytest.fixture(scope="module")
def world8():
    """Every 8-rank case of the suite in one spawned group: CASES_8 (numerics.equivalence) and
    test_ep_folding.CASES_8 (ep_workers.equivalence: MoE folding)."""
    import ep_workers
    from test_expert_parallel import _cases as moe_cases

    from meshplan.train.spawn import run_ranks
    cases = {name: dict(case, kind="dense") for name, case in _cases(CASES_8, 8).items()}
    cases |= moe_cases(test_ep_folding.CASES_8, 8)
    results = run_ranks(8, ep_workers.run_cases, cases, timeout_s=300)
    return {name: [r[name] for r in results] for name in cases}


def test_eight_ranks_pp_fsdp_tp(world8):
    _check(world8["pp2_fsdp2_tp2"])


@pytest.mark.parametrize("name", sorted(test_ep_folding.CASES_8))
def test_eight_ranks_moe_folding(world8, name):
    """MoE parallel folding at 8 ranks (the layouts and what they check: test_ep_folding.py)."""
    test_ep_folding._agreed(world8[name])
