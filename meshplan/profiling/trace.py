"""Trace any single-device nn.Module into meshplan's graph IR and per-block profiles.

    profile = trace(model, seq_len=8192)            # model on the meta device, fake or real
    ops = trace_graph(model, seq_len=8192)          # the traced graph as a list of OpInfo

How (and why this way)
- `torch.export.export(strict=False)` on the model's own device: the meta device or
  FakeTensorMode, so no real memory is touched (real weights are fakified by export, never
  copied). `torch.fx.symbolic_trace` fails on transformers models, and FlopCounterMode on the
  meta device fails on their `.item()` calls (reference/cpu_platform.md §8).
- Repeated blocks are found from the module tree first (`blocks.find_block_containers`) and
  each list of blocks is swapped for one representative per unique structure, so a 126-layer
  model is traced with one layer (`blocks.shrunk`), then the names are mapped back. A layer
  list none of whose kinds repeats (one layer; two layers of different kinds) is still a list of
  blocks, each its own (count 1); a model with no such list has no blocks, and the planner says so.
- Each op gets shapes, dtype, forward/backward FLOPs (`op_costs.op_flops`), bytes, its owning
  module and the parameters it reads; blocks are then analysed by data flow
  (`block_analysis.analyse_block`).
- transformers MoE models default to a data-dependent loop over the experts that export
  cannot trace; for the duration of the trace their `config._experts_implementation` is set to
  the static-shape "grouped_mm" (and restored).

The parts: `trace_export` runs torch.export and translates its errors; `trace_nodes` turns the
exported graph into `Node`s; `trace_patterns` finds attention and MoE dispatch in them;
`block_analysis` classifies each block. This module puts them together into the profile.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from meshplan.errors import ConfigError, TraceError
from meshplan.ir.fingerprint import fingerprint
from meshplan.ir.profile import BlockProfile, ModelProfile, OpInfo
from meshplan.profiling.block_analysis import analyse_block, weight_of
from meshplan.profiling.blocks import BlockContainer, find_block_containers, join, shrunk
from meshplan.profiling.fusions import find_fusions
from meshplan.profiling.traits import fold_shared_roles, moe_balance
from meshplan.profiling.trace_export import (
    default_inputs,
    exception_chain,
    export_model,
    static_experts,
    train_mode,
)
from meshplan.profiling.trace_nodes import AttentionUnit, Node, build_nodes
from meshplan.profiling.trace_patterns import find_attention, mark_dispatch

__all__ = ["trace", "trace_graph"]


# --- public API ----------------------------------------------------------------------------

def _check(seq_len: int, batch: int, vocab: int | None, dtype: torch.dtype) -> None:
    for label, v in (("seq_len", seq_len), ("batch", batch)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{label} must be a positive int, got {v!r}")
    if vocab is not None and (not isinstance(vocab, int) or vocab < 1):
        raise ConfigError(f"vocab must be a positive int or None, got {vocab!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    """The floating dtype holding most parameters (the one the model computes in)."""
    by_dtype: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.dtype.is_floating_point:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
    return max(by_dtype, key=by_dtype.get) if by_dtype else None


class _Traced:
    """The shallow trace: nodes, attention units, and which block each node belongs to."""

    def __init__(self, nodes: list[Node], units: list[AttentionUnit],
                 containers: tuple[BlockContainer, ...]):
        self.nodes, self.units, self.containers = nodes, units, containers
        # representative instance FQN -> (container, key)
        self.reps = {join(c.fqn, k): (c, k) for c in containers for k in c.representatives()}
        instances = {join(c.fqn, k) for c in containers for k in c.block_keys}
        self.owner: dict[int, str] = {}
        # ops of non-representative instances: only present when the model had to be traced
        # whole; they repeat a representative and are left out of the profile
        self.repeats: set[int] = set()
        for n in nodes:
            if n.placeholder:
                continue
            path = n.module
            while path:
                if path in self.reps:
                    self.owner[n.index] = path
                    break
                if path in instances:
                    self.repeats.add(n.index)
                    break
                path = path.rpartition(".")[0]


def _run(model: nn.Module, *, seq_len: int, batch: int, vocab: int | None, dtype: torch.dtype,
         example_inputs: tuple | None, example_kwargs: dict | None) -> _Traced:
    _check(seq_len, batch, vocab, dtype)
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace() takes an nn.Module, got {type(model).__name__}")
    containers = find_block_containers(model)
    args, kwargs = default_inputs(model, seq_len=seq_len, batch=batch, vocab=vocab,
                                   example_inputs=example_inputs, example_kwargs=example_kwargs)
    model_dtype = _model_dtype(model)
    with static_experts(model), train_mode(model):
        try:
            with shrunk(model, containers) as fmap:
                ep = export_model(model, args, kwargs, fmap)
                nodes = build_nodes(ep, fmap, model_dtype, dtype)
        except TraceError as e:
            # A model that indexes its block list by absolute position (self.layers[i] for
            # i < num_layers) cannot run shortened: trace it whole (slower, still correct).
            if not containers or not any(isinstance(x, (IndexError, KeyError)) for x in exception_chain(e)):
                raise
            with shrunk(model, ()) as fmap:
                ep = export_model(model, args, kwargs, fmap)
                nodes = build_nodes(ep, fmap, model_dtype, dtype)
    units = find_attention(nodes)
    for u in units:
        for i in u.nodes:
            if nodes[i].kind != "view":
                nodes[i].kind = "attention"
    mark_dispatch(nodes)
    return _Traced(nodes, units, containers)


def _op_info(n: Node, nodes: list[Node], dtype: torch.dtype, model_dtype: torch.dtype | None) -> OpInfo:
    out_dtype = n.out[0].dtype if n.out else None
    if out_dtype is not None and out_dtype == model_dtype:
        out_dtype = dtype
    return OpInfo(
        name=n.name, target=str(n.target), kind=n.kind, module=n.module,
        input_shapes=tuple(nodes[j].shape for j in n.inputs),
        output_shapes=tuple(s.shape for s in n.out),
        dtype=str(out_dtype).removeprefix("torch.") if out_dtype is not None else "",
        fwd_flops=n.fwd, bwd_flops=n.bwd, bytes=n.bytes, params=n.params,
        inputs=tuple(nodes[j].name for j in n.inputs), role=n.role, scalars=_scalars(n))


def _scalars(n: Node) -> tuple[float, ...]:
    """Numeric constants passed to the op (positional, then keyword), e.g. a norm's eps."""
    vals = list(n.args) + list(n.kwargs.values())
    return tuple(float(v) for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool))


def trace_graph(model: nn.Module, *, seq_len: int, batch: int = 1, vocab: int | None = None,
                dtype: torch.dtype = torch.bfloat16, example_inputs: tuple | None = None,
                example_kwargs: dict | None = None) -> list[OpInfo]:
    """The traced graph as OpInfos in execution order (graph inputs left out).

    Repeated blocks appear once (their representative, named by its original FQN), exactly as
    `trace` analyses them; `trace(...).blocks[i].instances` lists where each one repeats.
    """
    t = _run(model, seq_len=seq_len, batch=batch, vocab=vocab, dtype=dtype,
             example_inputs=example_inputs, example_kwargs=example_kwargs)
    md = _model_dtype(model)
    for rep in t.reps:
        owned = [i for i, o in t.owner.items() if o == rep]
        if owned:
            _analyse(t, rep, owned, model, batch, seq_len)
    return [_op_info(n, t.nodes, dtype, md) for n in t.nodes
            if not n.placeholder and n.index not in t.repeats]


def _param_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}


def _analyse(t: _Traced, rep: str, owned: list[int], model: nn.Module, batch: int, seq: int) -> dict:
    try:
        return analyse_block(t.nodes, sorted(owned), t.units, inst=rep, batch=batch, seq=seq,
                             param_shapes=_param_shapes(model))
    except (IndexError, KeyError, ValueError, TypeError, ZeroDivisionError) as e:
        raise TraceError(
            f"cannot classify block {rep!r} ({type(e).__name__}: {e}); its ops do not match the "
            f"attention / MLP / MoE patterns meshplan knows. Please report the model") from e


def _attn_window(block: nn.Module) -> int:
    """The block's sliding attention window in tokens (0: full causal), from the integer
    `sliding_window` attribute its attention module carries (meshplan's Attention; transformers'
    Mistral / GPT-OSS / Gemma attention set it, None on their full-attention layers)."""
    windows = {m.sliding_window for m in block.modules()
               if isinstance(getattr(m, "sliding_window", None), int) and not isinstance(m.sliding_window, bool)}
    windows.discard(0)
    if len(windows) > 1:
        raise TraceError(f"block has attentions of different sliding windows {sorted(windows)}; meshplan prices "
                         "one window per block")
    return windows.pop() if windows else 0


def _numel(params) -> int:
    seen, total = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def trace(model: nn.Module, *, seq_len: int, batch: int = 1, vocab: int | None = None,
          dtype: torch.dtype = torch.bfloat16, example_inputs: tuple | None = None,
          example_kwargs: dict | None = None, name: str | None = None) -> ModelProfile:
    """Trace `model` without real memory and describe it for the cost model.

    The default input is `input_ids` (batch, seq_len) over `vocab` (default: the first
    nn.Embedding's size); pass `example_inputs` / `example_kwargs` (meta or fake tensors) for
    other signatures. `dtype` is the training precision: tensors in the model's own float dtype
    are counted at `dtype`'s size. Raises TraceError naming the module and op that cannot be
    traced or classified.
    """
    t = _run(model, seq_len=seq_len, batch=batch, vocab=vocab, dtype=dtype,
             example_inputs=example_inputs, example_kwargs=example_kwargs)
    nodes = t.nodes
    md = _model_dtype(model)
    named = dict(model.named_parameters(remove_duplicate=False))
    param_shapes = {k: tuple(p.shape) for k, p in named.items()}

    # --- blocks, one per representative that ran
    blocks: list[BlockProfile] = []
    block_of: dict[tuple[str, str], int] = {}          # (container fqn, signature) -> index
    first_op: dict[str, int] = {}
    for i, owner in t.owner.items():
        first_op[owner] = min(first_op.get(owner, i), i)
    containers = [c for c in t.containers
                  if any(join(c.fqn, k) in first_op for k in c.representatives())]
    containers.sort(key=lambda c: min(first_op.get(join(c.fqn, k), 1 << 62) for k in c.representatives()))
    for c in containers:
        for key in c.representatives():
            rep = join(c.fqn, key)
            owned = sorted(i for i, o in t.owner.items() if o == rep)
            facts = _analyse(t, rep, owned, model, batch, seq_len) if owned else {}
            expert_params = facts.pop("expert_params", 0)
            module = model.get_submodule(rep)
            sig = c.signature_of(key)
            block_of[(c.fqn, sig)] = len(blocks)
            blocks.append(BlockProfile(
                signature=sig, instances=c.instances(sig),
                params=_numel(module.parameters()), expert_params=expert_params,
                fwd_flops=sum(nodes[i].fwd for i in owned), bwd_flops=sum(nodes[i].bwd for i in owned),
                ops=tuple(_op_info(nodes[i], nodes, dtype, md) for i in owned),
                attn_window=_attn_window(module),
                attn_sinks=any(n.rsplit(".", 1)[-1] == "sinks" for n, _ in module.named_parameters()),
                **{"hidden": 0, **facts}))
    layers = tuple(block_of[(c.fqn, c.signature_of(k))] for c in containers for k in c.block_keys)

    # --- ops outside the blocks
    outside = [n for n in nodes if not n.placeholder and n.index not in t.owner
               and n.index not in t.repeats]
    owned_all = [i for i, o in t.owner.items() if any(o == join(c.fqn, k) for c in containers
                                                       for k in c.representatives())]
    last = max(owned_all, default=-1)
    pre = [n for n in outside if n.index < last] if owned_all else outside
    post = [n for n in outside if n.index > last] if owned_all else []

    # --- embedding and head
    emb_nodes = [n for n in outside if n.kind == "embedding"]
    token = next((n for n in emb_nodes if any(nodes[j].placeholder == "input" for j in n.inputs)),
                 emb_nodes[0] if emb_nodes else None)
    emb_weights = {p for n in emb_nodes for p in n.params}
    embedding_params = _numel(named[p] for p in emb_weights if p in named)
    token_weight = weight_of(token, param_shapes) if token is not None else None
    if token_weight is None and token is not None and token.params:
        token_weight = token.params[0]
    vocab_size = vocab or (param_shapes[token_weight][0] if token_weight else 0)
    heads = [n for n in (post or outside) if n.kind == "linear" and n.shape and n.shape[-1] == vocab_size]
    head = heads[-1] if heads else None
    head_weight = weight_of(head, param_shapes) if head is not None else None
    tied = bool(head_weight and token_weight and named[head_weight] is named[token_weight])
    head_params = 0 if tied or head is None else _numel(named[p] for p in head.params if p in named)

    total = _numel(model.parameters())
    in_blocks = sum(b.params * b.count for b in blocks)
    # the MTP blocks are priced as layers of the last layer's kind (cost_models/ranks.py), the rest
    # of the MTP modules (norms, projection) as other parameters of the last stage
    mtp = _mtp_depth(cfg := getattr(model, "config", None))
    if mtp and layers:
        in_blocks += mtp * blocks[layers[-1]].params
    hidden = (param_shapes[token_weight][-1] if token_weight and len(param_shapes[token_weight]) == 2
              else max((b.hidden for b in blocks), default=0))
    cfg_name = getattr(cfg, "name", None) or getattr(cfg, "name_or_path", None)
    balance, capacity = moe_balance(model)      # how the routers stay balanced: the cost model's MoE load
    prof = ModelProfile(
        name=name or (cfg_name if isinstance(cfg_name, str) and cfg_name else type(model).__name__),
        fingerprint=fingerprint(model), seq_len=seq_len, vocab=vocab_size, hidden=hidden,
        dtype=str(dtype).removeprefix("torch."), embedding_params=embedding_params,
        head_params=head_params, tied_embeddings=tied,
        other_params=max(total - embedding_params - head_params - in_blocks, 0),
        blocks=tuple(blocks), layers=layers,
        pre_ops=tuple(_op_info(n, nodes, dtype, md) for n in pre),
        post_ops=tuple(_op_info(n, nodes, dtype, md) for n in post),
        embedding_fqn=token.module if token is not None else "",
        head_fqn=head.module if head is not None else "",
        pre_modules=_param_owners(pre), post_modules=_mtp_whole(_param_owners(post), mtp),
        moe_balance=balance, moe_capacity_factor=capacity, mtp_depth=mtp)
    # shared experts the runtime folds whole over TP (MoE layers without routed(x)): so placed and priced
    prof = fold_shared_roles(prof, model)
    return dataclasses.replace(prof, fusions=find_fusions(prof).applied)


def _mtp_depth(cfg) -> int:
    """Multi-token-prediction depths of a meshplan model (ModelConfig.mtp_depth). Their modules
    sit outside the block containers (models/mtp.py), so the trace counts their ops among the
    post ops and their parameters among other_params; the cost model prices them from this."""
    depth = getattr(cfg, "mtp_depth", 0)
    return depth if isinstance(depth, int) and not isinstance(depth, bool) and depth > 0 else 0


def _mtp_whole(modules: tuple[str, ...], mtp: int) -> tuple[str, ...]:
    """The MTP modules as one module, "mtp": the pipeline split moves it whole to the last stage
    (runtime/pipeline.py stubs it whole elsewhere), and TP leaves it whole (docs/models.md)."""
    if not mtp:
        return modules
    out = [m for m in modules if not m.startswith("mtp.")]
    return tuple(out + ["mtp"]) if len(out) < len(modules) else modules


def _param_owners(nodes) -> tuple[str, ...]:
    """Modules whose ops read parameters, first use first (a tied head counts as its own module)."""
    out: list[str] = []
    for n in nodes:
        if n.params and n.module and n.module not in out:
            out.append(n.module)
    return tuple(out)
