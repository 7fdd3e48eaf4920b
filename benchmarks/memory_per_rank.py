"""Per-rank memory a plan charges, by category, next to what `parallelize` allocates and what one
micro-batch's forward keeps for backward, at the plan's real world size in one process (torch's
fake process group, meta device: nothing is allocated); and, for a 128k context-parallel ring,
the attention memory of one ring block against the score matrices it avoids.

    python benchmarks/memory_per_rank.py [--out benchmarks/results/memory_per_rank-2026-11-27.txt]

The measuring helpers are test support (tests/runtime/fake_world.py: kept_for_backward,
charged_for_backward); see docs/runtime.md, "Activation and logits memory per rank".
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))

GIB = 2**30


def tp_table(lines: list[str]) -> None:
    import fake_world
    import meshplan as mp
    from meshplan.cost_models.memory import grad_store_bytes, optimizer_bytes
    from meshplan.ir.stack import resolve_stack
    cluster = mp.Cluster.preset("dgx-h100", nodes=1)
    r = fake_world.measure("llama3-8b", cluster, seq_len=131072, global_batch=8, fixed={"dp": 1, "tp": 8}, rank=0)
    mem, kept, charged = r["memory"], r["kept"], r["charged"]
    plan_layout = mp.plan(mp.models.build("llama3-8b", device="meta", seq_len=131072), cluster, seq_len=131072,
                          global_batch=8, fixed={"dp": 1, "tp": 8}).layout
    n = r["params"]
    # fp32 parameters under autocast (the master copy) + their bf16 compute copies the forward keeps
    runtime = {
        "weights (bf16 compute copies)": kept["weights"],
        "gradients": n * grad_store_bytes(plan_layout, resolve_stack(None, default="reference")),
        "optimizer (fp32 master + Adam)": n * optimizer_bytes(plan_layout) ,
        "activations, 1 micro-batch": kept["activations"],
        "logits + loss, 1 micro-batch": kept["logits"],
    }
    plan_side = {
        "weights (bf16 compute copies)": mem["weights"] * GIB,
        "gradients": mem["gradients"] * GIB,
        "optimizer (fp32 master + Adam)": mem["optimizer"] * GIB,
        "activations, 1 micro-batch": charged["per_mb"],
        "logits + loss, 1 micro-batch": charged["logits"],
    }
    lines += [(f"llama3-8b, {r['layout']}, seq 131072, world {r['world']}, rank {r['rank']} "
               f"({n / 1e9:.3f} B parameters held)"),
              f"{'category':34s} {'plan charges GiB':>17s} {'runtime GiB':>12s} {'runtime/plan':>13s}"]
    for k, p in plan_side.items():
        g = runtime[k]
        lines.append(f"{k:34s} {p / GIB:17.2f} {g / GIB:12.2f} {g / p if p else float('nan'):13.2f}")
    lines.append("(the runtime keeps fp32 parameters under autocast, counted as the optimizer's master copy; "
                 "the bf16 copies are those of the layers not recomputed)")
    lines.append(f"(plan: activations {mem['activations']:.2f} GiB = {charged['per_mb'] / GIB:.2f} per micro-batch x "
                 f"{charged['held']:g} in flight + {charged['largest_full'] / GIB:.2f} one recomputed layer rebuilt "
                 f"in backward + {charged['logits'] / GIB:.2f} logits; largest single tensor of the forward "
                 f"{kept['largest_op'] / GIB:.2f} GiB, inside the blocks {kept['largest_in_blocks'] / GIB:.2f} GiB)")


# the contract test's plans (tests/runtime/test_plan_contract.py MEMORY_CASES): model, nodes of
# dgx-h100, seq_len, global batch, fixed layout keys, rank
PLANS = [
    ("llama3-8b", 1, 131072, 8, {"dp": 1, "tp": 8}, 0),
    ("llama3-70b", 8, 8192, 512, {"tp": 8, "pp": 4, "recompute": "selective"}, -1),
    ("llama3-8b", 2, 131072, 16, {"cp": 2, "tp": 8}, 0),
    ("llama3-8b", 1, 8192, 64, {"tp": 2, "pp": 1, "zero": 3}, 0),
]


def plans_table(lines: list[str]) -> None:
    import fake_world

    import meshplan as mp
    lines += ["", "one micro-batch, GiB: what the plan charges / what the forward keeps (runtime/plan)",
              f"{'model, layout, seq, rank':68s} {'activations':>24s} {'logits':>22s}"]
    for model, nodes, seq, gb, fixed, rank in PLANS:
        r = fake_world.measure(model, mp.Cluster.preset("dgx-h100", nodes=nodes), seq_len=seq,
                               global_batch=gb, fixed=fixed, rank=rank)
        k, c = r["kept"], r["charged"]
        layout = " ".join(w for w in r["layout"].split() if w != "unfused-grad-accum")
        act = f"{c['per_mb'] / GIB:.2f} / {k['activations'] / GIB:.2f} ({k['activations'] / c['per_mb']:.2f}x)"
        logits = (f"{c['logits'] / GIB:.2f} / {k['logits'] / GIB:.2f} ({k['logits'] / c['logits']:.3f}x)"
                  if c["logits"] else "-")
        name = f"{model} {layout} seq {seq} rank {r['rank']}"
        lines.append(f"{name:68s} {act:>24s} {logits:>22s}")


def ring_block(lines: list[str], seq: int = 131072, cp: int = 8, heads: int = 32, kv_heads: int = 8,
               head_dim: int = 128, tp: int = 1) -> None:
    """One layer's ring attention (the runtime's autograd Function) at `seq` tokens over `cp` ranks,
    on meta tensors: the largest tensor one op creates, against one block's and the rank's whole
    score matrix (fp32 softmax)."""
    import fake_world
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp)
    try:
        h, hkv, local = heads // tp, kv_heads // tp, seq // cp
        q = torch.zeros(1, h, local, head_dim, dtype=torch.bfloat16, device="meta", requires_grad=True)
        k = torch.zeros(1, hkv, local, head_dim, dtype=torch.bfloat16, device="meta", requires_grad=True)
        v = torch.zeros_like(k, requires_grad=True)
        rec = fake_world._Recorder()
        with fake_world.ring_on_meta(), rec:
            out = fake_world._meta_ring_attention(q, k, v, dist.group.WORLD, is_causal=True, enable_gqa=True)
        kept = sum(rec.alive({fake_world._local(t).untyped_storage()._cdata for t in (q, k, v)}).values())
        largest = max(rec.largest.values())
        rec.release()
        del out
    finally:
        dist.destroy_process_group()
    block = 4 * h * (local // 2) ** 2            # one (query chunk, key chunk) block of fp32 scores
    full = 4 * h * local * seq                   # this rank's queries against every key
    lines += ["", (f"ring attention, one layer: seq {seq}, cp {cp} ({local} local tokens, 2 chunks of {local // 2}), "
                   f"{h} query / {hkv} key-value heads, head dim {head_dim}, bf16"),
              f"{'largest tensor one op creates (fp32 running output)':52s} {largest / 2**20:10.1f} MiB",
              f"{'kept for backward (bf16 output, fp32 LSE)':52s} {kept / 2**20:10.1f} MiB",
              f"{'one block of fp32 scores, if materialised':52s} {block / 2**20:10.1f} MiB",
              f"{'the rank queries x all keys, fp32 scores':52s} {full / 2**20:10.1f} MiB"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args()
    lines = [(f"# memory_per_rank  {datetime.date.today().isoformat()}  machine: CPU ({platform.machine()}), "
              f"torch {torch.__version__}, meta device / fake process group (nothing allocated)"), ""]
    tp_table(lines)
    plans_table(lines)
    ring_block(lines)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
