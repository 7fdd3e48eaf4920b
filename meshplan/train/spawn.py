"""Run a function on N local processes with an initialised process group (tests, calibration).

`run_ranks(world, fn, *args)` spawns `world` processes, initialises gloo (or NCCL on GPUs) with
a timeout on every collective, calls `fn(rank, world, *args)` and returns the list of results
by rank. A rank that raises ends the whole group: the exception is re-raised in the caller with
the failing rank named, the others are terminated instead of waiting on a collective forever.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path

__all__ = ["run_ranks", "free_port", "RankFailed", "exit_worker"]


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


def _entry(rank: int, world: int, port: int, outdir: str, timeout_s: float, backend: str, fn, args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    out = Path(outdir)
    code = 0
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, world, *args)
        (out / f"{rank}.pkl").write_bytes(pickle.dumps(("ok", result)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which re-raises
        (out / f"{rank}.pkl").write_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    exit_worker(code)


def run_ranks(world: int, fn, *args, timeout_s: float = 120.0, backend: str = "gloo") -> list:
    """Run `fn(rank, world, *args)` on `world` fresh processes; results by rank.

    `fn` must be importable (module-level). `timeout_s` bounds every collective and the whole run.
    """
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="meshplan-ranks-") as outdir:
        ctx = mp.start_processes(_entry, args=(world, free_port(), outdir, timeout_s, backend, fn, args),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s + 60
        failure = None
        try:
            while True:
                try:
                    if ctx.join(timeout=1.0):
                        break
                except Exception as e:  # one rank failed: report the first one that wrote its error
                    failure = e
                    break
                if time.monotonic() > deadline:
                    failure = TimeoutError(f"ranks did not finish within {timeout_s + 60:.0f} s")
                    break
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
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
        if failure is not None:
            raise RankFailed(f"distributed run failed: {failure}")
        return results
