"""Shared spawned worlds: many test cases in one group of ranks (starting a rank costs seconds).

`spawn_cases(world, fn, cases)` runs `fn(rank, world, cases)` once on `world` spawned ranks and
returns {case name: [rank 0's result, rank 1's, ...]}; the workers loop over their cases with
`each_case`, which names each case as the rank's phase (a run past its deadline says which case
every rank was in), catches a case's exception with its traceback (the case's test fails with
it; the other cases go on) and keeps the ranks in step with a barrier between cases. `ok(results)`
is the check each test makes first.

Work that runs in the test process and keeps one core busy - planning, above all - is spread
over two processes: `in_processes(fn, items)`, and the `plans` cache whose `prefetch` makes a
world's plans two at a time. Most of a small model's planning time is its trace (about 95%: the
search over a few CPU ranks takes milliseconds), and a world plans each model at many layouts:
`planning_model` keeps one model object per key and `traced_once` has `meshplan.plan` trace each
object once (the `plans` cache plans inside it).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import traceback


def each_case(rank: int, cases: dict, run_one) -> dict:
    """`run_one(name, case)` for each case in turn; {name: result or {"error", "tb"}}."""
    import torch.distributed as dist

    from meshplan.train import spawn
    out = {}
    for name, case in cases.items():
        spawn.phase(f"case {name}")
        try:
            out[name] = run_one(name, case)
        except Exception as e:  # noqa: BLE001 - reported per case, under the case's own test
            out[name] = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-4000:]}
            # printed at once too: if the other ranks then hang in a collective, this is what comes back
            print(f"rank {rank}, case {name}: {out[name]['tb']}", file=sys.stderr, flush=True)
        spawn.phase(f"barrier after case {name}")
        dist.barrier()
    return out


def spawn_cases(world: int, fn, cases: dict, *args, timeout_s: float = 240) -> dict:
    """Run every case in one spawned group of `world` ranks; {case name: [result by rank]}."""
    from meshplan.train.spawn import run_ranks
    results = run_ranks(world, fn, cases, *args, timeout_s=timeout_s)
    return {name: [r[name] for r in results] for name in cases}


def ok(results: list) -> None:
    """Every rank ran the case without an exception (else: the first failing rank's traceback)."""
    for rank, r in enumerate(results):
        assert not (isinstance(r, dict) and "error" in r), f"rank {rank}: {r['error']}\n{r.get('tb', '')}"


def _set_environ(env: dict) -> None:
    """A pool worker: the test session's environment, one torch thread (as spawned ranks have)."""
    import os

    import torch
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)


def _call(fn, item):
    try:
        return {"ok": fn(item)}
    except Exception as e:  # noqa: BLE001 - reported per item, under the item's own test
        return {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-4000:]}


_pool = None


def _workers(processes: int):
    """The session's pool of worker processes (kept: its workers' imports and caches stay warm)."""
    global _pool
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    from meshplan.train import spawn
    if _pool is None or _pool._broken or _pool._max_workers != processes:
        if _pool is not None:
            _pool.shutdown(wait=False, cancel_futures=True)
        ctx = multiprocessing.get_context(spawn.start_method())
        _pool = ProcessPoolExecutor(max_workers=processes, mp_context=ctx, initializer=_set_environ,
                                    initargs=(dict(os.environ),))
    return _pool


def in_processes(fn, items: list, *, processes: int = 2) -> list:
    """[fn(item) for item in items] over `processes` worker processes (single-process tests that
    are CPU-bound leave the second core idle otherwise). Each result is {"ok": value} or
    {"error", "tb"}: an item's failure is reported under its own test. `fn` must be importable."""
    import functools
    return list(_workers(processes).map(functools.partial(_call, fn), items))


# ---- one trace per model ---------------------------------------------------------------------------

_models: dict = {}
_traces: dict = {}          # (id(model), seq_len) -> (model, its profile): the model is kept, so its id stays its own


def planning_model(key, build):
    """The model object this process plans for `key` (built once by `build()`). Planned under
    `traced_once`, it is traced once for every layout and world size it is planned with. Never
    changed after it is built (a plan of a changed model needs a model of its own)."""
    if key not in _models:
        _models[key] = build()
    return _models[key]


@contextlib.contextmanager
def traced_once():
    """Inside: `meshplan.plan` traces each model object once per sequence length and reuses the
    profile (a ModelProfile is frozen, and tracing reads only the module's structure, so the plan
    is the one a fresh trace gives: the same JSON but for the search's own seconds). Only for
    models that are not changed after their first plan (`planning_model`'s)."""
    import torch

    import meshplan
    from meshplan import api
    # meshplan.profile is resolved (and kept) on first use: resolve it now, so that it is never
    # this context's cache, which must not outlive the context
    meshplan.profile  # noqa: B018
    real = api.profile
    if getattr(real, "_traced_once", False):          # nested: the outer context's cache serves
        yield
        return

    def profile(model, *, seq_len: int = api.TRACE_SEQ_LEN, **kw):
        if kw or not isinstance(model, torch.nn.Module):
            return real(model, seq_len=seq_len, **kw)
        key = (id(model), seq_len)
        if key not in _traces:
            _traces[key] = (model, real(model, seq_len=seq_len))
        return _traces[key][1]
    profile._traced_once = True
    api.profile = profile
    try:
        yield
    finally:
        api.profile = real


# ---- plans made two at a time ----------------------------------------------------------------------

def _planned(item):
    module, name, args = item
    import importlib
    with traced_once():
        return getattr(importlib.import_module(module), name).fn(*args)


class plans:
    """A plan-making function's cache (decorator, like functools.lru_cache on positional
    arguments) that can make many plans at once in two processes: `f.prefetch([args, ...])`
    before building a world's cases (planning is CPU-bound and single-threaded, and a world
    needs dozens of plans). The decorated function must be a module-level name; it runs under
    `traced_once`, so a model it takes from `planning_model` is traced once per process."""

    def __init__(self, fn):
        self.fn, self.done = fn, {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        if args not in self.done:
            with traced_once():
                self.done[args] = self.fn(*args)
        return self.done[args]

    def prefetch(self, calls) -> None:
        prefetch((self, args) for args in calls)


def prefetch(calls) -> None:
    """Make the plans [(plans cache, args), ...] not made yet, two at a time; a plan whose
    making failed is left to be made (and to raise) where it is used."""
    missing = list(dict.fromkeys((cache, tuple(args)) for cache, args in calls if tuple(args) not in cache.done))
    if len(missing) < 3:        # made where they are used
        return
    items = [(cache.fn.__module__, cache.fn.__name__, args) for cache, args in missing]
    for (cache, args), r in zip(missing, in_processes(_planned, items)):
        if "ok" in r:
            cache.done[args] = r["ok"]
