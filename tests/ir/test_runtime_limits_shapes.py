"""Runtime limits that depend on the model's shapes and code (meshplan.ir.support, read by the
planner's search and by `parallelize`):

- the model's forward must run on tensor-parallel local shapes (profiling/tp_probe.py): nanoGPT-style
  attention that splits by the full width is planned without TP, with the reason;
- FSDP2 shards a routed expert's weight over the expert-data-parallel ranks only where one of its
  dimensions (this rank's experts, inner width, hidden) divides evenly (it pads only dim 0, which
  with fewer local experts than ranks would give every rank a whole expert): such layouts are not
  returned (mixtral-8x7b on a GB200 NVL72 rack used to plan edp=18 over 2 local experts of
  14336 x 4096, which the runtime refused on every rank).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import meshplan as mp
from meshplan.errors import MeshplanError
from meshplan.ir.support import ModelTraits, runtime_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))


def test_expert_weights_must_shard_evenly_over_edp():
    traits = ModelTraits(moe=True, expert_shapes=((8, 14336, 4096),))
    # 72 ranks, ep=4: edp 18, this rank's (2, 14336, 4096): nothing divides by 18
    why = runtime_limits(dict(tp=1, cp=1, dp=72, ep=4, etp=1, pp=1, zero=1), traits)
    assert any("18 expert-data-parallel ranks" in w and "2 x 14336 x 4096" in w for w in why), why
    # 64 ranks, ep=8: edp 8 divides 14336 and 4096
    assert runtime_limits(dict(tp=1, cp=1, dp=64, ep=8, etp=1, pp=1, zero=1), traits) == []
    # no FSDP (one data-parallel rank): nothing is sharded over edp
    assert runtime_limits(dict(tp=8, cp=1, dp=1, ep=1, etp=1, pp=1, zero=1), traits) == []


def test_tp_forward_limit_names_the_reason():
    traits = ModelTraits(tp_forward="block h.0 fails on tensor-parallel local shapes (ValueError: x)")
    why = runtime_limits(dict(tp=2, dp=1), traits)
    assert len(why) == 1 and "block h.0 fails" in why[0] and "use tp=1" in why[0], why
    assert runtime_limits(dict(tp=1, dp=2), traits) == []


def test_full_width_attention_is_planned_without_tp():
    # the probe's model zoo lives beside the probe's tests (tests/profiling), on the path however
    # this file is collected
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "profiling"))
    from test_tp_probe import GPT, LocalAttention, NanoAttention
    cl = mp.Cluster.preset("local-cpu")
    with pytest.raises(MeshplanError, match=r"block h.0 fails on tensor-parallel local shapes"):
        mp.plan(GPT(NanoAttention), cl, seq_len=64, global_batch=8, fixed={"tp": 2})
    assert mp.plan(GPT(NanoAttention), cl, seq_len=64, global_batch=8).layout.tp == 1
    assert mp.plan(GPT(LocalAttention), cl, seq_len=64, global_batch=8, fixed={"tp": 2}).layout.tp == 2


@pytest.mark.slow
def test_mixtral_on_an_nvl72_rack_plans_what_fsdp_can_shard():
    import fake_world
    cl = mp.Cluster.preset("gb200-nvl72", nodes=18)
    for seq in (4096, 32768, 131072):
        r = fake_world.accepted("mixtral-8x7b", cl, seq_len=seq, global_batch=max(64, cl.num_gpus))
        assert r["status"] in ("accepted", "no plan"), (seq, r)


def test_runtime_plans_price_what_pytorch_runs():
    """Gradient accumulation: PyTorch adds each micro-batch's weight gradients by a separate pass
    (AccumulateGrad), so plans for meshplan's runtime are priced unfused; plans for other
    frameworks keep Megatron's fused default. MoE routing: the runtime is dropless, so a capacity
    factor (Megatron's token dropping / padding) is refused for it."""
    m = mp.models.build("tiny-llama", device="meta", seq_len=64)
    cl = mp.Cluster.preset("local-cpu")
    assert mp.plan(m, cl, seq_len=64, global_batch=64).layout.grad_accum_fusion is False
    assert mp.plan(m, cl, seq_len=64, global_batch=64, stack="megatron-core").layout.grad_accum_fusion is True
    why = runtime_limits(dict(tp=1, dp=4, moe_capacity_factor=1.0))
    assert len(why) == 1 and "dropless" in why[0], why
