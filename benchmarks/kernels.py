"""Benchmark meshplan's fused kernels against PyTorch eager and torch.compile on a CUDA GPU.

    python benchmarks/kernels.py                 # Llama-3 8B and 70B shapes, 8192 tokens, bf16
    python benchmarks/kernels.py --cpu-smoke     # tiny shapes, Triton interpreter on CPU: proves
                                                 # the script runs; its timings mean nothing

For each kernel: forward and backward time (median of triton.testing.do_bench on CUDA),
achieved GB/s from the fused kernel's minimal HBM traffic, as a fraction of the device's
measured copy bandwidth (a large tensor copy, read + write), and for fused linear + CE the
peak memory (torch.cuda.max_memory_allocated over fwd + bwd) against eager.
"Eager" is meshplan.kernels.reference (HF-style PyTorch ops, fp32 math); "compile" is
torch.compile of the same function. Results print as a table and are written to
benchmarks/results/kernels-<date>-<device>.{md,json}.

Targets: memory-bound kernels >= 85% of copy bandwidth and faster than
torch.compile; fused linear + CE <= 1/4 of eager peak memory at a 128k vocabulary with no
slowdown.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if "--cpu-smoke" in sys.argv:  # must precede any import of triton (torch may import it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from meshplan import kernels as K  # noqa: E402
from meshplan.kernels import reference as R  # noqa: E402

MEMORY_BOUND_TARGET = 0.85   # fraction of measured copy bandwidth (target)
CE_MEMORY_TARGET = 0.25      # fused peak / eager peak (target)
COPY_BYTES = 2**30           # 1 GiB copy to measure bandwidth: far past any L2 cache (50 MB H100)


@dataclass(frozen=True, kw_only=True)
class Shape:
    name: str
    tokens: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int   # MoE cases use this many experts of the model's hidden size
    top_k: int


# Llama-3 8B / 70B: hidden, ffn, heads, kv heads, head_dim, vocab from Meta's Llama-3 model card
# / HF config.json. Llama has no MoE: the MoE rows use 8 experts, top-2 (Mixtral-style).
SHAPES = {
    "llama3-8b": Shape(name="llama3-8b", tokens=8192, hidden=4096, ffn=14336, heads=32,
                       kv_heads=8, head_dim=128, vocab=128256, experts=8, top_k=2),
    "llama3-70b": Shape(name="llama3-70b", tokens=8192, hidden=8192, ffn=28672, heads=64,
                        kv_heads=8, head_dim=128, vocab=128256, experts=8, top_k=2),
}
SMOKE = Shape(name="smoke", tokens=16, hidden=64, ffn=96, heads=4, kv_heads=2, head_dim=16,
              vocab=200, experts=4, top_k=2)


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    inputs: Callable[[Shape, torch.dtype, torch.device], list]  # tensors (+ ints)
    fused: Callable[..., object]
    eager: Callable[..., object]
    bytes_fwd: Callable[[Shape, int], float]  # minimal HBM traffic of the fused kernel
    bytes_bwd: Callable[[Shape, int], float]
    memory_bound: bool = True


def _rand(shape, dtype, device, grad=True, scale=1.0):
    return (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_(grad)


def _rope_tables(s: Shape, device):
    inv = 10000.0 ** (-torch.arange(0, s.head_dim, 2, device=device) / s.head_dim)
    ang = torch.arange(s.tokens, device=device)[:, None] * inv
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def _moe_inputs(s: Shape, dtype, device):
    x = _rand((s.tokens, s.hidden), dtype, device)
    experts = torch.stack([torch.randperm(s.experts, device=device)[:s.top_k]
                           for _ in range(min(s.tokens, 64))]).repeat(
        math.ceil(s.tokens / 64), 1)[:s.tokens]
    w = torch.rand(s.tokens, s.top_k, device=device, requires_grad=True)
    return [x, experts, w, s.experts]


def _permute_unpermute(permute, unpermute):
    def run(x, experts, w, num_experts):
        perm = permute(x, experts, num_experts)
        return unpermute(perm[0], perm, w)
    return run


def _ref_unpermute(out, perm, w):
    return R.moe_unpermute(out, perm[2], w)


def cases() -> list[Case]:
    return [
        Case(name="rms_norm",
             inputs=lambda s, dt, dev: [_rand((s.tokens, s.hidden), dt, dev),
                                        _rand((s.hidden,), dt, dev)],
             fused=K.rms_norm, eager=R.rms_norm,
             bytes_fwd=lambda s, b: 2 * s.tokens * s.hidden * b,
             bytes_bwd=lambda s, b: 3 * s.tokens * s.hidden * b),
        Case(name="rms_norm_residual",
             inputs=lambda s, dt, dev: [_rand((s.tokens, s.hidden), dt, dev),
                                        _rand((s.tokens, s.hidden), dt, dev),
                                        _rand((s.hidden,), dt, dev)],
             fused=K.rms_norm_residual, eager=R.rms_norm_residual,
             bytes_fwd=lambda s, b: 4 * s.tokens * s.hidden * b,
             bytes_bwd=lambda s, b: 4 * s.tokens * s.hidden * b),
        Case(name="swiglu_packed",
             inputs=lambda s, dt, dev: [_rand((s.tokens, 2 * s.ffn), dt, dev)],
             fused=K.swiglu_packed, eager=R.swiglu_packed,
             bytes_fwd=lambda s, b: 3 * s.tokens * s.ffn * b,
             bytes_bwd=lambda s, b: 5 * s.tokens * s.ffn * b),
        Case(name="rope",
             inputs=lambda s, dt, dev: [_rand((1, s.tokens, s.heads, s.head_dim), dt, dev),
                                        _rand((1, s.tokens, s.kv_heads, s.head_dim), dt, dev),
                                        *_rope_tables(s, dev)],
             fused=K.rope, eager=lambda q, k, c, si: R.rope(q, k, c, si),
             bytes_fwd=lambda s, b: 2 * s.tokens * (s.heads + s.kv_heads) * s.head_dim * b,
             bytes_bwd=lambda s, b: 2 * s.tokens * (s.heads + s.kv_heads) * s.head_dim * b),
        Case(name="moe_permute_unpermute",
             inputs=_moe_inputs,
             fused=_permute_unpermute(K.moe_permute, K.moe_unpermute),
             eager=_permute_unpermute(R.moe_permute, _ref_unpermute),
             # permute: read x k times, write T k rows; unpermute: read T k rows, write T rows
             bytes_fwd=lambda s, b: (3 * s.top_k + 1) * s.tokens * s.hidden * b,
             bytes_bwd=lambda s, b: (4 * s.top_k + 1) * s.tokens * s.hidden * b),
        Case(name="fused_linear_cross_entropy",
             inputs=lambda s, dt, dev: [_rand((s.tokens, s.hidden), dt, dev),
                                        _rand((s.vocab, s.hidden), dt, dev,
                                              scale=1 / math.sqrt(s.hidden)),
                                        torch.randint(0, s.vocab, (s.tokens,), device=dev)],
             fused=K.fused_linear_cross_entropy, eager=R.linear_cross_entropy,
             bytes_fwd=lambda s, b: 0.0, bytes_bwd=lambda s, b: 0.0, memory_bound=False),
    ]


# --- timing --------------------------------------------------------------------------------

def _timer(device: torch.device, reps: int) -> Callable[[Callable[[], object]], float]:
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=100,
                                                        return_mode="median"))

    def cpu(fn):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return cpu


def _float_outputs(out) -> list[torch.Tensor]:
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()
            and o.requires_grad]


def _leaves(inputs: list) -> list[torch.Tensor]:
    return [t for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point()
            and t.requires_grad]


def fwd_bwd_ms(fn, inputs, timer) -> tuple[float, float]:
    leaves = _leaves(inputs)
    fwd = timer(lambda: fn(*inputs))
    outs = _float_outputs(fn(*inputs))
    grads = [torch.randn_like(o) for o in outs]
    bwd = timer(lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True,
                                            allow_unused=True))
    return fwd, bwd


def peak_memory_bytes(fn, inputs, device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    leaves = _leaves(inputs)
    outs = _float_outputs(fn(*inputs))
    torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])
    torch.cuda.synchronize()
    return float(torch.cuda.max_memory_allocated() - base)


def copy_bandwidth_gbs(device: torch.device, timer) -> float:
    n = COPY_BYTES if device.type == "cuda" else 2**22
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9


# --- run -----------------------------------------------------------------------------------

def run(shapes: list[Shape], device: torch.device, dtype: torch.dtype, with_compile: bool,
        reps: int, judge: bool = True) -> dict:
    timer = _timer(device, reps)
    copy_bw = copy_bandwidth_gbs(device, timer)
    b = torch.finfo(dtype).bits // 8
    rows = []
    for shape in shapes:
        for case in cases():
            impls: dict[str, Callable] = {"fused": case.fused, "eager": case.eager}
            if with_compile:
                # the backward is timed by replaying one graph (retain_graph=True), which
                # compiled graphs with donated buffers refuse
                import torch._functorch.config as functorch_config
                functorch_config.donated_buffer = False
                impls["compile"] = torch.compile(case.eager)
            result = {"kernel": case.name, "shape": shape.name}
            for impl, fn in impls.items():
                torch.manual_seed(0)
                inputs = case.inputs(shape, dtype, device)
                fwd, bwd = fwd_bwd_ms(fn, inputs, timer)
                result[f"{impl}_fwd_ms"], result[f"{impl}_bwd_ms"] = fwd, bwd
                if case.memory_bound and impl == "fused":
                    result["fused_fwd_gbs"] = case.bytes_fwd(shape, b) / (fwd * 1e-3) / 1e9
                    result["fused_bwd_gbs"] = case.bytes_bwd(shape, b) / (bwd * 1e-3) / 1e9
                if not case.memory_bound and impl in ("fused", "eager"):
                    result[f"{impl}_peak_bytes"] = peak_memory_bytes(fn, inputs, device)
                del inputs
            rows.append(_judge(result, case, copy_bw) if judge else {**result, "target": "n/a"})
    return {"device": _device_name(device), "dtype": str(dtype).replace("torch.", ""),
            "copy_bandwidth_gbs": copy_bw, "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "rows": rows}


def _judge(r: dict, case: Case, copy_bw: float) -> dict:
    fused = r["fused_fwd_ms"] + r["fused_bwd_ms"]
    if case.memory_bound:
        frac = min(r["fused_fwd_gbs"], r["fused_bwd_gbs"]) / copy_bw
        r["fraction_of_copy_bw"] = frac
        faster = "compile_fwd_ms" not in r or fused < r["compile_fwd_ms"] + r["compile_bwd_ms"]
        r["target"] = "met" if frac >= MEMORY_BOUND_TARGET and faster else "missed"
    else:
        peaks = r.get("fused_peak_bytes"), r.get("eager_peak_bytes")
        ratio = None if None in peaks else peaks[0] / peaks[1]
        r["peak_memory_ratio"] = ratio
        no_slowdown = fused <= r["eager_fwd_ms"] + r["eager_bwd_ms"]
        r["target"] = ("n/a" if ratio is None else
                       "met" if ratio <= CE_MEMORY_TARGET and no_slowdown else "missed")
    return r


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu (Triton interpreter)"


def table(report: dict) -> str:
    head = ("| kernel | shape | fused fwd/bwd ms | eager fwd/bwd ms | compile fwd/bwd ms | "
            "fused GB/s fwd/bwd | % copy BW | peak mem fused/eager | target |")
    lines = [f"Device: {report['device']}, dtype {report['dtype']}, torch {report['torch']}, "
             f"copy bandwidth {report['copy_bandwidth_gbs']:.0f} GB/s", "", head,
             "|" + "---|" * 9]

    def pair(r, key):
        a, b = r.get(f"{key}_fwd_ms"), r.get(f"{key}_bwd_ms")
        return "-" if a is None else f"{a:.3f} / {b:.3f}"
    for r in report["rows"]:
        gbs = (f"{r['fused_fwd_gbs']:.0f} / {r['fused_bwd_gbs']:.0f}"
               if "fused_fwd_gbs" in r else "-")
        frac = f"{100 * r['fraction_of_copy_bw']:.0f}%" if "fraction_of_copy_bw" in r else "-"
        mem = "-"
        if r.get("fused_peak_bytes") is not None:
            mem = (f"{r['fused_peak_bytes'] / 2**30:.2f} / {r['eager_peak_bytes'] / 2**30:.2f}"
                   f" GiB ({r['peak_memory_ratio']:.2f}x)")
        lines.append(f"| {r['kernel']} | {r['shape']} | {pair(r, 'fused')} | {pair(r, 'eager')} "
                     f"| {pair(r, 'compile')} | {gbs} | {frac} | {mem} | {r['target']} |")
    return "\n".join(lines)


def write(report: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", report["device"].lower()).strip("-")
    stem = out_dir / f"kernels-{report['date']}-{slug}"
    md = stem.with_suffix(".md")
    md.write_text(f"# Kernel benchmark {report['date']}\n\n{table(report)}\n\nTargets: "
                  f"memory-bound >= {MEMORY_BOUND_TARGET:.0%} of copy bandwidth and faster than "
                  f"torch.compile; fused linear+CE peak <= {CE_MEMORY_TARGET:.0%} of eager with "
                  "no slowdown.\n")
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on CPU through the Triton interpreter (checks the script)")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        K.set_backend("triton")  # raises with the reason if the interpreter cannot run
        report = run([SMOKE], torch.device("cpu"), torch.float32, with_compile=False, reps=1,
                     judge=False)  # interpreter timings say nothing about the targets
    else:
        if not torch.cuda.is_available():
            print("benchmarks/kernels.py: no CUDA GPU here; nothing to measure "
                  "(use --cpu-smoke to check the script under the Triton interpreter)")
            return 0
        K.set_backend("triton")
        report = run([SHAPES[n] for n in args.shapes], torch.device("cuda"), torch.bfloat16,
                     with_compile=not args.no_compile, reps=0)
    print(table(report))
    print(f"\nwritten: {write(report, args.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
