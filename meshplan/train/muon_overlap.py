"""Muon's update exchange in flight across the step boundary (train/muon.py, step 4).

The exchange that brings each shard its slice of the orthogonalised update is posted at the end
of `Muon.step()` and not waited for there. The updates are grouped by the module whose forward
first needs them (a "forward group"); each group is its own batched point-to-point call, posted in
forward order, and is waited for and applied by a forward pre-hook on that module, so the later
groups' messages travel while the earlier layers compute. Anything that reads the weights
between steps calls `Muon.finish_pending()` first (checkpoints, the parameter-norm metric, the
end of training); the stage modules' state_dict / load_state_dict pre-hooks do it too. Waiting
needs nothing more from the peers (every rank posted all its sends and receives at the end of its
step), so one rank may finish on its own, e.g. in a state_dict only rank 0 takes.

Which module a parameter's group hooks (`forward_groups`):

- FSDP2: the innermost FSDP unit holding it. FSDP2 all-gathers a unit's shards in its own forward
  pre-hook (registered with prepend=True when `fully_shard` ran); ours is registered later, also
  with prepend=True, so it runs first. A unit that prefetches the next one (FSDP2's
  `set_modules_to_forward_prefetch`) all-gathers that unit's shards in its own pre-forward: its
  hook applies the prefetched units' groups as well. ZeRO-1/2 with one unit per stage: one group,
  applied before the stage's all-gather (the exchange then hides nothing of the forward).
- Otherwise (TP, PP stages without FSDP): the repeated block holding it (the plan's `blocks`),
  else the stage module itself.

A hook applies every pending group up to the last one it needs, in forward order, so waits are
issued in the order the messages were posted even when a module is skipped. The hooks are cheap
no-ops when nothing is pending (recomputed blocks run them again in backward) and stay eager
under torch.compile (a compiled block's hooks run inside its compiled call).

Message count per step: one batched call per forward group in which this rank sends or receives
anything, each with at most one message to and one from each peer: at most (groups x peers)
messages, groups <= FSDP units (blocks, expert units, the stage root) or blocks of the rank's
stages. The gradient exchange (step 2) stays one batched call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Posted", "PendingGroup", "ForwardGroups", "forward_groups"]

Key = tuple[int, int]                       # (unit index, rank holding the piece)


@dataclass(eq=False)
class Posted:
    """One batched exchange in flight: what this rank already has (its own pieces), the works, the
    buffers they fill and what each buffer holds. Send buffers are kept alive until the wait."""

    local: dict[Key, torch.Tensor] = field(default_factory=dict)
    works: list = field(default_factory=list)
    sends: list[torch.Tensor] = field(default_factory=list)
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    incoming: dict[int, list[tuple[Key, tuple[int, ...]]]] = field(default_factory=dict)

    def collect(self) -> dict[Key, torch.Tensor]:
        """Wait for the messages; {(unit index, holder rank): piece} for everything this rank has."""
        for work in self.works:
            work.wait()
        out = dict(self.local)
        for peer, parts in self.incoming.items():
            sizes = [math.prod(s) for _, s in parts]
            for (key, shape), chunk in zip(parts, self.buffers[peer].split(sizes)):
                out[key] = chunk.reshape(shape)
        self.works, self.sends = [], []
        return out


def post(units: list, keys: Iterable[int], *, send: Callable, direction: str, me: int,
         device: torch.device) -> tuple[Posted, bool]:
    """Post the exchange of units `keys` (indices into `units`). to_owner: every holder's piece of
    each matrix to its owner; from_owner: the owner's slice for every holder. One message per peer
    (its pieces, in unit order, concatenated), all in one batch_isend_irecv. Returns the posted
    exchange and whether a batched call was issued (not when every piece is this rank's own)."""
    posted = Posted()
    outgoing: dict[int, list[torch.Tensor]] = {}
    for k in keys:
        u = units[k]
        for r in u.pieces:
            src, dst = (r, u.owner) if direction == "to_owner" else (u.owner, r)
            if src == me and dst == me:
                posted.local[(k, r)] = send(k, u, r)
            elif src == me:
                outgoing.setdefault(dst, []).append(send(k, u, r).reshape(-1))
            elif dst == me:
                posted.incoming.setdefault(src, []).append(((k, r), u.pieces[r][1]))
    if not outgoing and not posted.incoming:
        return posted, False
    ops = []
    for peer, parts in sorted(outgoing.items()):
        buf = torch.cat(parts).contiguous()
        posted.sends.append(buf)
        ops.append(dist.P2POp(dist.isend, buf, peer))
    for peer, parts in sorted(posted.incoming.items()):
        buf = torch.empty(sum(math.prod(s) for _, s in parts), dtype=torch.float32, device=device)
        posted.buffers[peer] = buf
        ops.append(dist.P2POp(dist.irecv, buf, peer))
    posted.works = list(dist.batch_isend_irecv(ops))
    return posted, True


@dataclass(eq=False)
class PendingGroup:
    """A forward group's update slices in flight, and the learning rate of the step that sent them."""

    index: int
    posted: Posted
    units: list[int]
    lr: float


@dataclass
class ForwardGroups:
    """Where Muon's update slices are applied in the next forward. `of_param`: id(parameter) ->
    group index (forward order); parameters missing from it are applied at the end of the step."""

    of_param: dict[int, int]
    count: int
    hooks: list = field(default_factory=list)           # removable handles

    def detach(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def _fsdp_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:                                  # torch without FSDP2: no unit to find
        return ()
    return FSDPModule


def _prefetched(module: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The modules FSDP2 all-gathers in `module`'s pre-forward besides its own (explicit forward
    prefetch), or None where that cannot be read (the hook then applies everything)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    states = getattr(get_state(), "_states_to_forward_prefetch", None)
    if states is None:
        return None
    return [m for s in states for m in getattr(s, "_modules", ())]


def forward_groups(stages: list[torch.nn.Module], params: list[torch.Tensor], blocks: Iterable[str],
                   apply_upto: Callable[[int], None],
                   finish: Callable[[], None]) -> ForwardGroups:
    """Group `params` by the module whose forward pre-hook must apply their updates (module
    docstring), in forward order over `stages`, and register the hooks: a module's pre-hook calls
    `apply_upto(last group it needs)`; the stages' state_dict / load_state_dict pre-hooks call
    `finish()`."""
    fsdp_type = _fsdp_module_type()
    blocks = set(blocks)
    wanted = {id(p) for p in params}
    order: list[torch.nn.Module] = []                    # hook modules, forward (pre-)order
    index: dict[int, int] = {}                           # id(module) -> group index
    of_param: dict[int, int] = {}
    for stage in stages:
        path: list[tuple[str, torch.nn.Module]] = []
        for name, module in stage.named_modules(remove_duplicate=True):
            depth = 0 if not name else name.count(".") + 1
            path = path[:depth] + [(name, module)]
            for p in module.parameters(recurse=False):
                if id(p) not in wanted or id(p) in of_param:
                    continue
                fsdp = [m for _, m in path if fsdp_type and isinstance(m, fsdp_type)]
                block = [m for n, m in path if n in blocks]
                hook = fsdp[-1] if fsdp else block[-1] if block else stage
                if id(hook) not in index:
                    index[id(hook)] = -1
                    order.append(hook)
                of_param[id(p)] = id(hook)
    # number the hook modules in forward order: their order in the stages' module traversal
    rank_of = {}
    for stage in stages:
        for module in stage.modules():
            rank_of.setdefault(id(module), len(rank_of))
    order.sort(key=lambda m: rank_of[id(m)])
    index = {id(m): i for i, m in enumerate(order)}
    of_param = {pid: index[mid] for pid, mid in of_param.items()}
    groups = ForwardGroups(of_param=of_param, count=len(order))
    for i, module in enumerate(order):
        extra = _prefetched(module)
        need = len(order) - 1 if extra is None else max([i] + [index[id(m)] for m in extra if id(m) in index])
        groups.hooks.append(module.register_forward_pre_hook(_pre_hook(apply_upto, need), prepend=True))
    for stage in stages:
        groups.hooks.append(stage.register_state_dict_pre_hook(lambda *_: finish()))
        groups.hooks.append(stage.register_load_state_dict_pre_hook(lambda *_: finish()))
    return groups


def _pre_hook(apply_upto: Callable[[int], None], need: int):
    @torch.compiler.disable
    def hook(module, args):
        apply_upto(need)
    return hook
