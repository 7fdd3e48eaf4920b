"""Does MoE load balancing balance? A tiny MoE trained N steps with each balancing option.

    python benchmarks/moe_balance.py [--steps 200] [--out benchmarks/results/moe_balance.json]

One process (gloo, world 1), the embedded corpus, the same seed and data for every variant:
  none       no balancing
  aux        global auxiliary loss, coefficient 1e-2 (Megatron-Core's default)
  bias       aux-loss-free expert bias (DeepSeek-V3), update rate 1e-2 per step
  aux+bias   both
For each: mean and final max/mean tokens per expert (the max over layers, MoEBalancer's
`moe_imbalance`) over the run's second half, and the loss. 1.0 is perfect balance.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "none": {},
    "aux": dict(moe_aux_loss_coeff=1e-2),
    "bias": dict(moe_expert_bias=True, moe_bias_update_rate=1e-2),
    "aux+bias": dict(moe_aux_loss_coeff=1e-2, moe_expert_bias=True, moe_bias_update_rate=1e-2),
}
MODEL = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, moe_ffn_hidden=64, vocab=256,
             experts=8, topk=2)
SEQ, BATCH = 64, 8


def run_variant(options: dict, *, steps: int, seed: int = 0) -> dict:
    """Train the tiny MoE in this process (a process group of one must be initialised)."""
    import torch

    import meshplan as mp
    from meshplan.cluster import Cluster
    from meshplan.train.metrics import read_metrics
    from meshplan.runtime.parallel import parallelize
    from meshplan.train.loop import TrainConfig, train
    plan = mp.plan(mp.models.build("moe", seq_len=SEQ, device="meta", **MODEL, **options),
                   Cluster(gpu="cpu", num_gpus=1, gpus_per_node=1), seq_len=SEQ, global_batch=BATCH)
    torch.manual_seed(seed)
    model = mp.models.build("moe", seq_len=SEQ, device="cpu", **MODEL, **options)
    model.init_weights()
    with tempfile.TemporaryDirectory(prefix="moe-balance-") as out:
        cfg = TrainConfig(steps=steps, lr=3e-3, warmup=10, seed=seed, out_dir=out, checkpoint_every=0,
                          progress=False, resume=False)
        t0 = time.perf_counter()
        res = train(model, plan, cfg, pm=parallelize(model, plan, compute_dtype=None))
        seconds = time.perf_counter() - t0
        records = read_metrics(Path(out) / "metrics.jsonl")
    half = [r for r in records if r["step"] > steps // 2]
    return {"imbalance_mean_2nd_half": sum(r["moe_imbalance"] for r in half) / len(half),
            "imbalance_final": records[-1]["moe_imbalance"],
            "imbalance_first": records[0]["moe_imbalance"],
            "aux_loss_final": records[-1]["moe_aux_loss"],
            "loss_final": res.losses[max(res.losses)], "seconds": round(seconds, 1)}


def main(argv=None) -> int:
    import torch.distributed as dist

    from meshplan.train.spawn import free_port
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        for name in args.variants.split(","):
            results[name] = run_variant(VARIANTS[name], steps=args.steps)
            print(name, json.dumps(results[name]), flush=True)
    finally:
        dist.destroy_process_group()
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": args.steps, "model": MODEL, "seq_len": SEQ,
                                              "global_batch": BATCH, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
