"""Sequence parallelism keeps the sequence shard for backward, not the gathered activation.

Under SP the activation entering a block's attention or feed-forward module is all-gathered once
(tensor_parallel._gather_once) and every column-parallel linear there (Q, K, V; gate, up) saves
that whole-sequence tensor for its weight gradient: tp times what Megatron keeps. Megatron's
sequence parallelism keeps the shard and all-gathers it again in backward, which is what the
cost model charges (cost_models.layer.activation_bytes: the norm outputs divided by tp under
SP). `ShardKeeper` does the same for one such module:

- the gather pre-hook reports each all-gather it makes (`gathered(shard, whole)`);
- the module's forward runs under a `saved_tensors_hooks` pair whose pack turns any tensor
  that views the gathered storage into a handle holding the shard (which the norm made anyway),
  and whose unpack all-gathers the shard again, the same redistribution as in forward, so the
  values are bit-identical. The first unpack gathers; the other handles of that gather reuse
  the tensor until the last of them is read, so backward gathers once per module, not once per
  linear.

When it steps aside (the tensors are then saved as they are): inside an outer saved-tensor hook
(a checkpointed block - full or selective recompute rebuild the gather themselves -, "norm_act",
activation offloading: an inner hook would take their tensors from them) and while torch.compile
traces (the partitioner chooses what a compiled block saves).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from meshplan.runtime.recompute import local_tensor, storage_key

__all__ = ["ShardKeeper"]


def _storage_id(t: torch.Tensor) -> int | None:
    key = storage_key(t)
    return None if key is None else key[0]


@dataclass(eq=False)
class _Gather:
    """One forward all-gather: the shard it read and the whole tensor's local layout."""
    shard: torch.Tensor                 # a detached DTensor sharded on the sequence
    size: torch.Size
    stride: tuple[int, ...]
    pending: int = 0                    # handles not yet unpacked
    _whole: torch.Tensor | None = field(default=None, repr=False)

    def whole(self, mesh) -> torch.Tensor:
        if self._whole is None:
            from torch.distributed.tensor import Replicate
            with torch.no_grad():
                w = self.shard.redistribute(mesh, [Replicate()]).to_local()
            if w.size() != self.size or w.stride() != self.stride:
                w = torch.empty_strided(self.size, self.stride, dtype=w.dtype, device=w.device).copy_(w)
            self._whole = w
        return self._whole

    def release(self) -> None:
        self.pending -= 1
        if self.pending <= 0:           # the last saver read it: free the gathered copy
            self._whole = None


@dataclass(frozen=True)
class _Handle:
    """What autograd keeps instead of a view of a gathered activation."""
    gather: _Gather
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    spec: object = None                 # a DTensor's spec, else None (a plain local view)


class ShardKeeper:
    """Saves the sequence shard in place of the all-gathered input of one module (see the module
    docstring). `gathered` is called by the gather pre-hook; `wrap` installs the forward."""

    def __init__(self, mesh):
        self.mesh = mesh
        self._next: dict[int, _Gather] = {}     # gathers made by the pre-hook for the next forward

    @staticmethod
    def active() -> bool:
        return not torch.compiler.is_compiling() and torch.is_grad_enabled() \
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None

    def gathered(self, shard: torch.Tensor, whole: torch.Tensor) -> None:
        if not self.active():
            return
        key, loc = _storage_id(whole), local_tensor(whole)
        if key is not None and key != _storage_id(shard):
            self._next[key] = _Gather(shard.detach(), loc.size(), loc.stride())

    def wrap(self, module: nn.Module) -> None:
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            gathers, self._next = self._next, {}
            if not gathers or not self.active():
                return inner(*args, **kwargs)
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(_pack, gathers), self._unpack):
                return inner(*args, **kwargs)
        module.forward = forward

    def _unpack(self, h):
        if not isinstance(h, _Handle):
            return h
        whole = h.gather.whole(self.mesh)
        h.gather.release()
        v = whole.as_strided(h.size, h.stride, h.offset)
        if h.spec is not None:
            from torch.distributed.tensor import DTensor
            v = DTensor(v, h.spec, requires_grad=False)
        return v


def _pack(gathers: dict[int, _Gather], t: torch.Tensor):
    g = gathers.get(_storage_id(t))
    if g is None:
        return t
    loc = local_tensor(t)
    g.pending += 1
    return _Handle(g, loc.size(), loc.stride(), loc.storage_offset(), t._spec if loc is not t else None)
