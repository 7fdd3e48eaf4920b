"""Tensor parallelism for the models users bring: packed projections and transposed weights.

- a small model with a fused QKV projection (grouped-query: 4 query heads, 2 KV heads, with a
  bias) and a fused gate/up projection;
- transformers' Phi-3 from a tiny config (fused `qkv_proj`, GQA; fused `gate_up_proj`; its
  attention slices the fused output by `config.num_attention_heads`);
- transformers' GPT-2 from a tiny config (`Conv1D` linears, weights stored (in, out); fused
  `c_attn` split by the attention's `split_size`).

Each runs TP2 on 2 gloo ranks, with and without sequence parallelism (and once on 4 ranks with
FSDP2, and Phi-3 with a 2-stage pipeline), with a plan made by `meshplan.plan`, and is compared with the single-device model: loss, every gradient, every
parameter after one AdamW step (tp_fused_workers.py), and every packed weight's local shard is
checked to hold this rank's slice of each part.

Two spawned groups run every case (starting ranks costs seconds): 2 ranks (`world2`: the six
TP2 runs with and without SP, the packed optimizer state resharded TP2 <-> DP2 through a
checkpoint, deferred initialisation of the packed projections) and 4 ranks (`world4`: TP2 x
FSDP2 with SP for the three models, Phi-3 under TP2 x PP2, transformers' Mixtral experts
resharded EP2 x ETP2 <-> EP2 through a checkpoint). Each test reads its cases' results.
"""

from __future__ import annotations

import pytest
import tp_fused_workers as workers

SEQ, BATCH = 32, 8
MODELS = ("fused-gqa", "hf-phi3", "hf-gpt2")
# param FQN (block 0) -> (part widths, output-feature dim of the weight)
SHARDS = {
    "fused-gqa": {"layers.0.attention.wqkv.weight": ((64, 32, 32), 0),
                  "layers.0.attention.wqkv.bias": ((64, 32, 32), 0),
                  "layers.0.feed_forward.w13.weight": ((96, 96), 0)},
    "hf-phi3": {"model.layers.0.self_attn.qkv_proj.weight": ((64, 32, 32), 0),
                "model.layers.0.mlp.gate_up_proj.weight": ((96, 96), 0)},
    "hf-gpt2": {"transformer.h.0.attn.c_attn.weight": ((64, 64, 64), 1),
                "transformer.h.0.attn.c_attn.bias": ((64, 64, 64), 0),
                "transformer.h.0.mlp.c_fc.weight": ((256,), 1),
                "transformer.h.0.attn.c_proj.weight": ((64,), 0)},     # row-parallel: input rows
}
# the planner's labels for the packed and transposed linears of block 0
LABELS = {
    "fused-gqa": {"layers.0.attention.wqkv": "colwise_qkv", "layers.0.feed_forward.w13": "colwise_gate_up",
                  "layers.0.attention.wo": "rowwise", "layers.0.attention": "heads"},
    "hf-phi3": {"model.layers.0.self_attn.qkv_proj": "colwise_qkv",
                "model.layers.0.mlp.gate_up_proj": "colwise_gate_up", "model.layers.0.self_attn": "heads"},
    "hf-gpt2": {"transformer.h.0.attn.c_attn": "colwise_qkv", "transformer.h.0.mlp.c_fc": "colwise",
                "transformer.h.0.mlp.c_proj": "rowwise", "transformer.h.0.attn": "heads"},
}


def _fixed(sp: bool) -> dict:
    return dict(tp=2, sp=sp, dp=1, pp=1, mbs=2)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    from worlds import spawn_cases
    workers.prefetch_plans([(kind, 2, _fixed(sp), SEQ, BATCH) for kind in MODELS for sp in (False, True)]
                           + [("fused-gqa", 2, dict(tp=1, dp=2, pp=1, mbs=2, zero=3), SEQ, BATCH)])
    cases = {}
    for kind in MODELS:
        for sp in (False, True):
            cases[f"{kind}_sp{int(sp)}"] = dict(model=kind, seq_len=SEQ, global_batch=BATCH, shards=SHARDS[kind],
                                                plan=workers.plan_for(kind, 2, _fixed(sp), SEQ, BATCH))
    # save under TP2, resume under DP2 and the reverse (test_checkpoint_reshards_packed_optimizer_state)
    cases["reshard_tp2_dp2"] = dict(
        kind="reshard_optimizer", model="fused-gqa", seq_len=SEQ, global_batch=BATCH,
        dir=str(tmp_path_factory.mktemp("reshard_packed")),
        plans={"tp2": workers.plan_for("fused-gqa", 2, dict(tp=2, dp=1, pp=1, mbs=2, sp=False), SEQ, BATCH),
               "dp2": workers.plan_for("fused-gqa", 2, dict(tp=1, dp=2, pp=1, mbs=2, zero=3), SEQ, BATCH)})
    # built on the meta device, parallelised with TP2 (test_deferred_init_of_packed_projections_...)
    cases["deferred_tp2"] = dict(kind="deferred", seed=11, plan=workers.plan_for(
        "fused-gqa", 2, dict(tp=2, dp=1, pp=1, mbs=2, sp=False), SEQ, BATCH))
    return spawn_cases(2, workers.run_cases, cases, timeout_s=300)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    import functools

    from worlds import prefetch, spawn_cases
    import hf_moe_workers
    import test_hf_moe_ep
    etp = [("hf-mixtral", 4, tuple(sorted(dict(ep=2, etp=2, dp=4, tp=1, cp=1, pp=1, zero=3, mbs=1).items()))),
           ("hf-mixtral", 4, tuple(sorted(dict(ep=2, etp=1, dp=4, tp=1, cp=1, pp=1, zero=1, mbs=1).items())))]
    tp_fsdp = tuple(sorted(dict(tp=2, dp=2, pp=1, zero=3, mbs=2, sp=True).items()))
    prefetch([(workers._plan, (kind, 4, tp_fsdp, SEQ, BATCH)) for kind in MODELS]
             + [(workers._plan, ("hf-phi3", 4, tuple(sorted(dict(tp=2, dp=1, pp=2, vp=1, schedule="1f1b", mbs=2,
                                                                  sp=False).items())), SEQ, BATCH))]
             + [(test_hf_moe_ep._plan, spec) for spec in etp])
    cases = {kind: dict(model=kind, seq_len=SEQ, global_batch=BATCH,
                        plan=workers.plan_for(kind, 4, dict(tp=2, dp=2, pp=1, zero=3, mbs=2, sp=True), SEQ, BATCH))
             for kind in MODELS}
    cases["hf-phi3_pp2"] = dict(model="hf-phi3", seq_len=SEQ, global_batch=BATCH, plan=workers.plan_for(
        "hf-phi3", 4, dict(tp=2, dp=1, pp=2, vp=1, schedule="1f1b", mbs=2, sp=False), SEQ, BATCH))
    # transformers' Mixtral experts saved under EP2 x ETP2, resumed under EP2 and back
    # (test_checkpoint_reshards_etp_experts)
    plan = functools.partial(test_hf_moe_ep._plan, "hf-mixtral", 4)
    cases["reshard_etp_experts"] = dict(
        kind="reshard_optimizer", model="hf-mixtral", workers="hf_moe_workers", seq_len=hf_moe_workers.SEQ,
        global_batch=hf_moe_workers.BATCH, dir=str(tmp_path_factory.mktemp("reshard_etp")),
        plans={"ep2etp2": plan(tuple(sorted(dict(ep=2, etp=2, dp=4, tp=1, cp=1, pp=1, zero=3, mbs=1).items()))),
               "ep2": plan(tuple(sorted(dict(ep=2, etp=1, dp=4, tp=1, cp=1, pp=1, zero=1, mbs=1).items())))})
    return spawn_cases(4, workers.run_cases, cases, timeout_s=300)


def _ok(runs: list) -> None:
    for rank, r in enumerate(runs):
        assert "error" not in r, f"rank {rank}: {r['error']}\n{r.get('tb', '')}"


@pytest.mark.parametrize("sp", (False, True), ids=("tp2", "tp2_sp"))
@pytest.mark.parametrize("kind", MODELS)
def test_matches_single_device(world2, kind, sp):
    runs = world2[f"{kind}_sp{int(sp)}"]
    _ok(runs)
    assert len({r["loss"] for r in runs}) == 1


def test_packed_weights_are_kept_in_tp_order(world2):
    """Packed weights are plain column-parallel DTensors over rows in TP order (rank 0's slice of
    every part, then rank 1's); the runs above put their gradients back in the model's order,
    and full_state_dict / checkpoints see the model's order."""
    _ok(world2["fused-gqa_sp0"])
    _ok(world2["hf-gpt2_sp0"])
    assert world2["fused-gqa_sp0"][0]["tp_order"] == [
        f"layers.{i}.{p}" for i in (0, 1)
        for p in ("attention.wqkv.bias", "attention.wqkv.weight", "feed_forward.w13.weight")]
    assert world2["hf-gpt2_sp0"][0]["tp_order"] == [
        f"transformer.h.{i}.attn.c_attn.{p}" for i in (0, 1) for p in ("bias", "weight")]


@pytest.mark.parametrize("name", ["fused-gqa", "hf-phi3", "hf-gpt2", "hf-phi3_pp2"])
def test_with_fsdp_and_pipeline(world4, name):
    """TP2 x FSDP2 (sequence parallel) and TP2 x PP2 on 4 ranks: FSDP composes its sharding with
    the packed weights' TP shards; each pipeline stage shards its own packed projections."""
    _ok(world4[name])


@pytest.mark.parametrize("kind", MODELS)
def test_planner_labels_packed_linears(kind):
    import meshplan as mp
    from meshplan.ir.support import runtime_limits
    from meshplan.profiling.traits import model_traits
    model = workers.build_model(kind, seq_len=SEQ)
    traits = model_traits(mp.profile(model, seq_len=SEQ), model)
    assert traits.fused_qkv and runtime_limits({"tp": 2}, traits) == []
    for fixed in ({"tp": 2}, {"tp": 2, "sp": False}, {"tp": 2, "sp": True}):
        plan = workers.plan_for(kind, 2, fixed, SEQ, BATCH)
        assert plan.layout.tp == 2
        for fqn, label in LABELS[kind].items():
            assert plan.placements[fqn] == label, (fqn, plan.placements[fqn])


def test_checkpoint_reshards_packed_optimizer_state(world2):
    """Save under TP2, resume under DP2 and the reverse: a packed projection's Adam moments are kept
    in TP order by the optimizer and must be checkpointed in the model's order (fused GQA QKV with
    a bias, fused gate/up), or the resumed step moves the wrong rows."""
    _ok(world2["reshard_tp2_dp2"])
    assert world2["reshard_tp2_dp2"][0]["tp2->dp2"] == [
        f"layers.{i}.{p}" for i in (0, 1) for p in ("attention.wqkv.bias", "attention.wqkv.weight",
                                                     "feed_forward.w13.weight")]


def test_checkpoint_reshards_etp_experts(world4):
    """transformers' Mixtral experts under EP2 x ETP2 keep gate|up rows in TP order too: saved under
    ep2 x etp2, resumed under ep2 (etp 1) and back, the resumed step equals the single-device one."""
    _ok(world4["reshard_etp_experts"])
    assert world4["reshard_etp_experts"][0]["ep2etp2->ep2"] == [
        f"model.layers.{i}.mlp.experts.gate_up_proj" for i in (0, 1)]


def test_deferred_init_of_packed_projections_equals_single_device(world2):
    """Built on the meta device and parallelised with TP2: every rank initialises its slice of
    each part of the packed projections (kept in TP order), so the model holds exactly the
    weights the CPU-built model gets under the same seed."""
    import torch
    _ok(world2["deferred_tp2"])
    got = world2["deferred_tp2"][0]
    torch.manual_seed(11)
    want = workers.FusedLM().state_dict()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
