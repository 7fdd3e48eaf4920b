"""Running torch.export on a model without real memory, and what can go wrong.

- `default_inputs`: the example call (token ids of (batch, seq_len) on the model's own device
  or fake mode, `use_cache=False` for HF models), unless the caller passes one.
- `static_experts` / `train_mode`: context managers that switch transformers' MoE experts to a
  static-shape implementation and every module to training mode for the trace, and restore them.
- `export_model`: `torch.export.export(strict=False)`; any failure becomes a TraceError naming
  the module (original FQN), the op and the line of user code that failed
  (`exception_chain` walks an error's causes).
"""

from __future__ import annotations

import inspect
import io
import linecache
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, redirect_stderr

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from meshplan.errors import MeshplanError, TraceError
from meshplan.profiling.blocks import FqnMap

__all__ = ["default_inputs", "static_experts", "train_mode", "exception_chain", "export_model"]

# Implementations of transformers' experts whose shapes do not depend on the routing.
_STATIC_EXPERTS = ("grouped_mm", "batched_mm")
_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = os.path.dirname(os.__file__)


# --- inputs and model state ----------------------------------------------------------------

def _first_tensor(model: nn.Module) -> torch.Tensor | None:
    for t in model.parameters():
        return t
    for t in model.buffers():
        return t
    return None


def _fake_mode(model: nn.Module):
    t = _first_tensor(model)
    return t.fake_mode if isinstance(t, FakeTensor) else None


def default_inputs(model: nn.Module, *, seq_len: int, batch: int, vocab: int | None,
                    example_inputs: tuple | None, example_kwargs: dict | None) -> tuple[tuple, dict]:
    kwargs = dict(example_kwargs or {})
    try:
        accepted = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        accepted = {}
    if "use_cache" in accepted and "use_cache" not in kwargs:
        kwargs["use_cache"] = False       # HF: no KV cache while training
    if example_inputs is not None:
        return tuple(example_inputs), kwargs
    if vocab is None and not any(isinstance(m, nn.Embedding) for m in model.modules()):
        raise TraceError(
            f"{type(model).__name__} has no nn.Embedding to take token ids from; pass "
            f"example_inputs=(tensor, ...) (meta or fake tensors) to trace it")
    t = _first_tensor(model)
    device = t.device if t is not None else torch.device("meta")
    fake = _fake_mode(model)
    with fake if fake is not None else ExitStack():
        # token 0 is valid for any vocabulary; the values never matter on meta/fake tensors
        ids = torch.zeros((batch, seq_len), dtype=torch.long, device=device)  # (B, T)
    return (ids,), kwargs


@contextmanager
def static_experts(model: nn.Module, implementation: str | None = None) -> Iterator[None]:
    """Switch transformers' experts to a static-shape implementation, restore on exit: a dynamic
    one becomes grouped_mm (what the tracer prices), or every one becomes `implementation`
    (batched_mm also runs fp32 on fake tensors)."""
    configs = {}
    for m in [model, *model.modules()]:
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(type(cfg), "_experts_implementation"):
            configs[id(cfg)] = cfg
    saved = []
    try:
        for cfg in configs.values():
            current = cfg._experts_implementation
            if current not in _STATIC_EXPERTS or (implementation and current != implementation):
                saved.append((cfg, current))
                cfg._experts_implementation = implementation or "grouped_mm"
        yield
    finally:
        for cfg, current in reversed(saved):
            cfg._experts_implementation = current


@contextmanager
def train_mode(model: nn.Module) -> Iterator[None]:
    """Trace what training runs (dropout, routing noise); restore every module's mode."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.train()
        yield
    finally:
        for m, mode in modes:
            m.training = mode


# --- export and its errors -----------------------------------------------------------------

def exception_chain(e: BaseException) -> Iterator[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _translate(e: BaseException, model: nn.Module, fmap: FqnMap) -> TraceError:
    """A TraceError naming the module (original FQN) and the op or line that failed."""
    fqn_of = {id(m): name for name, m in model.named_modules()}
    module_fqn, module_cls, where = None, "", ""
    for exc in exception_chain(e):
        for frame, lineno in traceback.walk_tb(exc.__traceback__):
            obj = frame.f_locals.get("self")
            if isinstance(obj, nn.Module) and id(obj) in fqn_of:
                module_fqn, module_cls = fqn_of[id(obj)], type(obj).__name__
            fname = frame.f_code.co_filename
            # the last frame of user code (the model, transformers, ...) says where it failed
            if not fname.startswith((_TORCH_DIR, _STDLIB_DIR)) and "/meshplan/profiling/" not in fname:
                where = f"{os.path.basename(fname)}:{lineno} in {frame.f_code.co_name}"
                src = _source_line(fname, lineno)
                if src:
                    where += f": `{src}`"
    text = " ".join(str(x) for x in exception_chain(e))
    op = re.search(r"Caused by: \([^)]* in (\w+)\)", text)
    op_text = f" (op `{op.group(1)}`)" if op else ""
    place = f"{module_cls} at {fmap.original(module_fqn)!r}" if module_fqn is not None else "the model"
    if module_fqn == "":
        place = f"{module_cls} (the root module)"
    dd = any(type(x).__name__ in ("GuardOnDataDependentSymNode", "DataDependentOutputException",
                                  "PendingUnbackedSymbolNotFound", "DynamicOutputShapeException")
             for x in exception_chain(e)) or "data-dependent" in text or "data dependent" in text
    if dd:
        advice = ("data-dependent control flow: a Python branch, loop or shape depends on tensor "
                  "values, which a trace without real data cannot know. Use static-shape dispatch "
                  "such as meshplan.models.grouped_mm (sort tokens by expert, one grouped matmul), "
                  "or for transformers models experts_implementation='grouped_mm'")
    elif isinstance(e, NotImplementedError) or "meta" in text and "kernel" in text:
        advice = ("an op without a meta/fake implementation: register one with "
                  "torch.library.register_fake for custom ops")
    else:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        advice = f"{type(e).__name__}: {first[:300]}"
    return TraceError(f"cannot trace {place}{op_text} [{where}]: {advice}")


def _source_line(fname: str, lineno: int) -> str:
    return linecache.getline(fname, lineno).strip()[:120]


@contextmanager
def _quiet_failures() -> Iterator[None]:
    """On failure torch.export prints the partial graph to stderr and logs a symbolic-shapes
    warning; the TraceError says what matters, so keep that noise out of the user's console
    (what was printed is passed through when export succeeds)."""
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    buffer = io.StringIO()
    failed = False
    shapes_log.setLevel(logging.ERROR)
    try:
        with redirect_stderr(buffer):
            yield
    except BaseException:
        failed = True
        raise
    finally:
        shapes_log.setLevel(level)
        if not failed and buffer.getvalue():
            sys.stderr.write(buffer.getvalue())


def export_model(model: nn.Module, args: tuple, kwargs: dict, fmap: FqnMap):
    try:
        with _quiet_failures():
            return torch.export.export(model, args, kwargs, strict=False)
    except MeshplanError:
        raise
    except Exception as e:  # noqa: BLE001 - every export failure is translated, cause kept
        raise _translate(e, model, fmap) from e
