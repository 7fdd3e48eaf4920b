"""Muon for the hidden matrices, AdamW for the rest, in one optimizer; layer-wise distributed.

The update (per matrix W of shape m x n, gradient G, momentum mu, learning rate lr, decay wd):

    B <- mu * B + G                       momentum buffer (Nesterov: the update uses G + mu * B)
    O <- NS5(G + mu * B)                  the nearest semi-orthogonal matrix, by Newton-Schulz
    W <- W * (1 - lr * wd) - lr * 0.2 * sqrt(max(m, n)) * O

NS5 is the quintic Newton-Schulz iteration with coefficients (3.4445, -4.7750, 2.0315), 5 steps,
on X = M / (||M||_F + 1e-7) (transposed so that X is wide: the Gram matrix X X^T is the small one).
It runs in fp32 on CPU (no fast bf16 matrix multiply there, and fp32 keeps sharded and
single-device results equal to rounding) and in bf16 on GPUs, where tensor cores make it several
times faster and the iteration is known to stay stable (it only needs singular values pushed
into roughly [0.7, 1.2]); `ns_dtype` overrides either.

Scale: 0.2 * sqrt(max(m, n)) makes the update's RMS about 0.2, that of a typical AdamW update
(Moonlight, "Muon is Scalable for LLM Training", 2025), so the learning rate, its schedule and
the decoupled weight decay are the AdamW ones: switching optimizers needs no new hyper-parameters.

Which parameters get Muon (`is_muon_param`, overridable with `muon_params=`): tensors of 2 or
more dimensions except the token embedding, the output head and MoE routers (matrices, but a
lookup table, a classifier and a gate rather than hidden linear maps: Muon's authors and
Moonlight keep them on AdamW). A 3-D tensor (stacked experts, [E, out, in]) is E matrices, each
orthogonalised on its own. A matrix without a gradient is stepped with a zero one (its shard
group's exchange must be the same on every member). Everything else - embeddings, head, norms, biases,
routers, expert biases - is stepped by AdamW (torch's formula, fp32) in the same optimizer, as
separate param groups (`group["muon"]`).

Layer-wise distribution. A sharded parameter (a DTensor: FSDP2 Shard(0), TP Shard(0|1), EP
Shard(0), or any product of those) is split among the ranks holding its distinct shards (its
"shard group": the mesh axes that shard it; replicated axes repeat the work per replica). Each
whole matrix (each expert's matrix for a 3-D tensor) is assigned one owner in its shard group,
greedily by size so the owners' Newton-Schulz work is balanced (a member holding all of it, as an
EP rank holds its experts, is preferred: no traffic). Per step:

1. every rank updates the momentum of its own shards and forms its shard of G + mu * B
   (elementwise: no communication, and the momentum stays sharded like the parameter, so
   checkpoints reshard it as they reshard the weights);
2. one batched point-to-point exchange (`batch_isend_irecv`, every peer's message posted at once,
   one message per peer holding all its pieces) brings each matrix's shards to its owner;
3. owners orthogonalise their whole matrices;
4. the update slices go back to the shards, and each rank applies weight decay and the update:
   with `overlap_update` (the default) and the optimizer attached to the model (`attach`, which
   the training loop calls), this exchange is posted at the end of `step()` and not waited for:
   one batched call per forward group (the FSDP unit, else the block, whose forward first reads
   the weights), each waited for and applied by a forward pre-hook of that module, which runs
   before FSDP2's own pre-forward all-gather (train/muon_overlap.py). The exchange then travels
   while the earlier layers compute, as Megatron-LM overlaps its distributed optimizer's
   parameter all-gather with the next forward. Weight decay is applied in `step()`; until the
   pending slices arrive the shards are decayed but not yet updated, so whatever reads the weights
   between steps calls `finish_pending()` first (checkpoint save and load, the parameter-norm
   metric, the end of training; the stage modules' state_dict and load_state_dict pre-hooks do it
   too, and `step()` does it for slices a forward did not consume). `overlap_update=False`, or an
   optimizer never attached, waits at the end of the step, in one batched call.

So a step issues two collective calls (overlap off) or one plus one per forward group with
traffic (overlap on), whatever the number of matrices. Pieces travel in fp32, the master
weights' dtype (bf16 would halve the traffic but lose agreement with single-device Muon to
rounding). What does not overlap: the step waits for the gradient exchange before any
Newton-Schulz (a matrix is not started as soon as its own pieces arrive), and the first forward
group's slices are waited for before the first layer computes. Unsharded parameters (one rank,
DDP replicas, TP-replicated weights) are orthogonalised where they are, with no communication.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshplan.errors import ConfigError
from meshplan.train.muon_overlap import ForwardGroups, PendingGroup, forward_groups, post
from meshplan.train.optim import closure_loss, local_shard

__all__ = ["Muon", "is_muon_param", "newton_schulz", "finish_pending", "update_pending", "NS_COEFFS", "NS_STEPS", "RMS_SCALE"]

NS_COEFFS = (3.4445, -4.7750, 2.0315)      # quintic Newton-Schulz (K. Jordan, 2024)
NS_STEPS = 5
NS_EPS = 1e-7
RMS_SCALE = 0.2                             # the update's RMS, as AdamW's (Moonlight)

# names of parameters that are matrices but are not hidden linear maps: AdamW steps them. The
# output head is a top-level "output" (meshplan's models) or "lm_head" (transformers): a block's
# "attention.output.dense" stays a hidden matrix. "gate.weight" is transformers' MoE router
# (Mixtral, Qwen-MoE); "gate_proj" is an MLP matrix.
_NOT_MUON = re.compile(r"(^|\.)(tok_embeddings|embed_tokens|embeddings?|wte|wpe|lm_head|router)(\.|$)"
                       r"|^(_orig_mod\.)?output\.|(^|\.)gate\.weight$")


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """The default rule: Muon for >= 2-D tensors except embeddings, output head and routers."""
    return p.dim() >= 2 and not _NOT_MUON.search(name)


def newton_schulz(m: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The semi-orthogonal matrix nearest to `m` (2-D), approximately: quintic Newton-Schulz."""
    a, b, c = NS_COEFFS
    x = m.to(dtype)
    wide = x.shape[0] <= x.shape[1]
    if not wide:
        x = x.mT                                        # iterate on the smaller Gram matrix
    x = x / (x.norm() + NS_EPS)                         # singular values into (0, 1]
    for _ in range(steps):
        gram = x @ x.mT                                 # [k, k], k = min(m, n)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x if wide else x.mT).to(torch.float32)


# ---- where each shard lives ----------------------------------------------------------------

Box = tuple[tuple[int, ...], tuple[int, ...]]          # (offset, shape) in the global tensor


@dataclass(eq=False)
class _Unit:
    """One matrix: a 2-D parameter, or expert `index` of a 3-D one."""

    param: torch.Tensor
    index: int | None
    box: Box                                           # where it lies in the parameter
    owner: int                                         # global rank
    pieces: dict[int, Box] = field(default_factory=dict)   # global rank -> its part of the matrix

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.box[1][-2:])


def _intersect(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1]))
    if any(h <= lo_ for lo_, h in zip(lo, hi)):
        return None
    return lo, tuple(h - lo_ for lo_, h in zip(lo, hi))


def _slices(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - base, o - base + n) for o, n, base in zip(box[0], box[1], origin))


def _shard_boxes(p: torch.Tensor) -> dict[int, Box]:
    """{global rank: the box it holds} over `p`'s shard group (only this rank for plain tensors)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard
    me = dist.get_rank() if dist.is_initialized() else 0
    if not isinstance(p, DTensor):
        return {me: ((0,) * p.dim(), tuple(p.shape))}
    mesh, placements = p.device_mesh, p.placements
    coord = mesh.get_coordinate()
    # FSDP2 over TP shards with _StridedShard, which is_shard() does not count
    sharded = [d for d, pl in enumerate(placements) if pl.is_shard() or isinstance(pl, _StridedShard)]
    ranks = mesh.mesh
    index = tuple(slice(None) if d in sharded else coord[d] for d in range(mesh.ndim))
    members = ranks[index]                              # the sharded axes, in mesh order
    out: dict[int, Box] = {}
    for pos, rank in zip(_positions(members.shape), members.flatten().tolist()):
        c = list(coord)
        for d, i in zip(sharded, pos):
            c[d] = i
        shape, offset = _compute_local_shape_and_global_offset(tuple(p.shape), tuple(mesh.shape), c, placements)
        out[int(rank)] = (tuple(offset), tuple(shape))
    return out


def _positions(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [pos + (i,) for pos in out for i in range(n)]
    return out


def _plan_units(params: list[torch.Tensor]) -> list[_Unit]:
    """Every matrix of `params`, with its owner: per shard group, the largest matrices first,
    each to the least loaded member holding all of it (no traffic: an expert under EP), else to
    the least loaded member (every member computes the same answer: same parameters, same order)."""
    units: list[_Unit] = []
    by_group: dict[tuple[int, ...], list[_Unit]] = {}
    for p in params:
        boxes = _shard_boxes(p)
        shape = tuple(p.shape)
        wholes = ([((0, 0), shape)] if p.dim() == 2 else
                  [((e,) + (0,) * (p.dim() - 1), (1,) + shape[1:]) for e in range(shape[0])])
        key = tuple(sorted(boxes))
        for i, whole in enumerate(wholes):
            pieces = {r: cut for r, b in boxes.items() if (cut := _intersect(whole, b)) is not None}
            u = _Unit(param=p, index=None if p.dim() == 2 else i, box=whole, owner=-1, pieces=pieces)
            units.append(u)
            by_group.setdefault(key, []).append(u)
    for key, members in by_group.items():
        load = {r: 0 for r in key}
        for u in sorted(members, key=lambda u: -math.prod(u.box[1])):     # stable: ties keep order
            whole = [r for r, cut in u.pieces.items() if cut == u.box]
            u.owner = min(whole or key, key=lambda r: (load[r], r))
            load[u.owner] += math.prod(u.box[1])
    return units


# ---- the optimizer --------------------------------------------------------------------------

class Muon(torch.optim.Optimizer):
    """Muon for matrices + AdamW for the other parameters (module docstring).

    `named_params`: (name, parameter) pairs, e.g. `model.named_parameters()`; `muon_params`
    decides which get Muon (default `is_muon_param`). Hyper-parameters: `lr` and `weight_decay`
    are shared (the RMS-matched scale makes one learning rate fit both), `momentum`/`nesterov`/
    `ns_steps` are Muon's, `betas`/`eps` AdamW's. State keys: `momentum_buffer` (Muon), `step`,
    `exp_avg`, `exp_avg_sq` (AdamW, torch's), each shaped and sharded like its parameter.
    `overlap_update`: leave the update exchange in flight into the next forward once `attach`ed
    to the model (module docstring, step 4); False waits in `step()`.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.Tensor]], *, lr: float = 1e-3,
                 weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = NS_STEPS, ns_dtype: torch.dtype | None = None,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 muon_params: Callable[[str, torch.Tensor], bool] = is_muon_param, overlap_update: bool = True):
        named = list(named_params)
        if not named or not all(isinstance(x, tuple) and len(x) == 2 for x in named):
            raise ConfigError("Muon needs (name, parameter) pairs, e.g. Muon(model.named_parameters()): "
                              "the names decide which matrices are embeddings, output head or routers")
        if not lr > 0:
            raise ConfigError(f"lr must be > 0, got {lr!r}")
        if not 0 <= momentum < 1:
            raise ConfigError(f"Muon momentum must be in [0, 1), got {momentum!r}; 0.95 is usual")
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
            raise ConfigError(f"ns_steps must be a whole number >= 1, got {ns_steps!r}; 5 is usual")
        seen: set[int] = set()
        matrices, others = [], []
        for name, p in named:
            if id(p) in seen:                           # tied weights: one parameter
                continue
            seen.add(id(p))
            (matrices if muon_params(name, p) else others).append(p)
        groups = []
        if matrices:
            groups.append(dict(params=matrices, muon=True, momentum=momentum, nesterov=nesterov))
        if others:
            groups.append(dict(params=others, muon=False, betas=betas, eps=eps))
        super().__init__(groups, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      betas=betas, eps=eps, muon=False))
        self.ns_steps = ns_steps
        self.ns_dtype = ns_dtype
        self._units: list[_Unit] | None = None
        self._origins: dict[int, tuple[int, ...]] = {}  # id(param) -> global offset of this rank's shard
        self.collective_calls = 0                       # batched exchanges issued (tests count them)
        self.overlap_update = bool(overlap_update)
        self._forward: ForwardGroups | None = None
        self._pending: list[PendingGroup] = []          # forward order

    # -- the update exchange left in flight into the next forward (train/muon_overlap.py) --
    def attach(self, stages: Iterable[torch.nn.Module], blocks: Iterable[str] = ()) -> None:
        """Hook this rank's stage modules (`ParallelModel.stages`; `blocks`: the plan's block FQNs)
        so that each forward group's pending update is applied just before the module reading it
        runs. Without it, or with `overlap_update=False`, `step()` applies the whole update itself."""
        stages = list(stages)
        if not stages or not all(isinstance(m, torch.nn.Module) for m in stages):
            raise ConfigError("Muon.attach needs the model's stage modules (ParallelModel.stages), "
                              f"got {stages!r}")
        self.finish_pending()
        if self._forward is not None:
            self._forward.detach()
        matrices = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        self._forward = forward_groups(stages, matrices, blocks, self._apply_upto, self.finish_pending)

    @property
    def pending(self) -> bool:
        """Whether some shards still wait for their slice of the last step's update."""
        return bool(self._pending)

    @torch.no_grad()
    def finish_pending(self) -> None:
        """Wait for the update slices still in flight and apply them (a no-op when none are)."""
        self._apply_upto(None)

    @torch.no_grad()
    def _apply_upto(self, last: int | None) -> None:
        """Apply the pending forward groups up to index `last` (None: all), in posting order."""
        if not self._pending:
            return
        me = dist.get_rank() if dist.is_initialized() else 0
        while self._pending and (last is None or self._pending[0].index <= last):
            group = self._pending.pop(0)
            with torch.profiler.record_function("muon.update_exchange.wait"):
                self._apply(group.units, group.posted.collect(), group.lr, me)

    def _apply(self, keys: Iterable[int], back: dict, lr: float, me: int) -> None:
        """Add -lr x the received update slices of units `keys` to this rank's shards."""
        for k in keys:
            u = self._units[k]
            if me in u.pieces:
                w = local_shard(u.param)
                w[_slices(u.pieces[me], self._origins[id(u.param)])].add_(back[(k, me)].to(w.dtype), alpha=-lr)

    def initial_state(self, p: torch.Tensor) -> dict:
        """Zero state for `p` (what a checkpoint loads into before the first step)."""
        if self._is_muon(p):
            return {"momentum_buffer": torch.zeros_like(p)}
        return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def _is_muon(self, p: torch.Tensor) -> bool:
        return any(g["muon"] and any(q is p for q in g["params"]) for g in self.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        self.finish_pending()           # slices no forward consumed since the last step
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    # -- AdamW on the non-matrix parameters: elementwise, on the local shards --
    def _adamw_step(self, group: dict) -> None:
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if not st:
                st.update(self.initial_state(p))
            st["step"] += 1
            t = float(st["step"])
            w, g, m, v = (local_shard(x) for x in (p, self._like_param(p.grad, p), st["exp_avg"], st["exp_avg_sq"]))
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            if wd:
                w.mul_(1 - lr * wd)
            denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
            w.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))

    # -- Muon on the matrices --
    def _muon_step(self, group: dict) -> None:
        params = group["params"]
        me = dist.get_rank() if dist.is_initialized() else 0
        if self._units is None:
            self._units = _plan_units(params)
            self._origins = {id(u.param): _shard_boxes(u.param)[me][0] for u in self._units}
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        # 1. momentum on the local shards; the shard of the matrix to orthogonalise
        inputs: dict[int, torch.Tensor] = {}
        for p in params:
            g = p.grad
            if g is None:
                g = torch.zeros_like(p)      # a sharded matrix's peers exchange it all the same
            g = self._like_param(g, p)
            st = self.state[p]
            if not st:
                st.update(self.initial_state(p))
            buf, g = local_shard(st["momentum_buffer"]), local_shard(g).float()
            buf.mul_(mu).add_(g)
            inputs[id(p)] = g.add(buf, alpha=mu) if group["nesterov"] else buf.clone()
        # 2. shards to their owners
        owned = self._exchange(
            send=lambda k, u, r: inputs[id(u.param)][_slices(u.pieces[r], self._origins[id(u.param)])],
            direction="to_owner", me=me, keys=range(len(self._units))).collect()
        # 3. owners orthogonalise their matrices
        updates: dict[int, torch.Tensor] = {}
        dtype = self.ns_dtype or (torch.bfloat16 if params[0].device.type == "cuda" else torch.float32)
        for k, u in enumerate(self._units):
            if u.owner != me:
                continue
            whole = torch.zeros(u.box[1], dtype=torch.float32, device=params[0].device)
            for r, box in u.pieces.items():
                whole[_slices(box, u.box[0])] = owned[(k, r)]
            m, n = u.shape
            o = newton_schulz(whole.reshape(m, n), self.ns_steps, dtype)
            updates[k] = o.mul_(RMS_SCALE * math.sqrt(max(m, n))).reshape(u.box[1])
        del inputs, owned           # the step holds at most three fp32 copies of the shards at once
        # 4. update slices back to the shards; decay now, the update now or in the next forward
        for p in params:
            if wd:
                local_shard(p).mul_(1 - lr * wd)

        def send(k, u, r):
            return updates[k][_slices(u.pieces[r], u.box[0])]

        if self._forward is None or not self.overlap_update:
            self._apply(range(len(self._units)), self._exchange(
                send=send, direction="from_owner", me=me, keys=range(len(self._units))).collect(), lr, me)
            return
        by_group: dict[int, list[int]] = {}
        for k, u in enumerate(self._units):
            by_group.setdefault(self._forward.of_param.get(id(u.param), -1), []).append(k)
        for g in sorted(by_group):                      # forward order; -1: not under a hooked module
            with torch.profiler.record_function("muon.update_exchange.issue"):
                posted = self._exchange(send=send, direction="from_owner", me=me, keys=by_group[g])
            if g < 0 or not posted.works:               # nothing to wait for: apply now
                self._apply(by_group[g], posted.collect(), lr, me)
            else:
                self._pending.append(PendingGroup(index=g, posted=posted, units=by_group[g], lr=lr))

    def _like_param(self, g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """The gradient with the parameter's placements (a DTensor gradient could differ)."""
        placements = getattr(p, "placements", None)
        if placements is not None and getattr(g, "placements", placements) != placements:
            return g.redistribute(p.device_mesh, placements)
        return g

    def _exchange(self, *, send, direction: str, me: int, keys: Iterable[int]):
        """Post the exchange of units `keys` (muon_overlap.post: one message per peer, one batched
        call); `.collect()` on the result waits and returns {(unit, holder rank): piece}."""
        posted, issued = post(self._units, keys, send=send, direction=direction, me=me,
                              device=self._units[0].param.device)
        self.collective_calls += issued
        return posted


def update_pending(optimizer: torch.optim.Optimizer) -> bool:
    """Whether an optimizer's last update is still in flight (Muon with `overlap_update`): it lands
    during the next forward, so nothing should read the weights before then without finish_pending."""
    return bool(getattr(optimizer, "pending", False))


def finish_pending(optimizer: torch.optim.Optimizer) -> None:
    """Apply an optimizer's update still in flight (Muon with `overlap_update`); others have none."""
    finish = getattr(optimizer, "finish_pending", None)
    if finish is not None:
        finish()
