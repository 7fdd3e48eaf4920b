"""Everything only a GPU can show, in one command (one H100: about 10 minutes).

    python benchmarks/gpu_suite.py              # on a CUDA machine
    python benchmarks/gpu_suite.py --dry-run    # tiny model on CPU: proves the suite runs (CI)

Parts, each printed as a table and written together to
benchmarks/results/gpu_suite-<date>-<device>.{md,json}:

1. Device ceilings: a 1 GiB device-to-device copy (bytes read + written) and an 8192^3 bf16
   matrix product, on random data (zeros run faster than real data).
2. Runtime step time of a ~1B Llama on one GPU: hand-written eager PyTorch (fp32 master weights,
   bf16 autocast, fused AdamW), the same under torch.compile, meshplan (`plan` + `parallelize`
   on a one-process NCCL group), meshplan's FP8 plan (`plan(precision="fp8")`: the placement
   ILP's module set) through `parallelize` with each FP8 backend (torchao; Transformer Engine
   when installed), and FP8 through torchao's float8 training (tensorwise and rowwise) under
   torch.compile when torchao is installed. Each row: median step time over the timed steps, tokens/s,
   MFU (model FLOPs over the GPU's dense BF16 peak), peak memory, and the cost model's predicted
   step time and memory for the same layout.
3. Kernel benchmarks: benchmarks/kernels.py (fused kernels vs eager vs torch.compile).

Targets: meshplan >= 1.3x eager and >= torch.compile; FP8 >= 1.3x BF16 at 8B-class
GEMM shapes; measured step within 10% of the prediction.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meshplan as mp  # noqa: E402

RESULTS = Path(__file__).parent / "results"
# ~1.2B parameters: Llama-3 shapes at a quarter of 8B's width, 16 layers, full 128k vocabulary.
GPU_MODEL = dict(layers=16, hidden=2048, heads=16, kv_heads=8, ffn_hidden=8192)
GPU_SEQ, GPU_BATCH = 2048, 4


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_steps(step, device, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def ceilings(device) -> dict:
    if device.type != "cuda":
        return {}
    from triton.testing import do_bench
    n = 2**29  # 1 GiB of bf16
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    copy = 2 * src.numel() * 2 / (ms * 1e-3) / 1e9
    del src, dst
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    mm = 2 * 8192**3 / (ms * 1e-3) / 1e12
    out = {"copy_gbs": copy, "bf16_matmul_tflops": mm}
    if hasattr(torch, "_scaled_mm"):
        try:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
            one = torch.ones((), device=device)
            ms = do_bench(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16),
                          warmup=50, rep=300, return_mode="median")
            out["fp8_matmul_tflops"] = 2 * 8192**3 / (ms * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            out["fp8_matmul_error"] = repr(e)[:200]
    return out


def _batches(vocab, batch, seq, device, n=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g).to(device) for _ in range(n)]


def _eager_runner(model, device, compile_: bool, fp8: str | None):
    if fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        cfg = Float8LinearConfig.from_recipe_name(fp8)
        # the output layer stays in bf16 (as torchtitan and Megatron do)
        convert_to_float8_training(model, config=cfg,
                                   module_filter_fn=lambda m, fqn: fqn != "output")
    fwd = torch.compile(model) if compile_ else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    ac = torch.autocast(device.type, dtype=torch.bfloat16)

    def step(ids):
        with ac:
            logits = fwd(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def runtime_rows(device, *, dry: bool, warmup: int, steps: int) -> list[dict]:
    if dry:
        name, over, seq, batch = "tiny-llama", {}, 64, 4
        cluster = mp.Cluster.preset("local-cpu", nproc=1)
    else:
        name, over, seq, batch = "llama3-8b", GPU_MODEL, GPU_SEQ, GPU_BATCH
        gpu = "h200" if "H200" in torch.cuda.get_device_name() else "h100-sxm"
        cluster = mp.Cluster(gpu=gpu, gpus_per_node=1, nodes=1)
    cfg = mp.models.config(name, **over)
    meta = mp.models.build(cfg, device="meta")
    tokens = batch * seq
    from meshplan.cost_models.flops import model_flops_per_step
    model_flops = model_flops_per_step(mp.profile(meta, seq_len=seq), seq, batch)
    peak = cluster.gpu.bf16_tflops * 1e12
    rows = []

    def measure(label, make_step, predicted=None):
        torch.manual_seed(0)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            step, cleanup = make_step()
            data = _batches(cfg.vocab, batch, seq, device)
            it = iter(range(10**9))
            times = _time_steps(lambda: step(data[next(it) % len(data)]), device, warmup, steps)
            med = statistics.median(times)
            row = {"case": label, "step_s": med, "tokens_per_s": tokens / med,
                   "mfu": model_flops / med / peak,
                   "peak_mem_gib": (torch.cuda.max_memory_allocated() / 2**30
                                    if device.type == "cuda" else None)}
            cleanup()
        except Exception as e:  # noqa: BLE001 - one failing row must not hide the others
            row = {"case": label, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        if predicted:
            row.update(predicted)
        rows.append(row)
        print("  ", json.dumps(row), flush=True)

    def eager(compile_=False, fp8=None):
        def make():
            m = mp.models.build(cfg, device=device)
            m.init_weights()
            return _eager_runner(m, device, compile_, fp8), lambda: None
        return make

    def pred(precision, layout=None):
        try:
            est = mp.estimate(meta, cluster, layout or {"dp": 1, "mbs": batch, "zero": 0},
                              seq_len=seq, global_batch=batch, precision=precision)
            return {"pred_step_s": est.step_time_s, "pred_mem_gib": est.peak_memory_gb}
        except Exception as e:  # noqa: BLE001
            return {"pred_error": f"{type(e).__name__}: {str(e)[:200]}"}

    measure("eager bf16 (autocast, fp32 master)", eager(), pred("bf16"))
    if device.type == "cuda":
        measure("torch.compile bf16", eager(compile_=True), pred("bf16"))

    plan = mp.plan(meta, cluster, seq_len=seq, global_batch=batch, precision="bf16")
    lay = plan.layout
    print("   meshplan plan:", json.dumps(lay.to_dict()), flush=True)

    def meshplan_step(the_plan=None, **parallel_kw):
        m = mp.models.build(cfg, device="cpu" if device.type == "cpu" else "meta")
        if device.type == "cuda":
            m = m.to_empty(device=device)
        m.init_weights()
        pm = mp.parallelize(m, the_plan or plan, **parallel_kw)
        if pm.precisions:
            from meshplan.runtime.fp8 import precision_summary
            print("   precisions:", "; ".join(precision_summary(pm.precisions)), flush=True)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, fused=device.type == "cuda")

        def step(ids):
            pm.forward_backward(ids[:, :-1], ids[:, 1:])
            opt.step()
            pm.zero_grad()
        return step, lambda: None
    e = plan.estimate
    measure("meshplan bf16 (plan + parallelize)", meshplan_step,
            {"pred_step_s": e.step_time_s, "pred_mem_gib": e.peak_memory_gb,
             "layout": {k: getattr(lay, k) for k in ("dp", "zero", "mbs", "recompute")}})

    try:
        import torchao  # noqa: F401
        have_ao = True
    except Exception:  # noqa: BLE001
        have_ao = False
    # meshplan's FP8 plan (the placement ILP's module set) run by its runtime, per backend
    import warnings

    from meshplan.runtime.fp8 import backend_available
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)      # CPU dry run: "FP8 is emulated"
        plan8 = mp.plan(meta, cluster, seq_len=seq, global_batch=batch, precision="fp8")
    e8 = plan8.estimate
    for backend in ("torchao", "te"):
        label = f"meshplan fp8 {backend} ({len(plan8.fp8_modules)} FP8 linears)"
        if backend == "te" and device.type != "cuda":
            continue
        if not backend_available(backend):
            rows.append({"case": label, "error": f"{backend} not installed (pip install 'meshplan[{'fp8' if backend == 'torchao' else 'gpu'}]')"})
            continue
        measure(label, lambda b=backend: meshplan_step(plan8, fp8_backend=b),
                {"pred_step_s": e8.step_time_s, "pred_mem_gib": e8.peak_memory_gb})
    if have_ao and device.type == "cuda":
        for recipe in ("tensorwise", "rowwise"):
            measure(f"torchao fp8 {recipe} + compile", eager(compile_=True, fp8=recipe), pred("fp8"))
    elif not have_ao:
        rows.append({"case": "torchao fp8", "error": "torchao not installed (pip install torchao)"})
    return rows


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def runtime_table(rows) -> str:
    lines = ["| case | step s | tokens/s | MFU | peak GiB | predicted s | pred/meas | predicted GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error: {r['error']} |||||||")
            continue
        ratio = r["pred_step_s"] / r["step_s"] if r.get("pred_step_s") else None
        lines.append(f"| {r['case']} | {r['step_s']:.4f} | {r['tokens_per_s']:.0f} | "
                     f"{100 * r['mfu']:.1f}% | {_fmt(r.get('peak_mem_gib'), '.2f')} | "
                     f"{_fmt(r.get('pred_step_s'), '.4f')} | {_fmt(ratio, '.2f')} | "
                     f"{_fmt(r.get('pred_mem_gib'), '.2f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU (checks the suite)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    if not args.dry_run and dry:
        print("gpu_suite: no CUDA GPU here; running the CPU dry run instead")
    device = torch.device("cpu" if dry else "cuda")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo" if dry else "nccl", rank=0, world_size=1)
    if not dry:
        torch.cuda.set_device(0)
    report = {"date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name() if not dry else "cpu (dry run)",
              "torch": torch.__version__, "dry_run": dry}
    print("== device ceilings", flush=True)
    report["ceilings"] = ceilings(device)
    print("  ", report["ceilings"], flush=True)
    print("== runtime step time", flush=True)
    steps = args.steps or (2 if dry else 20)
    report["runtime"] = runtime_rows(device, dry=dry, warmup=1 if dry else 5, steps=steps)
    dist.destroy_process_group()
    if not args.skip_kernels:
        print("== kernels", flush=True)
        cmd = [sys.executable, str(Path(__file__).parent / "kernels.py"), "--out-dir", str(args.out_dir)]
        if dry:
            cmd.append("--cpu-smoke")
        r = subprocess.run(cmd, capture_output=True, text=True)
        report["kernels"] = r.stdout[-6000:] + (f"\nexit {r.returncode}: {r.stderr[-2000:]}"
                                                if r.returncode else "")
    text = (f"# GPU suite {report['date']} on {report['device']} (torch {report['torch']})\n\n"
            f"Ceilings: {json.dumps(report['ceilings'])}\n\n## Runtime step\n\n"
            f"{runtime_table(report['runtime'])}\n\n## Kernels\n\n{report.get('kernels', 'skipped')}\n")
    print(text)
    if not dry:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^a-z0-9]+", "-", report["device"].lower()).strip("-")
        stem = args.out_dir / f"gpu_suite-{report['date']}-{slug}"
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
