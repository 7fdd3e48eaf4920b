"""Vocabulary-parallel cross entropy: the default loss on logits sharded over the vocabulary.

Under tensor parallelism the output layer is column-parallel, so each TP rank computes the logits
of its slice of the vocabulary, (tokens, vocab / tp). With the runtime's default loss they stay
that way (tensor_parallel.py keeps the head's output Shard(-1)), and the cross entropy is
computed from the slices (Megatron's vocab-parallel cross entropy):

    loss_i = log sum_v exp(z_iv) - z_i,target_i
           = m_i + log sum_ranks sum_{v in slice} exp(z_iv - m_i) - z_i,target_i

with m_i the global row maximum (an all-reduce MAX of each rank's local maxima), the sums of
exponentials and the target logit (non-zero only on the rank whose slice holds the target)
summed in one all-reduce over the TP group. Each rank keeps its own softmax slice for backward,
where the gradient of the logits is (softmax - one_hot(target)) restricted to its columns: no
communication, and no rank ever holds a full-vocabulary tensor. Rows whose label is the ignore
index contribute zero loss and zero gradient, as in F.cross_entropy(reduction="sum").

Why a custom autograd.Function rather than torch's `loss_parallel()` context: the pipeline
schedule runs the loss and its backward inside `schedule.step`, and stage outputs cross stages
as plain local tensors, so the DTensor op overrides that `loss_parallel()` installs globally would
have to span the schedule and the logits be re-wrapped as DTensors; here the backward needs no
context and no collective, and the fp32 softmax buffer is reused for the gradient in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshplan.errors import ConfigError, LayoutError

__all__ = ["VocabShard", "vocab_parallel_cross_entropy"]


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary: logits columns [start, start + width) of `vocab`.

    The split is DTensor's Shard(0) of the output layer's weight (torch.chunk's: ranks hold
    ceil(vocab / size) rows each, the last ones fewer or none when vocab is not a multiple)."""

    group: object           # the TP process group
    rank: int               # this rank's index in `group`
    size: int               # TP degree
    vocab: int              # global vocabulary size (the output layer's out_features)

    @property
    def _chunk(self) -> int:
        return -(-self.vocab // self.size)

    @property
    def start(self) -> int:
        return min(self.rank * self._chunk, self.vocab)

    @property
    def width(self) -> int:
        return max(0, min(self._chunk, self.vocab - self.start))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, shard: VocabShard, ignore_index: int):
        group = shard.group
        # the softmax in fp32 whatever the logits' dtype (as the single-device path's `.float()`);
        # a copy even for fp32 logits, since the buffer is turned into the softmax in place
        z = logits.to(torch.float32, copy=True)
        valid = target != ignore_index
        local = target.long() - shard.start         # gather indexes with int64
        owned = valid & (local >= 0) & (local < shard.width)
        index = torch.where(owned, local, torch.zeros_like(local)).unsqueeze(-1)

        if z.shape[-1]:
            row_max = z.amax(dim=-1)
        else:       # an empty slice (a vocabulary smaller than tp chunks): contributes nothing
            row_max = z.new_full(z.shape[:-1], float("-inf"))
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        z.sub_(row_max.unsqueeze(-1))
        picked = torch.where(owned, z.gather(-1, index).squeeze(-1) if z.shape[-1] else row_max,
                             torch.zeros_like(row_max))
        z.exp_()
        # sum of exponentials, target logit and owner count in one collective
        stats = torch.stack([z.sum(dim=-1), picked, owned.to(torch.float32)])
        dist.all_reduce(stats, group=group)
        sum_exp, target_logit, owners = stats
        # every rank sees the same owner counts, so a bad label stops every rank (no hang)
        if bool((owners != valid.to(torch.float32)).any()):
            bad = target[valid & (owners != 1)]
            raise ConfigError(f"labels hold {bad.numel()} value(s) outside [0, vocab={shard.vocab}) that "
                              f"are not ignore_index={ignore_index}, e.g. {int(bad[0])}")
        rows = torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(sum_exp))
        z.div_(sum_exp.unsqueeze(-1))       # this rank's softmax slice, kept for backward
        ctx.save_for_backward(z, index, owned, valid)
        ctx.logits_dtype = logits.dtype
        ctx.used = False
        return rows.sum()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.used:
            # the softmax buffer became the gradient in place: a second backward would read that
            raise RuntimeError("vocab_parallel_cross_entropy supports one backward per forward "
                               "(retain_graph=True and a second backward are not supported)")
        ctx.used = True
        grad, index, owned, valid = ctx.saved_tensors
        if grad.shape[-1]:
            grad.scatter_add_(-1, index, -owned.to(grad.dtype).unsqueeze(-1))     # softmax - one_hot
        grad.mul_((valid.to(grad.dtype) * grad_loss.to(grad.dtype)).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, shard: VocabShard, *,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Summed cross entropy of the whole-vocabulary logits, from this rank's slice of them.

    `logits` (..., shard.width): this rank's columns of the logits; `target` (...): global class
    indices. Returns the fp32 scalar F.cross_entropy(full_logits, target, ignore_index=...,
    reduction="sum") would, the same on every rank of the TP group. Collective over
    `shard.group` in forward (two all-reduces); backward is local.
    """
    if logits.shape[-1] != shard.width:
        raise LayoutError(
            f"the model's output has {logits.shape[-1]} logits per token on this rank, but its slice of "
            f"the vocabulary is {shard.width} of {shard.vocab}: the model changes the logits' last "
            "dimension after the output layer, which the vocabulary-parallel loss cannot follow; pass "
            "parallelize(..., loss_fn=...) to get whole logits instead")
    if logits.shape[:-1] != target.shape:
        raise ConfigError(f"logits {tuple(logits.shape)} and labels {tuple(target.shape)} do not match: "
                          "expected logits (..., vocab) for labels (...)")
    # rows counted from the labels: an empty slice (width 0) cannot infer them
    rows = target.numel()
    return _VocabParallelCrossEntropy.apply(logits.reshape(rows, logits.shape[-1]), target.reshape(rows),
                                            shard, ignore_index)
