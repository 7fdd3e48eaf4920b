"""Workers for the training-loop tests (imported by spawned ranks)."""

from __future__ import annotations

from pathlib import Path

import torch


def train_run(rank: int, world: int, case: dict) -> dict:
    from meshplan.runtime.parallel import parallelize
    from meshplan.train.loop import TrainConfig, train
    import numerics
    torch.manual_seed(0)
    model = numerics.build_model(case.get("model", "tiny-llama"), seq_len=case["seq_len"])
    pm = parallelize(model, case["plan"], compute_dtype=None)
    cfg = TrainConfig(steps=case["steps"], lr=3e-3, warmup=2, out_dir=case["out"], checkpoint_every=case.get("every", 0),
                      keep_checkpoints=case.get("keep", 2), async_checkpoint=case.get("async", False),
                      stop_at=case.get("stop_at"), progress=False)
    res = train(model, case["plan"], cfg, pm=pm)
    ckpts = Path(case["out"]) / "checkpoints"         # as train() left it, before this process exits
    done = sorted(p.name for p in ckpts.iterdir() if (p / "meta.json").exists())
    return {"losses": res.losses, "start": res.start_step, "checkpoint": res.checkpoint, "complete": done,
            "other": sorted(p.name for p in ckpts.iterdir() if p.name not in done),
            "params": pm.full_state_dict() if case.get("params") else None}


def train_runs(rank: int, world: int, cases: dict) -> dict:
    """Several train() runs in turn in one process group (starting ranks costs seconds), each as
    a fresh job would run it (its own model, optimizer and output directory: a later run that
    uses an earlier run's directory resumes from its checkpoint); errors are reported per run."""
    from worlds import each_case
    return each_case(rank, cases, lambda name, case: train_run(rank, world, case))
