"""Workers for the batch-schedule and observability tests (imported by spawned ranks)."""

from __future__ import annotations

import torch


def run(rank: int, world: int, case: dict) -> dict:
    """One train() job as a fresh process would run it; optionally an inf gradient injected on
    rank 1 after forward-backward number `inf_at` (the loss scaler must skip that step everywhere)."""
    from pathlib import Path

    import numerics

    from meshplan.runtime.parallel import parallelize
    from meshplan.train.loop import TrainConfig, train
    from meshplan.train.metrics import read_metrics
    torch.manual_seed(0)
    model = numerics.build_model("tiny-llama", seq_len=case["seq_len"])
    pm = parallelize(model, case["plan"], compute_dtype=None)
    if case.get("inf_at"):
        _inject_inf(pm, rank, case["inf_at"])
    cfg = TrainConfig(steps=case["steps"], lr=3e-3, warmup=1, out_dir=case["out"], checkpoint_every=0,
                      stop_at=case.get("stop_at"), progress=False, batch_schedule=case.get("schedule"),
                      loss_scaling=case.get("loss_scaling", "auto"), initial_loss_scale=2.0 ** 10,
                      loss_scale_window=case.get("window", 1000))
    res = train(model, case["plan"], cfg, pm=pm)
    records = read_metrics(Path(case["out"]) / "metrics.jsonl") if rank == 0 else None
    return {"losses": res.losses, "start": res.start_step, "skipped": list(res.skipped_steps),
            "records": records, "summary": res.summary}


def _inject_inf(pm, rank: int, at: int) -> None:
    real, calls = pm.forward_backward, [0]

    def forward_backward(x, y):
        loss = real(x, y)
        calls[0] += 1
        if calls[0] == at and rank == 1:
            g = next(p.grad for p in pm.parameters() if p.grad is not None)
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("inf")
        return loss
    pm.forward_backward = forward_backward


def fp32_grads(rank: int, world: int, case: dict) -> dict:
    """One bf16 forward-backward under each of `case["runs"]` (plan, fp32_grads patterns); the
    full gradients of every parameter, per run."""
    import numerics
    from torch.distributed.tensor import DTensor

    from meshplan.runtime.parallel import parallelize
    x, y = numerics.batch(case["batch"], case["seq_len"])
    out = {}
    for name, (plan, patterns) in case["runs"].items():
        model = numerics.build_model("tiny-llama", seq_len=case["seq_len"])
        pm = parallelize(model, plan, fp32_grads=patterns)
        pm.forward_backward(x, y)
        out[name] = {"modules": list(pm.fp32_grads),
                     "grads": {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float()
                               for n, p in pm.named_parameters()}}
    return out


def runs(rank: int, world: int, cases: dict) -> dict:
    from worlds import each_case
    return each_case(rank, cases, lambda name, case: (fp32_grads if case.get("kind") == "fp32_grads" else run)(
        rank, world, case))
