"""Repeated blocks found from the module tree, before any tracing.

A 126-layer Llama-405B exported whole takes ~14 s on 2 cores (DESIGN.md); traced with one
layer it takes a fraction of a second. So the tracer first finds the repeated blocks
structurally, swaps each list of blocks for a short list holding one representative per
unique structure, traces that shallow model, and maps the names back.

- `signature(module)`: structural fingerprint of a block: class names, child names, parameter
  and buffer shapes and dtypes, and str/bool attributes (e.g. HF's `attention_type`) — never
  integer attributes such as `layer_idx`, which differ between otherwise identical layers.
- `find_block_containers(model)`: the outermost nn.ModuleList / nn.ModuleDict / nn.Sequential
  whose children are non-leaf modules with parameters and repeat a signature; failing a repeat,
  the outermost ModuleList / ModuleDict of such modules (a one-layer model, two layers of
  different kinds), each child then a block of its own (count 1).
- `shrunk(model, containers)`: context manager that swaps in the representatives (same module
  objects, no copies) and restores the original lists on exit, even on error.
- the whole model's fingerprint lives in meshplan.ir.fingerprint (planner and runtime share it).

The traced graph's node types are in `trace_nodes`; what a traced block computes (roles of its
linears, attention geometry, MoE facts) is worked out in `block_analysis`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from meshplan.ir.fingerprint import tensor_desc

__all__ = [
    "signature",
    "BlockContainer",
    "find_block_containers",
    "FqnMap",
    "shrunk",
    "join",
]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
# Attribute types that change what a block computes without changing its parameters (HF's
# per-layer `attention_type = "sliding_attention"`, `is_causal`, ...). Integers are left out on
# purpose: `layer_idx` differs on every layer and would make every layer unique.
_ATTR_TYPES = (str, bool)
_SKIP_ATTRS = frozenset({"training"})


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _describe(module: nn.Module) -> str:
    parts = [type(module).__qualname__]
    parts += [f"p:{n}={tensor_desc(p)}" for n, p in module._parameters.items()]
    parts += [f"b:{n}={tensor_desc(b)}" for n, b in module._buffers.items()]
    parts += [f"a:{k}={v!r}" for k, v in sorted(vars(module).items())
              if not k.startswith("_") and k not in _SKIP_ATTRS and isinstance(v, _ATTR_TYPES)]
    parts += [f"c:{n}=({'None' if c is None else _describe(c)})" for n, c in module._modules.items()]
    return ";".join(parts)


def signature(module: nn.Module) -> str:
    """Structural fingerprint of one block (16 hex digits); equal for interchangeable blocks."""
    return hashlib.sha256(_describe(module).encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class BlockContainer:
    """A list of blocks: `keys` are the child names in order, `signatures` one per key.

    `start`/`stop` bound the blocks inside the container (all children for ModuleList and
    ModuleDict; for nn.Sequential, the span between the first and last repeated child).
    """

    fqn: str
    keys: tuple[str, ...]
    signatures: tuple[str, ...]
    start: int
    stop: int
    renumber: bool            # ModuleList / Sequential index by position, so keys are renumbered

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.signatures):
            raise ValueError("keys and signatures must have the same length")
        if not 0 <= self.start < self.stop <= len(self.keys):
            raise ValueError(f"bad block span {self.start}:{self.stop} of {len(self.keys)} children")

    @property
    def block_keys(self) -> tuple[str, ...]:
        return self.keys[self.start:self.stop]

    def representatives(self) -> tuple[str, ...]:
        """Key of the first block of each unique signature, in container order."""
        seen: set[str] = set()
        reps = []
        for key, sig in zip(self.block_keys, self.signatures[self.start:self.stop]):
            if sig not in seen:
                seen.add(sig)
                reps.append(key)
        return tuple(reps)

    def instances(self, signature_: str) -> tuple[str, ...]:
        """FQNs of every block with this signature, in container order."""
        return tuple(join(self.fqn, k) for k, s in zip(self.keys[self.start:self.stop],
                                                       self.signatures[self.start:self.stop])
                     if s == signature_)

    def signature_of(self, key: str) -> str:
        return self.signatures[self.keys.index(key)]


def _is_block(module: nn.Module | None) -> bool:
    """A candidate block: has submodules and owns parameters (a bare Linear or norm is not)."""
    if module is None or not module._modules:
        return False
    return any(True for _ in module.parameters())


def _layer_list(fqn: str, module: nn.Module, children: list[tuple[str, nn.Module]],
                sigs: list[str]) -> BlockContainer | None:
    """A list of layers none of which repeats (one layer; a hybrid model whose local and global
    attention layers alternate, at a depth too small to repeat either kind): a ModuleList or
    ModuleDict whose children are all blocks, none of them a container itself. Each layer is then
    a block of its own, so its heads, FFN width and window reach the planner's divisibility checks.
    nn.Sequential is left out: it also chains non-layer modules (a projection, an activation)
    whose span only a repeat bounds."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or not all(sigs):
        return None
    if any(isinstance(c, _CONTAINERS) for _, c in children):
        return None            # a list of lists (stages, towers): its layers are one level down
    return BlockContainer(fqn=fqn, keys=tuple(k for k, _ in children), signatures=tuple(sigs),
                          start=0, stop=len(children), renumber=isinstance(module, nn.ModuleList))


def _container(fqn: str, module: nn.Module) -> BlockContainer | None:
    children = list(module._modules.items())
    if not children:
        return None
    sigs = [signature(c) if _is_block(c) else "" for _, c in children]
    counts: dict[str, int] = {}
    for s in sigs:
        if s:
            counts[s] = counts.get(s, 0) + 1
    repeated = [i for i, s in enumerate(sigs) if s and counts[s] >= 2]
    if not repeated:
        return _layer_list(fqn, module, children, sigs)
    if isinstance(module, nn.Sequential):
        start, stop = repeated[0], repeated[-1] + 1
    else:
        start, stop = 0, len(children)
    if not all(sigs[start:stop]):
        return None
    return BlockContainer(fqn=fqn, keys=tuple(k for k, _ in children), signatures=tuple(sigs),
                          start=start, stop=stop, renumber=not isinstance(module, nn.ModuleDict))


def find_block_containers(model: nn.Module) -> tuple[BlockContainer, ...]:
    """The outermost containers of repeated blocks, in module-tree order."""
    found: list[BlockContainer] = []

    def visit(fqn: str, module: nn.Module) -> None:
        if isinstance(module, _CONTAINERS):
            c = _container(fqn, module)
            if c is not None:
                found.append(c)
                return           # blocks nested inside blocks (expert lists) stay whole
        for name, child in module._modules.items():
            if child is not None:
                visit(join(fqn, name), child)

    visit("", model)
    return tuple(found)


@dataclass(frozen=True)
class FqnMap:
    """Shallow-model FQN -> original FQN, for the containers that were shrunk.

    `keys[container_fqn]` maps a child name in the shallow container to its original name.
    """

    keys: dict[str, dict[str, str]]

    def original(self, fqn: str) -> str:
        for cfqn, mapping in self.keys.items():
            if cfqn and not (fqn == cfqn or fqn.startswith(cfqn + ".")):
                continue
            rest = fqn[len(cfqn) + 1:] if cfqn else fqn
            if not rest:
                return fqn
            head, _, tail = rest.partition(".")
            if head in mapping:
                return join(join(cfqn, mapping[head]), tail) if tail else join(cfqn, mapping[head])
        return fqn


IDENTITY = FqnMap({})


@contextmanager
def shrunk(model: nn.Module, containers: tuple[BlockContainer, ...]) -> Iterator[FqnMap]:
    """Temporarily keep only the representatives in each container; restore on exit.

    The container object stays the same (its `_modules` dict is swapped), so code holding a
    reference to it, slicing it (`self.layers[:n]`) or asking its length keeps working.
    """
    saved: list[tuple[nn.Module, dict]] = []
    keys: dict[str, dict[str, str]] = {}
    try:
        for c in containers:
            module = model.get_submodule(c.fqn) if c.fqn else model
            original = module._modules
            reps = set(c.representatives())
            kept = [k for i, k in enumerate(c.keys)
                    if not (c.start <= i < c.stop) or k in reps]
            new = {}
            mapping = {}
            for pos, key in enumerate(kept):
                new_key = str(pos) if c.renumber else key
                new[new_key] = original[key]
                mapping[new_key] = key
            saved.append((module, original))
            module._modules = type(original)(new)
            keys[c.fqn] = mapping
        yield FqnMap(keys)
    finally:
        for module, original in reversed(saved):
            module._modules = original
