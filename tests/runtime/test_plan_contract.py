"""The contract between planner, cost model and runtime at the scale plans are made for: with
torch's fake process group, `parallelize` runs real plans at their real world size in one
process on the meta device, and the parameters each rank then holds must be what the cost
model charged that rank for (its optimizer state: fp32 master + Adam moments per held
parameter), within 5%. Ranks 0 and world-1 are checked (first and last pipeline stage). The
cases are planned and checked in two processes side by side (planning is CPU-bound and
single-threaded); each test reads its case's rows."""

from __future__ import annotations

import pytest

import fake_world
import meshplan as mp

CASES = [
    ("llama3-70b", 8, 8192, 512),          # 64 ranks
    ("llama3-70b", 64, 8192, 1024),        # 512 ranks
    ("llama3-405b", 256, 8192, 2048),      # 2048 ranks
    ("qwen3-235b-a22b", 32, 4096, 1024),   # 256 ranks, expert parallel
    ("deepseek-v3", 32, 4096, 1024),       # 256 ranks, expert parallel
]


def _check_case(case) -> list[dict]:
    model, nodes, seq_len, global_batch = case
    # the runtime runs multi-token prediction without EP (docs/models.md): DeepSeek-V3's
    # expert-parallel accounting is checked on its main model
    overrides = dict(mtp_depth=0) if model == "deepseek-v3" else None
    return fake_world.check(model, mp.Cluster.preset("dgx-h100", nodes=nodes), seq_len=seq_len,
                            global_batch=global_batch, overrides=overrides)


@pytest.fixture(scope="module")
def contract_rows():
    from worlds import in_processes
    return dict(zip(CASES, in_processes(_check_case, CASES)))


@pytest.mark.slow
@pytest.mark.parametrize("model, nodes, seq_len, global_batch", CASES)
def test_rank_holds_what_the_cost_model_charged(contract_rows, model, nodes, seq_len, global_batch):
    r = contract_rows[(model, nodes, seq_len, global_batch)]
    assert "error" not in r, f"{r['error']}\n{r['tb']}"
    rows = r["ok"]
    for row in rows:
        assert row["error"] <= 0.05, row
    if model in ("qwen3-235b-a22b", "deepseek-v3"):
        assert " ep" in rows[0]["layout"] and "ep1 " not in rows[0]["layout"] + " ", rows[0]


def test_runtime_pattern_placements_match_single_device():
    """When the sharding ILP's dataflow is one the runtime does not run, the planner falls back to
    the runtime's role-based pattern (meshplan.ir.support.TP_ROLE_PLACEMENT, attention on local
    heads); that fallback must itself be exact: TP2 + SP against the single-device model."""
    import dataclasses

    import numerics
    from meshplan.planner.build import placements_for
    from meshplan.train.spawn import run_ranks
    seq, batch = 32, 8
    plan = numerics.plan_for("tiny-llama", 2, (("sp", True), ("tp", 2)), seq, batch)
    prof = mp.profile(mp.models.build("tiny-llama", seq_len=seq, device="meta"), seq_len=seq)
    role_based = placements_for(prof, plan.layout)          # no cluster: the role path
    assert any(v == "heads" for v in role_based.values()) and role_based != plan.placements
    case = dict(model="tiny-llama", seq_len=seq, global_batch=batch,
                plan=dataclasses.replace(plan, placements=role_based))
    for r in run_ranks(2, numerics.equivalence, case, timeout_s=180):
        assert "error" not in r, r
