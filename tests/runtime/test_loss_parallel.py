"""Vocabulary-parallel cross entropy under tensor parallelism (meshplan.runtime.loss_parallel).

With the runtime's default loss, the output layer's logits stay sharded over the vocabulary
on every TP rank and the loss is computed from the slices; a user's `loss_fn` gets whole
logits. Checked on gloo ranks (workers: loss_parallel_workers.py):

- the loss function alone, on 2 ranks, against F.cross_entropy on the whole logits (loss and
  logits gradient; ignored rows, uneven and empty slices, bf16 logits, bad labels);
- tiny Llama under TP2 and TP2 + SP (2 ranks) and PP2 x TP2 + SP (4 ranks): one training step
  equals the single-device model's (loss, every gradient, every parameter after AdamW), each
  rank's output layer returns vocab / tp logits per token, and no rank creates a tensor with a
  full-vocabulary dimension; with a `loss_fn` the same step gathers whole logits.
"""

from __future__ import annotations

import loss_parallel_workers as workers
import numerics
import pytest

from worlds import ok, spawn_cases

SEQ, BATCH, VOCAB, TP = 24, 8, 256, 2   # 192 tokens a batch: no size equals the vocabulary
HEAD = "output"             # tiny-llama's output layer

CASES_2 = {
    "tp2": dict(tp=2, sp=False, dp=1, pp=1),
    "tp2_sp": dict(tp=2, sp=True, dp=1, pp=1, mbs=2),
    "tp2_custom_loss": dict(tp=2, sp=False, dp=1, pp=1),
}
CASES_4 = {
    "pp2_tp2_sp": dict(tp=2, pp=2, dp=1, vp=1, sp=True, schedule="1f1b", mbs=1),
}


def _cases(table: dict, world: int) -> dict:
    items = {name: tuple(sorted(fixed.items())) for name, fixed in table.items()}
    numerics.plan_for.prefetch([("tiny-llama", world, it, SEQ, BATCH) for it in set(items.values())])
    return {name: dict(model="tiny-llama", plan=numerics.plan_for("tiny-llama", world, it, SEQ, BATCH),
                       seq_len=SEQ, global_batch=BATCH, vocab=VOCAB, head=HEAD,
                       custom_loss="custom_loss" in name)
            for name, it in items.items()}


@pytest.fixture(scope="module")
def world2():
    cases = _cases(CASES_2, 2)
    cases["unit"] = dict(kind="unit")
    return spawn_cases(2, workers.run_cases, cases, timeout_s=240)


@pytest.fixture(scope="module")
def world4():
    return spawn_cases(4, workers.run_cases, _cases(CASES_4, 4), timeout_s=240)


def _same_loss(runs: list) -> None:
    ok(runs)
    assert len({r["loss"] for r in runs}) == 1, [r["loss"] for r in runs]


def test_loss_and_logits_gradient_match_cross_entropy(world2):
    ok(world2["unit"])
    assert len(world2["unit"][0]["checked"]) == 8


@pytest.mark.parametrize("name", ["tp2", "tp2_sp"])
def test_tp_step_matches_single_device_on_vocab_slices(world2, name):
    runs = world2[name]
    _same_loss(runs)
    for rank, r in enumerate(runs):
        assert r["vocab_shard"] == (rank * VOCAB // TP, VOCAB // TP), r["vocab_shard"]
        # one output per micro-batch, this rank's vocabulary slice of every token's logits
        assert r["head_out"] == [("Tensor", (BATCH // r["microbatches"], SEQ, VOCAB // TP))] * r["microbatches"]
        assert r["vocab_wide"] == [], f"rank {rank} held full-vocabulary tensors {r['vocab_wide']}"


def test_custom_loss_fn_gets_whole_logits(world2):
    runs = world2["tp2_custom_loss"]
    _same_loss(runs)
    for r in runs:
        assert r["vocab_shard"] is None
        assert r["head_out"] == [("Tensor", (BATCH // r["microbatches"], SEQ, VOCAB))] * r["microbatches"]
        assert r["vocab_wide"], "the control case should see whole logits"
    # the same step as the vocabulary-parallel one
    assert runs[0]["loss"] == pytest.approx(world2["tp2"][0]["loss"], rel=1e-6)


def test_pipeline_last_stage_runs_vocab_parallel_loss(world4):
    runs = world4["pp2_tp2_sp"]
    _same_loss(runs)
    last = [r for r in runs if r["last_stage"]]
    assert len(last) == TP
    for r in runs:
        assert r["vocab_wide"] == [], r["vocab_wide"]
        if not r["last_stage"]:
            assert r["vocab_shard"] is None and r["head_out"] == []
    assert sorted(r["vocab_shard"] for r in last) == [(0, VOCAB // TP), (VOCAB // TP, VOCAB // TP)]
    for r in last:
        assert {shape[-1] for _, shape in r["head_out"]} == {VOCAB // TP}
