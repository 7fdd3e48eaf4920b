"""Deferred initialisation: a model built on the meta device is sharded first, then each rank
allocates and initialises only its own shards.

`parallelize` takes a meta model this way, so a model larger than one rank's memory can start.
The weights are the single-device model's, whatever the layout: every rank replays the model's
initialisation module by module in the single-device order (one random stream, the same draws),
on a full-size CPU copy of ONE module at a time, and keeps the slice its shards own. Peak host
memory is therefore this rank's shards plus the largest single module (an embedding, or one MoE
layer's experts), never the model.

A model initialises per module through, in order of preference:
- `init_module(name, module, generator)` + `init_buffers()` (meshplan's models);
- `_init_weights(module)` (transformers' PreTrainedModel; its rotary buffers are rebuilt);
- each module's own `reset_parameters()` (plain torch modules).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from meshplan.errors import ConfigError
from meshplan.runtime.packed_projections import to_tp_order, tp_order_params

__all__ = ["is_meta", "materialize_buffers", "materialize", "local_slice"]


def is_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in _tensors(model))


def _tensors(model: nn.Module) -> Iterable[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def materialize_buffers(stage: nn.Module, device: torch.device) -> None:
    """Allocate the stage's buffers (rotary tables, positions, routing biases) on `device` and fill
    them as the single-device model would: buffers are small and are read by steps that run before
    the parameters are materialised (context parallelism reorders the rotary tables)."""
    for mod in stage.modules():
        for name, buf in list(mod._buffers.items()):
            if buf is not None and buf.device.type == "meta":
                mod._buffers[name] = torch.zeros_like(buf, device=device)
    if hasattr(stage, "init_buffers"):
        stage.init_buffers()
        return
    # other models: take buffer values from a CPU build of each owning module's own init
    for fqn, mod in stage.named_modules():
        if not mod._buffers or not hasattr(mod, "config"):
            continue
        try:
            fresh = type(mod)(config=mod.config, device="cpu")
        except TypeError:
            try:
                fresh = type(mod)(config=mod.config)
            except Exception:   # noqa: BLE001 - not rebuildable this way: its buffers stay zero
                continue
        for name, buf in fresh._buffers.items():
            if buf is not None and name in mod._buffers and mod._buffers[name] is not None:
                mod._buffers[name].copy_(buf.to(device))


def _init_steps(reference: nn.Module):
    """(fqn, module, step) in the single-device initialisation order; `step(module_copy)` fills a
    full-size CPU copy of `module`'s subtree as the single-device init would at that point."""
    if hasattr(reference, "init_module"):
        for fqn, mod in reference.named_modules():
            if reference.init_module(fqn, mod, None, dry=True):
                yield fqn, mod, (lambda m, fqn=fqn: reference.init_module(fqn, m, None))
        return
    if hasattr(reference, "_init_weights"):
        for fqn, mod in reference.named_modules():
            if any(True for _ in mod.parameters(recurse=False)):
                yield fqn, mod, reference._init_weights
        return
    for fqn, mod in reference.named_modules():
        if hasattr(mod, "reset_parameters") and any(True for _ in mod.parameters(recurse=False)):
            yield fqn, mod, lambda m: m.reset_parameters()


def local_slice(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The part of the full tensor `full` that `target` (a DTensor shard or a plain tensor) holds."""
    from torch.distributed.tensor import DTensor
    if not isinstance(target, DTensor):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return full[index]


@torch.no_grad()
def materialize(stages: list[nn.Module], reference: nn.Module, device: torch.device, *,
                rng_state: torch.Tensor | None = None) -> None:
    """Allocate every stage's (sharded) parameters on `device` and fill each shard with the values
    the single-device model gets from its initialisation under the current torch seed.

    `reference`: the user's model, still on the meta device and unsharded (the FQNs of its
    parameters are the stages' FQNs). Every rank replays the whole initialisation, so the random
    stream advances as on one device whatever this rank owns. `rng_state`: the CPU generator
    state to replay from (the one the model's initialisation would have started from), for ranks
    that materialise several pipeline stages one call at a time."""
    from torch.distributed.tensor import DTensor
    if not any(is_meta(st) for st in stages):
        return
    if rng_state is not None:
        torch.set_rng_state(rng_state)
    for stage in stages:
        # Module.to_empty also re-allocates the buffers, which materialize_buffers filled already;
        # FSDP2 needs its own to_empty path (it re-points its sharded parameters), hence not by hand
        kept = [(mod, name, buf.clone()) for mod in stage.modules() for name, buf in mod._buffers.items()
                if buf is not None and buf.device.type != "meta"]
        stage.to_empty(device=device)
        for mod, name, value in kept:
            mod._buffers[name].copy_(value)
    targets: dict[str, list[torch.Tensor]] = {}
    for stage in stages:
        for fqn, p in stage.named_parameters(remove_duplicate=False):
            targets.setdefault(_clean(fqn), []).append(p)
    # packed projections (and transformers' experts under ETP) hold their rows in TP order
    # (runtime/packed_projections.py): the user's full tensor is permuted before it is sliced
    orders = {_clean(n): spec for stage in stages for n, spec in tp_order_params(stage).items()}
    # tied parameters (an output layer sharing the embedding) are one tensor on one device: a
    # step writing either name writes both, the later step winning, as on one device, even when
    # pipeline stages hold the two names on different ranks
    by_id: dict[int, list[str]] = {}
    for n, p in reference.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    aliases = {n: names for names in by_id.values() for n in names}
    filled: set[str] = set()
    for fqn, mod, step in _init_steps(reference):
        # every step runs on every rank, owned or not: the random stream must advance as on one device
        tmp = copy.deepcopy(mod).to_empty(device="cpu")
        step(tmp)
        for n, p in tmp.named_parameters(remove_duplicate=False):
            full_fqn = f"{fqn}.{n}" if fqn else n
            for name in aliases.get(full_fqn, [full_fqn]):
                full = to_tp_order(p, *orders[name]) if name in orders else p
                for dst in targets.get(name, ()):
                    local = dst.to_local() if isinstance(dst, DTensor) else dst
                    local.copy_(local_slice(full, dst).to(local.dtype))
                    filled.add(name)
        del tmp
    missing = sorted(n for n in targets if n not in filled)
    if missing:
        raise ConfigError(f"deferred initialisation left {len(missing)} parameter(s) without values "
                          f"({missing[:3]}): the model's initialisation does not reach them; build the "
                          "model on the CPU instead of the meta device")


def _clean(fqn: str) -> str:
    # wrappers (activation checkpointing, torch.compile) insert these into names
    for token in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        fqn = fqn.replace(token, "")
    return fqn
