"""FP8 plans and BF16 optimizer states in this process (world size 1, gloo; no spawning).

- plan(precision=...) takes train's names; an FP8 plan on CPU processes is emulated (warned) and
  its FP8 module set is the placement ILP's;
- parallelize swaps exactly Plan.fp8_modules (a transformers Llama here; meshplan's own model
  in test_fp8.py) and reports every module's precision; the explicit BF16 override and a missing
  backend package;
- loss trajectories: an FP8 run of the default job's model and data against the BF16 run, and
  bf16 Adam moments against fp32 moments (tolerances and measured numbers at each test). The
  three 60-step runs are independent and single-threaded: they run two at a time, each in a
  worker process with its own one-rank gloo group (tests/runtime/worlds.py).
"""

from __future__ import annotations

import functools
import json
import warnings

import pytest
import torch

import meshplan as mp
from meshplan.errors import ConfigError


pytestmark = pytest.mark.usefixtures("one_process_group")     # tests/conftest.py


def _plan(model, *, seq_len: int, global_batch: int, precision: str, **fixed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return mp.plan(model, mp.Cluster.preset("local-cpu", nproc=1), seq_len=seq_len, global_batch=global_batch,
                       precision=precision, fixed=fixed or None)


@functools.lru_cache(maxsize=None)
def _tiny_plan(precision: str, seq_len: int = 32, global_batch: int = 8, optimizer_dtype: str = "fp32"):
    model = mp.models.build("tiny-llama", seq_len=seq_len, device="meta")
    return _plan(model, seq_len=seq_len, global_batch=global_batch, precision=precision,
                 optimizer_dtype=optimizer_dtype)


def _tiny(seq_len: int = 32):
    torch.manual_seed(0)
    model = mp.models.build("tiny-llama", seq_len=seq_len, device="cpu")
    model.init_weights()
    return model


# ---- plan(): precision names ----------------------------------------------------------------------
def test_plan_takes_train_precision_names():
    model = mp.models.build("tiny-llama", seq_len=32, device="meta")
    with pytest.warns(UserWarning, match="planned with BF16 costs"):
        p32 = mp.plan(model, mp.Cluster.preset("local-cpu", nproc=1), seq_len=32, global_batch=8, precision="fp32")
    assert p32.precision == "fp32" and p32.fp8_modules == ()
    with pytest.warns(UserWarning, match="FP8 is emulated"):
        p8 = mp.plan(model, mp.Cluster.preset("local-cpu", nproc=1), seq_len=32, global_batch=8, precision="fp8")
    # the ILP's choice: every linear of the middle blocks; first/last block and the head stay BF16
    assert p8.precision == "fp8" and p8.notes.fp8_emulated
    assert {m.split(".")[1] for m in p8.fp8_modules} == {"1", "2"} and "output" not in p8.fp8_modules
    assert _tiny_plan("auto").precision == "bf16"          # local-cpu has no FP8 units to prefer
    with pytest.raises(ConfigError, match="fp32, bf16, fp16, fp8, auto"):
        mp.plan(model, mp.Cluster.preset("local-cpu", nproc=1), seq_len=32, global_batch=8, precision="int8")


def test_fp8_on_a_gpu_without_fp8_units_is_refused():
    if "dgx-a100" not in mp.Cluster.presets():
        pytest.skip("no A100 preset")
    with pytest.raises(ConfigError, match="no FP8 matrix units"):
        mp.plan("llama3-8b", mp.Cluster.preset("dgx-a100", nodes=1), seq_len=2048, global_batch=64, precision="fp8")


# ---- parallelize(): the swap and the report -------------------------------------------------------
def test_transformers_llama_swaps_exactly_the_planned_modules():
    pytest.importorskip("torchao")
    transformers = pytest.importorskip("transformers")
    from meshplan.runtime import parallelize
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    plan = _plan(model, seq_len=64, global_batch=4, precision="fp8")
    assert len(plan.fp8_modules) == 14          # 7 linears x the 2 middle blocks
    pm = parallelize(model, plan)
    swapped = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert swapped == set(plan.fp8_modules) == set(pm.fp8.modules)
    assert {n for n, p in pm.precisions.items() if p.startswith("fp8")} == swapped
    assert {p for n, p in pm.precisions.items() if n not in swapped} == {"bf16"}
    x = torch.randint(0, 256, (4, 65))
    loss = pm.forward_backward(x[:, :-1], x[:, 1:])
    assert 5.0 < loss < 6.0                     # ~ln(256) at initialisation


def test_explicit_bf16_override_runs_no_fp8_and_says_so():
    pytest.importorskip("torchao")
    from meshplan.runtime import parallelize
    from meshplan.cli.train import run_precision
    plan = _tiny_plan("fp8")
    kw = run_precision(plan, "bf16")
    assert kw == {"compute_dtype": torch.bfloat16, "fp8": False}
    model = _tiny()
    with pytest.warns(UserWarning, match="explicit precision override"):
        pm = parallelize(model, plan, **kw)
    assert pm.fp8 is None and set(pm.precisions.values()) == {"bf16"}
    assert run_precision(plan, None) == run_precision(plan, "fp8") == {"compute_dtype": "plan", "fp8": True}
    with pytest.raises(ConfigError, match="re-plan with --precision fp8"):
        run_precision(_tiny_plan("bf16"), "fp8")


def test_missing_backend_fails_before_training_naming_the_package(monkeypatch, tmp_path):
    import argparse

    from meshplan.runtime import fp8 as fp8_mod
    from meshplan.runtime import parallelize
    from meshplan.cli.train import check_fp8_backend
    monkeypatch.setattr(fp8_mod, "backend_available", lambda name: False)
    plan = _tiny_plan("fp8")
    with pytest.raises(ConfigError, match=r"torchao package is not installed: pip install 'meshplan\[fp8\]'"):
        parallelize(_tiny(), plan)
    args = argparse.Namespace(precision=None, fp8_backend="auto")
    with pytest.raises(ConfigError, match="--precision bf16"):
        check_fp8_backend(plan, args)
    check_fp8_backend(plan, argparse.Namespace(precision="bf16", fp8_backend="auto"))   # the override
    with pytest.raises(ConfigError, match="needs CUDA"):
        fp8_mod.resolve_backend("te", torch.device("cpu"))
    monkeypatch.setattr(fp8_mod, "backend_available", lambda name: name == "torchao")
    assert fp8_mod.resolve_backend("auto", torch.device("cuda")) == "torchao"    # no TE: torchao on GPUs too
    # with only Transformer Engine installed on a GPU, a tp > 1 plan cannot run on it: "auto" names torchao
    # before launch (TE's linears are not DTensor modules), as the ranks would
    import dataclasses
    monkeypatch.setattr(fp8_mod, "backend_available", lambda name: name == "te")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_fp8_backend(plan, args)                                                  # tp 1: TE runs it
    tp2 = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, tp=2))
    with pytest.raises(ConfigError, match="torchao package is not installed"):
        check_fp8_backend(tp2, args)


# ---- loss trajectories ----------------------------------------------------------------------------
def _trajectory(plan, tmp_path, steps: int, seq_len: int) -> list[float]:
    from meshplan.train.loop import TrainConfig, train
    res = train(_tiny(seq_len), plan, TrainConfig(steps=steps, out_dir=str(tmp_path), resume=False, progress=False,
                                                  checkpoint_every=0))
    return [res.losses[k] for k in sorted(res.losses)]


# The default job's model, data, optimizer and schedule (tiny-llama, embedded corpus, AdamW lr 3e-3,
# warm-up 10, cosine), 60 steps, on a smaller batch (4 x 32 tokens instead of 16 x 128) to keep
# CI cheap (~6 s a run on one core). Compared on 10-step window means: at this batch single steps
# are noisy (measured at 100 steps: per-step differences up to 0.13 for FP8 vs BF16 and for bf16
# vs fp32 Adam moments). Window means, measured at 60 steps: within 0.060 (FP8 vs BF16) and 0.018
# (moments), the BF16 run's falling from 4.56 to 2.72; at 100 steps within 0.046 and 0.069.
# Allowed: 0.15 per window. A wrong FP8 backward or an optimizer that does not step does not
# train (windows stay > 4).
# The full default job (16 x 128, one process) measured: FP8 vs BF16 per-step |diff| <= 0.099, last
# 10 steps' mean 1.542 vs 1.604 (FP8 lower); bf16 vs fp32 moments: see the README (300 steps).
TRAJ_STEPS, TRAJ_SEQ, TRAJ_BATCH = 60, 32, 4
WINDOW, WINDOW_TOL = 10, 0.15


def _windows(losses: list[float]) -> list[float]:
    return [sum(losses[i:i + WINDOW]) / WINDOW for i in range(0, len(losses), WINDOW)]


def _trajectory_in_worker(item) -> list[float]:
    """_trajectory in a worker process (worlds.in_processes), in a one-rank gloo group of its own
    (destroyed after: the worker serves other tests next)."""
    from pathlib import Path

    import torch.distributed as dist

    from meshplan.train.spawn import init_single_process_group
    plan, out = item
    created = init_single_process_group(120)
    try:
        return _trajectory(plan, Path(out), TRAJ_STEPS, TRAJ_SEQ)
    finally:
        if created:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def trajectories(tmp_path_factory):
    """{run: (losses, output directory)} of the BF16 run, the FP8 run (when torchao is installed)
    and the BF16 run with bf16 Adam moments, two at a time; a run that raised: (error, None)."""
    import importlib.util

    from worlds import in_processes
    plans = {"bf16": _tiny_plan("bf16", TRAJ_SEQ, TRAJ_BATCH),
             "bf16_moments": _tiny_plan("bf16", TRAJ_SEQ, TRAJ_BATCH, optimizer_dtype="bf16")}
    if importlib.util.find_spec("torchao") is not None:
        plans["fp8"] = _tiny_plan("fp8", TRAJ_SEQ, TRAJ_BATCH)
    dirs = {name: tmp_path_factory.mktemp(name) for name in plans}
    results = in_processes(_trajectory_in_worker, [(plan, str(dirs[name])) for name, plan in plans.items()])
    return {name: (r["ok"], dirs[name]) if "ok" in r else (f"{r['error']}\n{r['tb']}", None)
            for name, r in zip(plans, results)}


def _run(trajectories, name: str):
    losses, out = trajectories[name]
    assert out is not None, f"the {name} run failed: {losses}"
    return losses, out


def _close(run: list[float], base: list[float]) -> None:
    w, wb = _windows(run), _windows(base)
    worst = max(abs(a - b) for a, b in zip(w, wb))
    assert worst < WINDOW_TOL, f"10-step means differ by up to {worst:.3f}: {w} vs {wb}"
    assert w[-1] < w[0] - 1.5                                  # it trains


def test_fp8_run_tracks_the_bf16_run(trajectories):
    pytest.importorskip("torchao")
    plan = _tiny_plan("fp8", TRAJ_SEQ, TRAJ_BATCH)
    losses, out = _run(trajectories, "fp8")
    _close(losses, _run(trajectories, "bf16")[0])
    report = json.loads((out / "precisions.json").read_text())
    assert report["plan_precision"] == "fp8"
    assert sorted(m for m, p in report["modules"].items() if p.startswith("fp8")) == sorted(plan.fp8_modules)


def test_bf16_adam_moments_track_fp32_moments(trajectories):
    from meshplan.train.optim import AdamWBF16Moments
    plan = _tiny_plan("bf16", TRAJ_SEQ, TRAJ_BATCH, optimizer_dtype="bf16")
    assert plan.layout.optimizer_dtype == "bf16"
    losses, out = _run(trajectories, "bf16_moments")
    _close(losses, _run(trajectories, "bf16")[0])
    assert json.loads((out / "precisions.json").read_text())["optimizer_dtype"] == "bf16"
    # the optimizer really keeps bf16 moments over fp32 master weights
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64))
    ref = torch.nn.Parameter(w.detach().clone())
    opt, ref_opt = AdamWBF16Moments([w], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2)
    for _ in range(5):
        w.grad = torch.randn(64, 64)
        ref.grad = w.grad.clone()
        opt.step()
        ref_opt.step()
    st = opt.state[w]
    assert w.dtype == torch.float32 and st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
    # the same update up to the moments' bf16 rounding (relative 2^-9 each): a fraction of lr
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=0, atol=2e-4)
    torch.testing.assert_close(st["exp_avg"].float(), ref_opt.state[ref]["exp_avg"], rtol=1e-2, atol=5e-3)


# ---- the layout knob and its memory price ---------------------------------------------------------
def test_optimizer_dtype_is_a_validated_layout_knob_priced_in_memory():
    from meshplan.cost_models import memory
    from meshplan.ir.layout import Layout
    lay = Layout(optimizer_dtype="bf16")
    assert "adam-bf16" in lay.short() and Layout.from_dict(lay.to_dict()) == lay
    with pytest.raises(ConfigError, match="optimizer_dtype='fp8'"):
        Layout(optimizer_dtype="fp8")
    # fp32 master weights + m + v: 4 + 4 + 4 vs 4 + 2 + 2 bytes per parameter
    assert memory.optimizer_bytes(Layout()) == 12 and memory.optimizer_bytes(lay) == 8
    full = memory.state_bytes(1e9, 8, 1)
    half = memory.state_bytes(1e9, 8, 1, optimizer_bytes=memory.optimizer_bytes(lay))
    assert full["optimizer"] == 12e9 / 8 and half["optimizer"] == 8e9 / 8
    assert full["weights"] == half["weights"] and full["gradients"] == half["gradients"]
    with pytest.raises(ConfigError, match="optimizer_dtype"):
        mp.plan(mp.models.build("tiny-llama", seq_len=32, device="meta"), mp.Cluster.preset("local-cpu", nproc=1),
                seq_len=32, global_batch=8, fixed={"optimizer_dtype": "fp16"})
