"""Multi-token prediction under the runtime's layouts (gloo, one spawned world of 2 ranks, one of 4).

Models with one MTP depth (meshplan.models.mtp): tiny-llama, and a small MoE with latent attention
whose MTP block is a MoE block, as DeepSeek-V3's. One step each, equal to the single-device model trained on the same
objective (workers: mtp_workers.py):

- TP2: the MTP depth's logits go through the same vocabulary-parallel cross entropy as the main
  logits (the output layer's logits stay sharded: each rank holds vocab / 2 of them); its block
  is tensor-parallel as the last layer (runtime/mtp_parallel.py);
- TP2 with SP: the depth's norms and projection run on the sequence shards of the hidden state and
  of the shifted tokens' embeddings, its block under the main blocks' TP+SP placements;
- DP2 under FSDP with two micro-batches per rank: each depth's loss is averaged over its own
  global label count, whatever the split of the batch;
- PP2 (1F1B, 4 micro-batches): the first stage sends the shifted tokens' embeddings with its
  hidden state to the last, which runs the MTP depth (runtime/pipeline.py); on 4 ranks, PP2 with
  TP2, with TP2+SP and EP2 (the MoE), and with CP2;
- CP2: the shift by one token crosses the load-balanced chunks (ids gathered over CP, labels
  shifted before the split), and the MTP block's attention runs the ring;
- EP2 (MoE, data-parallel ranks), EP2 over TP2 with SP and ETP2 (MoE folding): the MTP block's
  routed experts are sharded like the main blocks'.
"""

from __future__ import annotations

import mtp_workers as workers
import pytest

from worlds import ok, spawn_cases

SEQ, BATCH, VOCAB = 16, 4, 256
CP_SEQ = 32         # tiny-llama's rotary tables are (seq_len, 16): at 16 tokens CP takes them for a mask
CASES = {"tp2": ("llama", SEQ, dict(tp=2, dp=1, pp=1, sp=False)),
         "tp2_sp": ("llama", SEQ, dict(tp=2, dp=1, pp=1, sp=True)),
         "dp2_fsdp_accum2": ("llama", SEQ, dict(dp=2, tp=1, pp=1, zero=3, mbs=1)),
         "pp2_1f1b": ("llama", SEQ, dict(pp=2, vp=1, schedule="1f1b", tp=1, dp=1, mbs=1)),
         "cp2": ("llama", CP_SEQ, dict(cp=2, tp=1, dp=1, pp=1)),
         "moe_dp2_ep2": ("moe", SEQ, dict(dp=2, ep=2, tp=1, pp=1)),
         "moe_tp2_sp_ep2": ("moe", SEQ, dict(tp=2, sp=True, ep=2, dp=1, pp=1)),
         "moe_tp2_etp2": ("moe", SEQ, dict(tp=2, sp=False, ep=1, etp=2, dp=1, pp=1))}


# 4 ranks: pipeline stages that are tensor- (sequence-) or context-parallel
CASES4 = {"pp2_tp2": ("llama", SEQ, dict(pp=2, tp=2, sp=False, dp=1, mbs=1, schedule="1f1b")),
          "moe_pp2_tp2_sp_ep2": ("moe", SEQ, dict(pp=2, tp=2, sp=True, ep=2, dp=1, mbs=1, schedule="1f1b")),
          "pp2_cp2": ("llama", CP_SEQ, dict(pp=2, cp=2, tp=1, dp=1, mbs=1, schedule="1f1b"))}


def _calls(world: int, cases: dict) -> list[tuple]:
    return [(kind, world, tuple(sorted(fixed.items())), seq, BATCH) for kind, seq, fixed in cases.values()]


def _world(world: int, cases: dict) -> dict:
    calls = _calls(world, cases)
    planned = {name: dict(plan=workers.plan_for(*call), seq_len=call[3], global_batch=BATCH, kind=call[0])
               for name, call in zip(cases, calls)}
    return spawn_cases(world, workers.run_cases, planned, timeout_s=240)


@pytest.fixture(scope="module")
def world2():
    # both worlds' plans, made two at a time before the first world starts
    workers.plan_for.prefetch(_calls(2, CASES) + _calls(4, CASES4))
    return _world(2, CASES)


@pytest.fixture(scope="module")
def world4():
    workers.plan_for.prefetch(_calls(4, CASES4))
    return _world(4, CASES4)


def test_tp2_mtp_step_matches_single_device_on_vocab_slices(world2):
    runs = world2["tp2"]
    ok(runs)
    assert [r["vocab_shard"] for r in runs] == [(0, VOCAB // 2), (VOCAB // 2, VOCAB // 2)]
    assert runs[0]["blocks"] == ["layers.0", "layers.1", "mtp.0.block"]


def test_tp2_sp_mtp_step_matches_single_device(world2):
    runs = world2["tp2_sp"]
    ok(runs)
    # the depth's own modules on the sequence shards (without SP: whole tokens, weights replicated)
    assert set(runs[0]["mtp_own"].values()) == {"sequence"}
    assert set(world2["tp2"][0]["mtp_own"].values()) == {"replicate"}


def test_pp2_mtp_step_matches_single_device(world2):
    ok(world2["pp2_1f1b"])


def test_dp2_fsdp_mtp_step_matches_single_device(world2):
    runs = world2["dp2_fsdp_accum2"]
    ok(runs)
    assert runs[0]["data_parallel"] == "fsdp"


def test_cp2_mtp_shift_across_chunks_matches_single_device(world2):
    ok(world2["cp2"])


@pytest.mark.parametrize("case", ["moe_dp2_ep2", "moe_tp2_sp_ep2", "moe_tp2_etp2"])
def test_ep2_shards_the_mtp_blocks_experts_and_matches_single_device(world2, case):
    runs = world2[case]
    ok(runs)
    assert "mtp.0.block.feed_forward.experts" in runs[0]["experts"]


def test_pp2_tp2_mtp_carries_the_reduced_lookups_and_matches_single_device(world4):
    """The first stage sends the shifted tokens' embeddings as the model sees them: all-reduced
    over TP (vocabulary-parallel embedding), or, under SP, this rank's sequence shard of them."""
    ok(world4["pp2_tp2"])
    runs = world4["moe_pp2_tp2_sp_ep2"]
    ok(runs)
    assert set(runs[-1]["mtp_own"].values()) == {"sequence"}
    assert "mtp.0.block.feed_forward.experts" in runs[-1]["experts"]


def test_pp2_cp2_mtp_step_matches_single_device(world4):
    ok(world4["pp2_cp2"])
