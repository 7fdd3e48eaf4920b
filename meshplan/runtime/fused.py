"""Swap the Plan's fused kernels into the model: the runtime half of meshplan.profiling.fusions.

Each `Plan.fused_kernels` record (`FusedKernel`) names a kernel and a module FQN. The module's `forward` is replaced on the instance (its parameters, FQNs and
children stay as they are, so TP styles, FSDP and checkpoints see the same module tree):

- rms_norm: `forward(x) = kernels.rms_norm(x, self.<weight>, eps)`, eps and the weight's name
  taken from the trace;
- swiglu: `forward(x) = down(kernels.swiglu(gate(x), up(x)))` over the module's own children;
- linear_cross_entropy: the output layer returns its input (the hidden state) and the loss is
  `kernels.fused_linear_cross_entropy(hidden, head.weight, labels)`, so the (tokens x vocab)
  logits never exist at once (ParallelModel applies it; `FusedHead`).

Where a kernel is not swapped in (its backend is slower here, or fused kernels are off), the
plan's rms_norm and swiglu modules, and every `nn.RMSNorm`, still run its reference math as an
autograd Function keeping only what the kernel keeps for backward (`apply_lean_elementwise`,
meshplan.kernels.lean): the activation memory the cost model charges, on every device.

Before a module is swapped, both forwards run on a small random input and must agree (tolerance
by dtype): a module the plan names that computes something else stops the run with an error that
names it, instead of training on a wrong number.

Under tensor/sequence parallelism the kernels run on local shards: the norm is row-wise and
silu*mul element-wise, so a Shard or Replicate DTensor is computed on its local tensor and
wrapped back with the same placements. A replicated norm weight used on sequence shards gets a
Partial gradient (each rank saw part of the sequence), which ParallelModel reduces like the
gradients DTensor's own ops produce.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from meshplan.errors import ConfigError
from meshplan.ir.plan import FusedKernel
from meshplan.kernels import backend, fused_linear_cross_entropy, lean, rms_norm, swiglu
from meshplan.models.moe import kernel_route
from meshplan.runtime.pipeline import _PassThrough, _ZeroEmbedding

__all__ = ["apply_fused_kernels", "apply_lean_elementwise", "apply_router_kernel", "FusedHead", "Swapped", "choose_kernels", "FASTER_THAN_EAGER"]

# Which kernels beat the eager modules they replace, by (device type, kernel backend): the
# runtime swaps a kernel in for training only where it is faster.
# cuda/triton: benchmarks/results/kernels-2026-11-24-nvidia-h100-80gb-hbm3.md, bf16, fwd+bwd:
#   rms_norm 0.61 vs 1.90 ms, swiglu 0.66 vs 4.36 ms, rope 0.54 vs 2.24 ms, linear+CE 43 vs 52 ms
#   (llama3-8b shapes; the same order at llama3-70b shapes).
# Everything else (CPU with the plain-PyTorch reference, the Triton interpreter) is slower than
# the modules it replaces: on CPU the reference fallbacks made a tiny-llama step 0.129 s against
# 0.123 s eager; they exist to test the swap's correctness, not to train.
FASTER_THAN_EAGER: dict[tuple[str, str], frozenset[str]] = {
    ("cuda", "triton"): frozenset({"rms_norm", "swiglu", "rope", "linear_cross_entropy"}),
}

# forward outputs of the eager and the fused module must agree this closely on a random input
_TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-6, 1e-8)}
_LOW_PRECISION_TOLERANCE = (2e-2, 2e-2)     # bf16 / fp16: a few units in the last place
_SAMPLE_TOKENS = 6

# the element-wise kernels whose reference math runs as an input-saving autograd Function where
# the kernel itself does not run (apply_lean_elementwise)
_LEAN = {"rms_norm": lean.rms_norm, "swiglu": lean.swiglu}


@dataclass
class FusedHead:
    """The output layer whose matmul moved into the loss (linear_cross_entropy)."""

    fqn: str
    module: nn.Module
    compute_dtype: torch.dtype | None = None    # autocast's dtype (the loss runs outside the forward's autocast)

    def loss(self, hidden: torch.Tensor, target: torch.Tensor, *, ignore_index: int) -> torch.Tensor:
        """Summed cross entropy of hidden @ weight.T against target (the default loss's contract)."""
        w = self.module.weight
        if _is_dtensor(w):
            raise ConfigError(f"{self.fqn}.weight is still sharded when the loss runs; plan with "
                              "fused_kernels=False for this layout")
        dtype = self.compute_dtype or w.dtype     # fp32 master weights under autocast: run the matmul in bf16
        return fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]).to(dtype), w.to(dtype),
                                          target.reshape(-1), ignore_index=ignore_index, reduction="sum")


@dataclass
class Swapped:
    """What apply_fused_kernels changed in one stage."""

    modules: list[str]                # FQNs whose forward now runs a fused kernel
    head: FusedHead | None = None     # set when this stage's output layer moved into the loss


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _on_local(fn, *tensors):
    """Run an element-wise / row-wise kernel on DTensor inputs' local shards, same placements out."""
    from torch.distributed.tensor import DTensor
    ref = next((t for t in tensors if isinstance(t, DTensor)), None)
    if ref is None:
        return fn(*tensors)
    if any(p.is_partial() for t in tensors if isinstance(t, DTensor) for p in t.placements):
        raise ConfigError("a fused kernel got a partial-sum (unreduced) tensor; plan with "
                          "fused_kernels=False for this layout")
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return DTensor.from_local(fn(*local), ref.device_mesh, ref.placements, run_check=False)


def _rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    eps, w = self._meshplan_eps, getattr(self, self._meshplan_weight)
    if eps is None:     # nn.RMSNorm(eps=None): the machine epsilon of the dtype it computes in
        eps = torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
    if _is_dtensor(w):
        from torch.distributed.tensor import Partial
        # rows on other ranks contribute to this weight's gradient: declare it partial
        sharded = _is_dtensor(x) and any(p.is_shard() for p in x.placements)
        w = w.to_local(grad_placements=[Partial()] * len(w.placements)) if sharded else w.to_local()
    norm = self.__dict__.get("_meshplan_norm_fn", rms_norm)
    return _on_local(lambda xl: norm(xl, w, eps), x)


def _swiglu_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up, down = self._meshplan_swiglu
    g, u = getattr(self, gate)(x), getattr(self, up)(x)
    return getattr(self, down)(_on_local(self.__dict__.get("_meshplan_swiglu_fn", swiglu), g, u))


def _identity_forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return hidden


def _sample(module: nn.Module, width: int) -> torch.Tensor:
    p = next(module.parameters())
    g = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn(2, _SAMPLE_TOKENS // 2, width, generator=g).to(device=p.device, dtype=p.dtype)


def _check_same(fqn: str, kernel: str, eager: torch.Tensor, fused: torch.Tensor) -> None:
    rtol, atol = _TOLERANCE.get(eager.dtype, _LOW_PRECISION_TOLERANCE)
    if eager.shape != fused.shape or not torch.allclose(eager.float(), fused.float(), rtol=rtol, atol=atol):
        diff = (eager.float() - fused.float()).abs().max().item() if eager.shape == fused.shape else float("nan")
        raise ConfigError(
            f"the plan swaps {fqn} for the fused {kernel} kernel, but that module computes something "
            f"else (max difference {diff:.3g} on a random input, shapes {tuple(eager.shape)} vs "
            f"{tuple(fused.shape)}); has the model changed since planning? Re-run meshplan plan, or "
            "plan with fused_kernels=False")


def _swap(fqn: str, module: nn.Module, new_forward, width: int, kernel: str) -> None:
    x = _sample(module, width)
    if x.is_meta:
        # a model not yet materialised (deferred initialisation) cannot be checked numerically:
        # the match was made on the traced graph, and the kernels' own tests cover their numerics
        module.forward = types.MethodType(new_forward, module)
        return
    with torch.no_grad():
        eager = module(x)
        module.forward = types.MethodType(new_forward, module)
        try:
            if not isinstance(eager, torch.Tensor):
                raise ConfigError(f"the plan swaps {fqn} for the fused {kernel} kernel, but its forward "
                                  f"returns {type(eager).__name__}, not a tensor; re-run meshplan plan")
            _check_same(fqn, kernel, eager, module(x))
        except BaseException:
            del module.forward          # leave the user's module as it was
            raise


def _module(stage: nn.Module, fqn: str) -> nn.Module | None:
    """The stage's real (not stubbed) module `fqn`, or None where another pipeline stage holds it."""
    try:
        m = stage.get_submodule(fqn)
    except AttributeError:
        return None                  # a block another pipeline stage holds (stubbed whole)
    return None if isinstance(m, (_PassThrough, _ZeroEmbedding)) else m


def apply_fused_kernels(stage: nn.Module, entries: Iterable[FusedKernel], *, fuse_loss: bool = True) -> Swapped:
    """Swap the fused kernels `entries` (Plan.fused_kernels) into `stage` (plain modules, before
    TP/FSDP); the output layer only when `fuse_loss` (the default loss is used)."""
    out = Swapped(modules=[])
    entries = list(entries)
    routers = [f.module for f in entries if f.kernel == "moe_router"]
    if routers:
        out.modules += apply_router_kernel(stage, routers)
    for f in entries:
        fqn, m = f.module, _module(stage, f.module)
        if m is None or f.kernel == "moe_router":
            continue
        if f.kernel in ("rms_norm", "swiglu"):
            _swap_elementwise(fqn, m, f)
            out.modules.append(fqn)
        elif f.kernel == "linear_cross_entropy" and fuse_loss:
            if not isinstance(getattr(m, "weight", None), torch.Tensor) or getattr(m, "bias", None) is not None:
                raise ConfigError(f"{fqn}: the fused linear + cross-entropy needs a linear layer "
                                  "without bias; re-run meshplan plan")
            x = _sample(m, m.weight.shape[1])
            if not x.is_meta:          # deferred initialisation: see _swap
                with torch.no_grad():
                    _check_same(fqn, f.kernel, m(x), x @ m.weight.t())
            m.forward = types.MethodType(_identity_forward, m)
            out.head = FusedHead(fqn=fqn, module=m)
            out.modules.append(fqn)
    return out


def _swap_elementwise(fqn: str, m: nn.Module, f: FusedKernel, *, lean_fn=None) -> None:
    """`m` (the plan's rms_norm or swiglu module `fqn`) runs the kernel `f` names; with `lean_fn`,
    that kernel's reference math as an input-saving autograd Function instead (kernels.lean)."""
    if f.kernel == "rms_norm":
        name = f.option.get("weight", "weight")
        w = getattr(m, name, None)
        if not isinstance(w, torch.Tensor) or w.dim() != 1:
            raise ConfigError(f"{fqn}: the fused rms_norm needs a 1-D parameter {name!r}; "
                              "re-run meshplan plan")
        m._meshplan_eps = float(f.option.get("eps", "1e-6"))
        m._meshplan_weight = name
        if lean_fn is not None:
            m._meshplan_norm_fn = lean_fn
        _swap(fqn, m, _rms_norm_forward, w.shape[0], f.kernel)
        return
    names = tuple(f.option.get(k, "") for k in ("gate", "up", "down"))
    if not all(isinstance(getattr(m, n, None), nn.Module) for n in names):
        raise ConfigError(f"{fqn}: the fused swiglu needs children {names}; re-run meshplan plan")
    m._meshplan_swiglu = names
    if lean_fn is not None:
        m._meshplan_swiglu_fn = lean_fn
    gate = getattr(m, names[0])
    width = gate.weight.shape[1] if isinstance(getattr(gate, "weight", None), torch.Tensor) else 0
    if not width:
        raise ConfigError(f"{fqn}.{names[0]}: expected a linear layer with a 2-D weight")
    _swap(fqn, m, _swiglu_forward, width, f.kernel)


def apply_lean_elementwise(stage: nn.Module, entries: Iterable[FusedKernel], swapped: Iterable[str] = (), *,
                           device_type: str = "cpu", mode="auto") -> list[str]:
    """Where no fused kernel runs, the eager norms and SwiGLU still keep only what the kernel keeps
    for backward (its inputs; cost_models/layer.py charges that): the plan's rms_norm and swiglu
    modules not in `swapped` (the FQNs apply_fused_kernels swapped) and every `nn.RMSNorm` of
    `stage` run the kernels' reference math as input-saving autograd Functions (kernels.lean).
    `nn.RMSNorm` as aten runs it on CPU keeps an fp32 upcast of its input, the rstd and the fp32
    normalised tensor; eager SwiGLU keeps silu's output next to gate and up. An `nn.RMSNorm` runs
    the Triton kernel itself where `choose_kernels` would swap it in (`device_type`, `mode`: the
    fused_kernels option). Returns the FQNs."""
    done = set(swapped)
    out: list[str] = []
    entries = list(entries)
    probe = [FusedKernel(kernel="rms_norm", module="norm")]      # choose_kernels decides for an rms_norm entry
    norm = rms_norm if mode is not False and choose_kernels(probe, device_type, mode)[0] else lean.rms_norm
    for f in entries:
        m = _module(stage, f.module) if f.kernel in _LEAN and f.module not in done else None
        if m is not None:
            _swap_elementwise(f.module, m, f, lean_fn=_LEAN[f.kernel])
            done.add(f.module)
            out.append(f.module)
    for fqn, m in stage.named_modules():
        # torch's own class only: a subclass may compute something else
        if (type(m) is not nn.RMSNorm or fqn in done or "forward" in m.__dict__ or m.weight is None
                or len(m.normalized_shape) != 1):
            continue
        m._meshplan_eps = m.eps         # None: the dtype's epsilon, as nn.RMSNorm does
        m._meshplan_weight = "weight"
        m._meshplan_norm_fn = norm
        _swap(fqn, m, _rms_norm_forward, m.weight.shape[0], "rms_norm")
        out.append(fqn)
    return out


def choose_kernels(entries: Iterable[FusedKernel], device_type: str, mode) -> tuple[list[FusedKernel], dict[str, str]]:
    """The plan's fused-kernel entries to swap in on this device, and per kernel what runs and why.

    `mode`: True swaps every entry (correctness tests), False none, "auto" only the kernels whose
    backend here beats eager (FASTER_THAN_EAGER). Returns (entries to swap, {kernel: decision}).
    """
    entries = list(entries)
    kinds = list(dict.fromkeys(e.kernel for e in entries))
    lean_note = "; inputs kept for backward, as the kernel keeps them: kernels.lean"
    if mode is False or not entries:
        return [], {k: "eager (fused kernels off" + (lean_note if k in _LEAN else "") + ")" for k in kinds}
    be = backend()
    if mode is True:
        return list(entries), {k: f"fused ({be} on {device_type}, forced)" for k in kinds}
    if mode != "auto":
        raise ConfigError(f"fused_kernels={mode!r}: use 'auto', True or False")
    faster = FASTER_THAN_EAGER.get((device_type, be), frozenset())
    keep = [e for e in entries if e.kernel in faster]
    return keep, {k: (f"fused ({be} on {device_type})" if k in faster else
                      f"eager ({be} on {device_type} is slower than the module it replaces"
                      + (lean_note if k in _LEAN else "") + ")") for k in kinds}


def apply_router_kernel(stage: nn.Module, modules: Iterable[str] | None = None) -> list[str]:
    """Route the MoE layers of `stage` (the FQNs `modules`, or every routed layer)
    with the fused router kernel (meshplan.kernels.moe_route: top-k, softmax/sigmoid, expert
    bias, summed probabilities for the aux loss), after checking it picks the same experts with
    the same weights as the eager router on a random input. Returns the swapped FQNs."""
    names = None if modules is None else set(modules)
    swapped = []
    for fqn, m in stage.named_modules():
        if not (hasattr(m, "route_fn") and hasattr(m, "_route") and isinstance(getattr(m, "router", None), nn.Module)):
            continue
        if names is not None and fqn not in names:
            continue
        if getattr(m, "num_groups", 0) > 1:
            continue        # group-limited routing: the kernel's top-k spans every expert; eager routes
        w = m.router.weight
        if not w.is_meta:
            logits = torch.randn(16, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.device)
            with torch.no_grad():
                want_w, want_e, probs = m._route(logits)
                got_w, got_e, prob_sum = kernel_route(logits, m)
            if not torch.equal(want_e, got_e):
                raise ConfigError(f"{fqn}: the fused router picks other experts than the module's own router "
                                  "(different scoring); run with fused kernels off")
            _check_same(fqn, "moe_router", want_w, got_w)
            _check_same(fqn, "moe_router", probs.sum(0), prob_sum)
        m.route_fn = kernel_route
        swapped.append(fqn)
    return swapped
