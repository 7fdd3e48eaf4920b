"""Fixed layouts the model's shapes rule out get an error in the model's terms (not "nothing fits"),
and a MoE with forced balance is still planned as a MoE."""

import pytest

import meshplan as mp
from meshplan.errors import ConfigError
from meshplan.profiling.analytic import profile_from_config

CPU4 = mp.Cluster.preset("local-cpu")


def _plan(name, fixed, **cfg):
    return mp.plan(mp.models.build(name, device="meta", **cfg), CPU4, seq_len=128, global_batch=16, fixed=fixed)


def test_fixed_ep_on_a_dense_model_names_the_missing_experts():
    with pytest.raises(ConfigError, match="tiny-llama has no routed experts.*use ep=1"):
        _plan("tiny-llama", {"ep": 2, "dp": 4})


def test_fixed_ep_that_does_not_divide_the_experts_lists_what_does():
    with pytest.raises(ConfigError, match=r"ep=3 does not divide the 4 experts.*\[1, 2, 4\]"):
        _plan("tiny-moe", {"ep": 3})


def test_fixed_tp_that_does_not_divide_the_heads_names_the_shape():
    with pytest.raises(ConfigError, match="tp=4 does not divide tiny-llama's kv heads 2"):
        _plan("tiny-llama", {"tp": 4})


def test_forced_balance_moe_is_planned_as_a_moe():
    """moe_force_balance (Megatron's benchmarking mode) still picks experts with a top-k over the
    router's scores, so the trace finds the MoE layers and EP can be planned and priced."""
    plain = _plan("tiny-moe", {"ep": 2, "dp": 4, "tp": 1, "pp": 1, "cp": 1})
    forced = _plan("tiny-moe", {"ep": 2, "dp": 4, "tp": 1, "pp": 1, "cp": 1}, moe_force_balance=True)
    assert forced.layout.ep == 2
    assert forced.estimate.step_time_s == pytest.approx(plain.estimate.step_time_s, rel=0.05)


def test_a_fixed_value_layout_refuses_is_refused_before_the_search():
    """Candidates are Layouts, so a fixed value is checked as Layout checks it, once, in its words
    (not "nothing fits" after a search whose every candidate failed)."""
    prof = profile_from_config(mp.models.config("tiny-llama"), seq_len=128)
    for fixed, match in (({"recompute": "partial"}, r"fixed recompute: layout recompute='partial': use one of"),
                         ({"grad_dtype": "fp16"}, r"fixed grad_dtype: .*use one of \('fp32', 'bf16'\)"),
                         ({"schedule": "zigzag"}, r"fixed schedule: .*use one of \('1f1b'")):
        with pytest.raises(ConfigError, match=match):
            mp.plan(prof, CPU4, seq_len=128, global_batch=16, fixed=fixed)


def test_a_fixed_choice_only_some_meshes_take_is_planned_on_those():
    """fsdp_impl names a ZeRO-3 implementation: the meshes at zero < 3 cannot take it and are
    skipped; the plan is a zero=3 layout with it."""
    prof = profile_from_config(mp.models.config("tiny-llama"), seq_len=128)
    plan = mp.plan(prof, CPU4, seq_len=128, global_batch=16, fixed={"fsdp_impl": "megatron"},
                   stack="megatron-core")
    assert plan.layout.zero == 3 and plan.layout.fsdp_impl == "megatron"
    assert all(r.layout.zero == 3 for r in plan.runner_ups)
