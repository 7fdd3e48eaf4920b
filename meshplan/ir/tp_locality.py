"""What tensor parallelism changes inside a user's module, in one place for the runtime (which
does it) and the planner (which first checks, on the meta device, that the model's own forward
still runs with it: profiling/tp_probe.py).

Under TP a rank's column-parallel linear returns its slice of the output features and a
row-parallel one takes its slice of the input features. The user's forward runs unchanged on
those local tensors, so whatever it reads to reshape them must be local too: head counts kept as
attributes (of the attention module or of its transformers `config`) and integer split widths
(`split_size`, GPT-2) are divided by tp ("heads" label). A forward that takes sizes from
elsewhere (the residual stream's width `x.size(-1)`, a `n_embd` attribute) cannot run on local
tensors; the planner's probe finds that before a plan is returned.

Structure only: no class names are read. transformers' GPT-2 `Conv1D` stores its weight
transposed, (in, out) (`is_conv1d`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from meshplan.errors import LayoutError

__all__ = ["HEAD_COUNT_ATTRS", "Q_HEAD_ATTRS", "KV_HEAD_ATTRS", "WIDTH_ATTRS", "is_conv1d", "out_dim",
           "head_count", "localise_heads"]

# attribute names user attention modules keep head counts in (their own, or their `config`'s)
HEAD_COUNT_ATTRS = ("n_heads", "n_kv_heads", "num_heads", "num_kv_heads", "num_key_value_heads",
                    "n_head", "n_local_heads", "n_local_kv_heads", "num_attention_heads", "heads", "kv_heads")
Q_HEAD_ATTRS = ("num_heads", "n_heads", "num_attention_heads", "n_head", "heads")
KV_HEAD_ATTRS = ("num_kv_heads", "n_kv_heads", "num_key_value_heads", "kv_heads")
# integer widths (heads x head_dim) attention modules split their packed output by
WIDTH_ATTRS = ("split_size",)


def is_conv1d(module: nn.Module) -> bool:
    """A linear whose weight is stored (in, out) and whose forward is x @ W + b (GPT-2's
    Conv1D): told by its structure, not its class name."""
    w = getattr(module, "weight", None)
    nf, nx = module.__dict__.get("nf"), module.__dict__.get("nx")
    return (not isinstance(module, nn.Linear) and isinstance(w, torch.Tensor) and w.dim() == 2
            and isinstance(nf, int) and isinstance(nx, int) and tuple(w.shape) == (nx, nf))


def out_dim(module: nn.Module) -> int:
    """The weight dim that holds the output features."""
    return 1 if is_conv1d(module) else 0


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def head_count(module: nn.Module, names: tuple[str, ...]) -> int:
    """The first positive integer among `names`, on the module or its `config`; 0 if none."""
    config = module.__dict__.get("config")
    for holder in (module.__dict__, getattr(config, "__dict__", {})):
        for n in names:
            if _positive_int(holder.get(n)):
                return holder[n]
    return 0


def _local_counts(holder, where: str, tp: int, names: tuple[str, ...], what: str) -> dict[str, int]:
    out = {}
    for attr in names:
        v = holder.__dict__.get(attr)
        if _positive_int(v):
            if v % tp:
                raise LayoutError(f"{where}.{attr} = {v} {what} cannot be split over tp={tp}; use a tp that "
                                  f"divides {v}")
            out[attr] = v // tp
    return out


def localise_heads(module: nn.Module, fqn: str, tp: int) -> None:
    """Head counts and split widths of an attention module (label "heads") divided by tp. Its
    `config` is replaced by a copy with local counts: the model and the other layers keep the
    global one (transformers' Phi-3 slices its fused QKV output by `config.num_attention_heads`)."""
    for attr, v in _local_counts(module, fqn, tp, HEAD_COUNT_ATTRS, "heads").items():
        setattr(module, attr, v)
    config = module.__dict__.get("config")
    if config is not None and not isinstance(config, (int, str, nn.Module)):
        counts = _local_counts(config, f"{fqn}.config", tp, HEAD_COUNT_ATTRS, "heads")
        if counts:
            local = copy.copy(config)
            for attr, v in counts.items():
                setattr(local, attr, v)
            module.config = local
    for attr, v in _local_counts(module, fqn, tp, WIDTH_ATTRS, "features").items():
        setattr(module, attr, v)
