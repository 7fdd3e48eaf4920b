"""Activation offloading per block, as the Plan's `offload_activations` says.

Each transformer block's forward runs under a `saved_tensors_hooks` pair: every tensor autograd
saves for the block's backward (but parameters, which stay where they are) is copied to host memory
as it is saved, and brought back when backward needs it. What is saved is what the block's recompute
policy keeps (runtime/recompute.py; offloading wraps the recompute wrapper, so the policy runs
inside it): with "none" every activation the block saves; with "full" the block input that
non-reentrant checkpointing keeps (it saves it through the same hooks), while the tensors of the
recomputed forward stay on the GPU for the moment backward uses them. The embedding and the output
layer are not blocks: their activations stay. Under pipeline parallelism every micro-batch in
flight keeps its saved tensors on the host, where the saving is largest.

On CUDA the copies run on a side stream: device -> host into pinned memory as forward saves each
tensor (the block's kernels go on; the GPU tensor is released once its copy has run), host -> device
for a whole block at once, started when backward first unpacks a tensor of the block after it, so
that each block's tensors arrive while the later block's backward runs. The GPU then holds about two
blocks' saved tensors (the one computing and the one in transfer), the working set the cost model
prices (cost_models/offload.py).

Why not `torch.autograd.graph.save_on_cpu(pin_memory=True)`: it copies on the compute stream, so
every kernel after a save waits for its copy, and it copies back only when backward reaches the
tensor, so backward waits for every copy too; the plan prices copies hidden behind compute. It also
moves the weights a linear saves (views of parameters), which are on the GPU anyway.

On CPU processes the "host" is the same memory: the copies run (so the mechanism and its numerics
are tested everywhere) and save nothing. `Offloader.bytes_offloaded` counts the bytes moved.

Blocks that offload run eagerly under torch.compile (the hooks are Python around each save).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Offloader", "apply_offload"]


@dataclass(eq=False)
class _Entry:
    host: torch.Tensor                  # the copy in host memory
    spec: Any                           # a DTensor's spec (placements, mesh), else None
    pending: int = 1                    # handles not yet unpacked
    back: torch.Tensor | None = None    # the copy brought back to the device


@dataclass(eq=False)
class _Group:
    """The tensors one block's forward saved for one micro-batch."""
    prev: _Group | None                 # the block before it in this stage's forward (prefetched next)
    entries: list[_Entry] = field(default_factory=list)
    index: dict = field(default_factory=dict)       # storage view -> entry (a tensor saved twice moves once)
    keep: list = field(default_factory=list)        # device tensors held while the block's forward runs
    loaded: bool = False
    event: Any = None                   # CUDA: the host -> device copies' completion


@dataclass(frozen=True, eq=False)
class _Handle:
    group: _Group
    entry: _Entry


class Offloader:
    """The saved-tensor hooks of one pipeline stage's blocks on `device` (one per stage: each
    stage's blocks form their own chain of prefetches)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.bytes_offloaded = 0        # bytes copied to host by the pack hook (cumulative)
        self.bytes_reloaded = 0         # bytes brought back for backward (cumulative)
        self._group: _Group | None = None
        self._last: _Group | None = None

    # ---- one block's forward ------------------------------------------------------------------
    def begin(self, first: bool) -> _Group:
        if first:                       # a new micro-batch's forward through this stage
            self._last = None
        self._group = _Group(prev=self._last)
        self._last = self._group
        return self._group

    def end(self, group: _Group) -> None:
        group.keep.clear()              # CUDA: freed for reuse once the side stream's copies ran
        group.index.clear()
        self._group = None

    # ---- saved_tensors_hooks ------------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        group = self._group
        local, spec = _local(t)
        if group is None or local is None or not self._moves(t, local):
            return t
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.size()),
               tuple(local.stride()), local.dtype, local._version)
        entry = group.index.get(key)
        if entry is not None:
            entry.pending += 1
            return _Handle(group, entry)
        entry = _Entry(host=self._to_host(local), spec=spec)
        group.keep.append(local)        # its address cannot be reused by a later save of this block
        group.index[key] = entry
        group.entries.append(entry)
        self.bytes_offloaded += local.numel() * local.element_size()
        return _Handle(group, entry)

    def unpack(self, h):
        if not isinstance(h, _Handle):
            return h
        group = h.group
        if not group.loaded:            # backward reached this block: bring it (if not prefetched)
            self._load(group)
        if group.prev is not None and not group.prev.loaded:
            self._load(group.prev)      # the block backward runs next, while this one computes
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(group.event)
        entry = h.entry
        out = entry.back
        if self.cuda:                   # used on the compute stream: not reused before it is done
            out.record_stream(torch.cuda.current_stream(self.device))
        entry.pending -= 1
        if entry.pending <= 0:          # its last handle read: release both copies
            entry.back = None
            entry.host = None
        if entry.spec is not None:
            from torch.distributed.tensor import DTensor
            out = DTensor(out, entry.spec, requires_grad=False)
        return out

    # ---- copies -------------------------------------------------------------------------------
    def _moves(self, t: torch.Tensor, local: torch.Tensor) -> bool:
        """Activations on this device move; parameters (and their views) and tensor subclasses the
        copy cannot rebuild (FP8 training tensors) stay."""
        base = t._base if t._base is not None else t
        if base.is_leaf and base.requires_grad:
            return False
        return type(local) is torch.Tensor and local.device.type == self.device.type

    def _to_host(self, local: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return local.detach().clone()
        host = torch.empty(local.size(), dtype=local.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))   # the tensor is written
        with torch.cuda.stream(self.stream):
            host.copy_(local, non_blocking=True)
        local.record_stream(self.stream)        # its memory is not reused before the copy ran
        return host

    def _load(self, group: _Group) -> None:
        group.loaded = True
        live = [e for e in group.entries if e.host is not None]
        self.bytes_reloaded += sum(e.host.numel() * e.host.element_size() for e in live)
        if not self.cuda:
            for e in live:
                e.back = e.host
            return
        with torch.cuda.stream(self.stream):    # after the same tensors' device -> host copies
            for e in live:
                e.back = e.host.to(self.device, non_blocking=True)
            group.event = torch.cuda.Event()
            group.event.record(self.stream)


def _local(t: torch.Tensor) -> tuple[torch.Tensor | None, Any]:
    """(the tensor that owns memory, a DTensor's spec or None)."""
    inner = getattr(t, "_local_tensor", None)
    if isinstance(inner, torch.Tensor):
        return inner, t._spec
    return t, None


def _wrap(block: nn.Module, off: Offloader, first: bool) -> None:
    inner = block.forward

    @torch.compiler.disable
    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():         # nothing is saved: nothing to offload
            return inner(*args, **kwargs)
        group = off.begin(first)
        try:
            with torch.autograd.graph.saved_tensors_hooks(off.pack, off.unpack):
                return inner(*args, **kwargs)
        finally:
            off.end(group)
    block.forward = forward


def apply_offload(stage: nn.Module, blocks: list[str], device: torch.device) -> Offloader:
    """Offload the saved activations of the stage's blocks (FQNs in execution order) to host memory;
    call after runtime/recompute.py wrapped them. Returns the stage's Offloader."""
    off = Offloader(device)
    for k, fqn in enumerate(blocks):
        _wrap(stage.get_submodule(fqn), off, first=k == 0)
    return off
