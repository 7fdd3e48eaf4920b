"""The software stack as an input (meshplan.ir.stack): presets, what each offers, and that plan()
and estimate() price and search what the stack runs."""

from __future__ import annotations

import pytest

import meshplan as mp
from meshplan.errors import ConfigError
from meshplan.ir.stack import STACKS, Stack, resolve_stack


def test_presets_are_valid_cited_and_round_trip():
    for name, st in STACKS.items():
        assert st.name == name and st.sources, name
        assert Stack.from_dict(st.to_dict()) == st
    assert resolve_stack(None) is STACKS["meshplan"]
    assert resolve_stack("torchtitan") is STACKS["torchtitan"]
    assert resolve_stack(None, default="reference").name == "reference"
    with pytest.raises(ConfigError, match="unknown stack 'tensorflow'; presets: reference, meshplan"):
        Stack.preset("tensorflow")
    with pytest.raises(ConfigError, match="tp_overlap='magic'"):
        STACKS["meshplan"].replace(tp_overlap="magic")
    with pytest.raises(ConfigError, match="fields"):
        STACKS["meshplan"].replace(speed=2)


def test_attention_kernel_follows_the_stack_and_the_gpu():
    te = STACKS["megatron-core"]
    assert te.attention_kernel("h100-sxm") == "cudnn" and te.attention_kernel("b200") == "cudnn"
    assert te.attention_kernel("a100-80gb") == "fa2"           # TE takes FlashAttention-2 before Hopper
    assert STACKS["meshplan"].attention_kernel("h100-sxm") == "fa2"    # PyTorch SDPA's flash backend
    assert STACKS["llm-foundry"].attention_kernel("h100-sxm") == "triton"
    assert STACKS["reference"].replace(attention="fa3").attention_kernel("a100-80gb") == "fa2"


def test_offered_recompute_policies():
    assert STACKS["torchtitan"].offers_recompute("op_sac") and not STACKS["torchtitan"].offers_recompute("selective")
    assert STACKS["megatron-core"].offers_recompute("norm_moe")
    assert not STACKS["meshplan"].offers_recompute("norm_moe") and STACKS["meshplan"].offers_recompute(3)


@pytest.fixture(scope="module")
def moe_prof():
    return mp.profile("mixtral-8x7b")


def test_plans_search_only_what_the_stack_runs(moe_prof):
    from meshplan.planner.search import _recompute_options
    assert set(_recompute_options(moe_prof, 2, 4096, STACKS["torchtitan"])) <= {"none", "op_sac", "full"} | set(range(1, 17))
    assert "norm_moe" in _recompute_options(moe_prof, 2, 4096, STACKS["megatron-core"])
    assert not {"norm_moe", "op_sac"} & set(_recompute_options(moe_prof, 2, 4096, STACKS["meshplan"]))


def test_plans_use_only_the_parallel_dims_the_stack_runs(moe_prof):
    big = mp.Cluster.preset("dgx-h100", nodes=8)
    # llm-foundry's model parallelism is FSDP alone: a 70B model is sharded, never split
    pl = mp.plan("llama3-70b", big, seq_len=4096, global_batch=512, stack="llm-foundry")
    assert (pl.layout.tp, pl.layout.cp, pl.layout.pp, pl.layout.ep) == (1, 1, 1, 1) and pl.layout.zero == 3
    # Megatron-LM 2021 had no context parallelism and no MoE layers: experts stay replicated
    old = mp.plan(moe_prof, big, seq_len=4096, global_batch=512, stack="megatron-2021")
    assert old.layout.cp == 1 and old.layout.ep == 1
    with pytest.raises(ConfigError, match="llm-foundry stack runs no tensor parallelism"):
        mp.plan("llama3-8b", big, seq_len=4096, global_batch=512, stack="llm-foundry", fixed=dict(tp=2))
    with pytest.raises(ConfigError, match="parallel_dims"):
        STACKS["megatron-core"].replace(parallel_dims=("tp", "sp"))


def test_meshplans_fused_kernels_price_only_meshplans_runtime():
    # the traced model matches meshplan's fused linear + cross-entropy; torchtitan runs its own eager
    # loss, which holds the logits (128k vocabulary at tp 1), so its estimate holds more memory
    cl = mp.Cluster.preset("dgx-h100", nodes=1)
    lay, kw = dict(tp=1, dp=8, zero=3, mbs=2, recompute="full"), dict(seq_len=8192, global_batch=64)
    ours = mp.estimate("llama3-8b", cl, lay, stack="meshplan", **kw)
    titan = mp.estimate("llama3-8b", cl, lay, stack="torchtitan", **kw)
    logits = 2 * 8192 * 128256 * 4 / 2 ** 30          # fp32 logits of one micro-batch, GiB
    assert titan.peak_memory_gb - ours.peak_memory_gb > logits
    assert not mp.plan("llama3-8b", cl, stack="torchtitan", **kw).fused_kernels
    assert mp.plan("llama3-8b", cl, stack="meshplan", **kw).fused_kernels


def test_plan_records_its_stack_and_prices_like_estimate():
    cl = mp.Cluster.preset("dgx-h100", nodes=1)
    kw = dict(seq_len=8192, global_batch=64)
    plans = {st: mp.plan("llama3-8b", cl, stack=st, **kw) for st in ("meshplan", "megatron-core")}
    for st, pl in plans.items():
        assert pl.stack == st
        again = mp.estimate("llama3-8b", cl, pl.layout, stack=st, **kw)
        assert again.step_time_s == pytest.approx(pl.estimate.step_time_s)
    # cuDNN attention on Hopper (Transformer Engine) makes the same layout faster than PyTorch SDPA
    lay = plans["meshplan"].layout
    core = mp.estimate("llama3-8b", cl, lay, stack="megatron-core", **kw)
    assert core.step_time_s < plans["meshplan"].estimate.step_time_s
    assert mp.Plan.from_json(plans["megatron-core"].to_json()).stack == "megatron-core"


def test_deprecated_for_runtime_maps_to_a_stack():
    cl = mp.Cluster.preset("dgx-h100", nodes=1)
    with pytest.warns(DeprecationWarning, match="stack="):
        pl = mp.plan("llama3-8b", cl, seq_len=4096, global_batch=64, for_runtime=False)
    assert pl.stack == "megatron-core"


def test_export_plans_for_the_targets_stack(capsys):
    from meshplan.cli import main
    assert main(["plan", "--model", "llama3-8b", "--nodes", "1", "--seq-len", "4096", "--global-batch", "64",
                 "--export", "torchtitan"]) == 0
    assert "for the torchtitan stack" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", "--nodes", "1", "--export", "torchtitan",
                 "--stack", "megatron-core"]) == 2
    assert "runs on the torchtitan stack" in capsys.readouterr().err


def test_runtime_refuses_other_stacks_recompute_policies():
    from meshplan.ir.support import runtime_limits
    for rc in ("norm_moe", "op_sac"):
        why = runtime_limits(dict(tp=1, dp=4, recompute=rc))
        assert why and rc in why[0]
    assert not runtime_limits(dict(tp=1, dp=4, recompute="norm_act"))
