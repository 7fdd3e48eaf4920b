"""`meshplan train` across machines and under launchers: two "nodes" of two processes on
localhost (torchrun c10d rendezvous), `meshplan launch --plan p.json -- meshplan train --plan
p.json`, options torchrun must not read, and a rendezvous nobody answers.

Each `meshplan` command that starts processes runs as a user runs it, in a subprocess
(tests/runtime/procs.py: a timeout that stretches with the machine's load, and a failure naming
what was running); `meshplan train --plan p.json` alone is test_train.py's killed-rank test. Options
refused before anything starts (bad node options, a rendezvous nobody answers) are checked through
`meshplan.cli.main` in this process."""

from __future__ import annotations

import json
import math
import socket
import sys
import time

import pytest

import procs
from meshplan.train.launch import target_spec, torchrun_command

COMMON = ["--steps", "2", "--global-batch", "8", "--seq-len", "32", "--precision", "fp32",
          "--checkpoint-every", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _meshplan(*args, what: str, cwd, timeout=240, start_only=False):
    """`meshplan ARGS` in a subprocess (tests/runtime/procs.py: a timeout that stretches with the
    load, and a failure naming `what`); started only, to finish later, if start_only."""
    proc = procs.Proc([sys.executable, "-m", "meshplan.cli", *args], what=f"meshplan {args[0]} ({what})",
                      timeout=timeout, cwd=cwd)
    return proc if start_only else proc.finish()


def test_torchrun_does_not_read_meshplan_options():
    """torchrun's parser stops on `--nproc` (an ambiguous prefix of its --nproc-per-node); the
    command meshplan writes keeps it away from the words after the module."""
    from torch.distributed.run import get_args_parser
    cmd = torchrun_command(2, target_spec(["meshplan", "train", "--nproc", "2", "--max-restarts", "1"]))
    parsed = get_args_parser().parse_args(cmd[3:])
    assert parsed.nproc_per_node == "2" and parsed.max_restarts == 0
    assert parsed.training_script == "meshplan.cli"
    # Python's argparse keeps or drops the `--` depending on its version; meshplan.cli takes both
    args = parsed.training_script_args
    assert args[args[:1] == ["--"]:] == ["train", "--nproc", "2", "--max-restarts", "1"]
    from meshplan import cli
    with pytest.raises(SystemExit):          # cli drops the `--` and parses the rest as its own
        cli.main(["--", "train", "--help"])


def test_two_nodes_on_localhost(tmp_path):
    port = _free_port()
    args = [*COMMON, "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-timeout", "60", "--out", str(tmp_path / "o")]
    node1 = _meshplan("train", *args, "--node-rank", "1", what="node 1 of 2 on localhost", cwd=tmp_path,
                      start_only=True)
    try:
        node0 = _meshplan("train", *args, "--node-rank", "0", what="node 0 of 2 on localhost", cwd=tmp_path)
        r1 = node1.finish()
    finally:
        if node1.proc.poll() is None:                    # node 0 failed the test: do not leave node 1 behind
            node1.proc.kill()
            node1.proc.communicate()
    assert node0.returncode == 0, node0.stderr[-3000:]
    assert r1.returncode == 0, r1.stderr[-3000:]
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert plan["cluster"]["nodes"] == 2 and plan["cluster"]["gpus_per_node"] == 2
    assert math.prod(plan["mesh"].values()) == 4
    log = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2]
    assert (tmp_path / "o" / "checkpoints" / "step_000002" / "meta.json").is_file()


def test_launch_a_saved_plan(tmp_path):
    """The README's two-step form: plan once, launch the plan's processes, each running train.
    (`meshplan train --plan` alone, which takes its process count from the plan: test_train.py's
    killed-rank test, whose two runs train a saved plan.)"""
    import meshplan as mp
    from meshplan.cluster import Cluster
    plan = mp.plan(mp.models.build("tiny-llama", seq_len=32, device="meta"),
                   Cluster(gpu="cpu", num_gpus=2, gpus_per_node=2), seq_len=32, global_batch=8,
                   fixed={"dp": 2})
    plan.save(tmp_path / "p.json")
    # `meshplan launch --plan` running `meshplan train --plan` in each process
    r = _meshplan("launch", "--plan", str(tmp_path / "p.json"), "--", "meshplan", "train", "--plan",
                  str(tmp_path / "p.json"), *COMMON, "--out", str(tmp_path / "o"),
                  what="a saved plan's processes, each running train --plan", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trained steps 1..2" in r.stdout, r.stdout[-2000:]


@pytest.mark.filterwarnings("ignore:precision='fp32'")     # the plan's own note: --precision fp32 (COMMON)
def test_unreachable_rendezvous_names_the_endpoint(tmp_path, capsys):
    """Checked before torchrun starts, so in this process (`meshplan train`'s own code path)."""
    from meshplan import cli
    port = _free_port()
    t0 = time.monotonic()
    code = cli.main(["train", *COMMON, "--nproc", "1", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                     f"127.0.0.1:{port}", "--rdzv-timeout", "2", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2
    assert f"could not reach the rendezvous at 127.0.0.1:{port} within 2 s" in err, err[-2000:]
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize("args, message", [
    (["--nnodes", "2"], "need --rdzv-endpoint"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "outside 0..1"),
    (["--nnodes", "0"], "--nnodes must be >= 1"),
])
def test_bad_node_options(tmp_path, capsys, args, message):
    """Refused before anything starts: in this process (`meshplan train`'s own code path)."""
    from meshplan import cli
    code = cli.main(["train", *args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err[-2000:]
