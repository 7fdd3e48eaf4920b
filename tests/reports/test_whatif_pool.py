"""reports/whatif_pool.py: points planned by worker processes come back in order; a task's
exception is raised in the caller; progress is reported once per point."""

from __future__ import annotations

import operator

import pytest

from meshplan.reports.whatif_pool import run_points


def test_results_come_back_in_the_order_of_the_points():
    seen = []
    out = run_points(operator.mul, 3, [(1,), (2,), (5,), (7,)], jobs=2, on_done=lambda done, i: seen.append((done, i)))
    assert out == [3, 6, 15, 21]
    assert sorted(d for d, _ in seen) == [1, 2, 3, 4] and sorted(i for _, i in seen) == [0, 1, 2, 3]


def test_a_task_error_is_raised_here():
    with pytest.raises(ZeroDivisionError):
        run_points(operator.truediv, 1, [(1,), (0,), (2,)], jobs=2)
