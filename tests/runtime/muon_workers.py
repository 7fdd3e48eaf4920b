"""Workers for tests/runtime/test_muon.py (imported by spawned ranks).

- `equivalence`: the model parallelised by a plan takes two Muon steps (gradients from the
  model's own backward on a fixed batch); its full parameters must equal those of the
  single-device model after two single-device Muon steps from the same weights and batches.
  The step's collectives are counted (every c10d / functional collective, and the calls to
  batch_isend_irecv): the Muon exchange is two batched calls per step, whatever the number of
  matrices.
- `train`: meshplan.train.loop.train with optimizer="muon" (train_workers.train_run's pattern).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numerics
import torch
import torch.distributed as dist

LR, WD, STEPS = 1e-2, 0.1, 2


class _CountStep:
    """Counts, inside `with`, the calls to dist.batch_isend_irecv and every other collective."""

    NAMES = ("batch_isend_irecv", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
             "broadcast", "all_to_all_single", "all_to_all", "scatter", "gather", "send", "recv")

    def __enter__(self):
        self.counts: dict[str, int] = {}
        self._saved = {n: getattr(dist, n) for n in self.NAMES}
        for n, fn in self._saved.items():
            setattr(dist, n, self._wrap(n, fn))
        self._functional = numerics._CountCollectives().__enter__()
        return self

    def _wrap(self, name, fn):
        def counted(*a, **kw):
            self.counts[name] = self.counts.get(name, 0) + 1
            return fn(*a, **kw)
        return counted

    def __exit__(self, *exc):
        self._functional.__exit__(*exc)
        for n, fn in self._saved.items():
            setattr(dist, n, fn)
        for n, c in self._functional.counts.items():
            self.counts[f"functional.{n}"] = c


def _build(case: dict):
    if case["model"] == "moe":
        import ep_workers
        return ep_workers.build_model("moe", seq_len=case["seq_len"])
    return numerics.build_model(case["model"], seq_len=case["seq_len"])


def equivalence(rank: int, world: int, case: dict) -> dict:
    from meshplan.runtime import parallelize
    from meshplan.train.optim import build_optimizer
    torch.manual_seed(0)
    model = _build(case)
    ref = copy.deepcopy(model)
    pm = parallelize(model, case["plan"], compute_dtype=None)
    # eps as numerics.py explains: AdamW (embeddings, head, norms) turns reordering noise on ~0
    # gradients into whole steps with a tiny eps
    opt = build_optimizer(pm.named_parameters(), optimizer="muon", lr=LR, weight_decay=WD, eps=numerics.EPS)
    ref_opt = build_optimizer(ref.named_parameters(), optimizer="muon", lr=LR, weight_decay=WD, eps=numerics.EPS)
    counts = []
    for step in range(STEPS):
        x, y = numerics.batch(case["global_batch"], case["seq_len"])
        x, y = x.roll(step, 0), y.roll(step, 0)             # another batch for the second step
        pm.forward_backward(x, y)
        with _CountStep() as c:
            opt.step()
        counts.append(c.counts)
        pm.zero_grad()
        numerics.reference_loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    params = pm.full_state_dict()
    for n, t in ref.state_dict().items():
        torch.testing.assert_close(params[n], t, **numerics.PARAM_TOL, msg=lambda m, n=n: f"param {n}: {m}")
    moved = max(float((params[n] - t).abs().max()) for n, t in _build(case).state_dict().items())
    owned = sum(1 for u in opt._units if u.owner == rank)
    return {"counts": counts, "moved": moved, "owned": owned, "units": len(opt._units),
            "calls": opt.collective_calls}


def train_run(rank: int, world: int, case: dict) -> dict:
    from meshplan.runtime.parallel import parallelize
    from meshplan.train.loop import TrainConfig, train
    torch.manual_seed(0)
    model = numerics.build_model("tiny-llama", seq_len=case["seq_len"])
    pm = parallelize(model, case["plan"], compute_dtype=None)
    cfg = TrainConfig(steps=case["steps"], lr=3e-3, warmup=1, out_dir=case["out"], checkpoint_every=0,
                      stop_at=case.get("stop_at"), progress=False, optimizer=case.get("optimizer", "muon"))
    try:
        res = train(model, case["plan"], cfg, pm=pm)
    except Exception as e:      # the refusal's message is the result
        if case.get("expect_error"):
            return {"raised": type(e).__name__, "message": str(e)}
        raise
    return {"losses": res.losses, "start": res.start_step,
            "checkpoint": res.checkpoint and Path(res.checkpoint).name}


def run_cases(rank: int, world: int, cases: dict) -> dict:
    from worlds import each_case
    kinds = {"train": train_run}
    return each_case(rank, cases, lambda name, case: kinds.get(case.get("kind"), equivalence)(rank, world, case))
