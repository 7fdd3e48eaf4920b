"""PyTorch context parallelism's element-wise work per ring step, timed with torch's own code.

    python benchmarks/cp_merge_probe.py            # on a CUDA machine (about 30 s on one H200)
    python benchmarks/cp_merge_probe.py --dry-run  # tiny shapes on CPU: proves the script runs

What meshplan/cost_models/cp.py (torch_ring_forward / torch_ring_backward) counts, run as torch runs it:
- one forward step of `_SDPAMerger.step` (torch/distributed/tensor/experimental/_context_parallel/
  _attention.py) on a flash-shaped block (bf16 output as a [b, h, n, d] view of [b, n, h, d] memory, fp32
  LSE), whole-query (`partial=False`) and half-query (`partial=True`: half the rows, then `_partial_update`);
- one backward step of the whole-query branch as `_templated_ring_attention_backward` runs it: dK/dV
  `_partial_update(add=True)` of the received fp32 gradients, the fp32 torch.cat for the all-to-all, dQ +=,
  and the bf16 K/V torch.cat the all-gather rotater builds;
- the whole-query merge under torch.compile (one call per step: at small sizes the compiled wrapper's host
  time, not the GPU, sets the figure).
Kernels are counted with the profiler, times are device events (3 warm-ups, median of 20). Prints one
markdown table. Imports nothing from meshplan.
"""

from __future__ import annotations

import argparse

import torch
from gpu_rates import time_median      # device events, 3 warm-ups, the median

try:
    from torch.distributed.tensor.experimental._context_parallel import _attention as A
except ImportError:                      # torch before the _context_parallel package
    from torch.distributed.tensor.experimental import _attention as A




def _kernels(fn, dev) -> int | None:
    if dev.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in p.events() if str(getattr(e, "device_type", "")).endswith("CUDA"))


def _merge(out, lse, block, block_lse, partial: bool):
    m = A._SDPAMerger(True, seq_dim=2)
    m._out, m._lse = out, lse
    m.step(block, block_lse, partial)
    return m._out, m._lse


def run(dev, heads: int, dim: int, sizes: tuple[int, ...], compiled_sizes: tuple[int, ...]) -> list[dict]:
    def flash_block(n):
        return (torch.randn(1, n, heads, dim, device=dev, dtype=torch.bfloat16).transpose(1, 2),
                torch.randn(1, heads, n, device=dev))

    rows = []
    for n in sizes:
        b0, l0 = flash_block(n)
        out, lse = b0.float(), l0.unsqueeze(-1)
        (bw, lw), (bh, lh) = flash_block(n), flash_block(n // 2)
        def whole(out=out, lse=lse, bw=bw, lw=lw):
            return _merge(out, lse, bw, lw, False)

        def half(out=out, lse=lse, bh=bh, lh=lh):
            return _merge(out, lse, bh, lh, True)

        e = heads * n * dim
        dq, dk, dv = (torch.randn(1, n, heads, dim, device=dev, dtype=torch.bfloat16).transpose(1, 2)
                      for _ in range(3))
        grad_q = torch.zeros(1, heads, n, dim, device=dev)
        key = torch.randn(1, heads, n, dim, device=dev, dtype=torch.bfloat16)
        value = torch.randn_like(key)
        received = torch.randn(2 * e, device=dev)

        def backward_step(e=e, n=n, dq=dq, dk=dk, dv=dv, grad_q=grad_q, key=key, value=value, received=received):
            g_k = received[:e].reshape(grad_q.shape)
            g_v = received[e:].reshape(grad_q.shape)
            g_k = A._partial_update(g_k, dk[:, :, : n // 2], dim=2, n_chunks=2, idx=0, add=True)
            g_v = A._partial_update(g_v, dv[:, :, : n // 2], dim=2, n_chunks=2, idx=0, add=True)
            send = torch.cat([g_k.flatten(), g_v.flatten()])
            grad_q.add_(dq)
            return send, torch.cat([key.flatten(), value.flatten()])

        row = dict(tokens=n, whole_s=time_median(whole, dev), whole_k=_kernels(whole, dev),
                   half_s=time_median(half, dev), half_k=_kernels(half, dev),
                   bwd_s=time_median(backward_step, dev), bwd_k=_kernels(backward_step, dev))
        if n in compiled_sizes:
            fn = torch.compile(lambda o, s, b, bl: _merge(o, s, b, bl, False), dynamic=False)

            def call(fn=fn, out=out, lse=lse, bw=bw, lw=lw):
                return fn(out, lse, bw, lw)

            row.update(compiled_s=time_median(call, dev), compiled_k=_kernels(call, dev))
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    args = ap.parse_args()
    dry = args.dry_run or not torch.cuda.is_available()
    dev = torch.device("cpu" if dry else "cuda")
    heads, dim = (2, 16) if dry else (16, 128)
    rows = run(dev, heads, dim, (256, 128) if dry else (16384, 8192, 4096), () if dry else (16384, 4096))
    name = "cpu" if dry else torch.cuda.get_device_name()
    print(f"torch {torch.__version__} on {name}, {heads} heads x {dim}; ms per step (kernels)\n")
    print("| tokens per rank | merge, whole query | merge, half query | backward step, whole query | merge, compiled |")
    print("|---|---|---|---|---|")
    def cell(r, k):
        return "-" if k + "_s" not in r else f"{r[k + '_s'] * 1e3:.3f} ({r[k + '_k']})"

    for r in rows:
        print(f"| {r['tokens']} | {cell(r, 'whole')} | {cell(r, 'half')} | {cell(r, 'bwd')} | {cell(r, 'compiled')} |")


if __name__ == "__main__":
    main()
