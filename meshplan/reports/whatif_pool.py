"""Plan a what-if sweep's points in several worker processes.

Each worker is a fresh interpreter (`python -m meshplan.reports.whatif_pool`) that receives the
model profile once, then one point at a time, and answers each with the point's result; a thread
per worker in the calling process hands out the next point as soon as one is answered, so fast
and slow points balance across workers. Fresh interpreters, not multiprocessing's fork or
forkserver: a forked copy of a process whose solver threads are running can deadlock, and
forkserver / spawn workers re-run the caller's main script unless it is guarded by
`if __name__ == "__main__"`, which a sweep called from a plain script must not require.

Messages are pickles on the worker's stdin / stdout (both ends are this module).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from typing import Any, Callable, Sequence

__all__ = ["run_points"]


def run_points(task: Callable, shared: Any, points: Sequence[tuple], jobs: int,
               on_done: Callable[[int, int], None] | None = None) -> list:
    """[task(shared, *point) for point in points], computed by `jobs` worker processes (`task`
    must be a module-level function). on_done(done, index) is called as each point finishes.
    A worker that dies leaves its points to this process; an exception a task raises is raised
    here (the first one, after every worker stopped)."""
    out: list = [None] * len(points)
    finished = [False] * len(points)
    errors: list[BaseException] = []
    lock = threading.Lock()
    queue = list(range(len(points)))[::-1]
    done = [0]

    def take() -> int | None:
        with lock:
            return queue.pop() if queue and not errors else None

    def serve(proc: subprocess.Popen) -> None:
        try:
            pickle.dump((task, shared), proc.stdin)
            proc.stdin.flush()
            while (i := take()) is not None:
                pickle.dump((i, points[i]), proc.stdin)
                proc.stdin.flush()
                ok, value = pickle.load(proc.stdout)
                with lock:
                    if not ok:
                        errors.append(value)
                        continue
                    out[i], finished[i] = value, True
                    done[0] += 1
                    if on_done is not None:
                        on_done(done[0], i)
            pickle.dump(None, proc.stdin)
            proc.stdin.flush()
        except (OSError, EOFError, pickle.UnpicklingError):
            pass                        # the worker died: its points are planned below
        finally:
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            proc.wait()

    procs = [subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
             for _ in range(jobs)]
    threads = [threading.Thread(target=serve, args=(p,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for i, ok in enumerate(finished):
        if not ok:
            out[i] = task(shared, *points[i])
            done[0] += 1
            if on_done is not None:
                on_done(done[0], i)
    return out


def _worker() -> None:
    # the pickles go out on a private copy of stdout; file descriptor 1 itself, where C libraries
    # write (the solver's banner), is pointed at /dev/null and Python's print at stderr
    stdout = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    sys.stdout = sys.stderr
    stdin = sys.stdin.buffer
    task, shared = pickle.load(stdin)
    while (msg := pickle.load(stdin)) is not None:
        i, point = msg
        try:
            reply = (True, task(shared, *point))
        except Exception as e:          # sent back to be raised in the caller
            try:
                pickle.dumps(e)
            except Exception:
                e = RuntimeError(f"{type(e).__name__}: {e}")
            reply = (False, e)
        pickle.dump(reply, stdout)
        stdout.flush()


if __name__ == "__main__":
    _worker()
