"""Workers for the data tests (imported by spawned ranks): train() on prepared data with document
masking and validation under one layout; per case the losses and the metrics log's eval losses."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def build_model(seq_len: int):
    from meshplan import models
    torch.manual_seed(1234)
    model = models.build("tiny-llama", seq_len=seq_len, device="cpu", layers=2, hidden=64, ffn_hidden=128,
                         vocab=128)
    model.init_weights()
    return model


def train_case(rank: int, world: int, case: dict) -> dict:
    from meshplan.runtime.parallel import parallelize
    from meshplan.train.loop import TrainConfig, train
    model = build_model(case["seq_len"])
    pm = parallelize(model, case["plan"], compute_dtype=None)
    cfg = TrainConfig(steps=case["steps"], lr=3e-3, warmup=1, out_dir=case["out"], checkpoint_every=0,
                      progress=False, data=case["data"], eval_every=1, eval_fraction=0.2, eval_batches=1)
    res = train(model, case["plan"], cfg, pm=pm)
    records = [json.loads(line) for line in (Path(case["out"]) / "metrics.jsonl").read_text().splitlines()] \
        if rank == 0 else []
    return {"losses": res.losses, "eval": {r["step"]: r.get("eval_loss") for r in records}}


def train_cases(rank: int, world: int, cases: dict) -> dict:
    from worlds import each_case
    return each_case(rank, cases, lambda name, case: train_case(rank, world, case))
