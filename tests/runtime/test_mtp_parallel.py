"""Multi-token prediction under the runtime's layouts (gloo, 2 ranks, one spawned world).

tiny-llama with one MTP depth (meshplan.models.mtp), one step each, equal to the single-device
model trained on the same objective (workers: mtp_workers.py):

- TP2: the MTP depth's logits go through the same vocabulary-parallel cross entropy as the main
  logits (the output layer's logits stay sharded: each rank holds vocab / 2 of them), and the
  MTP block runs whole on both TP ranks;
- DP2 under FSDP with two micro-batches per rank: each depth's loss is averaged over its own
  global label count, whatever the split of the batch;
- PP2 (1F1B, 4 micro-batches): the first stage sends the shifted tokens' embeddings with its
  hidden state to the last, which runs the MTP depth (runtime/pipeline.py).
The refusals (cp, sp, ep with MTP) are checked without a world in tests/models/test_mtp.py.
"""

from __future__ import annotations

import mtp_workers as workers
import pytest

import meshplan as mp
from meshplan.cluster import Cluster
from worlds import ok, spawn_cases

SEQ, BATCH, VOCAB = 16, 4, 256
CASES = {"tp2": dict(tp=2, dp=1, pp=1), "dp2_fsdp_accum2": dict(dp=2, tp=1, pp=1, zero=3, mbs=1),
         "pp2_1f1b": dict(pp=2, vp=1, schedule="1f1b", tp=1, dp=1, mbs=1)}


@pytest.fixture(scope="module")
def world2():
    model = mp.models.build("tiny-llama", seq_len=SEQ, device="meta", **workers.MTP)
    cluster = Cluster(gpu="cpu", num_gpus=2, gpus_per_node=2)
    cases = {name: dict(plan=mp.plan(model, cluster, seq_len=SEQ, global_batch=BATCH, fixed=fixed),
                        seq_len=SEQ, global_batch=BATCH) for name, fixed in CASES.items()}
    return spawn_cases(2, workers.run_cases, cases, timeout_s=240)


def test_tp2_mtp_step_matches_single_device_on_vocab_slices(world2):
    runs = world2["tp2"]
    ok(runs)
    assert [r["vocab_shard"] for r in runs] == [(0, VOCAB // 2), (VOCAB // 2, VOCAB // 2)]


def test_pp2_mtp_step_matches_single_device(world2):
    ok(world2["pp2_1f1b"])


def test_dp2_fsdp_mtp_step_matches_single_device(world2):
    runs = world2["dp2_fsdp_accum2"]
    ok(runs)
    assert runs[0]["data_parallel"] == "fsdp"
