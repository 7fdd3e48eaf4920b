"""Workers for the context-parallel tests (imported by spawned ranks; see test_context_parallel.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import numerics

# fp32: the ring sums the softmax over cp blocks in another order than SDPA's single pass, an
# O(1e-7) relative difference per element; 1e-5 / 1e-6 keeps an order of magnitude of margin,
# while a wrong mask, a lost block or a misrouted gradient is off by O(1e-1).
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
# bf16 inputs: both sides round the output (and the gradients) to bf16, whose unit roundoff is
# 2^-8 ~ 4e-3; the reference is fp32 SDPA on the same bf16 values. The ring's kernel reads bf16 and
# accumulates in fp32 but hands back each block's output and gradients in bf16 before the fp32
# merge, so the ring differs by one or two roundings of each result (measured at cp=2 and 4: at
# most 6e-3 on the output, 1.8e-2 on dq/dk/dv, values O(1)): rtol 2e-2 / atol 1e-2 holds.
BF16_TOL = dict(rtol=2e-2, atol=1e-2)


def _attention_case(rank: int, world: int, *, heads: int, kv_heads: int, causal: bool, dtype, seq: int = 16,
                    scale: float | None = None, v_hd: int = 8) -> dict:
    from meshplan.runtime.context_parallel import ring_attention, shard_sequence
    g = torch.Generator().manual_seed(7)
    B, hd = 2, 8
    q = torch.randn(B, heads, seq, hd, generator=g)
    k = torch.randn(B, kv_heads, seq, hd, generator=g)
    v = torch.randn(B, kv_heads, seq, v_hd, generator=g)
    dout = torch.randn(B, heads, seq, v_hd, generator=g)
    gqa = heads != kv_heads
    # reference: SDPA in fp32 on the whole sequence (on the bf16-rounded inputs for bf16)
    ref_in = [t.to(dtype).float().detach().clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal, scale=scale, enable_gqa=gqa)
    ref.backward(dout.to(dtype).float())
    local = [shard_sequence(t.to(dtype), world, rank, dim=2).detach().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, dist.group.WORLD, is_causal=causal, scale=scale, enable_gqa=gqa)
    out.backward(shard_sequence(dout.to(dtype), world, rank, dim=2))
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert out.dtype == dtype and local[1].grad.dtype == dtype
    torch.testing.assert_close(out.float(), shard_sequence(ref.detach(), world, rank, dim=2), **tol)
    errs = {"out": float((out.detach().float() - shard_sequence(ref.detach(), world, rank, dim=2)).abs().max())}
    for name, mine, full in zip("qkv", local, ref_in):
        want = shard_sequence(full.grad, world, rank, dim=2)
        torch.testing.assert_close(mine.grad.float(), want, **tol, msg=lambda m, n=name: f"d{n}: {m}")
        errs[f"d{name}"] = float((mine.grad.float() - want).abs().max())
    return errs


ATTENTION_CASES = {
    "causal_fp32": dict(heads=4, kv_heads=4, causal=True, dtype=torch.float32),
    "causal_gqa_fp32": dict(heads=4, kv_heads=2, causal=True, dtype=torch.float32),
    "noncausal_gqa_fp32": dict(heads=4, kv_heads=1, causal=False, dtype=torch.float32),
    "causal_scale_fp32": dict(heads=2, kv_heads=2, causal=True, dtype=torch.float32, scale=0.3),
    "causal_gqa_bf16": dict(heads=4, kv_heads=2, causal=True, dtype=torch.bfloat16),
    # multi-head latent attention: values narrower (and, for the padding's other side, wider) than q/k
    "causal_narrow_v_fp32": dict(heads=4, kv_heads=4, causal=True, dtype=torch.float32, v_hd=6),
    "causal_wide_v_gqa_fp32": dict(heads=4, kv_heads=2, causal=True, dtype=torch.float32, v_hd=12),
}


# the memory case: blocks of 256 local queries x 256 keys, head dim 8, so one fp32 score block
# (batch x heads x 256 x 256) is 16x the size of the local q and of the K/V pair travelling the ring
MEMORY_CASE = dict(batch=1, heads=4, kv_heads=2, hd=8, seq_per_rank=512)


def largest_ring_tensors(rank: int, world: int) -> dict:
    """Numel of the largest tensor any aten op returns inside ring attention's forward and backward,
    next to the size one (query chunk x key chunk) score block would have."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshplan.runtime.context_parallel import ring_attention

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel, self.op, self.ops = 0, None, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.add(func.__name__)
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                    self.numel, self.op = t.numel(), str(func)
            return out

    c = MEMORY_CASE
    S = c["seq_per_rank"]
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(c["batch"], c["heads"], S, c["hd"], generator=g, requires_grad=True)
    k = torch.randn(c["batch"], c["kv_heads"], S, c["hd"], generator=g, requires_grad=True)
    v = torch.randn(c["batch"], c["kv_heads"], S, c["hd"], generator=g, requires_grad=True)
    fwd, bwd = Largest(), Largest()
    with fwd:
        out = ring_attention(q, k, v, dist.group.WORLD, is_causal=True, enable_gqa=True)
    dout = torch.ones_like(out)
    with bwd:
        out.backward(dout)
    return {"forward": fwd.numel, "forward_op": fwd.op, "backward": bwd.numel, "backward_op": bwd.op,
            "forward_ops": sorted(fwd.ops), "backward_ops": sorted(bwd.ops),
            "score_block": c["batch"] * c["heads"] * (S // 2) ** 2, "q": q.numel()}


def attention_cases(rank: int, world: int) -> dict:
    from worlds import each_case
    return each_case(rank, ATTENTION_CASES, lambda name, kw: _attention_case(rank, world, **kw))


def mode_refusals(rank: int, world: int) -> dict:
    """What RingAttentionMode refuses (local checks: no communication happens before the error)."""
    from meshplan.runtime.context_parallel import RingAttentionMode
    q = torch.randn(1, 2, 8, 4)
    out = {}
    calls = {"mask": dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), "dropout": dict(dropout_p=0.1, is_causal=True),
             "cross": dict(is_causal=True)}
    for name, kw in calls.items():
        k = torch.randn(1, 2, 4, 4) if name == "cross" else q
        try:
            with RingAttentionMode(dist.group.WORLD):
                F.scaled_dot_product_attention(q, k, k, **kw)
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the test checks type and message
            out[name] = f"{type(e).__name__}: {e}"
    return out


def short_batch(rank: int, world: int, case: dict) -> dict:
    """forward_backward must refuse a batch shorter than the plan's seq_len (before any collective)."""
    from meshplan.runtime import parallelize
    model = numerics.build_model(case["model"], seq_len=case["seq_len"])
    pm = parallelize(model, case["plan"], compute_dtype=None)
    x, y = numerics.batch(case["global_batch"], case["seq_len"])
    try:
        pm.forward_backward(x[:, :-4], y[:, :-4])
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None}


def run_all(rank: int, world: int, cases: dict) -> dict:
    """Ring attention alone, then the model cases (numerics.run_cases), in one process group."""
    from worlds import each_case
    out = {"attention": attention_cases(rank, world), "refusals": mode_refusals(rank, world)}
    out.update(each_case(rank, {"memory": None}, lambda name, case: largest_ring_tensors(rank, world)))
    mine = {n: c for n, c in cases.items() if c.get("kind") == "cp_short_batch"}
    out.update(numerics.run_cases(rank, world, {n: c for n, c in cases.items() if n not in mine}))
    out.update(each_case(rank, mine, lambda name, case: short_batch(rank, world, case)))
    return out
