"""Layout knobs the cost model prices run as priced in meshplan's runtime, or are refused.

grad_dtype="bf16": the data-parallel gradient reduction runs in bf16 (2 ranks, gloo): FSDP2's
reduce_dtype, DDP's bf16 all-reduce hook. Gradients match the fp32-reduction run within bf16
rounding, and the recorded reductions carry bf16, about one element per parameter.
Knobs the runtime does not run (ir.support.runtime_limits) are refused by parallelize, naming
the knob. The FP8 backend "auto" never picks Transformer Engine where it would refuse the plan.
"""

from __future__ import annotations

import dataclasses

import numerics
import pytest
import torch

import meshplan as mp
from meshplan.errors import LayoutError

SEQ, BATCH = 32, 8
# name -> fixed layout of a 2-rank tiny-llama plan (made with grad_dtype fp32; the workers set bf16)
CASES = {"fsdp_zero3": dict(dp=2, tp=1, pp=1, zero=3, mbs=2),
         "fsdp_zero1_accum": dict(dp=2, tp=1, pp=1, zero=1, mbs=1),
         "ddp": dict(dp=2, tp=1, pp=1, zero=0, mbs=2)}
# bf16 keeps 8 mantissa bits: each rank's gradient rounds by <= 2^-9 relative, so a parameter's
# gradient moves by ~1e-3 in norm; a reduction left in fp32 moves it by 0, a wrong sum by O(1)
BF16_GRAD_NORM_TOL = 1e-2


@pytest.fixture(scope="module")
def pairs():
    import knob_workers
    from worlds import spawn_cases
    items = {name: tuple(sorted(fixed.items())) for name, fixed in CASES.items()}
    numerics.plan_for.prefetch([("tiny-llama", 2, it, SEQ, BATCH) for it in items.values()])
    cases = {name: dict(model="tiny-llama", seq_len=SEQ, global_batch=BATCH,
                        plan=numerics.plan_for("tiny-llama", 2, it, SEQ, BATCH)) for name, it in items.items()}
    return spawn_cases(2, knob_workers.run_cases, cases)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bf16_gradients_reduce_in_bf16(pairs, name):
    from worlds import ok
    ok(pairs[name])
    for r in pairs[name]:
        assert r["data_parallel"] == ("ddp" if name == "ddp" else "fsdp")
        ref_loss, low_loss = r["loss"]
        assert low_loss == ref_loss                  # forward is fp32 in both: only gradients differ
        worst = max(r["rel"].values())
        assert 0 < worst < BF16_GRAD_NORM_TOL, r["rel"]
        (ref_moved, low_moved) = r["moved"]
        # the fp32 run reduces no bf16; the bf16 run reduces every gradient element in bf16
        assert ref_moved["torch.bfloat16"] == 0 and ref_moved["torch.float32"] >= r["params"]
        assert low_moved["torch.float32"] == 0 and low_moved["torch.bfloat16"] >= r["params"]
        if name != "ddp":
            assert r["policies"] == (["None"], ["torch.bfloat16"])   # MixedPrecisionPolicy.reduce_dtype


# ---- refusals: parallelize refuses what runtime_limits refuses, before any collective --------------
@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("change, names", [
    (dict(moe_dispatcher="deepep"), ("moe_dispatcher='deepep'", "'alltoall'")),
    (dict(attn_kernel="fa3"), ("attn_kernel='fa3'", "attn_kernel='flash'")),
    (dict(moe_capacity_factor=1.0), ("moe_capacity_factor=1.0", "unset")),
    (dict(zero=3, fsdp_impl="megatron"), ("fsdp_impl='megatron'", "fsdp_impl='fsdp2'")),
    (dict(grad_dtype="bf16"), ("grad_dtype='bf16'", "one data-parallel rank", "grad_dtype='fp32'")),
])
def test_parallelize_refuses_unrun_knobs(change, names):
    from meshplan.runtime import parallelize
    model = mp.models.build("tiny-llama", seq_len=SEQ, device="meta")
    plan = mp.plan(model, mp.Cluster.preset("local-cpu", nproc=1), seq_len=SEQ, global_batch=BATCH)
    plan = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, **change))
    with pytest.raises(LayoutError) as err:
        parallelize(numerics.build_model("tiny-llama", seq_len=SEQ), plan, compute_dtype=None)
    for part in names:
        assert part in str(err.value)


# ---- FP8 backend "auto" -------------------------------------------------------------------------
def test_fp8_auto_picks_a_backend_that_runs_the_layout(monkeypatch):
    from meshplan.runtime import fp8 as fp8_mod
    cuda = torch.device("cuda")
    monkeypatch.setattr(fp8_mod, "backend_available", lambda name: True)      # "TE installed"
    assert fp8_mod.resolve_backend("auto", cuda) == "te"
    assert fp8_mod.resolve_backend("auto", cuda, tp=1, recipe="tensorwise") == "te"
    # TE refuses tp > 1 (apply_fp8) and has no rowwise recipe: auto runs torchao there
    assert fp8_mod.resolve_backend("auto", cuda, tp=2, recipe="tensorwise") == "torchao"
    assert fp8_mod.resolve_backend("auto", cuda, tp=1, recipe="rowwise") == "torchao"
    assert fp8_mod.resolve_backend("auto", torch.device("cpu"), tp=1) == "torchao"
    assert fp8_mod.resolve_backend("te", cuda, tp=2) == "te"      # named: kept, apply_fp8 refuses it
    monkeypatch.setattr(fp8_mod, "backend_available", lambda name: name == "torchao")
    assert fp8_mod.resolve_backend("auto", cuda, tp=1) == "torchao"                  # no TE
