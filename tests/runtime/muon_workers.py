"""Workers for tests/train/test_muon.py (imported by spawned ranks).

- `equivalence`: the model parallelised by a plan takes two Muon steps (gradients from the
  model's own backward on a fixed batch); its full parameters must equal those of the
  single-device model after two single-device Muon steps from the same weights and batches.
  The step's collectives are counted (every c10d / functional collective, and the calls to
  batch_isend_irecv): the Muon exchange is two batched calls per step, whatever the number of
  matrices. The optimizer is attached to the model with `overlap_update=False`: the update
  exchange is waited for inside the step, as without overlap.
- `overlapped`: the same with the update exchange left in flight into the next forward, over
  three steps; with `checkpoint`, a DCP checkpoint is saved after the first (while its update is
  in flight) and loaded into a freshly parallelised model and optimizer that take the other two.
  With `profile`, the second step and the third's forward-backward run under torch.profiler
  (CPU): the labels of the exchange's issue and wait (muon_overlap.py), of the step, of the
  forward-backward and of the moment the first block's compute begins come back with their times.
- `train`: meshplan.train.loop.train with optimizer="muon" (train_workers.train_run's pattern).
"""

from __future__ import annotations

import contextlib
import copy
import json
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
    opt.overlap_update = False
    opt.attach(pm.stages, blocks=case["plan"].blocks)
    ref_opt = _ref_optimizer(ref)
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


def _ref_optimizer(ref):
    from meshplan.train.optim import build_optimizer
    return build_optimizer(ref.named_parameters(), optimizer="muon", lr=LR, weight_decay=WD, eps=numerics.EPS)


def _parallel_muon(case: dict, model):
    from meshplan.runtime import parallelize
    from meshplan.train.optim import build_optimizer
    pm = parallelize(model, case["plan"], compute_dtype=None)
    opt = build_optimizer(pm.named_parameters(), optimizer="muon", lr=LR, weight_decay=WD, eps=numerics.EPS)
    opt.attach(pm.stages, blocks=case["plan"].blocks)
    return pm, opt


def _marks(prof) -> dict[str, list[tuple[float, float]]]:
    """{label: [(start us, end us)]} of the test's and Muon's record_function ranges."""
    out: dict[str, list[tuple[float, float]]] = {}
    for e in prof.events():
        if e.name.startswith(("muon.", "test.")):
            out.setdefault(e.name, []).append((e.time_range.start, e.time_range.end))
    return {k: sorted(v) for k, v in out.items()}


def overlapped(rank: int, world: int, case: dict) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    from meshplan.train import checkpoint as ckpt
    torch.manual_seed(0)
    model = _build(case)
    ref = copy.deepcopy(model)
    ref_opt = _ref_optimizer(ref)
    pm, opt = _parallel_muon(case, model)
    batches = [tuple(t.roll(step, 0) for t in numerics.batch(case["global_batch"], case["seq_len"]))
               for step in range(3)]
    for x, y in batches:
        numerics.reference_loss(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    pm.forward_backward(*batches[0])
    opt.step()
    pm.zero_grad()
    in_flight = opt.pending                          # the first step's update, not yet applied
    after_save = None
    if case.get("checkpoint"):
        path = ckpt.save(case["out"], 1, pm, opt, {"optimizer": "muon"})
        after_save = opt.pending
        del pm, opt
        pm, opt = _parallel_muon(case, _build(case))     # a fresh model: the checkpoint's weights only
        ckpt.load(path, pm, opt)
    pm.forward_backward(*batches[1])
    counts = []
    held = dict(pm.stages[0].named_modules())
    first_block = next(held[b] for b in case["plan"].blocks if b in held)     # this stage's first

    def layer0_begins(module, args):                 # after FSDP2's all-gather and Muon's hook
        with record_function("test.layer0.compute"):
            pass
    handle = first_block.register_forward_pre_hook(layer0_begins)
    prof = profile(activities=[ProfilerActivity.CPU]) if case.get("profile") else contextlib.nullcontext()
    with prof:
        with record_function("test.step"), _CountStep() as c:
            opt.step()
        counts.append(c.counts)
        pending = [g.index for g in opt._pending]
        pm.zero_grad()
        with record_function("test.forward_backward"), _CountStep() as c:
            pm.forward_backward(*batches[2])
        counts.append(c.counts)
    handle.remove()
    left = opt.pending                               # after the forward: every slice applied
    opt.step()
    at_end = opt.pending
    params = pm.full_state_dict()                    # its state_dict pre-hook applies the last step's update
    for n, t in ref.state_dict().items():
        torch.testing.assert_close(params[n], t, **numerics.PARAM_TOL, msg=lambda m, n=n: f"param {n}: {m}")
    return {"in_flight": in_flight, "after_save": after_save, "left": left, "at_end": at_end,
            "pending": pending, "after_state_dict": opt.pending, "groups": opt._forward.count,
            "counts": counts, "marks": _marks(prof) if case.get("profile") else {}}


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
    # the parameter norm each metrics line reports, and the weights' norm once training returned
    lines = Path(case["out"], "metrics.jsonl")
    norms = {r["step"]: r["param_norm"] for r in map(json.loads, lines.read_text().splitlines())} \
        if rank == 0 and lines.exists() else {}
    return {"losses": res.losses, "start": res.start_step, "param_norms": norms,
            "final_norm": pm.global_norm("params"), "checkpoint": res.checkpoint and Path(res.checkpoint).name}


def run_cases(rank: int, world: int, cases: dict) -> dict:
    from worlds import each_case
    kinds = {"train": train_run, "overlapped": overlapped}
    return each_case(rank, cases, lambda name, case: kinds.get(case.get("kind"), equivalence)(rank, world, case))
