"""Run a pulp model with the best MILP solver installed, silently.

HiGHS (through pulp's in-process `pulp.HiGHS` interface, which needs the `highspy` package) is
used when present: it is faster than CBC on meshplan's small models because it skips the
MPS-file round trip to a subprocess. CBC ships inside pulp's wheel, so it is always the fallback
and every ILP in meshplan must solve with it.

`solve` returns pulp's status string. A time limit that stops the solver with an incumbent is
reported by pulp as "Optimal" for some solvers; callers that need to know read
`problem.sol_status` (pulp.LpSolutionIntegerFeasible vs LpSolutionOptimal), see `proved_optimal`.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pulp

from meshplan.errors import ConfigError

__all__ = ["SOLVERS", "available_solvers", "solve", "proved_optimal", "has_solution"]

# Names accepted by `solve(solver=...)`, in order of preference for "auto".
SOLVERS = ("highs", "cbc")


@contextlib.contextmanager
def _quiet_stdout():
    """Silence file descriptor 1 for the duration: HiGHS prints its banner ("Running HiGHS ...")
    from C++ when a solver object is created, before pulp's msg=False reaches its options, so
    Python-level redirection cannot catch it."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):   # captured or replaced stdout: nothing to do
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


def _highs_available() -> bool:
    try:
        with _quiet_stdout():
            return bool(pulp.HiGHS(msg=False).available())
    except Exception:   # pulp raises various errors when highspy is missing or broken
        return False


def _cbc_available() -> bool:
    try:
        return bool(pulp.PULP_CBC_CMD(msg=False).available())
    except Exception:
        return False


def available_solvers() -> tuple[str, ...]:
    """Solver names usable on this machine, best first (a subset of SOLVERS)."""
    found = []
    if _highs_available():
        found.append("highs")
    if _cbc_available():
        found.append("cbc")
    return tuple(found)


def _make(name: str, time_limit_s: float, warm_start: bool):
    if name == "highs":   # pulp's in-process HiGHS interface takes no starting solution
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, warmStart=warm_start)


def resolve_solver(solver: str = "auto") -> str:
    """The concrete solver name `solve` would use for `solver`."""
    avail = available_solvers()
    if not avail:
        raise ConfigError("no MILP solver found: pulp's bundled CBC is missing; reinstall pulp "
                          "(pip install --force-reinstall pulp) or install highspy")
    if solver == "auto":
        return avail[0]
    if not isinstance(solver, str) or solver.lower() not in SOLVERS:
        raise ConfigError(f"unknown solver {solver!r}; available solvers: {', '.join(('auto',) + avail)}")
    name = solver.lower()
    if name not in avail:
        raise ConfigError(f"solver {name!r} is not installed here; available solvers: "
                          f"{', '.join(('auto',) + avail)}" + (" (pip install highspy for HiGHS)"
                                                              if name == "highs" else ""))
    return name


def solve(problem: pulp.LpProblem, *, time_limit_s: float = 10.0, solver: str = "auto",
          warm_start: bool = False) -> str:
    """Solve `problem` in place; return pulp's status string ("Optimal", "Infeasible", ...).

    solver: "auto" (HiGHS when highspy is installed, else CBC), "highs" or "cbc".
    warm_start: CBC starts from the variables' initial values (`LpVariable.setInitialValue`);
    HiGHS ignores it (callers that need an incumbent there add it as a bound).
    """
    if not (time_limit_s > 0):
        raise ConfigError(f"time_limit_s={time_limit_s!r}: must be a positive number of seconds")
    name = resolve_solver(solver)
    with _quiet_stdout():
        status = problem.solve(_make(name, float(time_limit_s), warm_start))
    return pulp.LpStatus[status]


def has_solution(problem: pulp.LpProblem) -> bool:
    """True when the last solve left an integer-feasible assignment in the variables."""
    return problem.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)


def proved_optimal(problem: pulp.LpProblem) -> bool:
    """True when the last solve proved its solution optimal (not merely stopped at the time limit)."""
    return problem.sol_status == pulp.LpSolutionOptimal
