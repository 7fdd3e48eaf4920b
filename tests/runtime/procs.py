"""Subprocesses for the tests (`meshplan train` under torchrun, benchmark scripts) with a timeout
that survives a loaded machine and a failure that says what was running.

The timeout counts quiet-machine seconds, as meshplan.train.spawn.run_ranks does: while the
1-minute load average exceeds the core count, a wall-clock second counts as 1/(load / cores)
(never stretching beyond spawn.MAX_STRETCH times). When it expires, the process gets SIGTERM
(meshplan's launcher passes it on to torchrun, which stops its ranks), then SIGKILL, and the
test fails naming `what`, the command, how long it ran, the load and the output so far.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time

import pytest

from meshplan.train import spawn

GRACE_S = 20.0        # after SIGTERM, for the launcher to stop torchrun and its ranks


class Proc:
    """A started subprocess (text stdout / stderr captured); `finish()` waits for it."""

    def __init__(self, cmd: list[str], *, what: str, timeout: float, **kw) -> None:
        self.cmd, self.what, self.timeout = [str(c) for c in cmd], what, timeout
        # the test session's fork-server preloads (tests/conftest.py) pay off over many spawned
        # worlds, not in a subprocess that spawns one
        kw.setdefault("env", {k: v for k, v in os.environ.items() if k != spawn.PRELOAD_ENV})
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, **kw)

    def finish(self) -> subprocess.CompletedProcess:
        """Wait for the process; its output. Sets quiet_elapsed: the seconds it ran, counted as
        the timeout counts them (wall-clock seconds over the load factor)."""
        last, peak = time.monotonic(), 0.0
        # the time since the start (spent waiting for something else, if anything): at today's load
        self.quiet_elapsed = (last - self.started) / spawn.load_factor(spawn._load())
        while True:
            try:
                out, err = self.proc.communicate(timeout=1.0)
                return subprocess.CompletedProcess(self.cmd, self.proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                pass
            finally:
                now = time.monotonic()
                load = spawn._load()
                peak = max(peak, load or 0.0)
                self.quiet_elapsed += (now - last) / spawn.load_factor(load)
                last = now
            if self.quiet_elapsed > self.timeout or now - self.started > self.timeout * spawn.MAX_STRETCH:
                self._fail(now - self.started, peak)

    def _fail(self, elapsed: float, peak: float) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, err = self.proc.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = self.proc.communicate()
        load = spawn._load()
        pytest.fail(
            f"{self.what} did not finish within {self.timeout:.0f} s (stopped after {elapsed:.0f} s wall clock; "
            f"the limit stretches while the 1-minute load average exceeds the {spawn._cores()} cores: now "
            f"{spawn._fmt(load)}, highest seen {peak:.1f}).\n"
            f"command: {shlex.join(self.cmd)}\n"
            f"--- its stdout (last 3000 characters) ---\n{(out or '')[-3000:]}\n"
            f"--- its stderr (last 5000 characters) ---\n{(err or '')[-5000:]}", pytrace=False)


def run(cmd: list[str], *, what: str, timeout: float, **kw) -> subprocess.CompletedProcess:
    """Run `cmd` to the end (see the module docstring); `what` names it in a timeout's failure."""
    return Proc(cmd, what=what, timeout=timeout, **kw).finish()
