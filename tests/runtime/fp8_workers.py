"""Workers for the FP8 runtime tests (imported by spawned ranks; see test_fp8.py).

Each equivalence case runs an FP8 plan sharded (TP2, or FSDP2 with FP8 all-gather) and, on every
rank, the same model with the same FP8 swap on one process (runtime.fp8.apply_fp8 on a copy, no
sharding), in fp32 around the FP8 GEMMs. Both quantise with the same per-tensor scales (the
sharded amax is reduced over the shards), so they differ only by fp32 summation order, plus the
rare element whose pre-quantisation value sits on an FP8 rounding boundary and flips by one FP8
step. Tolerances are set from measured errors with a wide margin, far below what a wrong scale
(a shard's own amax instead of the global one) or an unswapped module gives (~1e-2 relative).
"""

from __future__ import annotations

import copy
import warnings

import torch

from numerics import EPS, LR, batch, build_model

FP8_LOSS_TOL = dict(rtol=1e-4, atol=1e-5)
FP8_GRAD_TOL = dict(rtol=2e-3, atol=2e-4)
FP8_PARAM_TOL = dict(rtol=1e-3, atol=1e-4)


def fp8_plan(kind: str, world: int, fixed: dict, seq_len: int, global_batch: int, precision: str = "fp8"):
    import meshplan as mp
    from meshplan.cluster import Cluster
    model = (build_model(kind, seq_len=seq_len) if kind.startswith("hf")
             else mp.models.build(kind, seq_len=seq_len, device="meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)       # "FP8 is emulated" on CPU processes
        return mp.plan(model, Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world), seq_len=seq_len,
                       global_batch=global_batch, fixed=fixed, precision=precision)


def _single_fp8(model, plan):
    from meshplan.runtime.fp8 import apply_fp8
    ref = copy.deepcopy(model)
    swap = apply_fp8(ref, plan.fp8_modules, backend="torchao", device=torch.device("cpu"))
    assert sorted(swap.modules) == sorted(plan.fp8_modules)
    return ref


def reference(model, x, y, mbs: int):
    """The unsharded FP8 model over the plan's micro-batches: tensorwise scales are per GEMM call,
    so the reference quantises the same micro-batches (mbs sequences each) as the sharded run."""
    import torch.nn.functional as F

    from meshplan.runtime.pipeline import logits_of
    n_valid = float((y != -100).sum())
    total = 0.0
    for xm, ym in zip(x.split(mbs), y.split(mbs)):
        logits = logits_of(model(xm))
        loss = F.cross_entropy(logits.flatten(0, -2).float(), ym.flatten(), ignore_index=-100,
                               reduction="sum") / n_valid
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS).step()
    return total, grads, {n: p.detach().clone() for n, p in model.state_dict().items()}


def equivalence(rank: int, world: int, case: dict) -> dict:
    from torch.distributed.tensor import DTensor

    from meshplan.runtime import parallelize
    torch.manual_seed(0)
    model = build_model(case["model"], seq_len=case["seq_len"])
    plan = case["plan"]
    ref = _single_fp8(model, plan)
    x, y = batch(case["global_batch"], case["seq_len"])
    pm = parallelize(model, plan, compute_dtype=None)
    swapped = sorted(pm.fp8.modules) if pm.fp8 else []
    kinds = {type(m).__name__ for n, m in model.named_modules() if n in plan.fp8_modules}
    fp8_gather = []
    for n in plan.fp8_modules:
        w = model.get_submodule(n).weight
        local = w.to_local() if isinstance(w, DTensor) else w
        fp8_gather.append(type(local).__name__)
    loss = pm.forward_backward(x, y)
    grads = pm.full_grads()
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    opt.step()
    params = pm.full_state_dict()
    ref_loss, ref_grads, ref_params = reference(ref, x, y, plan.micro_batch_size)
    torch.testing.assert_close(loss, ref_loss, **FP8_LOSS_TOL)
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **FP8_GRAD_TOL, msg=lambda m, n=n: f"grad {n}: {m}")
    for n in ref_params:
        torch.testing.assert_close(params[n].float(), ref_params[n].float(), **FP8_PARAM_TOL,
                                   msg=lambda m, n=n: f"param {n}: {m}")
    worst = max(float((grads[n] - ref_grads[n]).abs().max() / (ref_grads[n].abs().max() + 1e-12))
                for n in ref_grads)
    return {"loss": loss, "ref_loss": ref_loss, "max_rel_grad_err": worst, "swapped": swapped,
            "kinds": sorted(kinds), "weight_types": sorted(set(fp8_gather)),
            "precisions": dict(pm.precisions)}


def checkpoint_round_trip(rank: int, world: int, case: dict) -> dict:
    """Train a step under plan A, save (DCP), load under plan B (other precision and sharding):
    every weight and Adam moment must arrive unchanged."""
    from meshplan.train import checkpoint as ckpt
    from meshplan.runtime import parallelize
    out = {}
    for name, (a, b) in {"fp8_to_bf16": (case["fp8"], case["bf16"]),
                         "bf16_to_fp8": (case["bf16"], case["fp8"])}.items():
        torch.manual_seed(0)
        pa = parallelize(build_model(case["model"], seq_len=case["seq_len"]), a)
        oa = torch.optim.AdamW(pa.parameters(), lr=LR)
        x, y = batch(case["global_batch"], case["seq_len"])
        pa.forward_backward(x, y)
        oa.step()
        pa.zero_grad()
        path = ckpt.save(f"{case['dir']}/{name}", 1, pa, oa, {"step": 1})
        saved = pa.full_state_dict()
        moments = {k: v["exp_avg"] for k, v in ckpt.optimizer_state(pa, oa).items()}
        pb = parallelize(build_model(case["model"], seq_len=case["seq_len"]), b)
        ob = torch.optim.AdamW(pb.parameters(), lr=LR)
        ckpt.load(path, pb, ob)
        loaded = pb.full_state_dict()
        assert set(saved) == set(loaded), sorted(set(saved) ^ set(loaded))
        for k in saved:
            torch.testing.assert_close(loaded[k].float(), saved[k].float(), rtol=0, atol=0,
                                       msg=lambda m, k=k: f"{name} {k}: {m}")
        got = ckpt.optimizer_state(pb, ob)
        from torch.distributed.tensor import DTensor
        full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t   # noqa: E731
        for k, m in moments.items():
            torch.testing.assert_close(full(got[k]["exp_avg"]), full(m), rtol=0, atol=0)
        # and it trains on under plan B
        loss = pb.forward_backward(x, y)
        out[name] = {"loss_after_load": loss, "fp8_here": bool(pb.fp8)}
    return out


def run_cases(rank: int, world: int, cases: dict) -> dict:
    import torch.distributed as dist
    out = {}
    for name, case in cases.items():
        try:
            fn = {"checkpoint": checkpoint_round_trip}.get(case.get("kind"), equivalence)
            out[name] = fn(rank, world, case)
        except Exception as e:  # noqa: BLE001 - reported per case; ranks stay in step
            import traceback
            out[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
        dist.barrier()
    return out
