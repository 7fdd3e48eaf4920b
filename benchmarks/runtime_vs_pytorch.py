"""meshplan's runtime against the PyTorch a user writes by hand for the same layout.

    python benchmarks/runtime_vs_pytorch.py            # full table: seq 256, 20 timed steps
    python benchmarks/runtime_vs_pytorch.py --quick    # CI: seq 64, 3 timed steps (~60 s on 2 cores)
    python benchmarks/runtime_vs_pytorch.py --rows tp2_dp2 --profile   # + where the time goes

Every row runs tiny-llama (bf16 compute, fp32 master weights, AdamW, the same global batch and
weights) on `world` local gloo processes. meshplan (`meshplan.plan(..., fixed=layout)` then
`parallelize`) and the hand-written PyTorch equivalent run in the SAME process group, step by
step interleaved (meshplan, hand, meshplan, ...), so both see the same machine load; the table
gives the median step (after a barrier on every rank) over the timed steps.

| row      | layout                   | hand-written PyTorch                                        |
|----------|--------------------------|-------------------------------------------------------------|
| one      | 1 process                | eager model under torch.autocast(bf16)                      |
| dp_ddp   | dp=4, zero=0             | DistributedDataParallel + autocast                          |
| dp_zero1 | dp=4, zero=1             | DDP + ZeroRedundancyOptimizer(AdamW) + autocast             |
| dp_fsdp  | dp=4, zero=3             | fully_shard per block + root, MixedPrecisionPolicy(bf16)    |
| tp2_dp2  | tp=2 (SP) x dp=2, zero=3 | parallelize_module (torchtitan's plan) + fully_shard        |
| pp2_dp2  | pp=2 x dp=2, 1F1B, zero=3| hand-split stages, Schedule1F1B + fully_shard               |
| cp2_dp2  | cp=2 x dp=2, zero=3      | none on CPU (torch's context_parallel has no CPU SDPA rule) |
| planner  | the planner's own choice | the fastest hand-written row above                          |

Results: benchmarks/results/runtime_vs_pytorch-<date>-<device>.md (with `--out`; current:
runtime_vs_pytorch-2026-11-24-cpu-quiet.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = "tiny-llama"
LR = 1e-3

# row -> (world, fixed layout or None for the planner's choice)
ROWS = {
    "one": (1, dict(tp=1, pp=1, dp=1)),
    "dp_ddp": (4, dict(dp=4, tp=1, pp=1, zero=0)),
    "dp_zero1": (4, dict(dp=4, tp=1, pp=1, zero=1)),
    "dp_fsdp": (4, dict(dp=4, tp=1, pp=1, zero=3, reshard_after_forward=True)),
    "tp2_dp2": (4, dict(tp=2, dp=2, pp=1, sp=True, zero=3, reshard_after_forward=True)),
    "pp2_dp2": (4, dict(pp=2, dp=2, tp=1, vp=1, schedule="1f1b", zero=3, reshard_after_forward=True)),
    "cp2_dp2": (4, dict(cp=2, dp=2, tp=1, pp=1, zero=3, fsdp_shard=0, reshard_after_forward=True)),
    "planner": (4, None),
}
HAND = {"one": "eager+autocast", "dp_ddp": "DDP", "dp_zero1": "DDP+ZeroRedundancyOptimizer",
        "dp_fsdp": "FSDP2 per block", "tp2_dp2": "parallelize_module+FSDP2", "pp2_dp2": "Schedule1F1B+FSDP2",
        "cp2_dp2": None, "planner": "best hand-written"}


# ---- model and batch ----------------------------------------------------------------------------
def _model(seq: int):
    import torch

    from meshplan import models
    torch.manual_seed(1234)
    m = models.build(MODEL, seq_len=seq, device="cpu")
    m.init_weights()
    return m


def _batch(batch: int, seq: int, step: int):
    import torch
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _ce(logits, y):
    import torch.nn.functional as F
    return F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())


# ---- hand-written PyTorch ------------------------------------------------------------------------
class Hand:
    """The hand-written equivalent of one row: `step(x, y)` runs forward, backward, AdamW."""

    def __init__(self, row: str, model, plan, world: int):
        import torch
        import torch.distributed as dist
        self.row, self.world, self.rank = row, world, dist.get_rank()
        self.schedule = None
        self.autocast = False
        if row == "one":
            self.model, self.autocast = model, True
        elif row in ("dp_ddp", "dp_zero1"):
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.model, self.autocast = DDP(model, gradient_as_bucket_view=True), True
        elif row == "dp_fsdp":
            self.model = self._fsdp(model, None)
        elif row == "tp2_dp2":
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            self._tp(model, mesh["tp"])
            self.model = self._fsdp(model, mesh["dp"])
        elif row == "pp2_dp2":
            self._pp(model, plan)
        else:
            raise ValueError(f"no hand-written equivalent for row {row!r}")
        params = list(self.model.parameters())
        if row == "dp_zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            self.opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR)
        else:
            self.opt = torch.optim.AdamW(params, lr=LR, foreach=True)

    @staticmethod
    def _fsdp(model, mesh):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        return model

    @staticmethod
    def _tp(model, tp_mesh):
        """torchtitan's Llama TP plan (sequence parallel, PrepareModuleInput per sub-module)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
        for layer in model.layers:
            parallelize_module(layer, tp_mesh, {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })

    def _pp(self, model, plan):
        import torch
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        r, n = mesh["pp"].get_local_rank(), len(model.layers)
        layers = list(model.layers)[r * n // 2:(r + 1) * n // 2]
        model.layers = nn.ModuleList(layers)
        if r == 0:
            model.norm = model.output = None
        else:
            model.tok_embeddings = None
        self.model = self._fsdp(model, mesh["dp"])
        stage = PipelineStage(self.model, r, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        self.schedule = Schedule1F1B(stage, n_microbatches=plan.num_microbatches, loss_fn=_ce)
        self.pp_rank, self.dp_rank = r, mesh["dp"].get_local_rank()

    def step(self, x, y) -> None:
        import torch
        if self.schedule is not None:
            n = x.shape[0] // 2
            x, y = x[self.dp_rank * n:(self.dp_rank + 1) * n], y[self.dp_rank * n:(self.dp_rank + 1) * n]
            if self.pp_rank == 0:
                self.schedule.step(x)
            else:
                self.schedule.step(target=y, losses=[])
        else:
            dp = {"one": 1, "tp2_dp2": 2}.get(self.row, self.world)
            dp_rank = self.rank if self.row != "tp2_dp2" else self.rank // 2
            n = x.shape[0] // dp
            x, y = x[dp_rank * n:(dp_rank + 1) * n], y[dp_rank * n:(dp_rank + 1) * n]
            if self.autocast:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = self.model(x)
            else:
                logits = self.model(x)
            _ce(logits, y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


# ---- one row on every rank -------------------------------------------------------------------------
def _timed(fn, *args) -> float:
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args)
    dist.barrier()
    return time.perf_counter() - t0


def run_row(rank: int, world: int, row: str, plan, cfg: dict) -> dict:
    import torch

    from meshplan.runtime import parallelize
    seq, batch, steps, warmup = cfg["seq"], cfg["batch"], cfg["steps"], cfg["warmup"]
    pm = parallelize(_model(seq), plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, foreach=True)

    def mesh_step(x, y):
        pm.forward_backward(x, y)
        opt.step()
        pm.zero_grad()

    hand_row = cfg.get("hand_row", row)
    hand = Hand(hand_row, _model(seq), plan, world) if hand_row else None
    times: dict[str, list[float]] = {"meshplan": [], "hand": []}
    for i in range(warmup + steps):
        x, y = _batch(batch, seq, i)
        t = _timed(mesh_step, x, y)
        if i >= warmup:
            times["meshplan"].append(t)
        if hand is not None:
            t = _timed(hand.step, x, y)
            if i >= warmup:
                times["hand"].append(t)
    out = {"meshplan_s": statistics.median(times["meshplan"]),
           "hand_s": statistics.median(times["hand"]) if times["hand"] else None,
           "layout": plan.layout.short(), "data_parallel": pm.data_parallel,
           "kernels": dict(pm.kernels), "predicted_s": plan.estimate.step_time_s}
    if cfg.get("profile") and rank == 0:
        out["profile"] = _profile(mesh_step, hand, batch, seq)
    elif cfg.get("profile"):
        _profile(mesh_step, hand, batch, seq)
    return out


def _profile(mesh_step, hand, batch: int, seq: int) -> str:
    """Top ops by self CPU time over 3 steps of each variant, and collective counts per step."""
    from torch.profiler import ProfilerActivity, profile
    text = []
    for name, fn in (("meshplan", mesh_step), ("hand", hand.step if hand else None)):
        if fn is None:
            continue
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(3):
                x, y = _batch(batch, seq, 1000 + i)
                _timed(fn, x, y)
        ev = prof.key_averages()
        coll = {e.key: e.count // 3 for e in ev if any(k in e.key for k in (
            "all_gather", "reduce_scatter", "all_reduce", "allreduce", "allgather", "send", "recv", "broadcast"))}
        redistribute = sum(e.cpu_time_total for e in ev if "redistribute" in e.key.lower()) / 3e3
        text.append(f"### {name}: collectives per step {coll}; DTensor redistribute {redistribute:.1f} ms/step\n"
                    + ev.table(sort_by="self_cpu_time_total", row_limit=14))
    return "\n".join(text)


def run_rows(rank: int, world: int, rows: list, cfg: dict) -> dict:
    import torch.distributed as dist
    out = {}
    for row, plan, hand_row in rows:
        out[row] = run_row(rank, world, row, plan, dict(cfg, hand_row=hand_row))
        dist.barrier()
    return out


# ---- driver ---------------------------------------------------------------------------------------
def _plans(rows: list[str], seq: int, batch: int) -> dict:
    import meshplan as mp
    from meshplan.cluster import Cluster
    model = mp.models.build(MODEL, seq_len=seq, device="meta")
    out = {}
    for row in rows:
        world, fixed = ROWS[row]
        cluster = mp.Cluster.preset("local-cpu") if fixed is None else \
            Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world)
        out[row] = mp.plan(model, cluster, seq_len=seq, global_batch=batch, fixed=fixed or {})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI mode: short sequences, few steps")
    ap.add_argument("--rows", default=None, help=f"comma-separated subset of {','.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="print a CPU profile of each row (rank 0)")
    ap.add_argument("--out", default=None, help="write the table to this Markdown file ('auto': results/)")
    args = ap.parse_args(argv)
    from meshplan.train.spawn import run_ranks
    quick = args.quick
    rows = args.rows.split(",") if args.rows else (
        ["one", "dp_ddp", "dp_zero1", "dp_fsdp", "tp2_dp2", "pp2_dp2", "planner"] if quick else list(ROWS))
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; known: {list(ROWS)}")
    cfg = dict(seq=args.seq or (64 if quick else 256), batch=args.batch,
               steps=args.steps or (3 if quick else 20), warmup=1 if quick else 3, profile=args.profile)
    t0 = time.perf_counter()
    plans = _plans(rows, cfg["seq"], cfg["batch"])
    results: dict[str, dict] = {}
    by_world: dict[int, list] = {}
    for row in rows:
        world = ROWS[row][0]
        hand_row = HAND[row] and row
        if row == "planner":        # the planner's layout against the fastest hand-written DP baseline
            hand_row = "dp_ddp"
        by_world.setdefault(world, []).append((row, plans[row], hand_row))
    for world, items in sorted(by_world.items()):
        res = run_ranks(world, run_rows, items, cfg, timeout_s=900)
        results.update(res[0])
    wall = time.perf_counter() - t0
    text = _table(rows, results, cfg, wall, quick)
    print(text)
    if args.profile:
        for row in rows:
            if "profile" in results[row]:
                print(f"\n## profile: {row}\n{results[row]['profile']}")
    if args.out:
        path = Path(args.out) if args.out != "auto" else Path(__file__).parent / "results" / (
            f"runtime_vs_pytorch-{datetime.date.today()}-cpu{'-quick' if quick else ''}.md")
        path.write_text(text + "\n")
        print(f"wrote {path}")
    return 0


def _table(rows, results, cfg, wall, quick) -> str:
    lines = [f"# meshplan runtime vs hand-written PyTorch ({datetime.date.today()})", "",
             f"Device: CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), gloo; "
             f"{MODEL}, bf16 compute, AdamW; seq {cfg['seq']}, global batch {cfg['batch']}; median of "
             f"{cfg['steps']} steps after {cfg['warmup']} warm-up, meshplan and hand-written interleaved in one "
             f"run{' (quick mode)' if quick else ''}. Wall time {wall:.0f} s.", "",
             "| row | layout (meshplan) | runs as | meshplan s | hand-written | hand s | ratio | predicted s |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        r = results[row]
        hand = r["hand_s"]
        ratio = f"{r['meshplan_s'] / hand:.2f}x" if hand else "-"
        name = HAND[row] if row != "planner" else "DDP (fastest by hand)"
        lines.append(f"| {row} | {r['layout']} | {r['data_parallel']} | {r['meshplan_s']:.3f} | {name or 'none on CPU'} | "
                     f"{hand:.3f} | {ratio} | {r['predicted_s']:.3f} |" if hand else
                     f"| {row} | {r['layout']} | {r['data_parallel']} | {r['meshplan_s']:.3f} | {name or 'none on CPU'} | - | - | "
                     f"{r['predicted_s']:.3f} |")
    kern = next((r["kernels"] for r in results.values() if r["kernels"]), {})
    if kern:
        lines += ["", "Fused kernels: " + "; ".join(f"{k}: {v}" for k, v in kern.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
