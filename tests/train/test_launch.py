"""`meshplan launch`: torchrun command lines, Slurm scripts, and real local launches."""

from __future__ import annotations

import os
import signal
import stat
import sys
import textwrap
from types import SimpleNamespace

import pytest

from meshplan import cli
from meshplan.errors import ConfigError
from meshplan.train.launch import (SlurmJob, Target, launch_local, layout_from_plan, slurm_script, submit_slurm,
                                     target_spec, torchrun_command)

PY = [sys.executable, "-m", "torch.distributed.run"]


# ---- targets and torchrun command lines --------------------------------------------------
def test_target_spec_forms():
    assert target_spec(["--", "train.py", "--lr", "1"]) == Target(args=("train.py", "--lr", "1"))
    assert target_spec(["-m", "pkg.train", "-x"]) == Target(args=("pkg.train", "-x"), module=True)
    assert target_spec(["meshplan", "train", "--model", "tiny-llama"]) == \
        Target(args=("meshplan.cli", "train", "--model", "tiny-llama"), module=True)
    assert target_spec(["python", "train.py"]) == Target(args=("train.py",))
    assert target_spec(["./run.sh", "a"]) == Target(args=("./run.sh", "a"), no_python=True)
    for bad in ([], ["--"], ["-m"]):
        with pytest.raises(ConfigError):
            target_spec(bad)


def test_torchrun_command_local():
    assert torchrun_command(4, ["train.py", "--lr", "3e-4"]) == \
        PY + ["--standalone", "--nproc-per-node", "4", "train.py", "--lr", "3e-4"]
    assert torchrun_command(2, ["meshplan.runtime.train_main", "--steps", "5"], module=True, max_restarts=3) == \
        PY + ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--module",
              "meshplan.runtime.train_main", "--steps", "5"]
    assert torchrun_command(1, target_spec(["./run.sh"]))[-2:] == ["--no-python", "./run.sh"]


def test_torchrun_command_multi_node():
    assert torchrun_command(8, ["t.py"], nnodes=2, rdzv_endpoint="node001:29500", rdzv_id="job7") == \
        PY + ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node001:29500", "--rdzv-id", "job7",
              "--nproc-per-node", "8", "t.py"]
    with pytest.raises(ConfigError, match="2 nodes need a rendezvous endpoint.*--rdzv-endpoint host:port"):
        torchrun_command(8, ["t.py"], nnodes=2)
    with pytest.raises(ConfigError, match="must be host:port"):
        torchrun_command(8, ["t.py"], nnodes=2, rdzv_endpoint="node001")
    with pytest.raises(ConfigError, match="nproc per node must be a whole number >= 1"):
        torchrun_command(0, ["t.py"])


def test_layout_from_plan():
    def plan(world, gpn):
        return SimpleNamespace(world_size=world, cluster={"gpus_per_node": gpn, "nodes": max(1, world // gpn)})
    assert layout_from_plan(plan(16, 8)) == (2, 8)
    assert layout_from_plan(plan(4, 8)) == (1, 4)
    assert layout_from_plan(plan(16, 8), nnodes=4) == (4, 4)
    with pytest.raises(ConfigError, match="12 processes, not a multiple of its cluster's 8 GPUs"):
        layout_from_plan(plan(12, 8))
    with pytest.raises(ConfigError, match="do not split evenly over 3 nodes"):
        layout_from_plan(plan(16, 8), nnodes=3)


# ---- Slurm -------------------------------------------------------------------------------
def test_slurm_script_content():
    job = SlurmJob(target=target_spec(["meshplan", "train", "--model", "tiny llama"]), nodes=4, gpus_per_node=8,
                   time="04:00:00", partition="gpu", account="proj42", max_restarts=2, job_name="llama")
    text = slurm_script(job)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    for expected in ["#SBATCH --job-name=llama", "#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1",
                     "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=64", "#SBATCH --time=04:00:00",
                     "#SBATCH --partition=gpu", "#SBATCH --account=proj42", "#SBATCH --output=meshplan-%j.out",
                     'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)', "RDZV_PORT=29500",
                     "export NCCL_DEBUG=WARN", "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                     "export OMP_NUM_THREADS=8"]:
        assert expected in lines, expected
    assert any("NCCL_IB_HCA" in line and line.startswith("#") for line in lines)   # left to the site
    # the srun line, joined across its continuations
    srun = text[text.index("srun "):].replace("\\\n", " ")
    assert " ".join(srun.split()) == (
        'srun --kill-on-bad-exit=1 --cpus-per-task=64 torchrun --nnodes "$SLURM_NNODES" --rdzv-backend c10d '
        '--rdzv-endpoint "$HEAD_NODE:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID" --nproc-per-node 8 --max-restarts 2 '
        "--module meshplan.cli -- train --model 'tiny llama'")
    assert text.index("#SBATCH") < text.index("set -euo pipefail")   # sbatch reads directives before code


def test_slurm_script_defaults_and_validation():
    text = slurm_script(SlurmJob(target=target_spec(["train.py"]), nodes=1, gpus_per_node=2))
    assert "#SBATCH --partition" not in text and "#SBATCH --account" not in text
    assert "#SBATCH --cpus-per-task=16" in text and "--max-restarts" not in text
    bad = dict(target=target_spec(["train.py"]), nodes=1, gpus_per_node=2)
    with pytest.raises(ConfigError, match="time limit '1 hour' is not a Slurm time"):
        SlurmJob(**bad, time="1 hour")
    with pytest.raises(ConfigError, match="partition 'my gpus' must be a non-empty word"):
        SlurmJob(**bad, partition="my gpus")
    with pytest.raises(ConfigError, match="nodes must be"):
        SlurmJob(**{**bad, "nodes": 0})
    for ok in ("90", "2-00:00:00", "1-12", "30:00"):
        SlurmJob(**bad, time=ok)


def _write_plan(path, *, world_mesh, gpus_per_node, nodes):
    import meshplan as mp
    from meshplan.api import Plan
    from meshplan.ir.layout import Layout
    lay = Layout(**world_mesh)
    est = mp.estimate("tiny-llama", mp.Cluster(gpu="h100-sxm", num_gpus=lay.world, gpus_per_node=gpus_per_node),
                      lay, seq_len=128, global_batch=8)
    plan = Plan(model="tiny-llama", model_fingerprint="m", cluster={"name": "c", "gpus_per_node": gpus_per_node,
                                                                   "nodes": nodes},
                cluster_fingerprint="c", seq_len=128, global_batch=8, precision="bf16", layout=lay,
                placements={}, stages=((),) * lay.pp, num_microbatches=1, estimate=est)
    plan.save(path)
    return path


def test_cli_slurm_from_plan_dry_run(tmp_path, capsys):
    plan = _write_plan(tmp_path / "plan.json", world_mesh={"pp": 2, "dp": 4, "cp": 1, "tp": 2}, gpus_per_node=8,
                       nodes=2)
    assert cli.main(["launch", "--plan", str(plan), "--slurm", "--dry-run", "--partition", "gpu", "--",
                     "meshplan", "train", "--plan", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --nodes=2\n" in out and "#SBATCH --gpus-per-node=8\n" in out
    assert "world size 16" in out and "--nproc-per-node 8" in out


def test_cli_slurm_submits_with_sbatch(tmp_path, capsys, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "sbatch"
    fake.write_text(f"#!/bin/sh\ncp \"$1\" {tmp_path}/submitted.sh\necho 'Submitted batch job 4242'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    script = tmp_path / "job.sh"
    assert cli.main(["launch", "--nproc", "4", "--nnodes", "2", "--slurm", "--out", str(script), "--",
                     "train.py"]) == 0
    assert "Submitted batch job 4242" in capsys.readouterr().out
    assert (tmp_path / "submitted.sh").read_text() == script.read_text()
    assert os.access(script, os.X_OK)


def test_cli_slurm_without_sbatch(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))                      # no sbatch anywhere
    script = tmp_path / "job.sh"
    assert cli.main(["launch", "--nproc", "2", "--slurm", "--out", str(script), "--", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "sbatch was not found on PATH" in err and "--dry-run" in err
    assert script.exists()                                         # still written, to submit by hand
    with pytest.raises(ConfigError, match="sbatch was not found"):
        submit_slurm(str(script))


def test_cli_local_dry_run_and_errors(capsys):
    assert cli.main(["launch", "--nproc", "3", "--max-restarts", "1", "--dry-run", "--", "-m", "pkg.train"]) == 0
    assert capsys.readouterr().out.split()[1:] == ["-m", "torch.distributed.run", "--standalone",
                                                   "--nproc-per-node", "3", "--max-restarts", "1", "--module",
                                                   "pkg.train"]
    assert cli.main(["launch", "--dry-run", "--", "train.py"]) == 2
    assert "--nproc N" in capsys.readouterr().err
    assert cli.main(["launch", "--nproc", "2", "--nnodes", "2", "--dry-run", "--", "train.py"]) == 2
    assert "rendezvous endpoint" in capsys.readouterr().err
    assert cli.main(["launch", "--plan", "missing.json", "--", "train.py"]) == 2
    assert "meshplan plan" in capsys.readouterr().err


# ---- real local launches (torchrun, gloo) ------------------------------------------------
ALL_REDUCE = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as f:
        f.write(f"{world} {t.item():.0f} {os.environ['LOCAL_RANK']}")
    dist.destroy_process_group()
""")

FAIL_ONCE = textwrap.dedent("""
    import os, sys, pathlib
    out, rank = pathlib.Path(sys.argv[1]), os.environ["RANK"]
    marker = out / "failed-once"
    if rank == "0" and not marker.exists():
        marker.write_text("attempt 0 failed on purpose")
        sys.exit(3)
    (out / f"ok{rank}").write_text(os.environ["TORCHELASTIC_RESTART_COUNT"])
""")


@pytest.mark.slow
def test_real_launch_two_ranks_all_reduce(tmp_path, capsys):
    script = tmp_path / "allreduce.py"
    script.write_text(ALL_REDUCE)
    assert cli.main(["launch", "--nproc", "2", "--", str(script), str(tmp_path)]) == 0
    assert (tmp_path / "rank0.txt").read_text() == "2 3 0"         # 1 + 2 summed over both ranks
    assert (tmp_path / "rank1.txt").read_text() == "2 3 1"
    assert "launching 2 process(es)" in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups, /proc")
def test_stop_kills_what_the_launcher_left_behind(tmp_path):
    import subprocess
    import time
    from meshplan.train.launch import _stop
    pidfile = tmp_path / "child.pid"
    # a launcher that dies on SIGTERM but leaves a child running, the case the group kill is for
    proc = subprocess.Popen(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], start_new_session=True)
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text().strip():
            break
        time.sleep(0.05)
    child = int(pidfile.read_text())
    t0 = time.perf_counter()
    _stop(proc, signal.SIGTERM, grace_s=5.0)
    assert time.perf_counter() - t0 < 5.0 and proc.returncode is not None
    for _ in range(100):                       # the orphaned child is dead (a zombie until init reaps it)
        if not _alive(child):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the launcher's child survived _stop")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_real_launch_restarts_after_a_failure(tmp_path):
    script = tmp_path / "fail_once.py"
    script.write_text(FAIL_ONCE)
    assert launch_local(2, [str(script), str(tmp_path)], max_restarts=1, timeout_s=120) == 0
    assert (tmp_path / "failed-once").exists()
    assert (tmp_path / "ok0").read_text() == "1" and (tmp_path / "ok1").read_text() == "1"   # the restarted group
    (tmp_path / "failed-once").unlink()
    assert launch_local(1, [str(script), str(tmp_path)], timeout_s=120) != 0                 # no restarts: fails
