"""Context parallelism: ring attention and CP plans against the single-device model (gloo, CPU).

Ring attention alone is compared with F.scaled_dot_product_attention on the whole sequence
(forward and dq/dk/dv; tolerances in cp_workers.py) and shown to hold no score block (the
largest tensor any op creates inside it, against one block's size). Each plan case parallelises
the model with cp > 1, runs one global batch forward and backward, takes one AdamW step and
compares loss, every full gradient and every parameter with the unsharded model
(numerics.equivalence and its tolerances: CP only reorders sums - the softmax over ring blocks,
the loss and the gradients over CP ranks - so the fp32 rounding argument there holds unchanged).
Cases that share a world size run in one spawned process group (starting ranks costs seconds): 2
ranks (`world2`: ring attention alone, what it refuses, CP2 with recompute, GPT and transformers
Llama, a short batch refused) and 4 ranks (`world4`: ring attention alone, CP x FSDP, CP x TP
with SP, CP x PP, and a bf16 training run). Each test reads its cases' results. CP splits the
sequence inside every layer the same way, so the cases run 2-layer models (numerics.VARIANTS)
but CP x PP, whose two stages keep 4 layers.
"""

from __future__ import annotations


import pytest
import torch

import cp_workers
import numerics

SEQ, BATCH = 32, 8

# name -> (model, fixed layout with cp); world size is the product of the degrees
CASES_2 = {
    "cp2": ("tiny-llama-2l", dict(cp=2, tp=1, dp=1, pp=1, mbs=2)),
    "cp2_recompute_full": ("tiny-llama-2l", dict(cp=2, tp=1, dp=1, pp=1, mbs=4, recompute="full")),
    "cp2_recompute_selective": ("tiny-llama-2l", dict(cp=2, tp=1, dp=1, pp=1, mbs=4, recompute="selective")),
    "gpt_cp2": ("tiny-gpt-2l", dict(cp=2, tp=1, dp=1, pp=1, mbs=4)),
    "hf_cp2": ("hf-llama-2l", dict(cp=2, tp=1, dp=1, pp=1, mbs=4)),
    # multi-head latent attention: query/key heads wider than the values (ring attention pads v)
    "mla_cp2": ("tiny-mla-2l", dict(cp=2, tp=1, dp=1, pp=1, mbs=4)),
}
CASES_4 = {
    "cp2_dp2_fsdp": ("tiny-llama-2l", dict(cp=2, dp=2, tp=1, pp=1, zero=3, mbs=2)),
    "cp2_tp2_sp": ("tiny-llama-2l", dict(cp=2, tp=2, sp=True, dp=1, pp=1, mbs=4)),
    "cp2_pp2": ("tiny-llama", dict(cp=2, pp=2, vp=1, schedule="1f1b", tp=1, dp=1, mbs=2)),
    "gpt_cp2_tp2_sp": ("tiny-gpt-2l", dict(cp=2, tp=2, sp=True, dp=1, pp=1, mbs=4)),
}


def _plan(kind: str, world: int, fixed_items: tuple):
    """The planner's plan with the fixed layout (a fixed cp is searched even at short sequences)."""
    plan = numerics.plan_for(kind, world, fixed_items, SEQ, BATCH)
    assert plan.layout.cp == dict(fixed_items)["cp"]
    return plan


def _cases(table: dict, world: int) -> dict:
    numerics.plan_for.prefetch([(kind, world, tuple(sorted(fixed.items())), SEQ, BATCH)
                                for kind, fixed in table.values()])
    return {name: dict(model=kind, plan=_plan(kind, world, tuple(sorted(fixed.items()))), seq_len=SEQ,
                       global_batch=BATCH) for name, (kind, fixed) in table.items()}


def _run(world: int, cases: dict) -> list[dict]:
    from meshplan.train.spawn import run_ranks
    return run_ranks(world, cp_workers.run_all, cases, timeout_s=240)


@pytest.fixture(scope="module")
def world2():
    cases = _cases(CASES_2, 2)
    # bad input at run time: a batch shorter than the plan's seq_len (the reordered position
    # tables and the 2*cp chunks are for exactly seq_len tokens)
    kind, fixed = CASES_2["cp2"]
    cases["short_batch"] = dict(kind="cp_short_batch", model=kind, seq_len=SEQ, global_batch=BATCH,
                                plan=_plan(kind, 2, tuple(sorted(fixed.items()))))
    return _run(2, cases)


@pytest.fixture(scope="module")
def world4():
    cases = _cases(CASES_4, 4)
    # the plan's own precision (bf16 compute through FSDP's mixed precision): a few steps train
    cases["cp2_tp2_sp_bf16_train"] = dict(cases["cp2_tp2_sp"], kind="train", steps=6)
    return _run(4, cases)


def _check(results: list[dict], name: str) -> None:
    for rank, r in enumerate(results):
        assert "error" not in r[name], f"rank {rank}: {r[name]['error']}\n{r[name].get('tb', '')}"
    losses = {r[name]["loss"] for r in results}
    assert len(losses) == 1, f"ranks disagree on the loss: {losses}"


@pytest.mark.parametrize("case", sorted(cp_workers.ATTENTION_CASES))
@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_sdpa(world2, world4, world, case):
    results = world2 if world == 2 else world4
    for rank, r in enumerate(results):
        err = r["attention"][case]
        assert "error" not in err, f"rank {rank}: {err['error']}\n{err.get('tb', '')}"


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_holds_no_score_block(world2, world4, world):
    """Each ring step runs the fused kernel: no tensor of a (query chunk x key chunk) score block's
    size is created, in forward or backward (cp_workers.largest_ring_tensors records every aten
    op's outputs); the largest is O(local tokens): the fp32 output / dK,dV buffers, at most 2x q."""
    for rank, r in enumerate(world2 if world == 2 else world4):
        m = r["memory"]
        assert "error" not in m, f"rank {rank}: {m['error']}\n{m.get('tb', '')}"
        # the kernels ran (else a small largest tensor would say nothing about them)
        assert "_scaled_dot_product_flash_attention_for_cpu.default" in m["forward_ops"]
        assert "_scaled_dot_product_flash_attention_for_cpu_backward.default" in m["backward_ops"]
        assert m["score_block"] >= 16 * m["q"]        # a case where one score block would stand out
        assert m["forward"] <= 2 * m["q"], m
        assert m["backward"] <= 2 * m["q"], m


@pytest.mark.parametrize("name", sorted(CASES_2))
def test_two_ranks(world2, name):
    _check(world2, name)


@pytest.mark.parametrize("name", sorted(CASES_4))
def test_four_ranks(world4, name):
    _check(world4, name)


def test_bf16_training_loss_falls(world4):
    runs = [r["cp2_tp2_sp_bf16_train"] for r in world4]
    assert all("error" not in r for r in runs), runs[0]
    losses = runs[0]["losses"]
    assert all(r["losses"] == losses for r in runs), "ranks disagree on the losses"
    assert losses[-1] < losses[0] - 0.5, losses


def test_unsupported_attention_calls_are_refused(world2):
    msgs = world2[0]["refusals"]
    assert msgs["mask"].startswith("LayoutError") and "attn_mask" in msgs["mask"] and "cp=1" in msgs["mask"]
    assert msgs["dropout"].startswith("LayoutError") and "dropout_p=0.1" in msgs["dropout"]
    assert msgs["cross"].startswith("LayoutError") and "8 queries and 4 keys" in msgs["cross"]


def test_short_batch_is_refused(world2):
    for r in world2:
        assert r["short_batch"]["raised"] == "ConfigError", r["short_batch"]
        assert "exactly the plan's seq_len=32" in r["short_batch"]["message"]


def test_load_balanced_split():
    from meshplan.runtime.context_parallel import load_balanced_positions, shard_sequence
    # 16 tokens, cp=2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert load_balanced_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert load_balanced_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = torch.arange(2 * 24).view(2, 24)
    parts = [shard_sequence(x, 3, r) for r in range(3)]
    for r, part in enumerate(parts):
        assert torch.equal(part, x[:, load_balanced_positions(24, 3, r)])
    # every token exactly once, and equal causal work: sum of (position + 1) over each rank's tokens
    assert sorted(torch.cat([load_balanced_positions(24, 3, r) for r in range(3)]).tolist()) == list(range(24))
    work = {int((load_balanced_positions(24, 3, r) + 1).sum()) for r in range(3)}
    assert len(work) == 1


def test_sequence_not_divisible_is_refused():
    from meshplan.errors import ConfigError
    from meshplan.runtime.context_parallel import load_balanced_positions, shard_sequence
    with pytest.raises(ConfigError, match="2\\*cp = 4 equal chunks"):
        load_balanced_positions(30, 2, 0)
    with pytest.raises(ConfigError, match="divisible by 8"):
        shard_sequence(torch.zeros(1, 20), 4, 0)


def test_learned_positions_buffer_is_not_saved():
    from meshplan import models
    model = models.build("tiny-gpt", seq_len=SEQ, device="meta")
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.positions.tolist() == list(range(SEQ))
    assert "positions" not in model.state_dict()


def test_models_cp_cannot_serve_are_refused():
    import transformers
    from torch import nn

    from meshplan.errors import LayoutError
    from meshplan.runtime.context_parallel import _model_kind
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, attn_implementation="eager")
    with pytest.raises(LayoutError, match="attn_implementation='eager'.*cp=1"):
        _model_kind(transformers.LlamaForCausalLM(cfg))
    with pytest.raises(LayoutError, match="Sequential is neither.*cp=1"):
        _model_kind(nn.Sequential(nn.Linear(2, 2)))
