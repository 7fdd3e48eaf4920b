"""The training loop: exact resume, resume under another plan (DCP resharding), crash + restart.

In-process jobs run in one spawned group of 2 ranks, several train() jobs in turn (starting ranks
costs seconds; `dp2_runs`): the uninterrupted DP2 reference, a run stopped at step 3 and resumed,
the same with background checkpoints, and a TP2 (SP) run stopped at step 3 and resumed under
PP2. `meshplan train` runs as a user runs it (torchrun subprocesses): the uninterrupted reference
and the run whose rank dies side by side, both training a saved plan (`--plan`), then the run
whose rank hangs alone (its 2 s collective timeout must not fire on a busy machine).

Tolerances: resuming under the same plan replays the same kernels on the same data in the same
order, so losses are equal to the last bit on CPU (checked with 1e-6 to stay robust to a BLAS
that picks another path). Under another plan the sums run in another order (tensor-parallel
partial products, pipeline micro-batches), so the continued losses agree to fp32 rounding:
rtol 1e-4, a wrong reshard (a shard in the wrong place, a missing optimizer state) moves them by
far more.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

import numerics
import procs
import train_workers
from worlds import planning_model, plans

SEQ, BATCH, STEPS = 32, 8, 6
# tiny-llama with 2 layers (numerics.VARIANTS): what a checkpoint holds and how it reshards is
# the same for every layer, and PP2 still gets one layer a stage
MODEL = "tiny-llama-2l"


@plans
def _plan(world: int, fixed: tuple):
    import meshplan as mp
    from meshplan.cluster import Cluster
    model = planning_model((MODEL, SEQ, "meta"), lambda: numerics.build_meta(MODEL, seq_len=SEQ))
    return mp.plan(model, Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world), seq_len=SEQ,
                   global_batch=BATCH, fixed=dict(fixed))


def _case(plan, out, **kw) -> dict:
    return dict(model=MODEL, plan=plan, seq_len=SEQ, steps=STEPS, out=str(out), **kw)


DP2 = (("dp", 2), ("zero", 3))
# resumed under another plan: tensor-parallel shards (weights and AdamW moments, DTensors over the
# TP mesh) saved, loaded into pipeline stages that hold whole tensors of half the layers
TP2 = (("tp", 2), ("sp", True), ("dp", 1), ("pp", 1))
PP2 = (("pp", 2), ("vp", 1), ("schedule", "1f1b"), ("tp", 1), ("dp", 1))


@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory):
    """One spawned group of 2 ranks runs, in turn, every training job of the resume tests: an
    uninterrupted DP2 (ZeRO-3) 6-step run (checkpoint only at the end), a run stopped at step 3
    and its resumption, the same with background checkpoints every step (keep 2), and a TP2 (SP)
    run stopped at step 3 and resumed under PP2."""
    from worlds import spawn_cases
    # made here, not in worker processes: one trace of one model serves the three plans
    plan, base = _plan(2, DP2), tmp_path_factory.mktemp("dp2")
    cases = {"full": _case(plan, base / "full", params=True),
             "stop3": _case(plan, base / "sync", stop_at=3),
             "resume": _case(plan, base / "sync", params=True),
             "async_stop3": _case(plan, base / "async", stop_at=3, every=1, keep=2, **{"async": True}),
             "async_resume": _case(plan, base / "async", every=1, keep=2, params=True, **{"async": True}),
             "tp2_stop3": _case(_plan(2, TP2), base / "reshard", stop_at=3),
             "pp2_resume": _case(_plan(2, PP2), base / "reshard")}
    return spawn_cases(2, train_workers.train_runs, cases, timeout_s=180), base


def _run(dp2_runs, name: str) -> list[dict]:
    from worlds import ok
    runs, _ = dp2_runs
    ok(runs[name])
    return runs[name]


def _assert_continues(first, second, full, *, rtol=1e-6, atol=1e-6):
    """Steps 1-3 of `first` and 4-STEPS of `second` have the uninterrupted run's losses."""
    for step in range(1, STEPS + 1):
        got = (first if step <= 3 else second)["losses"][step]
        torch.testing.assert_close(got, full["losses"][step], rtol=rtol, atol=atol)


def test_exact_resume_same_plan(dp2_runs):
    full, first, second = (_run(dp2_runs, n)[0] for n in ("full", "stop3", "resume"))
    assert sorted(first["losses"]) == [1, 2, 3] and first["checkpoint"].endswith("step_000003")
    assert second["start"] == 3 and sorted(second["losses"]) == [4, 5, 6]
    _assert_continues(first, second, full)
    for n, t in full["params"].items():
        torch.testing.assert_close(second["params"][n], t, rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_async_checkpoints_resume_exactly(dp2_runs):
    """Background checkpoints every step (each overlaps the next step; keep 2): stopping at 3 and
    resuming gives the uninterrupted run's losses and weights, and train() returns only after
    the last checkpoint is complete."""
    full = _run(dp2_runs, "full")[0]
    first = _run(dp2_runs, "async_stop3")
    for r in first:
        assert r["complete"] == ["step_000002", "step_000003"] and r["other"] == [], r
    assert first[0]["checkpoint"].endswith("step_000003")
    second = _run(dp2_runs, "async_resume")[0]
    assert second["start"] == 3 and second["checkpoint"].endswith("step_000006")
    assert second["complete"] == ["step_000005", "step_000006"] and second["other"] == []
    meta = json.loads((dp2_runs[1] / "async" / "checkpoints" / "step_000006" / "meta.json").read_text())
    assert meta["step"] == 6 and meta["config"]["async_checkpoint"] is True
    _assert_continues(first[0], second, full)
    for n, t in full["params"].items():
        torch.testing.assert_close(second["params"][n], t, rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_resume_under_another_plan(dp2_runs):
    """TP2 (SP) stopped at step 3, resumed under PP2: the plan and the checkpoint's layout differ
    (DCP reshards weights and optimizer state), and the continued losses are those of an
    uninterrupted run. Every plan computes the same losses up to fp32 rounding, so the
    uninterrupted DP2 run is the reference."""
    full, first, resumed = (_run(dp2_runs, n)[0] for n in ("full", "tp2_stop3", "pp2_resume"))
    assert sorted(first["losses"]) == [1, 2, 3] and first["checkpoint"].endswith("step_000003")
    assert resumed["start"] == 3 and sorted(resumed["losses"]) == [4, 5, 6]
    _assert_continues(first, resumed, full, rtol=1e-4, atol=1e-5)


def _cli(*args, what: str, cwd, timeout=300, start_only=False):
    """`meshplan train ARGS` in a subprocess (tests/runtime/procs.py: a timeout that stretches
    with the load, and a failure naming `what`); started only, to finish later, if start_only."""
    proc = procs.Proc([sys.executable, "-m", "meshplan.cli", "train", *args], what=f"meshplan train ({what})",
                      timeout=timeout, cwd=cwd)
    return proc if start_only else proc.finish()


def _final_params(ckpt_dir):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = ckpt_dir.parent / (ckpt_dir.name + ".pt")
    dcp_to_torch_save(str(ckpt_dir), str(out))
    return torch.load(out, weights_only=False)["model"]


def test_killed_rank_restarts_from_checkpoint(tmp_path):
    """Both runs train one saved plan with `meshplan train --plan p.json` alone, which takes its
    process count from the plan (test_multinode.py launches a saved plan with `meshplan launch`)."""
    import meshplan as mp
    from meshplan.cluster import Cluster
    plan = mp.plan(mp.models.build("tiny-llama", seq_len=32, device="meta"),
                   Cluster(gpu="cpu", num_gpus=2, gpus_per_node=2), seq_len=32, global_batch=8, fixed={"dp": 2})
    plan.save(tmp_path / "p.json")
    common = ["--plan", str(tmp_path / "p.json"), "--steps", "6", "--global-batch", "8", "--seq-len", "32",
              "--precision", "fp32", "--checkpoint-every", "2"]
    # the uninterrupted reference and the run whose rank 1 dies in step 3 run side by side
    clean = _cli(*common, "--out", str(tmp_path / "clean"), what="uninterrupted reference run", cwd=tmp_path,
                 start_only=True)
    crashed = _cli(*common, "--out", str(tmp_path / "crash"), "--fail-at-step", "3", "--max-restarts", "1",
                   what="run whose rank 1 dies in step 3, restarted once", cwd=tmp_path, start_only=True)
    ok, crashed = clean.finish(), crashed.finish()
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "launching 2 processes" in ok.stderr, ok.stderr[-3000:]
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    assert "resumed from" in crashed.stdout and "step_000002" in crashed.stdout, crashed.stdout[-2000:]
    a = _final_params(tmp_path / "clean" / "checkpoints" / "step_000006")
    b = _final_params(tmp_path / "crash" / "checkpoints" / "step_000006")
    assert set(a) == set(b)
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
    log = [json.loads(line) for line in (tmp_path / "crash" / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in log} == set(range(1, 7))


def test_hung_rank_is_named_and_ends_the_job(tmp_path):
    """Rank 1 stops responding in step 3; with --timeout 2 rank 0's collective times out, it
    names rank 1 and exits non-zero, and torchrun stops the job. Bound: start-up (~10-20 s on
    2 busy cores) + 2 s timeout + at most 2 s waiting for other ranks to time out + teardown."""
    proc = _cli("--nproc", "2", "--steps", "6", "--global-batch", "8", "--seq-len", "32", "--precision", "fp32",
                "--fix", "dp=2", "--checkpoint-every", "0", "--timeout", "2", "--hang-at-step", "2",
                "--out", str(tmp_path / "o"), what="run whose rank 1 hangs in step 3, --timeout 2", cwd=tmp_path,
                timeout=180, start_only=True)
    r = proc.finish()
    elapsed = proc.quiet_elapsed          # seconds, counted as on a quiet machine (see procs.py)
    assert r.returncode != 0, r.stdout[-2000:]
    reason = ("meshplan: error: rank 1 stopped responding (rank 1 in step 3; no collective completed within 2 s, "
              "set by --timeout). Rank(s) 0 (step 3) timed out waiting for it")
    assert reason in r.stderr.strip().splitlines()[-1], r.stderr[-4000:]     # repeated after torchrun's report
    assert elapsed < 120, elapsed
    log = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in log] == [1, 2]


def test_plan_for_another_world_size_is_refused(tmp_path, capsys):
    """Refused before any process starts: through `meshplan.cli.main` in this process."""
    from meshplan import cli
    plan = _plan(4, (("dp", 4),))
    plan.save(tmp_path / "p.json")
    code = cli.main(["train", "--plan", str(tmp_path / "p.json"), "--nproc", "2", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "needs 4 processes" in err, err[-2000:]


def test_incomplete_checkpoint_is_refused(tmp_path):
    from meshplan.errors import ConfigError
    from meshplan.train import checkpoint
    bad = tmp_path / "checkpoints" / "step_000004"
    bad.mkdir(parents=True)
    assert checkpoint.latest(tmp_path) is None          # no meta.json: never taken as complete
    (tmp_path / "checkpoints" / "step_000002.tmp").mkdir()
    assert checkpoint.latest(tmp_path) is None
    with pytest.raises(ConfigError, match="not a complete meshplan checkpoint"):
        checkpoint.load(bad, None, None)
