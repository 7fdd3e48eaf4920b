"""meshplan.train.spawn.run_ranks: a run past its deadline fails (it does not hang the test
session) with what every rank was doing and for how long, and the machine's load; the deadline
stretches with the load."""

from __future__ import annotations

import sys
import time

import pytest

from meshplan.train import spawn


def sleeps_past_the_deadline(rank: int, world: int) -> None:
    """Rank 0 sleeps far past the deadline; rank 1 waits for it in a collective (whose own
    timeout is longer than the deadline)."""
    import torch.distributed as dist
    if rank == 0:
        spawn.phase("sleeping past the deadline")
        time.sleep(600)
    spawn.phase("waiting for rank 0 in a barrier")
    dist.barrier()


def fails_in_a_phase(rank: int, world: int) -> None:
    spawn.phase("about to fail")
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    time.sleep(600)


def dies_in_a_phase(rank: int, world: int) -> None:
    import os
    spawn.phase("about to die")
    if rank == 1:
        print("rank 1's last words", file=sys.stderr, flush=True)
        os._exit(3)
    time.sleep(600)


def test_timeout_names_each_ranks_phase_and_the_load():
    t0 = time.monotonic()
    with pytest.raises(spawn.RankFailed) as info:
        spawn.run_ranks(2, sleeps_past_the_deadline, timeout_s=300, deadline_s=2)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "2 ranks running sleeps_past_the_deadline did not finish within 2 s" in msg, msg
    assert "load average" in msg and f"the {spawn._cores()} cores" in msg, msg
    # each rank, its phase (the function's own, or the one it was still in) and for how long
    assert "\n  rank 0: " in msg and "\n  rank 1: " in msg, msg
    lines = {line.split(":", 1)[0].strip(): line for line in msg.splitlines()[1:]}
    assert lines["rank 0"].endswith(" s") and ", for " in lines["rank 0"], msg
    if "running " in lines["rank 0"]:           # it got there within the deadline (it does unless overloaded)
        assert "sleeps_past_the_deadline: sleeping past the deadline" in lines["rank 0"], msg
        assert "waiting for rank 0 in a barrier" in lines["rank 1"], msg
    # the run was stopped at its (possibly stretched) deadline, not at the collectives' 300 s
    assert elapsed < 2 * spawn.MAX_STRETCH + 30, elapsed


def test_a_failing_rank_ends_the_run_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(spawn.RankFailed, match=r"(?s)rank 1 of 2 failed: ValueError: rank 1 fails on purpose.*"
                                               r"Traceback.*fails_in_a_phase"):
        spawn.run_ranks(2, fails_in_a_phase, timeout_s=300)
    assert time.monotonic() - t0 < 120


def test_a_rank_that_dies_is_named_with_its_phase_and_output():
    with pytest.raises(spawn.RankFailed) as info:
        spawn.run_ranks(2, dies_in_a_phase, timeout_s=300)
    msg = str(info.value)
    assert "distributed run failed" in msg and "exit code 3" in msg, msg
    assert "rank 1: running test_spawn.dies_in_a_phase: about to die" in msg and "exited (code 3)" in msg, msg
    assert "rank 1's last lines of stderr" in msg and "rank 1's last words" in msg, msg


def test_phase_outside_a_spawned_rank_does_nothing():
    spawn.phase("nothing to record")


def test_deadline_stretches_with_the_load():
    assert spawn.load_factor(1.0, 2) == 1.0
    assert spawn.load_factor(2.0, 2) == 1.0
    assert spawn.load_factor(6.0, 2) == 3.0
    assert spawn.load_factor(None, 2) == 1.0


def test_rank_description():
    now = 100.0
    lines = spawn.describe_ranks({0: [(10.0, "importing torch"), (40.0, "running f: case a")], 1: []}, 3, now,
                                 started=5.0, alive={0: True, 1: True, 2: False}, exitcodes={2: -9})
    assert lines == ["rank 0: running f: case a, for 60 s",
                     "rank 1: starting (process start-up, importing the function's module), for 95 s",
                     "rank 2: starting (process start-up, importing the function's module), for 95 s, "
                     "exited (code -9)"]
