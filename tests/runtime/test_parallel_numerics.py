"""Numerical equivalence of meshplan's runtime with the single-device model (gloo, CPU).

Every case parallelises the same model with a Plan made by `meshplan.plan` (layout fixed by the
test), runs one global batch forward and backward, takes one AdamW step, and compares loss, every
full gradient and every parameter with the unsharded model (tolerances: tests/runtime/numerics.py).
Cases that share a world size run in one spawned process group, because starting ranks costs
seconds each: 2 ranks (`world2`: TP, SP, DP as DDP and FSDP ZeRO-1/2/3 with accumulation, PP
1F1B / interleaved / zero-bubble V, recompute, tied embeddings, transformers Llama, a bf16
training run, and the refusals of a mismatched plan), 4 ranks (`world4`: TP x DP, TP x PP,
HSDP, and the planner's own choice trained a few steps); the 8-rank cases are in
test_parallel_numerics_8.py (a module of their own, so the two test workers can share the
numerics worlds). Each test reads its cases' results.

Cases that shard within a layer (TP, SP, DP, FSDP, recompute) run 2-layer versions of the models
("-2l", numerics.VARIANTS): every layer is the same, so a second pair of layers would repeat the
same check at twice the ranks' work. Pipeline cases keep 4 layers, one or more a stage, and the
sliding-window models theirs (numerics.VARIANTS says why).
"""

from __future__ import annotations


import pytest

import numerics

SEQ, BATCH = 32, 8

# name -> (model, fixed layout); world size is the product of the degrees
CASES_2 = {
    "tp2": ("tiny-llama-2l", dict(tp=2, sp=False, dp=1, pp=1)),
    "tp2_sp": ("tiny-llama-2l", dict(tp=2, sp=True, dp=1, pp=1, mbs=2)),
    # async TP is CUDA-only (symmetric memory): on CPU the plan's tp_comm_overlap changes nothing
    "tp2_sp_comm_overlap": ("tiny-llama-2l", dict(tp=2, sp=True, dp=1, pp=1, mbs=4, tp_comm_overlap=True)),
    "dp2_fsdp": ("tiny-llama-2l", dict(dp=2, tp=1, pp=1, zero=3, mbs=4)),
    "dp2_fsdp_no_overlap": ("tiny-llama-2l", dict(dp=2, tp=1, pp=1, zero=3, mbs=4)),
    "dp2_zero1_accum4": ("tiny-llama-2l", dict(dp=2, tp=1, pp=1, zero=1, mbs=1)),
    "dp2_zero2_accum2": ("tiny-llama-2l", dict(dp=2, tp=1, pp=1, zero=2, mbs=2)),
    # zero=0: plain DDP (bucketed all-reduce, summed), gradients accumulated under no_sync
    "dp2_ddp_accum2": ("tiny-llama-2l", dict(dp=2, tp=1, pp=1, zero=0, mbs=2)),
    "gpt_dp2_ddp_tied": ("tiny-gpt-2l", dict(dp=2, tp=1, pp=1, zero=0, mbs=4)),
    "pp2_1f1b": ("tiny-llama", dict(pp=2, vp=1, schedule="1f1b", tp=1, dp=1, mbs=2)),
    "pp2_vp2_interleaved": ("tiny-llama", dict(pp=2, vp=2, schedule="interleaved", tp=1, dp=1, mbs=2)),
    "pp2_vp2_interleaved_uneven": ("tiny-llama-5l", dict(pp=2, vp=2, schedule="interleaved", tp=1, dp=1, mbs=2)),
    "pp2_zbv": ("tiny-llama", dict(pp=2, vp=2, schedule="zbv", tp=1, dp=1, mbs=2)),
    "recompute_full": ("tiny-llama-2l", dict(dp=2, tp=1, pp=1, mbs=2, recompute="full")),
    "recompute_selective_tp2_sp": ("tiny-llama-2l", dict(tp=2, sp=True, dp=1, pp=1, mbs=2, recompute="selective")),
    "gpt_tp2_sp": ("tiny-gpt-2l", dict(tp=2, sp=True, dp=1, pp=1, mbs=2)),
    "gpt_pp2_tied": ("tiny-gpt", dict(pp=2, vp=1, schedule="1f1b", tp=1, dp=1, mbs=2)),
    "hf_tp2": ("hf-llama-2l", dict(tp=2, sp=False, dp=1, pp=1, mbs=2)),
    "hf_pp2": ("hf-llama", dict(pp=2, vp=1, schedule="1f1b", tp=1, dp=1, mbs=2)),
    # decomposed RMSNorm swapped for the fused kernel on sequence shards (DTensor, partial grads)
    "hf_tp2_sp": ("hf-llama-2l", dict(tp=2, sp=True, dp=1, pp=1, mbs=2)),
    "hf_fsdp2": ("hf-llama-2l", dict(dp=2, tp=1, pp=1, zero=3, mbs=2)),
    # multi-head latent attention (numerics.VARIANTS): wq_b / wkv_b split by heads, wq_a / wkv_a and
    # the latent norms whole on each rank, the shared rotary key's gradient summed over TP
    "mla_tp2": ("tiny-mla-2l", dict(tp=2, sp=False, dp=1, pp=1, mbs=2)),
    "mla_tp2_sp": ("tiny-mla-2l", dict(tp=2, sp=True, dp=1, pp=1, mbs=2)),
    # sliding-window attention (numerics.VARIANTS): the band mask is local to each sequence, so TP
    # with SP runs it unchanged; the sink logits are FSDP-sharded like any other parameter
    "swa_tp2_sp": ("tiny-swa-2l", dict(tp=2, sp=True, dp=1, pp=1, mbs=2)),
    "swa_sinks_fsdp2": ("tiny-swa-sinks-2l", dict(dp=2, tp=1, pp=1, zero=3, mbs=2)),
}
CASES_4 = {
    "tp2_dp2_sp": ("tiny-llama-2l", dict(tp=2, dp=2, pp=1, sp=True, zero=3, mbs=2)),
    "tp2_pp2": ("tiny-llama", dict(tp=2, pp=2, dp=1, vp=1, schedule="1f1b", mbs=1)),
    "hsdp_dp4": ("tiny-llama-2l", dict(dp=4, tp=1, pp=1, zero=3, fsdp_shard=2, mbs=1)),
    "gpt_tp2_pp2_sp_tied": ("tiny-gpt", dict(tp=2, pp=2, dp=1, vp=1, sp=True, schedule="1f1b", mbs=1)),
}
CASES_8 = {
    # 2 micro-batches a data-parallel rank: 1F1B's warm-up, steady and cool-down phases all run on
    # the first stage, and FSDP accumulates over micro-batches (4 would only double the 8 ranks' work)
    "pp2_fsdp2_tp2": ("tiny-llama", dict(pp=2, dp=2, tp=2, zero=3, sp=True, vp=1, schedule="1f1b", mbs=2)),
}


# cases whose TP collectives are counted (CommDebugMode) during forward_backward
COUNT_COMM = ("tp2_sp", "tp2", "hf_tp2_sp", "dp2_zero1_accum4")


def _plan(kind: str, world: int, fixed_items: tuple):
    return numerics.plan_for(kind, world, fixed_items, SEQ, BATCH)


def _cases(table: dict, world: int, more: tuple = ()) -> dict:
    """The table's cases with their plans (made two at a time, with the plans `more` names)."""
    numerics.plan_for.prefetch([(kind, world, tuple(sorted(fixed.items())), SEQ, BATCH)
                                for kind, fixed in table.values()]
                               + [(kind, w, items, SEQ, BATCH) for kind, w, items in more])
    out = {}
    for name, (kind, fixed) in table.items():
        out[name] = dict(model=kind, plan=_plan(kind, world, tuple(sorted(fixed.items()))), seq_len=SEQ,
                         global_batch=BATCH, overlap="no_overlap" not in name, count_comm=name in COUNT_COMM)
    return out


def _run(world: int, cases: dict) -> dict:
    from meshplan.train.spawn import run_ranks
    results = run_ranks(world, numerics.run_cases, cases, timeout_s=240)
    return {name: [r[name] for r in results] for name in cases}


@pytest.fixture(scope="module")
def world2():
    cases = _cases(CASES_2, 2, more=[("tiny-llama", 4, (("dp", 4),)),
                                     ("tiny-llama", 2, (("dp", 1), ("pp", 2), ("schedule", "1f1b"), ("tp", 1))),
                                     ("tiny-llama", 2, (("dp", 2),))])
    # bad input: a plan for 4 ranks on 2, and a model changed since planning
    cases["wrong_world"] = dict(kind="error", model="tiny-llama", seq_len=SEQ,
                                plan=_plan("tiny-llama", 4, (("dp", 4),)))
    # one data-parallel rank in bf16: autocast, no FSDP over a one-rank mesh (pipeline: autocast per stage)
    cases["pp2_bf16_train"] = dict(kind="train", model="tiny-llama", seq_len=SEQ, global_batch=BATCH,
                                   plan=_plan("tiny-llama", 2, (("dp", 1), ("pp", 2), ("schedule", "1f1b"),
                                                                ("tp", 1))))
    cases["changed_model"] = dict(kind="error", model="tiny-llama", seq_len=SEQ, change_model=True,
                                  plan=_plan("tiny-llama", 2, (("dp", 2),)))
    return _run(2, cases)


@pytest.fixture(scope="module")
def world4():
    import meshplan as mp
    cases = _cases(CASES_4, 4)
    # end to end: the planner's own choice for 4 local CPU processes, trained a few steps
    model = mp.models.build("tiny-llama", seq_len=SEQ, device="meta")
    chosen = mp.plan(model, mp.Cluster.preset("local-cpu"), seq_len=SEQ, global_batch=BATCH,
                     fixed={"cp": 1, "ep": 1})
    cases["planned_train"] = dict(kind="train", model="tiny-llama", plan=chosen, seq_len=SEQ, global_batch=BATCH)
    return _run(4, cases)


def _check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r['error']}\n{r.get('tb', '')}"
    losses = {r["loss"] for r in results}
    assert len(losses) == 1, f"ranks disagree on the loss: {losses}"


@pytest.mark.parametrize("name", sorted(CASES_2))
def test_two_ranks(world2, name):
    _check(world2[name])


def test_fused_kernels_swapped_in(world2):
    """The plans list fused kernels and the runtime ran them (the equivalence above held)."""
    def kinds(name):
        return {e.kernel for e in _plan(CASES_2[name][0], 2, tuple(sorted(CASES_2[name][1].items()))).fused_kernels}
    assert kinds("hf_fsdp2") == {"rms_norm", "swiglu", "linear_cross_entropy"}
    assert kinds("hf_tp2_sp") == {"rms_norm", "swiglu"}          # vocab-parallel head: eager loss
    fsdp = world2["hf_fsdp2"][0]["fused"]
    last = numerics.layers_of(CASES_2["hf_fsdp2"][0]) - 1
    assert "lm_head" in fsdp and "model.norm" in fsdp and f"model.layers.{last}.mlp" in fsdp
    assert "model.layers.0.input_layernorm" in world2["hf_tp2_sp"][1]["fused"]
    # pipeline: each stage swaps only the modules it holds
    first, last = (set(r["fused"]) for r in world2["hf_pp2"])
    assert "lm_head" in last and "lm_head" not in first and not first & last


@pytest.mark.parametrize("name", sorted(CASES_4))
def test_four_ranks(world4, name):
    _check(world4[name])


def test_plan_for_other_world_size_is_refused(world2):
    for r in world2["wrong_world"]:
        assert r["raised"] == "ConfigError" and "needs 4 processes" in r["message"], r


def test_changed_model_is_refused(world2):
    for r in world2["changed_model"]:
        assert r["raised"] == "ConfigError" and "changed since planning" in r["message"], r


def test_planned_layout_trains(world4):
    runs = world4["planned_train"]
    assert all("error" not in r for r in runs), runs[0]
    losses = runs[0]["losses"]
    assert all(r["losses"] == losses for r in runs), "ranks disagree on the losses"
    assert losses[-1] < losses[0] - 0.5, losses


def test_parallelize_needs_process_group():
    import meshplan as mp
    from meshplan.errors import ConfigError
    from meshplan.runtime import parallelize
    model = mp.models.build("tiny-llama", seq_len=SEQ, device="cpu")
    plan = _plan("tiny-llama", 2, (("dp", 2),))
    with pytest.raises(ConfigError, match="process group"):
        parallelize(model, plan)


def test_tp_gathers_once_per_block(world2):
    """The activation entering attention / feed-forward is gathered once for all its column-parallel
    linears (torchtitan's PrepareModuleInput), not once per linear (wq, wk, wv, w1, w3
    each gathered the same tensor). Per micro-batch and layer: 2 all-gathers forward + 4 backward
    under SP (the reduce-scatters' transposes, and the two inputs gathered again from the sequence
    shards kept for backward, once per module: runtime/sp_saved.py), 2 all-reduces each way
    without SP, plus a few for the embedding and head."""
    for name, collective, per_layer in (("tp2_sp", "all_gather_into_tensor", 6),
                                        ("hf_tp2_sp", "all_gather_into_tensor", 6), ("tp2", "all_reduce", 4)):
        layers = numerics.layers_of(CASES_2[name][0])
        m = _plan(CASES_2[name][0], 2, tuple(sorted(CASES_2[name][1].items()))).num_microbatches
        counts = world2[name][0]["comm"]
        # the per-linear gathers cost 2 + 5 per layer forward (SP) and 5 more in backward
        assert counts.get(collective, 0) <= m * (per_layer * layers + 3), (name, m, counts)


def test_data_parallel_flavours(world2):
    """zero=0 runs as DDP, zero>=1 through FSDP2, one data-parallel rank with no wrapper at all."""
    assert world2["dp2_ddp_accum2"][0]["data_parallel"] == "ddp"
    assert world2["gpt_dp2_ddp_tied"][0]["data_parallel"] == "ddp"
    assert world2["dp2_zero1_accum4"][0]["data_parallel"] == "fsdp"
    assert world2["dp2_fsdp"][0]["data_parallel"] == "fsdp"
    assert world2["tp2"][0]["data_parallel"] == "none"


def test_one_data_parallel_rank_trains_in_bf16_without_fsdp(world2):
    runs = world2["pp2_bf16_train"]
    assert all("error" not in r for r in runs), runs[0]
    losses = runs[0]["losses"]
    assert all(r["losses"] == losses for r in runs) and losses[-1] < losses[0] - 0.5, losses
    assert runs[0]["data_parallel"] == "none"


def test_zero1_gathers_weights_once_per_step(world2):
    """ZeRO-1 over 4 micro-batches: the weights are all-gathered once and the gradients
    reduce-scattered once per step (one FSDP unit on CPU), not once per micro-batch or block."""
    counts = world2["dp2_zero1_accum4"][0]["comm"]
    gathers = sum(v for k, v in counts.items() if "all_gather" in k or "allgather" in k)
    scatters = sum(v for k, v in counts.items() if "reduce_scatter" in k)
    assert gathers == 1 and scatters == 1, counts
