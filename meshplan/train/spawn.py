"""Run a function on N local processes with an initialised process group (tests, calibration).

`run_ranks(world, fn, *args)` spawns `world` processes, initialises gloo (or NCCL on GPUs) with
a timeout on every collective, calls `fn(rank, world, *args)` and returns the list of results
by rank. A rank that raises ends the whole group: the exception is re-raised in the caller with
the failing rank named, the others are terminated instead of waiting on a collective forever.

Ranks are forked from a fork server that has imported torch and torch.distributed once (plus
the modules named in $MESHPLAN_SPAWN_PRELOAD, comma-separated), so a rank starts in under a
second instead of importing them again (seconds each); MESHPLAN_SPAWN_START=spawn (or
`start="spawn"`) starts fresh interpreters instead. Either way a rank gets the caller's
environment variables as they are at the call, and its stdout and stderr are passed on to the
caller's (their last lines are quoted when the run fails).

Every rank records the phase it is in (starting and importing, process-group initialisation,
running the function, and any finer phase the function names with `phase("...")`), so a run
that outlives its deadline is reported with what each rank was doing and for how long. The
deadline stretches while the machine is overloaded (1-minute load average above the number of
cores, by that ratio, up to `MAX_STRETCH` times): on a busy machine every rank is slower, and
a test suite should not fail for it.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

__all__ = ["run_ranks", "free_port", "RankFailed", "exit_worker", "phase"]

# the whole-run deadline never stretches beyond this many times its quiet-machine length
MAX_STRETCH = 4.0
# environment variable: a file to which run_ranks appends each rank's phases and their durations
PHASE_LOG_ENV = "MESHPLAN_PHASE_LOG"
# environment variables: how ranks are started ("forkserver" where available, or "spawn"), and
# more modules for the fork server to import before it forks ranks
START_ENV = "MESHPLAN_SPAWN_START"
PRELOAD_ENV = "MESHPLAN_SPAWN_PRELOAD"
# imported once by the fork server: the third-party modules every rank imports anyway (about 3 s
# of CPU a rank). Not meshplan itself (a quarter of a second): each rank imports it as the files
# are when the rank starts, as a freshly started process would - a fork server started before
# an edit would otherwise hand out stale (or half-edited) modules for the rest of its life.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.fsdp", "torch.distributed.checkpoint", "torch.distributed.pipelining",
           "numpy", "pulp", "highspy")


class RankFailed(RuntimeError):
    """A spawned rank raised or died; the message names the rank and carries its traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process_group(timeout_s: float = 60.0) -> bool:
    """A one-rank gloo group in this process (tests and tools that run the runtime in-process);
    False, doing nothing, when a group is already initialised."""
    import torch.distributed as dist
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return True


def exit_worker(code: int) -> None:
    """End a distributed worker process now, skipping interpreter finalisation.

    Process groups outlive `destroy_process_group` when other objects still hold them (the
    DeviceMesh cache, FSDP state); gloo's C++ threads are then torn down during interpreter
    finalisation, which sometimes aborts the process ("terminate called without an active
    exception", SIGABRT) after its work is done and its result written - a launcher would read
    that as a failed rank and restart or fail the job. The worker's results are on disk and its
    groups destroyed when this is called, so nothing is lost by not finalising.
    """
    import sys
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
            pass
    os._exit(code)


# ---- phases -------------------------------------------------------------------------------------

_progress_file: str | None = None     # set in a rank spawned by run_ranks
_fn_name = ""


def _record(name: str) -> None:
    if _progress_file is None:
        return
    line = f"{time.monotonic():.3f}\t{' '.join(str(name).split())}\n"
    try:
        with open(_progress_file, "a") as f:          # one short append: read back whole
            f.write(line)
    except OSError:                                   # the run is over and its folder gone
        pass


def phase(name: str) -> None:
    """Name the phase this rank is now in (e.g. the test case it runs); `run_ranks` reports it,
    with how long the rank has been in it, if the run outlives its deadline. Does nothing
    outside a rank spawned by `run_ranks`."""
    _record(f"running {_fn_name}: {name}")


def _read_phases(path: Path) -> list[tuple[float, str]]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        t, sep, name = line.partition("\t")
        if sep:
            try:
                out.append((float(t), name))
            except ValueError:
                pass
    return out


def _entry(rank: int, world: int, port: int, outdir: str, timeout_s: float, backend: str, env: dict, fn,
           args) -> None:
    global _progress_file, _fn_name
    out = Path(outdir)
    # the caller's environment now (a forked rank would otherwise get the fork server's), and
    # stdout / stderr into files the caller passes on (a forked rank would write to the fork
    # server's, wherever they pointed when it started)
    os.environ.clear()
    os.environ.update(env)
    for fd, name in ((1, "out"), (2, "err")):
        f = os.open(out / f"{rank}.{name}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    # a rank killed by a signal (SIGSEGV, SIGABRT, ...) leaves the Python stack of every thread in its
    # stderr file, which a failing run quotes
    import faulthandler
    faulthandler.enable(file=sys.stderr, all_threads=True)
    _progress_file = str(out / f"{rank}.progress")
    _fn_name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    _record("importing torch")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    code = 0
    try:
        _record(f"process-group initialisation ({backend}, tcp://127.0.0.1:{port})")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        _record(f"running {_fn_name}")
        result = fn(rank, world, *args)
        _record("writing the result")
        (out / f"{rank}.pkl").write_bytes(pickle.dumps(("ok", result)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which re-raises
        (out / f"{rank}.pkl").write_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        code = 1
    finally:
        _record("destroying the process group")
        if dist.is_initialized():
            dist.destroy_process_group()
        _record("finished")
    exit_worker(code)


# ---- the parent -----------------------------------------------------------------------------------

def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def load_factor(load: float | None, cores: int | None = None) -> float:
    """How much slower than on a quiet machine a process runs at 1-minute load average `load`
    (os.getloadavg()[0]): the load over the number of cores, at least 1 (1 where unknown)."""
    if load is None:
        return 1.0
    return max(1.0, load / max(1, _cores() if cores is None else cores))


def describe_ranks(phases: dict[int, list[tuple[float, str]]], world: int, now: float, started: float,
                   alive: dict[int, bool] | None = None, exitcodes: dict[int, int | None] | None = None) -> list[str]:
    """One line per rank: the phase it is in (its last recorded one) and for how long."""
    lines = []
    for r in range(world):
        hist = phases.get(r) or []
        if hist:
            t, name = hist[-1]
        else:
            t, name = started, "starting (process start-up, importing the function's module)"
        state = ""
        if alive is not None and not alive.get(r, True):
            code = (exitcodes or {}).get(r)
            state = f", exited (code {code})" if code is not None else ", exited"
        lines.append(f"rank {r}: {name}, for {max(0.0, now - t):.0f} s{state}")
    return lines


def _phase_log(outdir: str, world: int, fn, elapsed: float) -> None:
    """Append each rank's phases and their durations to $MESHPLAN_PHASE_LOG (one JSON line a rank)."""
    path = os.environ.get(PHASE_LOG_ENV)
    if not path:
        return
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    try:
        with open(path, "a") as f:
            for r in range(world):
                hist = _read_phases(Path(outdir) / f"{r}.progress")
                steps = [(n, round(t2 - t1, 2)) for (t1, n), (t2, _) in zip(hist, hist[1:])]
                f.write(json.dumps(dict(fn=name, test=test, world=world, rank=r, wall=round(elapsed, 2),
                                        phases=steps)) + "\n")
    except OSError:
        pass


def start_method(method: str | None = None) -> str:
    """How ranks are started: `method`, else $MESHPLAN_SPAWN_START, else "forkserver" where the
    platform has it."""
    import multiprocessing
    method = method or os.environ.get(START_ENV, "").strip()
    if not method:
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        from multiprocessing import forkserver
        extra = [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
        # read when the fork server starts (on first use; it then serves every later run)
        forkserver.set_forkserver_preload([*PRELOAD, *extra])
    return method


class _Output:
    """Passes the ranks' stdout / stderr files on to this process's, as they grow."""

    def __init__(self, outdir: str, world: int) -> None:
        import sys
        self.outdir = Path(outdir)
        self.files = [(self.outdir / f"{r}.{name}", stream) for r in range(world)
                      for name, stream in (("out", sys.stdout), ("err", sys.stderr))]
        self.pos = [0] * len(self.files)

    def pump(self) -> None:
        for i, (path, stream) in enumerate(self.files):
            try:
                with open(path, "rb") as f:
                    f.seek(self.pos[i])
                    data = f.read()
            except OSError:
                continue
            if data:
                self.pos[i] += len(data)
                try:
                    stream.write(data.decode(errors="replace"))
                    stream.flush()
                except Exception:  # noqa: BLE001 - a closed stream: the files still hold it
                    pass

    def tail(self, rank: int, lines: int = 12) -> str:
        """The last lines rank `rank` wrote to stderr."""
        try:
            text = (self.outdir / f"{rank}.err").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


def run_ranks(world: int, fn, *args, timeout_s: float = 120.0, backend: str = "gloo",
              deadline_s: float | None = None, start: str | None = None) -> list:
    """Run `fn(rank, world, *args)` on `world` fresh processes; results by rank.

    `fn` must be importable (module-level). `timeout_s` bounds every collective; the whole run
    must end within `deadline_s` (default `timeout_s + 60`) seconds of quiet-machine time: while
    the load average exceeds the core count, a wall-clock second counts as 1/(load / cores)
    seconds (the deadline never stretches beyond MAX_STRETCH times). On a timeout the error says
    which phase each rank is in and for how long, and the machine's load. `start="spawn"` starts
    fresh interpreters whatever $MESHPLAN_SPAWN_START says (to measure a whole process's memory).
    """
    import torch.multiprocessing as mp
    budget = float(timeout_s + 60 if deadline_s is None else deadline_s)
    method = start_method(start)
    with tempfile.TemporaryDirectory(prefix="meshplan-ranks-") as outdir:
        output = _Output(outdir, world)
        started = time.monotonic()
        ctx = mp.start_processes(_entry, args=(world, free_port(), outdir, timeout_s, backend, dict(os.environ), fn,
                                               args),
                                 nprocs=world, join=False, start_method=method)
        used, last, peak_load = 0.0, started, None
        failure = timed_out = None
        try:
            while True:
                try:
                    if ctx.join(timeout=1.0):
                        break
                except Exception as e:  # one rank failed: report the first one that wrote its error
                    failure = e
                    break
                output.pump()
                now = time.monotonic()
                load = _load()
                if load is not None:
                    peak_load = load if peak_load is None else max(peak_load, load)
                used += (now - last) / load_factor(load)
                last = now
                if used > budget or now - started > budget * MAX_STRETCH:
                    timed_out = now
                    break
        finally:
            if failure is not None or timed_out is not None:
                now = time.monotonic()
                phases = {r: _read_phases(Path(outdir) / f"{r}.progress") for r in range(world)}
                alive = {r: p.is_alive() for r, p in enumerate(ctx.processes)}
                codes = {r: p.exitcode for r, p in enumerate(ctx.processes)}
                where = describe_ranks(phases, world, now, started, alive, codes)
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
            output.pump()
        elapsed = time.monotonic() - started
        _phase_log(outdir, world, fn, elapsed)
        results, errors = [], []
        for r in range(world):
            f = Path(outdir) / f"{r}.pkl"
            if f.exists():
                status, value = pickle.loads(f.read_bytes())
                if status == "error":
                    errors.append((r, value))
                results.append(value)
            else:
                results.append(None)
        if errors:
            r, msg = errors[0]
            raise RankFailed(f"rank {r} of {world} failed: {msg}")
        if timed_out is None and failure is None:
            return results
        tails = "".join(f"\n--- rank {r}'s last lines of stderr ---\n{t}" for r in range(world)
                        if (t := output.tail(r)))
        if timed_out is not None:
            load = _load()
            raise RankFailed(
                f"{world} ranks running {getattr(fn, '__qualname__', fn)} did not finish within {budget:.0f} s "
                f"(stopped after {elapsed:.0f} s wall clock; the deadline stretches while the 1-minute load "
                f"average exceeds the {_cores()} cores: now {_fmt(load)}, highest seen {_fmt(peak_load)}):\n  "
                + "\n  ".join(where) + tails)
        raise RankFailed(f"distributed run failed: {failure}\n  " + "\n  ".join(where) + tails)


def _fmt(load: float | None) -> str:
    return "unknown" if load is None else f"{load:.1f}"
