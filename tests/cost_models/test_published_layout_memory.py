"""Memory terms behind a published layout that ran: Nemotron-4 340B on 128 H100s (NeMo 24.07,
tp 8 / pp 8 / vp 12, selective recompute), which has to fit.

- The optimizer's main copy of the weights (memory.master_bytes, Stack.master_weights): Apex's
  DistributedFusedAdam under NeMo 1.x keeps only the 16 low bits of each fp32 main weight, and none
  at all when Adam's state is bf16, as the 340B launcher config sets it.
- What Megatron-Core's selective recompute keeps (cost_models.layer.activation_bytes): only core
  attention is re-run; the MLP activation's output (FC2's input) stays stored, and under FP8 the
  output projection keeps its input in one byte.
- The micro-batches each pipeline rank holds under the interleaved schedule (pipeline.in_flight).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan import models
from meshplan.cluster import Cluster
from meshplan.cost_models.context import Context
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.layer import activation_bytes
from meshplan.cost_models.memory import adam_bytes, master_bytes
from meshplan.cost_models.validation import load_rows, stack_of
from meshplan.errors import ConfigError
from meshplan.ir.layout import Layout
from meshplan.ir.stack import STACKS
from meshplan.profiling.analytic import profile_from_config

NEMOTRON_340B = "nemo2407-nemotron-340b-128gpu"
GPT175B = profile_from_config(models.config("gpt3-175b"))


def _bench():
    """benchmarks/validate_published.py (it supplies meshplan's model builders to the validation)."""
    import importlib.util
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "validate_published.py"
    spec = importlib.util.spec_from_file_location("validate_published_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- the optimizer's main weights ---------------------------------------------------------------------
def test_main_weight_bytes_by_stack_and_moment_dtype():
    """fp32 main weights: 4 + m + v; Apex's remainders: 2 + m + v with fp32 moments, 0 + m + v with
    bf16 moments (the bf16 parameters are the main copy)."""
    apex = STACKS["megatron-core"].replace(master_weights="remainders")
    table = {(st.master_weights, dt): adam_bytes(Layout(optimizer_dtype=dt), st)
             for st in (STACKS["megatron-core"], apex) for dt in ("fp32", "bf16")}
    assert table == {("fp32", "fp32"): 12, ("fp32", "bf16"): 8, ("remainders", "fp32"): 10, ("remainders", "bf16"): 4}
    assert master_bytes(Layout(), None) == 4          # no stack: a full fp32 copy


def test_stack_names_the_main_weight_choices():
    with pytest.raises(ConfigError, match="master_weights='bf16'.*remainders"):
        STACKS["megatron-core"].replace(master_weights="bf16")


def test_estimate_charges_the_stacks_main_weights():
    """The optimizer term alone follows the stack: same weights and gradients, optimizer state in the
    ratio of the bytes per parameter (10/12 and 4/8), on every pipeline stage."""
    prof = profile_from_config(models.config("gpt3-1.3b"))
    cl = Cluster(gpu="h100-sxm", num_gpus=16, gpus_per_node=8)
    apex = STACKS["megatron-core"].replace(master_weights="remainders")
    for dtype, ratio in (("fp32", 10 / 12), ("bf16", 4 / 8)):
        lay = dict(tp=2, pp=2, dp=4, zero=1, mbs=1, recompute="selective", sp=True, optimizer_dtype=dtype)
        kw = dict(seq_len=2048, global_batch=64)
        ref = estimate_profile(prof, cl, lay, stack=STACKS["megatron-core"], **kw)
        got = estimate_profile(prof, cl, lay, stack=apex, **kw)
        for a, b in zip(ref.memory_by_stage, got.memory_by_stage):
            assert b["weights"] == a["weights"] and b["gradients"] == a["gradients"]
            assert b["optimizer"] == pytest.approx(ratio * a["optimizer"], rel=1e-12)


def test_nemo_1x_rows_run_apex_main_weights():
    rows = {r.id: r for r in load_rows()}
    assert stack_of(rows["nemo2407-gpt3-175b-128gpu"]).master_weights == "remainders"
    assert stack_of(rows["nemo-longseq-llama2-7b-32k"]).master_weights == "remainders"
    assert stack_of(rows["mb-2604.01-llama3-70b-h100"]).master_weights == "fp32"     # Megatron-Core's optimizer


def test_nemotron_340b_fits_as_published_and_only_with_its_optimizer():
    """The row takes its launcher config (selective recompute, Adam state in bf16), fits with it, and
    lands within 10% of the measured 686 TFLOP/s; with Megatron-Core's fp32 main weights and fp32
    moments the same layout does not fit (validation would fall back to full recompute, 21% slow)."""
    vp = _bench()
    row = next(r for r in load_rows() if r.id == NEMOTRON_340B)
    res = vp.run_row(row, traced=False)
    lay = res.estimate.layout
    assert (lay.recompute, lay.optimizer_dtype, lay.vp, lay.sp) == ("selective", "bf16", 12, True)
    assert res.fits and abs(res.error) < 0.10
    worst = max(range(lay.pp), key=lambda r: sum(res.estimate.memory_by_stage[r].values()))
    assert worst == 0
    cl = Cluster(gpu="h100-sxm", num_gpus=128, gpus_per_node=8)
    prof = vp.model_profile(vp.model_config(row), traced=False)
    fp32 = estimate_profile(prof, cl, lay.replace(optimizer_dtype="fp32"), seq_len=4096, global_batch=32,
                            precision="fp8", stack=STACKS["megatron-core"])
    assert not fp32.fits


# ---- what selective recompute keeps ---------------------------------------------------------------------
def _gpt_block_bytes(fp8: bool, stack: str, policy: str, tp: int = 8) -> tuple[float, float]:
    """(bytes, h * tokens / tp) for one GPT-3 175B layer (MHA, GELU MLP of 4h), SP over tp."""
    b = GPT175B.layer_blocks()[0]
    lay = Layout(tp=tp, sp=True, mbs=1)
    c = Context.build(Cluster(gpu="h100-sxm", num_gpus=8), lay, 2048, fp8, stack=STACKS[stack])
    return activation_bytes(b, c, policy=policy), b.hidden * c.tokens / tp


@pytest.mark.parametrize("stack", ["reference", "megatron-core"])
def test_korthikanti_selective_keeps_the_mlp_activation(stack):
    """Korthikanti et al. (arXiv 2205.05198, Sec. 4.2, Table 2): selective recompute with SP keeps
    34 s b h / t bytes per layer, of which 2 s b h are dropout masks these runs do not have: 32 h per
    token over t (norm inputs 4, QKV/FC1 inputs 4, Q K V 6, out-proj input 2, GELU input 8, GELU
    output = FC2 input 8). Under FP8 (Transformer Engine keeps FP8 GEMM inputs in one byte) the QKV,
    FC1, out-proj and FC2 inputs halve: 4 + 2 + 6 + 1 + 8 + 4 = 25."""
    got, unit = _gpt_block_bytes(False, stack, "selective")
    assert got == pytest.approx(32 * unit, rel=1e-12)
    got8, unit = _gpt_block_bytes(True, stack, "selective")
    assert got8 == pytest.approx(25 * unit, rel=1e-12)
    # no recompute adds exactly the flash kernel's saved output and log-sum-exp
    none, _ = _gpt_block_bytes(True, stack, "none")
    b = GPT175B.layer_blocks()[0]
    assert none - got8 == pytest.approx((2 * b.o_dim + 4 * b.heads) * unit / b.hidden, rel=1e-12)


def test_meshplans_own_selective_re_runs_the_activation_and_output_projection():
    """meshplan's runtime checkpoints every op but the matmuls and collectives (Stack.selective_sac):
    it keeps less than Korthikanti's count, by at least FC2's input and the out-projection input."""
    sac, unit = _gpt_block_bytes(False, "meshplan", "selective")
    korthikanti, _ = _gpt_block_bytes(False, "reference", "selective")
    assert korthikanti - sac >= (8 + 2) * unit


# ---- micro-batches in flight under the interleaved schedule ----------------------------------------------
def test_interleaved_ranks_hold_megatrons_warmup_chunks():
    """Megatron-Core's interleaved 1F1B: rank r runs (p - r - 1) * 2 + (v - 1) * p chunk forwards, then
    one more, before its first backward (all m v of them when m = p). Nemotron-4 340B, p 8, v 12, 16
    micro-batches: 103 chunks on rank 0 (Korthikanti's p (1 + (p-1)/(p v))), 89 on the last rank."""
    from meshplan.cost_models.pipeline import in_flight
    p, v, m = 8, 12, 16
    held = [in_flight("interleaved", m, p, v, r) * v for r in range(p)]
    assert held == pytest.approx([103 - 2 * r for r in range(p)], rel=1e-12)
    assert in_flight("interleaved", m, p, v, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)), rel=1e-12)
    assert [in_flight("interleaved", p, p, v, r) for r in (0, p - 1)] == [p, p]     # m = p: all forwards first
    assert in_flight("interleaved", m, p, 1, p - 1) == in_flight("1f1b", m, p, 1, p - 1) == 1
