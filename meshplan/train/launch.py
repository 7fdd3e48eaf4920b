"""Start training processes: torchrun on this machine, or a Slurm batch script (srun + torchrun).

The target is what each process runs: a Python script (``train.py --lr 3e-4``), a module
(``-m meshplan.runtime.train_main ...``), the ``meshplan`` command itself (``meshplan train
...``, run as ``python -m meshplan.cli train ...`` so every rank uses this same Python), or any
other executable (run as-is, torchrun's ``--no-python``). `target_spec` turns the words after
``meshplan launch ... --`` into that form.

Locally, one node: ``python -m torch.distributed.run --standalone --nproc-per-node N ...``.
On Slurm: one task per node, each running torchrun with a c10d rendezvous on the first node of
the allocation, so PyTorch's elastic agent (restarts included) works the same on both.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshplan.errors import ConfigError

__all__ = ["Target", "target_spec", "torchrun_command", "launch_local", "SlurmJob", "slurm_script",
           "submit_slurm", "layout_from_plan", "wait_for_endpoint", "under_torchrun", "DEFAULT_RDZV_PORT"]

# 29500: the MASTER_PORT of PyTorch's distributed tutorials (torchrun's own multi-node example
# uses 29400); any port free on the head node works.
DEFAULT_RDZV_PORT = 29500
# Cores to ask Slurm for per GPU when the user does not say: a DGX H100 has 112 cores for 8 GPUs
# (2 x Xeon Platinum 8480C, NVIDIA DGX H100 user guide), 14 per GPU; 8 leaves room on nodes with
# fewer cores while giving each rank's data reading and NCCL proxy threads their own cores.
DEFAULT_CPUS_PER_GPU = 8
# seconds torchrun gets to stop its workers after SIGINT/SIGTERM before the group is killed: its
# own wait for workers (torchrun --shutdown-timeout, torch 2.13 help text) defaults to 30 s
STOP_GRACE_S = 35.0
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$")    # sbatch --time forms


@dataclass(frozen=True, kw_only=True)
class Target:
    """What every process runs: `args[0]` is a script path, a module (module=True) or an
    executable (no_python=True), followed by its arguments."""

    args: tuple[str, ...]
    module: bool = False
    no_python: bool = False

    def __post_init__(self) -> None:
        if not self.args:
            raise ConfigError("nothing to launch: give a script, `-m module`, or `meshplan train ...` after --")
        if self.module and self.no_python:
            raise ConfigError("a target is either a Python module or an executable, not both")


def target_spec(words: Sequence[str]) -> Target:
    """The words after ``--``: ``script.py args``, ``-m module args``, ``meshplan sub args`` or ``exe args``."""
    words = list(words)
    if words and words[0] == "--":
        words = words[1:]
    if not words:
        raise ConfigError("nothing to launch: put the command after --, e.g. "
                          "`meshplan launch --nproc 4 -- train.py` or `... -- meshplan train --model tiny-llama`")
    head = words[0]
    if head in ("-m", "--module"):
        if len(words) < 2:
            raise ConfigError("-m needs a module name, e.g. -m meshplan.cli train")
        return Target(args=tuple(words[1:]), module=True)
    if head == "meshplan":
        return Target(args=("meshplan.cli", *words[1:]), module=True)
    if head in ("python", "python3") or head == sys.executable:
        return target_spec(words[1:])            # torchrun already runs the script with Python
    if head.endswith(".py"):
        return Target(args=tuple(words))
    return Target(args=tuple(words), no_python=True)


def under_torchrun() -> bool:
    """True inside a process that torchrun (or `meshplan launch`, or a Slurm script) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _check_count(name: str, value: Any, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be a whole number >= {low}, got {value!r}")


def torchrun_command(nproc: int, target_args: Sequence[str] | Target, *, nnodes: int = 1, max_restarts: int = 0,
                     rdzv_endpoint: str | None = None, rdzv_id: str | None = None, module: bool = False,
                     launcher: Sequence[str] | None = None, node_rank: int | None = None,
                     rdzv_timeout_s: float | None = None) -> list[str]:
    """The torchrun command line starting `nproc` processes per node.

    One node without an endpoint uses ``--standalone`` (a private rendezvous on a free port);
    several nodes need `rdzv_endpoint` (host:port of a store every node reaches). `launcher`
    defaults to this interpreter's ``python -m torch.distributed.run`` (torchrun's own module),
    so no PATH lookup can pick another Python. `module` applies to a plain list of words; a
    `Target` (from `target_spec`) already says what it is.
    """
    _check_count("nproc per node", nproc)
    _check_count("nnodes", nnodes)
    _check_count("max_restarts", max_restarts, 0)
    target = target_args if isinstance(target_args, Target) else Target(args=tuple(target_args), module=module)
    cmd = list(launcher) if launcher is not None else [sys.executable, "-m", "torch.distributed.run"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd += ["--standalone"]
    else:
        if rdzv_endpoint is None:
            raise ConfigError(f"{nnodes} nodes need a rendezvous endpoint every node can reach: "
                              f"pass --rdzv-endpoint host:port (the first node's address), or use --slurm")
        if ":" not in rdzv_endpoint and not rdzv_endpoint.startswith("$"):
            raise ConfigError(f"rendezvous endpoint {rdzv_endpoint!r} must be host:port, e.g. node001:{DEFAULT_RDZV_PORT}")
        cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint]
        if rdzv_id is not None:
            cmd += ["--rdzv-id", rdzv_id]
        if node_rank is not None:
            # c10d orders nodes by arrival; the rank still names this node in torchrun's logs
            _check_count("node rank", node_rank, 0)
            cmd += ["--node-rank", str(node_rank)]
    cmd += ["--nproc-per-node", str(nproc)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    if rdzv_timeout_s is not None and not (nnodes == 1 and rdzv_endpoint is None):
        cmd += ["--rdzv-conf", f"join_timeout={int(rdzv_timeout_s)}"]
    if target.module:
        cmd += ["--module"]
    elif target.no_python:
        cmd += ["--no-python"]
    return cmd + _target_words(target)


def _target_words(target: Target) -> list[str]:
    """The words after torchrun's own flags."""
    args = list(target.args)
    if target.module and args[:1] == ["meshplan.cli"]:
        # torchrun's parser reads every word that looks like one of its options, even after the
        # module name, and stops on prefixes it finds ambiguous (`--nproc` -> "ambiguous option");
        # after `--` it reads none, and meshplan.cli drops the `--`
        args.insert(1, "--")
    return args


def launch_local(nproc: int, target_args: Sequence[str] | Target, *, nnodes: int = 1, max_restarts: int = 0,
                 rdzv_endpoint: str | None = None, module: bool = False, env: Mapping[str, str] | None = None,
                 cwd: str | None = None, timeout_s: float | None = None, grace_s: float = STOP_GRACE_S,
                 node_rank: int | None = None, rdzv_timeout_s: float | None = None) -> int:
    """Run torchrun here and wait; returns its exit code (0 when every rank succeeded).

    `env` adds variables on top of this process's environment. torchrun runs in its own process
    group so that nothing it started can outlive it: on Ctrl-C it gets SIGINT (exit code 130), on
    SIGTERM/SIGHUP to this process SIGTERM (128 + the signal), after `timeout_s` SIGTERM (exit
    code 124, as coreutils' timeout); it then has `grace_s` seconds to stop its workers before
    whatever is left of the group is killed.
    """
    cmd = torchrun_command(nproc, target_args, nnodes=nnodes, max_restarts=max_restarts,
                           rdzv_endpoint=rdzv_endpoint, module=module, node_rank=node_rank,
                           rdzv_timeout_s=rdzv_timeout_s)
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True)
    # torchrun is in its own session, so signals meant for this process must be passed on by hand
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, _raise_terminated)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc, signal.SIGTERM, grace_s)
        return 124
    except KeyboardInterrupt:
        _stop(proc, signal.SIGINT, grace_s)
        return 130
    except _Terminated as t:
        _stop(proc, signal.SIGTERM, grace_s)
        return 128 + t.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Terminated(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated(signum)


def _stop(proc: subprocess.Popen, sig: int, grace_s: float) -> None:
    """Signal the launcher (torchrun stops its workers on SIGINT/SIGTERM), wait up to grace_s, then
    SIGKILL its whole process group. The group id stays reserved while any member lives (Linux
    does not reuse a pid in use as a group id), so the kill only reaches processes it started."""
    try:
        proc.send_signal(sig)
        proc.wait(timeout=grace_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt, _Terminated, ProcessLookupError):
        pass    # impatient user or launcher stuck: go straight to the group kill
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


# ---- plan -> process layout --------------------------------------------------------------
def wait_for_endpoint(endpoint: str, timeout_s: float, *, poll_s: float = 1.0) -> None:
    """Block until a TCP connection to `endpoint` (host:port) succeeds; ConfigError naming it after
    `timeout_s`. A node that is not the rendezvous host checks this before starting torchrun, whose
    own failure to reach the store is a long stack trace per process."""
    import socket
    import time
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"rendezvous endpoint {endpoint!r} must be host:port, e.g. node001:{DEFAULT_RDZV_PORT}")
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(poll_s, 5.0)):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise ConfigError(f"could not reach the rendezvous at {endpoint} within {timeout_s:g} s ({last}); "
                              "start node 0 first, check the host name and port, or raise --rdzv-timeout")
        time.sleep(poll_s)


def layout_from_plan(plan: Any, *, nnodes: int | None = None) -> tuple[int, int]:
    """(nodes, processes per node) for a `Plan`: its world size spread over its cluster's nodes."""
    world = plan.world_size
    gpn = int(plan.cluster.get("gpus_per_node") or world)
    if nnodes is not None:
        _check_count("nnodes", nnodes)
        if world % nnodes:
            raise ConfigError(f"the plan needs {world} processes, which do not split evenly over "
                              f"{nnodes} nodes; use a node count that divides {world}")
        return nnodes, world // nnodes
    if world <= gpn:
        return 1, world
    if world % gpn:
        raise ConfigError(f"the plan needs {world} processes, not a multiple of its cluster's "
                          f"{gpn} GPUs per node; pass --nnodes explicitly")
    return world // gpn, gpn


# ---- Slurm -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class SlurmJob:
    """One Slurm job: `nodes` nodes, one task per node running torchrun with `gpus_per_node` ranks."""

    target: Target
    nodes: int
    gpus_per_node: int
    cpus_per_task: int | None = None       # default: DEFAULT_CPUS_PER_GPU per GPU
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    job_name: str = "meshplan"
    output: str = "meshplan-%j.out"        # %j: Slurm's job id
    max_restarts: int = 0
    rdzv_port: int = DEFAULT_RDZV_PORT
    comment: str = ""
    extra_env: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        _check_count("nodes", self.nodes)
        _check_count("GPUs per node", self.gpus_per_node)
        _check_count("max_restarts", self.max_restarts, 0)
        if self.cpus_per_task is not None:
            _check_count("cpus per task", self.cpus_per_task)
        if not _SLURM_TIME.match(self.time):
            raise ConfigError(f"time limit {self.time!r} is not a Slurm time; use e.g. 01:00:00, 90 "
                              "(minutes) or 2-00:00:00 (days-hours:minutes:seconds)")
        if not 1 <= self.rdzv_port <= 65535:
            raise ConfigError(f"rendezvous port {self.rdzv_port} is outside 1..65535")
        for name in ("partition", "account", "job_name", "output"):
            value = getattr(self, name)
            if value is not None and (not value or any(c.isspace() for c in value)):
                raise ConfigError(f"Slurm {name.replace('_', ' ')} {value!r} must be a non-empty word without spaces")
        for key, _ in self.extra_env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ConfigError(f"environment variable name {key!r} is not valid")

    @property
    def cpus(self) -> int:
        return self.cpus_per_task or DEFAULT_CPUS_PER_GPU * self.gpus_per_node


def slurm_script(job: SlurmJob) -> str:
    """The sbatch script text for `job`."""
    sbatch = [f"--job-name={job.job_name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
              f"--gpus-per-node={job.gpus_per_node}", f"--cpus-per-task={job.cpus}", f"--time={job.time}"]
    if job.partition:
        sbatch.append(f"--partition={job.partition}")
    if job.account:
        sbatch.append(f"--account={job.account}")
    sbatch.append(f"--output={job.output}")
    launcher = ["torchrun"]
    torchrun = torchrun_command(job.gpus_per_node, job.target, nnodes=job.nodes, max_restarts=job.max_restarts,
                                rdzv_endpoint="$HEAD_NODE:$RDZV_PORT", rdzv_id="$SLURM_JOB_ID",
                                launcher=launcher)
    words = _target_words(job.target)
    flags = torchrun[len(launcher):len(torchrun) - len(words)]
    flags[flags.index("--nnodes") + 1] = "$SLURM_NNODES"      # what Slurm actually granted
    lines = ["#!/bin/bash"] + [f"#SBATCH {s}" for s in sbatch]
    lines += [f"# written by `meshplan launch --slurm`{': ' + job.comment if job.comment else ''}",
              f"# {job.nodes} node(s) x {job.gpus_per_node} GPU(s) = {job.nodes * job.gpus_per_node} processes",
              "set -euo pipefail", "",
              "# rendezvous on the first node of the allocation",
              'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
              f"RDZV_PORT={job.rdzv_port}", "",
              "# NCCL: report warnings only; fail a hung collective instead of waiting forever",
              "export NCCL_DEBUG=WARN",
              "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
              "# InfiniBand / network interface choice (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, NCCL_IB_GID_INDEX,",
              "# ...) is left to the site's defaults; set them here if your cluster's guide says so.",
              "# OpenMP threads per rank: the task's cores split over its ranks (torchrun would force 1)",
              f"export OMP_NUM_THREADS={max(1, job.cpus // job.gpus_per_node)}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in job.extra_env]
    body = [" ".join(launcher)] + _flag_lines(flags) + [" ".join(shlex.quote(w) for w in words)]
    # --cpus-per-task again on srun: Slurm 22.05 stopped passing sbatch's value on to srun, and a
    # task pinned to one core would run all its ranks on it
    lines += ["", f"srun --kill-on-bad-exit=1 --cpus-per-task={job.cpus} " + " \\\n    ".join(body), ""]
    return "\n".join(lines)


def _shell_word(word: str) -> str:
    # "$VAR..." words must expand at run time: double quotes; everything else literally
    return f'"{word}"' if word.startswith("$") else shlex.quote(word)


def _flag_lines(flags: list[str]) -> list[str]:
    """torchrun flags one per line, each with its value (`--nnodes "$SLURM_NNODES"`)."""
    out: list[str] = []
    for w in flags:
        if w.startswith("--") or not out:
            out.append(_shell_word(w))
        else:
            out[-1] += " " + _shell_word(w)
    return out


def submit_slurm(script_path: str, *, sbatch: str | None = None) -> tuple[int, str]:
    """Run sbatch on the script; returns (exit code, sbatch's output). ConfigError if sbatch is missing."""
    exe = sbatch or shutil.which("sbatch")
    if exe is None:
        raise ConfigError(f"sbatch was not found on PATH, so the job was not submitted; the script is "
                          f"{script_path}: run it on a Slurm login node with `sbatch {script_path}`, "
                          "or use --dry-run to only write the script")
    proc = subprocess.run([exe, script_path], capture_output=True, text=True, check=False)
    return proc.returncode, (proc.stdout + proc.stderr).strip()
