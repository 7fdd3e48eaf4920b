#!/usr/bin/env python
"""Planning speed: trace + plan time and peak memory (RSS) per case, each in a fresh process.

Targets (2-core machine): every case <= 10 s and <= 3 GB peak RSS.

    python benchmarks/planning_speed.py [--out FILE] [--cases llama3-8b@8,...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [("llama3-8b", 8), ("llama3-8b", 64), ("llama3-70b", 64), ("llama3-70b", 1024), ("llama3-405b", 1024),
         ("llama3-405b", 16384), ("mixtral-8x22b", 128), ("deepseek-v3", 2048), ("hf-llama-7b", 64)]
SEQ, BATCH = 8192, 1024

_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch
import meshplan as mp
from meshplan.api import plan, profile
name, gpus = sys.argv[1], int(sys.argv[2])
t_import = time.perf_counter() - t0
t1 = time.perf_counter()
if name.startswith("hf-"):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
else:
    model = mp.models.build(name, device="meta")
prof = profile(model)
t_trace = time.perf_counter() - t1
t2 = time.perf_counter()
cluster = mp.Cluster.preset("dgx-h100", num_gpus=gpus)
pl = plan(prof, cluster, seq_len=%(seq)d, global_batch=%(batch)d)
t_plan = time.perf_counter() - t2
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 / 1024
print(json.dumps(dict(name=name, gpus=gpus, import_s=t_import, trace_s=t_trace, plan_s=t_plan, rss_gb=rss,
                      layout=pl.layout.short(), mfu=pl.estimate.mfu, meshes=pl.search["meshes"],
                      estimates=pl.search["estimates"])))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--cases", help="comma list name@gpus")
    args = ap.parse_args(argv)
    cases = CASES if not args.cases else [(c.split("@")[0], int(c.split("@")[1])) for c in args.cases.split(",")]
    code = _CHILD % {"seq": SEQ, "batch": BATCH}
    lines = [f"# planning speed, seq {SEQ}, global batch {BATCH}, dgx-h100 ({time.strftime('%Y-%m-%d')})", "",
             f"{'case':22s} {'trace s':>8s} {'plan s':>8s} {'total s':>8s} {'RSS GB':>7s} {'estimates':>9s}  "
             f"{'target':6s}  layout (MFU)"]
    ok_all = True
    for name, gpus in cases:
        r = subprocess.run([sys.executable, "-c", code, name, str(gpus)], capture_output=True, text=True, cwd=ROOT)
        if r.returncode != 0:
            lines.append(f"{name}@{gpus}: FAILED\n{r.stderr[-2000:]}")
            ok_all = False
            continue
        d = json.loads(r.stdout.strip().splitlines()[-1])
        total = d["trace_s"] + d["plan_s"]
        ok = total <= 10 and d["rss_gb"] <= 3
        ok_all &= ok
        lines.append(f"{name + '@' + str(gpus):22s} {d['trace_s']:8.2f} {d['plan_s']:8.2f} {total:8.2f} "
                     f"{d['rss_gb']:7.2f} {d['estimates']:9d}  {'ok' if ok else 'MISSED':6s}  "
                     f"{d['layout']} ({d['mfu'] * 100:.1f}%)")
        print(lines[-1], flush=True)
    lines.append("")
    lines.append("trace = build on meta + trace (torch.export of one instance per unique block); "
                 "plan = search + costing; import time excluded.")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
