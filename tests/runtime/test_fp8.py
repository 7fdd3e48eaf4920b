"""FP8 from the plan (runtime/fp8.py) on CPU with torchao, sharded over 2 gloo ranks.

One spawned group of 2 ranks runs every case (starting ranks costs seconds): FP8 under TP2 with
sequence parallelism and under FSDP2 (ZeRO-3) with FP8 all-gather, each against the same FP8 model on one process (tolerances in
fp8_workers.py), and DCP checkpoints moved between an FP8 plan and a BF16 plan in both
directions, and FP8 under PP2 (each stage swaps its own modules). (A transformers Llama's swapped set: test_fp8_one_rank.py, no spawning.)
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchao", reason="FP8 on CPU needs torchao: pip install 'meshplan[fp8]'")

import fp8_workers  # noqa: E402

SEQ, BATCH = 32, 8


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    from meshplan.train.spawn import run_ranks
    plan = lambda kind, **fixed: fp8_workers.fp8_plan(kind, 2, fixed, SEQ, BATCH)   # noqa: E731
    cases = {
        "tp2_sp": dict(model="tiny-llama", plan=plan("tiny-llama", tp=2, sp=True, dp=1, pp=1, mbs=2),
                       seq_len=SEQ, global_batch=BATCH),
        "fsdp2_fp8_allgather": dict(model="tiny-llama", plan=plan("tiny-llama", dp=2, tp=1, pp=1, zero=3, mbs=4),
                                    seq_len=SEQ, global_batch=BATCH),
        "pp2": dict(model="tiny-llama", plan=plan("tiny-llama", pp=2, dp=1, tp=1, mbs=2, schedule="1f1b"),
                    seq_len=SEQ, global_batch=BATCH),
        "checkpoint": dict(kind="checkpoint", model="tiny-llama", seq_len=SEQ, global_batch=BATCH,
                           dir=str(tmp_path_factory.mktemp("ckpt")),
                           fp8=plan("tiny-llama", dp=2, tp=1, pp=1, zero=3, mbs=4),
                           bf16=fp8_workers.fp8_plan("tiny-llama", 2, dict(tp=2, dp=1, pp=1, mbs=2), SEQ, BATCH,
                                                     precision="bf16")),
    }
    results = run_ranks(2, fp8_workers.run_cases, cases, timeout_s=240)
    return {name: [r[name] for r in results] for name in cases}, cases


def _ok(results):
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r['error']}\n{r.get('tb', '')}"


@pytest.mark.parametrize("name", ["tp2_sp", "fsdp2_fp8_allgather"])
def test_fp8_sharded_equals_one_process(world2, name):
    results, cases = world2
    _ok(results[name])
    r = results[name][0]
    plan = cases[name]["plan"]
    assert plan.precision == "fp8" and plan.fp8_modules
    # exactly the plan's FP8 modules were swapped, and they are torchao Float8Linears
    assert r["swapped"] == sorted(plan.fp8_modules)
    assert r["kinds"] == ["Float8Linear"]
    fp8 = {m for m, p in r["precisions"].items() if p.startswith("fp8")}
    assert fp8 == set(plan.fp8_modules)
    assert all(p == "fp32" for m, p in r["precisions"].items() if m not in fp8)
    assert r["weight_scales_match"]


def test_fp8_pipeline_stages_each_swap_their_own_modules(world2):
    """PP2: each pipeline rank swaps the plan's FP8 modules it holds, together exactly the plan's
    set, and the pipelined FP8 step equals the FP8 model on one process (checked in the worker)."""
    results, cases = world2
    _ok(results["pp2"])
    plan = cases["pp2"]["plan"]
    assert plan.precision == "fp8" and plan.fp8_modules
    held = [set(r["swapped"]) for r in results["pp2"]]
    assert held[0] and held[1] and not held[0] & held[1]
    assert held[0] | held[1] == set(plan.fp8_modules)


def test_fsdp_all_gathers_fp8_weights(world2):
    results, _ = world2
    _ok(results["fsdp2_fp8_allgather"])
    assert results["fsdp2_fp8_allgather"][0]["weight_types"] == ["WeightWithDynamicFloat8CastTensor"]


def test_checkpoint_moves_between_fp8_and_bf16_plans(world2):
    results, _ = world2
    _ok(results["checkpoint"])
    r = results["checkpoint"][0]
    assert r["fp8_to_bf16"]["fp8_here"] is False and r["bf16_to_fp8"]["fp8_here"] is True
