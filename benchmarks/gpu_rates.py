"""The kernel rates the GPU cost model prices, measured on the GPU at hand and set beside the model's
prediction for the same call.

    python benchmarks/gpu_rates.py                     # on a CUDA machine (about 4 minutes on one H100/H200)
    python benchmarks/gpu_rates.py --dry-run           # tiny shapes on CPU: proves the script runs
    python benchmarks/gpu_rates.py --report F.json     # re-render a results file with the model's predictions

Measuring imports nothing from meshplan (the numbers stand on their own); the report prices every
measured call with meshplan's GPU cost model for the device the numbers came from. Results go to
benchmarks/results/gpu_rates-<date>-<device>.{json,md}.

Parts (timed with device events: warm-up, then the median of the repeats; inputs random, never zeros):
1. ceilings: a 1 GiB device-to-device copy (bytes read + written) and 8192^3 BF16 / FP8 matmuls.
2. attention: PyTorch SDPA's backends FLASH (FlashAttention-2 as vendored in PyTorch: what torchtitan and
   meshplan run), CUDNN (cuDNN's fused attention: what Transformer Engine runs on Hopper) and EFFICIENT
   (memory-efficient, xformers-class), forward and backward, at FlashAttention-3's benchmark shapes
   (Shah et al. 2024, arXiv 2407.08608 Fig. 5/6: 16k tokens per call, 16 heads of 128; and 32 heads of 64),
   causal and not, plus single long sequences (32k, 64k). TFLOP/s of the masked FLOPs (causal = half).
3. context-parallel ring steps (PyTorch's context_parallel, load-balanced split): at 32k tokens split over
   cp ranks, the calls one rank runs (its causal diagonal block, then cp-1 half blocks without a mask)
   and the log-sum-exp merge of each step's output, against one causal call over the whole sequence / cp.
4. FP8 GEMMs per scaling recipe (torch._scaled_mm): tensorwise, rowwise, blockwise (1x128 activations,
   128x128 weights, where this torch has it) against BF16, at Llama-3 8B / 70B GEMM shapes.
5. host costs: host seconds per kernel launch, a per-expert GEMM loop against torch._grouped_mm and a
   CUDA-graph replay of the loop (MoE experts without grouped GEMM or graphs), a device-to-host sync.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # meshplan from this checkout (the report)


# ---- timing ----------------------------------------------------------------------------------
def time_median(fn, device, *, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of `fn` (device events on CUDA, the wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


# ---- 1. ceilings -----------------------------------------------------------------------------
def ceilings(device, dry: bool) -> dict:
    n = 2**14 if dry else 2**29
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_median(lambda: dst.copy_(src), device, reps=30)
    out = {"copy_gbs": 2 * 2 * n / t / 1e9}
    del src, dst
    s = 128 if dry else 8192
    a, b = torch.randn(s, s, device=device, dtype=torch.bfloat16), torch.randn(s, s, device=device, dtype=torch.bfloat16)
    out["bf16_matmul_tflops"] = 2 * s**3 / time_median(lambda: a @ b, device, reps=30) / 1e12
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=device)
        out["fp8_matmul_tflops"] = 2 * s**3 / time_median(
            lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), device, reps=30) / 1e12
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        out["fp8_matmul_error"] = _err(e)
    return out


# ---- 2. attention ----------------------------------------------------------------------------
BACKENDS = ("flash", "cudnn", "efficient")


def _backend(name):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def attn_flops(batch: int, heads: int, q: int, k: int, dim: int, causal: bool) -> float:
    """Forward FLOPs of the masked work: two matmuls of q x k x dim per (sequence, head); causal
    (square) halves them, as FlashAttention's benchmarks and meshplan's FLOP count do."""
    f = 4.0 * batch * heads * q * k * dim
    return f / 2 if causal else f


def _attn_case(device, backend, batch, heads, q_len, k_len, dim, causal, reps) -> dict:
    from torch.nn.attention import sdpa_kernel
    g = torch.Generator(device=device).manual_seed(q_len + k_len + dim)
    mk = lambda n: torch.randn(batch, heads, n, dim, device=device, dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v = mk(q_len).requires_grad_(), mk(k_len).requires_grad_(), mk(k_len).requires_grad_()
    row = dict(backend=backend, batch=batch, heads=heads, q_len=q_len, k_len=k_len, dim=dim, causal=causal)
    try:
        with sdpa_kernel([_backend(backend)]):
            fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
            out = fwd()
            grad = torch.randn_like(out)
            row["fwd_s"] = time_median(fwd, device, reps=reps)
            out = fwd()
            row["bwd_s"] = time_median(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
                                  device, reps=reps)
    except Exception as e:  # noqa: BLE001 - a backend this GPU / build lacks is reported
        row["error"] = _err(e)
        return row
    f = attn_flops(batch, heads, q_len, k_len, dim, causal)
    row["fwd_tflops"] = f / row["fwd_s"] / 1e12
    row["bwd_tflops"] = 2.5 * f / row["bwd_s"] / 1e12
    return row


def attention_rows(device, dry: bool) -> list[dict]:
    rows = []
    tokens = 256 if dry else 16384
    seqs = (64, 128) if dry else (512, 1024, 2048, 4096, 8192, 16384)
    heads_dims = ((2, 16),) if dry else ((16, 128), (32, 64))
    for heads, dim in heads_dims:
        for causal in (False, True):
            for s in seqs:
                for backend in BACKENDS:
                    rows.append(_attn_case(device, backend, tokens // s, heads, s, s, dim, causal, reps=3 if dry else 15))
    for s in ((256,) if dry else (32768, 65536)):            # single long sequences (long-context training)
        for backend in ("flash", "cudnn"):
            rows.append(_attn_case(device, backend, 1, 2 if dry else 16, s, s, 16 if dry else 128, True,
                                   reps=3 if dry else 5))
    return rows


# ---- 3. context-parallel ring steps ----------------------------------------------------------
def _lse_merge(out, lse, blk, blk_lse):
    """Merge one block's attention output into the running (fp32) output by the log-sum-exp rule, as
    a ring step does: new = out * w + blk * (1 - w), w = sigmoid(lse - blk_lse)."""
    w = torch.sigmoid(lse - blk_lse).unsqueeze(-1)
    out.mul_(w).add_(blk.float() * (1 - w))
    lse.copy_(torch.logaddexp(lse, blk_lse))


def cp_rows(device, dry: bool) -> list[dict]:
    total = 256 if dry else 32768
    heads, dim = (2, 16) if dry else (16, 128)
    rows = []
    for backend in ("flash", "cudnn"):
        for cp in (1, 2, 4, 8):
            n = total // cp
            diag = _attn_case(device, backend, 1, heads, n, n, dim, True, reps=3 if dry else 8)
            if "error" in diag:
                rows.append(dict(backend=backend, cp=cp, error=diag["error"]))
                continue
            row = dict(backend=backend, cp=cp, total=total, heads=heads, dim=dim,
                       diag_fwd_s=diag["fwd_s"], diag_bwd_s=diag["bwd_s"], half_fwd_s=0.0, half_bwd_s=0.0, merge_s=0.0)
            if cp > 1:
                half = _attn_case(device, backend, 1, heads, n, n // 2, dim, False, reps=3 if dry else 8)
                if "error" in half:
                    rows.append(dict(backend=backend, cp=cp, error=half["error"]))
                    continue
                row["half_fwd_s"], row["half_bwd_s"] = half["fwd_s"], half["bwd_s"]
                out = torch.randn(1, heads, n, dim, device=device)
                lse = torch.randn(1, heads, n, device=device)
                blk = torch.randn(1, heads, n, dim, device=device, dtype=torch.bfloat16)
                blk_lse = torch.randn(1, heads, n, device=device)
                row["merge_s"] = time_median(lambda: _lse_merge(out, lse, blk, blk_lse), device, reps=10)
            steps = cp - 1
            row["rank_fwd_s"] = row["diag_fwd_s"] + steps * (row["half_fwd_s"] + row["merge_s"])
            row["rank_bwd_s"] = row["diag_bwd_s"] + steps * row["half_bwd_s"]
            rows.append(row)
    return rows


# ---- 4. FP8 GEMMs per recipe -----------------------------------------------------------------
# (name, tokens, K, N): Llama-3 8B's QKV / output / fused gate+up / down at 8192 tokens; 70B's fused
# gate+up at TP 8; a square reference
GEMM_SHAPES = (("8b.qkv", 8192, 4096, 6144), ("8b.out", 8192, 4096, 4096), ("8b.gate_up", 8192, 4096, 28672),
               ("8b.down", 8192, 14336, 4096), ("70b.gate_up.tp8", 8192, 8192, 7168), ("square", 8192, 8192, 8192),
               # benchmarks/gpu_suite.py's ~1.2B Llama (hidden 2048, 8 kv heads of 128, ffn 8192) at 8192 tokens
               ("1b.qkv", 8192, 2048, 3072), ("1b.out", 8192, 2048, 2048), ("1b.gate_up", 8192, 2048, 16384),
               ("1b.down", 8192, 8192, 2048))


def _blockwise_mm(a8, b8, sa, sb):
    from torch.nn.functional import ScalingType, scaled_mm
    return scaled_mm(a8, b8, sa, ScalingType.BlockWise1x128, sb, ScalingType.BlockWise128x128,
                     output_dtype=torch.bfloat16)


def gemm_rows(device, dry: bool) -> list[dict]:
    rows = []
    shapes = (("tiny", 256, 256, 256),) if dry else GEMM_SHAPES
    for name, m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        flops = 2.0 * m * n * k
        variants = {"bf16": lambda: a @ w.t()}
        try:
            a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
            one = torch.ones((), device=device)
            ra, rb = torch.rand(m, 1, device=device) + 0.5, torch.rand(1, n, device=device) + 0.5
            variants["tensorwise"] = lambda: torch._scaled_mm(a8, w8.t(), one, one, out_dtype=torch.bfloat16)
            variants["tensorwise_fast_accum"] = lambda: torch._scaled_mm(a8, w8.t(), one, one, out_dtype=torch.bfloat16,
                                                                         use_fast_accum=True)
            variants["rowwise"] = lambda: torch._scaled_mm(a8, w8.t(), ra, rb, out_dtype=torch.bfloat16)
            variants["rowwise_fast_accum"] = lambda: torch._scaled_mm(a8, w8.t(), ra, rb, out_dtype=torch.bfloat16,
                                                                      use_fast_accum=True)
            ba = torch.rand(m, k // 128, device=device).t().contiguous().t() + 0.5   # 1x128 tiles, column-major
            bb = torch.rand(n // 128, k // 128, device=device) + 0.5                  # 128x128 blocks of w
            variants["blockwise"] = lambda: _blockwise_mm(a8, w8.t(), ba, bb.t())
        except Exception as e:  # noqa: BLE001
            rows.append(dict(shape=name, variant="fp8", error=_err(e)))
        for variant, fn in variants.items():
            row = dict(shape=name, m=m, k=k, n=n, variant=variant)
            try:
                row["s"] = time_median(fn, device, reps=3 if dry else 30)
                row["tflops"] = flops / row["s"] / 1e12
            except Exception as e:  # noqa: BLE001 - a recipe this torch / GPU lacks is reported
                row["error"] = _err(e)
            rows.append(row)
    return rows


# ---- 5. FP8 linear layers per recipe (torchao float8 training, compiled) -----------------------
def fp8_linear_rows(device, dry: bool) -> list[dict]:
    """Forward + backward of one linear layer (three GEMMs: output, input gradient, weight gradient)
    in BF16 and under torchao's float8 training per recipe, each under torch.compile (the fused
    casts torchao is written for): the layer's time over its three GEMMs' (part 4) is what the
    recipe's quantisation costs."""
    rows = []
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # noqa: BLE001
        return [dict(error=f"torchao not installed ({_err(e)})")]
    shapes = (("tiny", 256, 256, 256),) if dry else tuple(s for s in GEMM_SHAPES if s[0] in
                                                           ("8b.qkv", "8b.gate_up", "8b.down") or s[0].startswith("1b."))
    for name, m, k, n in shapes:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        for recipe, compiled in (("bf16", True), ("tensorwise", True), ("rowwise", True), ("bf16", False),
                                 ("tensorwise", False), ("rowwise", False)):
            row = dict(shape=name, m=m, k=k, n=n, recipe=recipe, compiled=compiled)
            try:
                lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device=device, dtype=torch.bfloat16)
                if recipe != "bf16":
                    convert_to_float8_training(lin, config=Float8LinearConfig.from_recipe_name(recipe))
                if compiled and not dry:
                    torch._dynamo.reset()          # a fresh cache: nine compiled layers pass the recompile limit
                    f = torch.compile(lin)
                else:
                    f = lin

                def step(f=f, lin=lin):
                    x.grad = None
                    lin[0].weight.grad = None
                    f(x).backward(g)
                t0 = time.perf_counter()
                step()
                row["compile_s"] = time.perf_counter() - t0
                row["s"] = time_median(step, device, reps=3 if dry else 30)
                row["tflops"] = 3 * 2.0 * m * n * k / row["s"] / 1e12
            except Exception as e:  # noqa: BLE001
                row["error"] = _err(e)
            rows.append(row)
    return rows


# ---- 6. host costs ---------------------------------------------------------------------------
def host_rows(device, dry: bool) -> dict:
    out: dict = {}
    x = torch.randn(1024, device=device)
    y = torch.empty_like(x)
    n = 200 if dry else 5000
    for _ in range(100):
        torch.add(x, 1.0, out=y)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        torch.add(x, 1.0, out=y)
    out["launch_host_s"] = (time.perf_counter() - t0) / n      # the host issues; the GPU keeps up
    _sync(device)
    w = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    xm = torch.randn(64, 1024, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    for _ in range(n):
        torch.mm(xm, w)
    out["mm_launch_host_s"] = (time.perf_counter() - t0) / n
    _sync(device)
    s = torch.randint(0, 10, (64,), device=device)
    for _ in range(5):
        s.add_(1).tolist()
    t0 = time.perf_counter()
    for _ in range(50):
        s.add_(1).tolist()
    out["sync_roundtrip_s"] = (time.perf_counter() - t0) / 50

    # experts: Qwen3-30B-A3B's shapes (hidden 2048, expert ffn 768, gated), 256 tokens per expert
    hidden, ffn, per = (64, 32, 16) if dry else (2048, 768, 256)
    out["experts"] = []
    for experts in ((4, 8) if dry else (8, 16, 32, 64, 128)):
        xs = torch.randn(experts * per, hidden, device=device, dtype=torch.bfloat16)
        w1 = torch.randn(experts, hidden, 2 * ffn, device=device, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(experts, ffn, hidden, device=device, dtype=torch.bfloat16) * 0.02
        chunks = xs.split(per)

        def loop():
            return [torch.mm(F.silu(torch.mm(c, w1[e])[:, :ffn]), w2[e]) for e, c in enumerate(chunks)]

        row = dict(experts=experts, tokens_per_expert=per, hidden=hidden, ffn=ffn)
        _sync(device)
        loop()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(5):
            loop()
        row["loop_host_s"] = (time.perf_counter() - t0) / 5
        _sync(device)
        row["loop_s"] = time_median(loop, device, reps=5 if dry else 20)
        try:
            offs = torch.arange(per, experts * per + 1, per, device=device, dtype=torch.int32)

            def grouped():
                h = torch._grouped_mm(xs, w1, offs=offs)[:, :ffn]
                return torch._grouped_mm(F.silu(h).contiguous(), w2, offs=offs)

            row["grouped_s"] = time_median(grouped, device, reps=5 if dry else 20)
        except Exception as e:  # noqa: BLE001
            row["grouped_error"] = _err(e)
        if device.type == "cuda":
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    loop()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    loop()
                row["graph_s"] = time_median(graph.replay, device, reps=20)
            except Exception as e:  # noqa: BLE001
                row["graph_error"] = _err(e)
        out["experts"].append(row)
    return out


# ---- report ----------------------------------------------------------------------------------
def _cluster_for(device_name: str):
    """The meshplan cluster preset whose GPU the numbers came from (one GPU of it is priced)."""
    import meshplan as mp
    name = device_name.lower()
    preset = "hgx-h200" if "h200" in name else "dgx-h100" if "h100" in name else "dgx-a100" if "a100" in name else None
    return mp.Cluster.preset(preset) if preset else None


def predictions(res: dict) -> dict:
    """The cost model's seconds for every measured call, on the device the numbers came from, for the
    kernel on its own: without the in-step slowdown a training step adds (training_gemm_eff = 1)."""
    import dataclasses

    from meshplan.cost_models import constants as K
    from meshplan.cost_models.attention import AttnCall, AttnShape
    from meshplan.cost_models.compute import attention_time
    from meshplan.cost_models.cp import RingTensors, merge_step, ring_work_time
    from meshplan.cost_models.device import device_of
    from meshplan.cost_models.roofline import gemm_roofline
    cluster = _cluster_for(res["device"])
    if cluster is None:
        return {}
    kernel = {"flash": "fa2", "cudnn": "cudnn"}
    alone = dataclasses.replace(K.FITTED, training_gemm_eff=1.0)

    def attn(r, backward):
        if r.get("backend") not in kernel or "error" in r:
            return None
        f = attn_flops(r["batch"], r["heads"], r["q_len"], r["k_len"], r["dim"], r["causal"])
        shape = AttnShape(batch_heads=r["batch"] * r["heads"],
                          calls=(AttnCall(q_len=r["q_len"], k_len=r["k_len"], causal=r["causal"]),))
        return attention_time(f, cluster, backward=backward, kernel=kernel[r["backend"]], shape=shape, fitted=alone)

    pred = {"cluster": cluster.gpu.id, "attention": [], "gemm": [], "cp": []}
    for r in res.get("attention", []):
        pred["attention"].append((attn(r, False), attn(r, True)))
    for r in res.get("cp", []):
        if "error" in r:
            pred["cp"].append(None)
            continue
        n = r["total"] // r["cp"]
        diag = dict(backend=r["backend"], batch=1, heads=r["heads"], q_len=n, k_len=n, dim=r["dim"], causal=True)
        half = dict(diag, k_len=n // 2, causal=False)
        # one eager log-sum-exp merge per step, as the cost model counts torch's (cp.merge_step)
        merge = ring_work_time(merge_step(RingTensors(out=n * r["heads"] * r["dim"], q=0, k=0, v=0,
                                                      lse=n * r["heads"]), compiled=False), cluster)
        steps = r["cp"] - 1
        pred["cp"].append((attn(diag, False) + steps * (attn(half, False) + merge),
                           attn(diag, True) + steps * attn(half, True)))
    dev = device_of(cluster)
    for r in res.get("gemm", []):
        if "error" in r:
            pred["gemm"].append(None)
            continue
        fp8 = r["variant"] != "bf16"
        recipe = r["variant"].replace("_fast_accum", "") if fp8 else "tensorwise"
        pred["gemm"].append(gemm_roofline(r["m"], r["n"], r["k"], cluster, fp8=fp8, recipe=recipe, fitted=alone)
                            + dev.gemm_fixed_s(cluster, fp8))
    pred["host_launch_s"] = K.HOST_LAUNCH_S
    return pred


def _f(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def render(res: dict, pred: dict) -> str:
    c = res.get("ceilings", {})
    lines = [f"# GPU kernel rates {res['date']} on {res['device']} (torch {res['torch']})", "",
             f"Ceilings: copy {_f(c.get('copy_gbs'), '.0f')} GB/s, BF16 matmul {_f(c.get('bf16_matmul_tflops'))} "
             f"TFLOP/s, FP8 matmul {_f(c.get('fp8_matmul_tflops'))} TFLOP/s (8192^3, random data). "
             f"Predictions: meshplan's GPU cost model for {pred.get('cluster', 'no matching GPU')}, each kernel on its "
             "own (a training step runs them at training_gemm_eff of that).", "",
             "## Attention (TFLOP/s of the masked FLOPs; pred = the model's rate for the same call)", "",
             "| backend | heads x dim | seq | batch | causal | fwd | pred fwd | bwd | pred bwd | fwd / BF16 matmul | bwd / BF16 matmul |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    mm = c.get("bf16_matmul_tflops") or float("nan")
    for i, r in enumerate(res.get("attention", [])):
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['heads']}x{r['dim']} | {r['q_len']} | {r['batch']} | {r['causal']} | "
                         f"{r['error']} |||||||")
            continue
        p = pred.get("attention", [])[i] if pred.get("attention") else (None, None)
        f = attn_flops(r["batch"], r["heads"], r["q_len"], r["k_len"], r["dim"], r["causal"])
        pf = f / p[0] / 1e12 if p and p[0] else None
        pb = 2.5 * f / p[1] / 1e12 if p and p[1] else None
        lines.append(f"| {r['backend']} | {r['heads']}x{r['dim']} | {r['q_len']} | {r['batch']} | {r['causal']} | "
                     f"{r['fwd_tflops']:.0f} | {_f(pf, '.0f')} | {r['bwd_tflops']:.0f} | {_f(pb, '.0f')} | "
                     f"{r['fwd_tflops'] / mm:.3f} | {r['bwd_tflops'] / mm:.3f} |")
    lines += ["", "## Context-parallel ring (one rank's attention per layer, ms; ideal = one causal call over the "
              "whole sequence / cp)", "",
              "| backend | cp | fwd | pred fwd | ideal fwd | bwd | pred bwd | ideal bwd | merge per step |",
              "|---|---|---|---|---|---|---|---|---|"]
    base = {r["backend"]: r for r in res.get("cp", []) if r.get("cp") == 1 and "error" not in r}
    for i, r in enumerate(res.get("cp", [])):
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['cp']} | {r['error']} |||||||")
            continue
        p = pred.get("cp", [])[i] if pred.get("cp") else None
        b = base.get(r["backend"])
        lines.append(f"| {r['backend']} | {r['cp']} | {r['rank_fwd_s'] * 1e3:.2f} | {_f(p and p[0] * 1e3, '.2f')} | "
                     f"{_f(b and b['diag_fwd_s'] / r['cp'] * 1e3, '.2f')} | {r['rank_bwd_s'] * 1e3:.2f} | "
                     f"{_f(p and p[1] * 1e3, '.2f')} | {_f(b and b['diag_bwd_s'] / r['cp'] * 1e3, '.2f')} | "
                     f"{r['merge_s'] * 1e3:.3f} |")
    lines += ["", "## GEMMs per FP8 recipe (TFLOP/s; pred from the model's time for the GEMM alone, no casts)", "",
              "| shape | m x k x n | variant | TFLOP/s | pred | / tensorwise |", "|---|---|---|---|---|---|"]
    tw = {r["shape"]: r.get("tflops") for r in res.get("gemm", []) if r.get("variant") == "tensorwise"}
    for i, r in enumerate(res.get("gemm", [])):
        if "error" in r:
            lines.append(f"| {r['shape']} | | {r['variant']} | {r['error']} | | |")
            continue
        p = pred.get("gemm", [])[i] if pred.get("gemm") else None
        pt = 2.0 * r["m"] * r["n"] * r["k"] / p / 1e12 if p else None
        rel = r["tflops"] / tw[r["shape"]] if tw.get(r["shape"]) and r["variant"] != "bf16" else None
        lines.append(f"| {r['shape']} | {r['m']}x{r['k']}x{r['n']} | {r['variant']} | {r['tflops']:.0f} | "
                     f"{_f(pt, '.0f')} | {_f(rel, '.2f')} |")
    lines += ["", "## FP8 linear layers (forward + backward, torch.compile unless eager; TFLOP/s of the three GEMMs)", "",
              "| shape | m x k x n | recipe | ms | TFLOP/s | / BF16 layer |", "|---|---|---|---|---|---|"]
    bf = {(r.get("shape"), r.get("compiled")): r.get("s") for r in res.get("fp8_linear", []) if r.get("recipe") == "bf16"}
    for r in res.get("fp8_linear", []):
        if "error" in r:
            lines.append(f"| {r.get('shape', '-')} | | {r.get('recipe', '-')} | {r['error']} | | |")
            continue
        b = bf.get((r["shape"], r.get("compiled")))
        lines.append(f"| {r['shape']} | {r['m']}x{r['k']}x{r['n']} | {r['recipe']}{'' if r.get('compiled') else ' eager'} | "
                     f"{r['s'] * 1e3:.3f} | {r['tflops']:.0f} | {_f(b and r['s'] / b, '.2f')} |")
    if "host" not in res:
        return "\n".join(lines) + "\n"
    h = res["host"]
    lines += ["", "## Host costs", "",
              f"Host seconds per launch: element-wise {h['launch_host_s'] * 1e6:.1f} us, small mm "
              f"{h['mm_launch_host_s'] * 1e6:.1f} us (the model: {_f(pred.get('host_launch_s') and pred['host_launch_s'] * 1e6)} "
              f"us per kernel); device-to-host sync round trip {h['sync_roundtrip_s'] * 1e6:.0f} us.", "",
              "| experts | tokens each | loop host ms | loop GPU ms | grouped ms | graph replay ms | host us per expert |",
              "|---|---|---|---|---|---|---|"]
    for r in h["experts"]:
        lines.append(f"| {r['experts']} | {r['tokens_per_expert']} | {r['loop_host_s'] * 1e3:.2f} | {r['loop_s'] * 1e3:.2f} | "
                     f"{_f(r.get('grouped_s') and r['grouped_s'] * 1e3, '.2f')} | "
                     f"{_f(r.get('graph_s') and r['graph_s'] * 1e3, '.2f')} | {r['loop_host_s'] / r['experts'] * 1e6:.1f} |")
    return "\n".join(lines) + "\n"


PARTS = {"ceilings": ceilings, "attention": attention_rows, "cp": cp_rows, "gemm": gemm_rows,
         "fp8_linear": fp8_linear_rows, "host": host_rows}


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on this machine's CPU")
    p.add_argument("--report", type=Path, help="re-render this results JSON with the model's predictions")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    args = p.parse_args(argv)
    if args.report:
        res = json.loads(args.report.read_text())
        md = render(res, predictions(res))
        args.report.with_suffix(".md").write_text(md)
        print(md)
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    res = {"date": datetime.date.today().isoformat(), "device": _device_name(device), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None}
    for part in args.parts.split(","):
        fn = PARTS[part]
        t0 = time.perf_counter()
        res[part] = fn(device, args.dry_run)
        print(f"[gpu_rates] {part}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    slug = res["device"].lower().replace("nvidia ", "").replace(" ", "-")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"gpu_rates-{res['date']}-{slug}{'-dry' if args.dry_run else ''}.json"
    path.write_text(json.dumps(res, indent=1))
    try:
        pred = predictions(res)
    except Exception as e:  # noqa: BLE001 - the measurements stand without the model
        print(f"[gpu_rates] no predictions: {_err(e)}", file=sys.stderr)
        pred = {}
    md = render(res, pred)
    path.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
