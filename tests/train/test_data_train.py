"""Training on prepared data: the validation loss is the model's own loss on the held-out batch
(one process), and a 2-rank run under DP (FSDP), TP and PP with document masking and validation
starts from the single-device model's loss and agrees across the layouts."""

from __future__ import annotations

import functools

import data_workers
import pytest
import torch
import torch.distributed as dist
from data_fixtures import bpe_tokenizer, documents, write_jsonl

SEQ, BATCH = 24, 4


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from meshplan.train import tokenizer
    from meshplan.train.prepare import prepare
    root = tmp_path_factory.mktemp("data")
    tok = tokenizer.load(bpe_tokenizer(root / "tok"))
    write_jsonl(root / "a.jsonl", documents(60))
    prepare([root / "a.jsonl"], root / "prepared", tokenizer=tok, progress=None)
    return root / "prepared"


@functools.cache
def _plan(world: int, fixed: tuple):
    import meshplan as mp
    from meshplan.cluster import Cluster
    model = mp.models.build("tiny-llama", seq_len=SEQ, device="meta", layers=2, hidden=64, ffn_hidden=128, vocab=128)
    return mp.plan(model, Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world), seq_len=SEQ,
                   global_batch=BATCH, fixed=dict(fixed))


def _direct_loss(model, batch) -> float:
    from meshplan.models.transformer import causal_lm_loss
    with torch.no_grad():
        return float(causal_lm_loss(model(batch.input_ids, document_ids=batch.document_ids), batch.labels))


def test_eval_loss_is_the_models_loss_on_the_held_out_batch(prepared, tmp_path):
    from meshplan.runtime.parallel import parallelize
    from meshplan.train.inputs import build_training_data
    from meshplan.train.loop import TrainConfig
    from meshplan.train.spawn import init_single_process_group
    if not init_single_process_group(60):
        pytest.skip("a process group is already initialised in this process")
    try:
        plan = _plan(1, (("mbs", 2),))
        model = data_workers.build_model(SEQ)
        pm = parallelize(model, plan, compute_dtype=None)
        cfg = TrainConfig(steps=2, warmup=1, data=str(prepared), eval_every=1, eval_fraction=0.25, out_dir=str(tmp_path))
        data = build_training_data(cfg, plan, model, vocab=128)
        assert data.document_mask and data.eval_sampler.document_mask      # on by default for prepared data
        held_out = data.eval_sampler.sample(0)
        assert data.evaluate(pm) == pytest.approx(_direct_loss(model, held_out), rel=1e-6)
        assert all(p.grad is None for p in pm.parameters())
        # the held-out tokens are not in the training windows
        train_ds, eval_ds = data.sampler.dataset, data.eval_sampler.dataset
        assert len(train_ds) + len(eval_ds) == len(TokenDataset_open(prepared))
    finally:
        dist.destroy_process_group()


def TokenDataset_open(path):
    from meshplan.train.data import TokenDataset
    return TokenDataset.open(path)


def test_two_ranks_dp_tp_pp_with_document_mask_and_eval(prepared, tmp_path):
    from worlds import ok, spawn_cases

    from meshplan.train.inputs import build_training_data
    from meshplan.train.loop import TrainConfig
    layouts = {"dp2": (("dp", 2), ("zero", 3)), "tp2": (("tp", 2),), "pp2": (("pp", 2), ("mbs", 1))}
    cases = {name: dict(plan=_plan(2, fixed), seq_len=SEQ, steps=2, out=str(tmp_path / name), data=str(prepared))
             for name, fixed in layouts.items()}
    runs = spawn_cases(2, data_workers.train_cases, cases, timeout_s=180)
    cfg = TrainConfig(steps=2, warmup=1, data=str(prepared), eval_every=1, eval_fraction=0.2, out_dir=str(tmp_path))
    model = data_workers.build_model(SEQ)
    first = build_training_data(cfg, _plan(1, ()), model, vocab=128).sampler.sample(0)
    assert first.document_ids is not None
    expect = _direct_loss(model, first)
    evals = {}
    for name in layouts:
        ok(runs[name])
        r0 = runs[name][0]
        assert r0["losses"][1] == pytest.approx(expect, rel=1e-5), name
        assert set(r0["eval"]) == {1, 2} and all(v is not None for v in r0["eval"].values()), name
        evals[name] = r0["eval"]
    for name in ("tp2", "pp2"):
        for step in (1, 2):
            assert evals[name][step] == pytest.approx(evals["dp2"][step], rel=1e-4), (name, step)
