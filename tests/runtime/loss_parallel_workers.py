"""Workers for tests/runtime/test_loss_parallel.py (imported by spawned ranks).

- `unit`: meshplan.runtime.loss_parallel.vocab_parallel_cross_entropy on each rank's slice of
  the same logits against F.cross_entropy on the whole logits (loss and logits gradient), with
  ignored rows, uneven and empty vocabulary slices, bf16 logits, and its refusals.
- `end_to_end`: a model parallelised by a plan runs one step and is compared with the
  single-device model (loss, every gradient, every parameter after AdamW: numerics.py's
  tolerances), while a forward hook records the output layer's output on each rank and a
  dispatch mode records every plain tensor with a full-vocabulary dimension.
"""

from __future__ import annotations

import copy

import numerics
import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE = -100


def _slice_check(rank: int, world: int, vocab: int, dtype: torch.dtype, seed: int) -> None:
    from meshplan.runtime.loss_parallel import VocabShard, vocab_parallel_cross_entropy
    g = torch.Generator().manual_seed(seed)
    whole = (4 * torch.randn(3, 7, vocab, generator=g)).to(dtype)     # the same on every rank
    target = torch.randint(0, vocab, (3, 7), generator=g)
    target[0, :3] = IGNORE
    target[2, -1] = IGNORE
    shard = VocabShard(group=dist.group.WORLD, rank=rank, size=world, vocab=vocab)
    cols = slice(shard.start, shard.start + shard.width)
    local = whole[..., cols].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, shard, ignore_index=IGNORE)
    (0.37 * loss).backward()           # an incoming gradient other than 1
    ref_in = whole.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.flatten(0, -2).float(), target.flatten(), ignore_index=IGNORE, reduction="sum")
    (0.37 * ref).backward()
    what = f"vocab={vocab} {dtype} rank {rank}"
    assert loss.dtype == torch.float32 and local.grad.dtype == dtype, what
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-5, msg=lambda m: f"loss, {what}: {m}")
    torch.testing.assert_close(local.grad, ref_in.grad[..., cols], msg=lambda m: f"grad, {what}: {m}")


def unit(rank: int, world: int, case: dict) -> dict:
    from meshplan.errors import ConfigError
    from meshplan.runtime.loss_parallel import VocabShard, vocab_parallel_cross_entropy
    checked = []
    # 256: even slices; 257: 129 + 128 columns; 3: 2 + 1; 1: one rank's slice is empty
    for seed, vocab in enumerate((256, 257, 3, 1)):
        for dtype in (torch.float32, torch.bfloat16):
            _slice_check(rank, world, vocab, dtype, seed)
            checked.append((vocab, str(dtype)))
    shard = VocabShard(group=dist.group.WORLD, rank=rank, size=world, vocab=16)
    # every label ignored: zero loss, zero gradient (F.cross_entropy's "sum")
    local = torch.randn(2, 4, shard.width, requires_grad=True)
    loss = vocab_parallel_cross_entropy(local, torch.full((2, 4), IGNORE), shard, ignore_index=IGNORE)
    loss.backward()
    assert float(loss) == 0.0 and not local.grad.any()
    # a label outside the vocabulary stops every rank (the verdict is all-reduced: no hang)
    bad = torch.tensor([[1, 16, IGNORE, 3]])
    try:
        vocab_parallel_cross_entropy(torch.randn(1, 4, shard.width), bad, shard, ignore_index=IGNORE)
        raise AssertionError("an out-of-range label was accepted")
    except ConfigError as e:
        assert "outside [0, vocab=16)" in str(e) and "e.g. 16" in str(e), e
    # the softmax buffer becomes the gradient in place: a second backward is refused
    local = torch.randn(1, 4, shard.width, requires_grad=True)
    loss = vocab_parallel_cross_entropy(local, torch.tensor([[0, 5, 9, 15]]), shard, ignore_index=IGNORE)
    loss.backward(retain_graph=True)
    try:
        loss.backward()
        raise AssertionError("a second backward was accepted")
    except RuntimeError as e:
        assert "one backward per forward" in str(e), e
    return {"checked": checked}


def _summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A user's loss_fn: the same loss as the default, computed from whole logits."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")


class _VocabWide:
    """Records the shapes of plain tensors with a dimension of the full vocabulary that the ops
    run during the block create (forward and backward): the logits, their fp32 copy, softmax
    and gradient when they are whole. DTensors (global shapes) are left out: their local
    tensors are what ranks hold."""

    def __init__(self, vocab: int):
        self.vocab, self.shapes = vocab, set()

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if type(t) is torch.Tensor and t.dim() >= 2 and outer.vocab in t.shape:
                        outer.shapes.add(tuple(t.shape))
                return out
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _head_hooks(pm, head: str) -> list:
    """A forward hook on this rank's output layer (if it holds it) recording its output's shape."""
    from meshplan.runtime.pipeline import _PassThrough
    seen: list = []
    for st in pm.stages:
        mod = st.get_submodule(head)
        if not isinstance(mod, _PassThrough):
            mod.register_forward_hook(lambda m, a, out: seen.append((type(out).__name__, tuple(out.shape))))
    return seen


def end_to_end(rank: int, world: int, case: dict) -> dict:
    from meshplan.runtime import parallelize
    torch.manual_seed(0)
    model = numerics.build_model(case["model"], seq_len=case["seq_len"])
    ref = copy.deepcopy(model)
    x, y = numerics.batch(case["global_batch"], case["seq_len"], case["vocab"])
    loss_fn = _summed_cross_entropy if case.get("custom_loss") else None
    pm = parallelize(model, case["plan"], compute_dtype=None, fused_kernels=True, loss_fn=loss_fn)
    head_out = _head_hooks(pm, case["head"])
    with _VocabWide(case["vocab"]) as wide:
        loss = pm.forward_backward(x, y)
    ref_loss = numerics.step_matches_reference(pm, ref, x, y, loss)["ref_loss"]
    shard = pm.vocab_shard
    return {"loss": loss, "ref_loss": ref_loss, "head_out": head_out, "vocab_wide": sorted(wide.shapes),
            "vocab_shard": None if shard is None else (shard.start, shard.width),
            "last_stage": pm.holds_last_stage, "microbatches": pm.num_microbatches,
            "kernels": dict(pm.kernels)}


def run_cases(rank: int, world: int, cases: dict) -> dict:
    from worlds import each_case
    kinds = {"unit": unit}
    return each_case(rank, cases, lambda name, case: kinds.get(case.get("kind"), end_to_end)(rank, world, case))
