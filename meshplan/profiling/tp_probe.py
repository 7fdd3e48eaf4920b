"""Does the model's own forward run on tensor-parallel local tensors? Asked of the model itself,
on fake tensors, before the planner offers tp > 1.

The runtime shards each block's linears (column-parallel: a rank computes its slice of the
output features; row-parallel: it takes its slice of the input features) and makes the attention
module's head counts local (meshplan.ir.tp_locality). The user's forward then runs unchanged on
local tensors. Whether it can is a property of its code, not of the traced graph: nanoGPT's
attention splits its fused QKV output by `self.n_embd` and reshapes with `C // self.n_head`, C
read from the residual stream, so on a rank holding 3C/tp features it fails, while an attention
that splits by local head counts or reshapes with -1 runs. The trace records constants either
way, so the probe runs the model: a copy on fake tensors (FakeTensorMode: shapes without storage,
and transformers skips its data-dependent checks on them; no weights are copied), shortened to
one block of each kind (the tracer's `shrunk`) before it is copied, once as it is, then with every block's linears
given their local weight shapes under the runtime's labels (tp_roles.role_placements) and the
attention modules' head counts made local. If the first run works and the second raises, or a
block's output shape changes, tensor parallelism is refused for the model with the error it
raised, instead of every rank failing at its first step.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import nn

from meshplan.errors import MeshplanError
from meshplan.ir.profile import ModelProfile
from meshplan.ir.tp_locality import is_conv1d, localise_heads
from meshplan.profiling.tp_roles import role_placements

__all__ = ["tp_probe"]

_COLWISE = ("colwise", "colwise_qkv", "colwise_gate_up")
_PROBE_SEQ = 16            # tokens: enough for any attention; the values never matter on meta


def tp_probe(model, profile: ModelProfile, tp: int = 2) -> str:
    """'' when `model`'s forward runs with tp-local shapes in every kind of block (or when the
    probe cannot tell: the model does not run eagerly on the meta device); else why not."""
    if not isinstance(model, nn.Module) or not any(b.ops and b.instances for b in profile.blocks):
        return ""
    key = (type(model).__module__, type(model).__qualname__, profile.fingerprint, tp,
           tuple((b.signature, b.heads, b.kv_heads, b.head_dim) for b in profile.blocks))
    if key not in _VERDICTS:
        if len(_VERDICTS) > 256:
            _VERDICTS.clear()
        _VERDICTS[key] = _probe(model, profile, tp)
    return _VERDICTS[key]


# (model class, structure fingerprint, tp) -> verdict: the answer is a property of the model's code
# and block shapes, so plans of the same model (a what-if sweep, a re-plan) ask once
_VERDICTS: dict[tuple, str] = {}


def _probe(model: nn.Module, profile: ModelProfile, tp: int) -> str:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshplan.profiling.blocks import find_block_containers, shrunk
    from meshplan.profiling.trace_export import static_experts, train_mode
    labels = _labels(profile, tp)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        # shortened to one block of each kind BEFORE the fake copy: copying every layer of a
        # 126-layer model only to drop all but one of them cost most of the probe
        with shrunk(model, find_block_containers(model)) as fmap:
            probe = _fake_copy(model, mode)
        args, kwargs = _inputs(probe)
    except Exception:  # noqa: BLE001 - a model the probe cannot copy or feed: no verdict
        return ""
    with static_experts(probe, "batched_mm"), train_mode(probe), torch.no_grad(), mode:
        modules = {fmap.original(f): m for f, m in probe.named_modules()}
        blocks = [inst for b in profile.blocks for inst in b.instances if inst in modules]
        try:
            probe(*args, **kwargs)
        except Exception:  # noqa: BLE001 - it does not run on meta as it is: the probe cannot tell
            return ""
        try:
            for fqn, label in labels.items():
                if fqn in modules and not _localise(modules[fqn], fqn, label, tp, mode):
                    return ""          # a weight TP cannot split evenly: other checks name that
        except MeshplanError:
            return ""
        shapes: dict[str, tuple] = {}
        running = [""]
        hooks = [modules[b].register_forward_pre_hook(_enter(b, running)) for b in blocks]
        hooks += [modules[b].register_forward_hook(_leave(b, shapes)) for b in blocks]
        try:
            probe(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the user's code on local shapes: report what it raised
            where = f"block {running[0]}" if running[0] else "the model"
            return f"{where} fails on tensor-parallel local shapes ({type(e).__name__}: {_short(e)})"
        finally:
            for h in hooks:
                h.remove()
    for b, (before, after) in shapes.items():
        if before != after:
            return f"block {b} returns shape {after} for input {before} on tensor-parallel local shapes"
    return ""


def _labels(profile: ModelProfile, tp: int) -> dict[str, str]:
    """{module FQN: label} the runtime applies at tp (the planner's role pattern, every instance)."""
    out = {}
    for b in profile.blocks:
        rel = role_placements(b, tp=tp)
        for inst in b.instances:
            out.update({f"{inst}.{k}": v for k, v in rel.items()})
    return out


def _fake_copy(model: nn.Module, mode) -> nn.Module:
    """The model on fake tensors: parameters and buffers replaced (not copied) by fake ones."""
    memo: dict[int, torch.Tensor] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        with mode:
            fake = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
    return copy.deepcopy(model, memo)


def _inputs(model: nn.Module) -> tuple[tuple, dict]:
    from meshplan.profiling.trace_export import default_inputs
    return default_inputs(model, seq_len=_PROBE_SEQ, batch=1, vocab=None, example_inputs=None, example_kwargs=None)


def _shrink(module: nn.Module, name: str, dim: int, tp: int, mode) -> bool:
    t = getattr(module, name, None)
    if t is None:
        return True
    if t.shape[dim] % tp:
        return False
    shape = list(t.shape)
    shape[dim] //= tp
    with mode:
        fake = torch.empty(shape, dtype=t.dtype, device="cpu")
    module.register_parameter(name, nn.Parameter(fake, requires_grad=t.requires_grad))
    return True


def _localise(module: nn.Module, fqn: str, label: str, tp: int, mode) -> bool:
    """Give `module` the local shapes the runtime gives it; False where the probe cannot."""
    if label == "heads":
        localise_heads(module, fqn, tp)
        return True
    if label not in _COLWISE and label != "rowwise":
        return True
    conv = is_conv1d(module)
    if not (isinstance(module, nn.Linear) or conv):
        return False
    if label == "rowwise":                      # its input features: Linear dim 1, Conv1D dim 0
        ok = _shrink(module, "weight", 0 if conv else 1, tp, mode)
    else:
        ok = _shrink(module, "weight", 1 if conv else 0, tp, mode) and _shrink(module, "bias", 0, tp, mode)
    if ok and conv:
        # the runtime runs a Conv1D by its own forward, sized by the local weight
        # (runtime/packed_projections.py); Conv1D's forward reads `nf` / `nx`, so make them local
        module.nx, module.nf = module.weight.shape
    return ok


def _first_tensor(obj):
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        return next((t for t in map(_first_tensor, obj) if t is not None), None)
    return None


def _enter(name: str, running: list):
    def hook(module, args):
        running[0] = name
    return hook


def _leave(name: str, shapes: dict):
    def hook(module, args, out):
        a, o = _first_tensor(args), _first_tensor(out)
        if a is not None and o is not None:
            shapes.setdefault(name, (tuple(a.shape), tuple(o.shape)))
    return hook


def _short(e: BaseException, limit: int = 160) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return s if len(s) <= limit else s[:limit] + " ..."
