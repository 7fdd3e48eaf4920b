"""Training-loop utilities: JSONL metrics log, progress line, MFU, peak memory, LR schedule."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
import torch

from meshplan.errors import ConfigError
from meshplan.train.metrics import (MetricsLog, Progress, StepMetrics, format_progress, human_count, mfu,
                                      peak_memory_gb, read_metrics, reset_peak_memory)
from meshplan.train.lr_schedule import lr_at, set_lr, warmup_cosine


def _m(step: int, **kw) -> StepMetrics:
    base = dict(step=step, loss=3.21, grad_norm=0.9, lr=3e-4, tokens_per_s=4100.0, step_time_s=0.84,
                predicted_step_time_s=0.80, mfu=0.012)
    return StepMetrics(**{**base, **kw})


# ---- metrics log -------------------------------------------------------------------------
def test_jsonl_log_round_trip_and_fields(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsLog(path) as log:
        for k in range(3):
            log.write(_m(k, loss=3.0 - k, peak_memory_gb=1.5))
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    rec = json.loads(lines[0])
    assert set(rec) == {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "cpu_time_s", "cpu_update_s",
                        "predicted_step_time_s", "mfu", "peak_memory_gb"}
    assert rec["step"] == 0 and rec["loss"] == 3.0 and rec["peak_memory_gb"] == 1.5
    assert [r["loss"] for r in read_metrics(path)] == [3.0, 2.0, 1.0]


def test_log_appends_after_resume_and_survives_a_torn_line(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        for k in range(5):
            log.write(_m(k))
    with open(path, "a") as f:                       # a crash half-way through a record
        f.write('{"step": 5, "loss": 2.')
    with MetricsLog(path) as log:                    # resumed from the checkpoint of step 3
        for k in (4, 5, 6):
            log.write(_m(k, loss=1.0))
    recs = read_metrics(path)
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4, 5, 6]
    assert recs[4]["loss"] == 1.0                    # the resumed run's record of step 4 wins
    assert len(read_metrics(path, last_per_step=False)) == 8


def test_two_writers_never_interleave(tmp_path):
    path = tmp_path / "m.jsonl"
    a, b = MetricsLog(path), MetricsLog(path)
    for k in range(50):
        (a if k % 2 else b).write({"step": k, "loss": 1.0, "note": "x" * 500})
    a.close()
    b.close()
    assert [r["step"] for r in read_metrics(path)] == list(range(50))
    with pytest.raises(ConfigError, match="closed"):
        a.write(_m(0))


def test_nan_loss_is_written_as_null(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        log.write(_m(0, loss=float("nan")))
    assert read_metrics(path)[0]["loss"] is None


def test_step_metrics_validation():
    with pytest.raises(ConfigError, match="step must be"):
        _m(-1)
    with pytest.raises(ConfigError, match="loss must be a number"):
        _m(0, loss="3.2")
    with pytest.raises(ConfigError, match="step_time_s must be >= 0"):
        _m(0, step_time_s=-1.0)


# ---- progress line -----------------------------------------------------------------------
def test_progress_format():
    assert format_progress(_m(12), 100) == "step 12/100 loss 3.21 tok/s 4.1k step 0.84 s (pred 0.80 s) mfu 1.2%"
    bare = StepMetrics(step=3, loss=5.5, lr=1e-3, tokens_per_s=812.0, step_time_s=1.5)
    assert format_progress(bare) == "step 3 loss 5.50 tok/s 812 step 1.50 s"
    assert format_progress(_m(1, peak_memory_gb=12.34), 2).endswith("mfu 1.2% mem 12.3 GB")
    assert [human_count(x) for x in (999, 1000, 2.5e6, 3e9)] == ["999", "1.0k", "2.5M", "3.0G"]


def test_progress_tty_rewrites_one_line():
    out = io.StringIO()
    p = Progress(total_steps=100, stream=out, tty=True)
    p.update(_m(9, loss=10.5))
    p.update(_m(10))
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    first, second = text.split("\r")[1:]
    assert len(second.rstrip("\n")) >= len(first)     # the shorter line covers the longer one


def test_progress_plain_lines_when_not_a_tty():
    out = io.StringIO()
    p = Progress(total_steps=5, stream=out)           # StringIO.isatty() is False
    for k in range(3):
        p.update(_m(k))
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 3 and lines[2].startswith("step 2/5 loss")


# ---- MFU and memory ----------------------------------------------------------------------
def test_mfu():
    # 8 GPUs at 989 TFLOP/s for 2 s could do 15.8 PFLOP; a 6.3 PFLOP step is 40 %
    assert mfu(0.4 * 8 * 989e12 * 2.0, 2.0, 989e12, 8) == pytest.approx(0.4)
    with pytest.raises(ConfigError, match="positive step time"):
        mfu(1e12, 0.0, 989e12, 8)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="compares with /proc/self/status")
def test_cpu_peak_memory_is_max_rss():
    if torch.cuda.is_available():
        pytest.skip("on CUDA the peak is torch's allocator peak")
    big = torch.ones(64 * 2**20, dtype=torch.uint8)               # touch 64 MiB
    got = peak_memory_gb()
    hwm_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    assert got == pytest.approx(hwm_kib / 2**20, rel=0.05)        # VmHWM is the same peak in KiB
    assert got > 64 / 1024
    reset_peak_memory()                                           # a no-op on CPU, must not fail
    del big


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_memory():
    reset_peak_memory("cuda")
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    assert peak_memory_gb("cuda") >= 0.25
    del x


# ---- LR schedule -------------------------------------------------------------------------
def test_lr_schedule_boundaries():
    kw = dict(base_lr=1e-3, warmup=10, total=110, min_lr=1e-4)
    assert lr_at(0, **kw) == pytest.approx(1e-4)                 # (0 + 1) / 10 of base
    assert lr_at(4, **kw) == pytest.approx(5e-4)
    assert lr_at(9, **kw) == pytest.approx(1e-3)                 # warm-up ends at base
    assert lr_at(10, **kw) == pytest.approx(1e-3)                # cosine starts at base
    assert lr_at(60, **kw) == pytest.approx(5.5e-4)              # half way: mean of base and floor
    assert lr_at(109, **kw) == pytest.approx(1e-4 + 0.45e-3 * (1 + math.cos(math.pi * 99 / 100)))
    assert lr_at(110, **kw) == lr_at(10_000, **kw) == pytest.approx(1e-4)
    rates = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))         # never rises after warm-up
    assert lr_at(0, base_lr=1.0, warmup=0, total=5) == 1.0       # no warm-up
    assert lr_at(4, base_lr=1.0, warmup=5, total=5) == 1.0       # all warm-up


def test_lr_schedule_errors():
    with pytest.raises(ConfigError, match="warm-up \\(20 steps\\) is longer than the run \\(10 steps\\)"):
        lr_at(0, base_lr=1e-3, warmup=20, total=10)
    with pytest.raises(ConfigError, match="min_lr must lie between 0 and"):
        lr_at(0, base_lr=1e-3, warmup=1, total=10, min_lr=1e-2)
    with pytest.raises(ConfigError, match="learning rate must be a positive"):
        lr_at(0, base_lr=0.0, warmup=1, total=10)
    with pytest.raises(ConfigError, match="step must be"):
        lr_at(-1, base_lr=1e-3, warmup=1, total=10)


def test_lambda_lr_matches_lr_at_per_group():
    w1, w2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [w1], "lr": 1e-3}, {"params": [w2], "lr": 2e-3}])
    sched = warmup_cosine(opt, warmup=3, total=20, min_lr_ratio=0.1)
    for step in range(25):
        for group, base in zip(opt.param_groups, (1e-3, 2e-3)):
            assert group["lr"] == pytest.approx(lr_at(step, base_lr=base, warmup=3, total=20, min_lr=0.1 * base))
        opt.step()
        sched.step()
    set_lr(opt, 5e-5)
    assert [g["lr"] for g in opt.param_groups] == [5e-5, 5e-5]


def test_a_run_far_from_its_prediction_says_how_to_price_this_machine(tmp_path):
    """The run summary names `meshplan calibrate` when the mean step is 1.5x off the prediction
    either way (a preset's rates come from another machine), and says nothing within it."""
    import io

    from meshplan.train.metrics import StepMetrics
    from meshplan.train.observe import RunSummary

    def summary(measured: float, predicted: float) -> str:
        s = RunSummary(seq_len=128)
        for step in (1, 2):
            s.add(StepMetrics(step=step, loss=2.0, lr=1e-3, tokens_per_s=1.0, step_time_s=measured,
                              predicted_step_time_s=predicted, global_batch=16))
        out = io.StringIO()
        s.finish(tmp_path, checkpoint=None, stream=out)
        return out.getvalue()

    far = summary(0.44, 0.134)
    assert "measured 3.3x the predicted step" in far and "meshplan calibrate --quick" in far
    assert "calibrate" not in summary(0.14, 0.134)
    assert "measured 0.3x the predicted step" in summary(0.04, 0.134)
