"""Tensor and sequence parallelism from the Plan's per-module placements.

The planner's intra-block ILP labels every module of each block, and the modules outside the
blocks; the Plan carries the labels by module FQN (`Plan.placements`) and whether the residual
stream is sequence-sharded (`Plan.sequence_parallel`). This module turns the labels into PyTorch
parallel styles and applies them with `parallelize_module`; nothing here looks at class names of
the user's model.

Labels and what they become (tp = size of the "tp" mesh axis):

| label          | module     | style                                                                  |
|----------------|------------|------------------------------------------------------------------------|
| colwise        | Linear     | ColwiseParallel; input Shard(1) (sequence-sharded) when the block is SP |
| rowwise        | Linear     | RowwiseParallel; output Shard(1) (reduce-scatter) when SP, else all-reduce |
| sequence       | any        | SequenceParallel: weights replicated, works on the local sequence shard |
| replicate      | any        | nothing (whole tensors, weights replicated, identical grads); inside a |
|                |            | sequence-parallel block, a norm's input is gathered first              |
| heads          | attention  | local head counts: integer head-count attributes divided by tp          |
| vocab_parallel | Embedding  | RowwiseParallel over the vocabulary; output Shard(1) when SP            |
| seq_split      | any        | output cut to this rank's sequence shard (learned positions under SP)  |
| colwise_qkv    | Linear     | fused q|k|v: each rank holds its heads' rows of q, of k and of v        |
| colwise_gate_up| Linear     | fused gate|up: each rank holds its slice of gate and of up             |

Inside an attention (or MLP) module whose input is gathered once (see below), "replicate"
modules run on that whole input: a linear takes the gathered activation as a plain tensor
(its input gradient is whole on every rank, so nothing is reduced for it) and a norm runs as it
is. This is multi-head latent attention (models/mla.py): the down-projections wq_a / wkv_a and
the latent norms stay whole on every rank, the up-projections wq_b / wkv_b are column-parallel
by heads, wo row-parallel. The up-projections' column-parallel input gathers the latents'
gradients over the ranks' heads in backward; the rotary key, one head that every rank's heads
read straight from wkv_a, has its gradient summed over the TP group by a hook on wkv_a (the
columns the attention names in its `shared_rope_key` attribute).

Packed projections and transposed-weight linears (transformers' GPT-2 Conv1D, colwise /
rowwise / packed) are sharded by meshplan.runtime.packed_projections (see there for how the
shards are laid out). An attention module labelled "heads" also gets a local copy of its
`config` (transformers' Phi-3 slices its fused QKV output by `config.num_attention_heads`), and
its split widths (`split_size`, GPT-2) divided by tp.

Without SP, activations between styles are plain local tensors. With SP, the residual stream
(embedding output, row-parallel outputs, sequence-parallel norm outputs) stays a DTensor sharded
on the sequence: code reading `x.shape` (head reshapes, position ids, causal masks built from
the embedding output, as in transformers' Llama) sees the global sequence length, residual adds
stay DTensor + DTensor, and the next column-parallel linear gathers its input by its placement.
Inside TP regions the user's reshapes see local feature sizes; attention modules that reshape with `-1` need nothing, and those that keep
head counts as attributes get them divided ("heads").

The output layer (the "colwise" module outside the blocks) is column-parallel over the
vocabulary. With the runtime's default loss its output stays sharded (Shard(-1), a plain local
tensor of (batch, seq, vocab / tp)) and the cross entropy runs vocabulary-parallel
(meshplan.runtime.loss_parallel): no rank holds whole logits, which is what the cost model
prices. Whatever the model does to the logits after the output layer must then be element-wise
(a cast, a soft-cap). A user's `loss_fn` gets whole logits instead: the head's output is
all-gathered (Replicate), at the memory of full logits (and their gradient) on every TP rank.

Communication (all through DTensor redistributions): the activation entering each block's
attention / feed-forward sub-module is made a Replicate DTensor once, by a pre-hook on that
sub-module (torchtitan's `PrepareModuleInput`): one all-gather under SP, none without, and in
backward one reduce-scatter / all-reduce of the summed input gradient of all its column-parallel
linears (not one per linear: wq, wk, wv each gathering the same activation cost 2.5x the
collectives). Row-parallel outputs are all-reduced (reduce-scattered under SP), their
transposes in backward. The vocabulary-parallel loss adds two all-reduces of (tokens,) and
(3, tokens) fp32 statistics per micro-batch in forward, none in backward. Overlap of these with
compute is async TP (`enable_async_tp`, the plan's tp_comm_overlap: symmetric memory + compiled
blocks, CUDA only); on CPU they are synchronous.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from meshplan.errors import LayoutError
from meshplan.ir.tp_locality import HEAD_COUNT_ATTRS, localise_heads
from meshplan.runtime.loss_parallel import VocabShard
from meshplan.runtime.sp_saved import ShardKeeper

__all__ = ["apply_tensor_parallel", "HEAD_COUNT_ATTRS", "enable_async_tp"]

_SUPPORTED = ("colwise", "rowwise", "sequence", "replicate", "heads", "vocab_parallel", "seq_split",
              "colwise_qkv", "colwise_gate_up")
_COLWISE = ("colwise", "colwise_qkv", "colwise_gate_up")


def _styles(label: str, sequence: bool, module: nn.Module, fqn: str, gathered_after: bool = False,
            in_gathered: bool = False):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )
    linear_or_emb = isinstance(module, (nn.Linear, nn.Embedding))
    if label in ("colwise", "rowwise", "vocab_parallel") and not linear_or_emb:
        raise LayoutError(f"module {fqn!r} is a {type(module).__name__}; the plan shards it {label}, which "
                          "the runtime supports for nn.Linear / nn.Embedding only")
    if label == "colwise":
        # a sequence-sharded input arrives as a DTensor (from a "sequence" norm) and is gathered by
        # its placement; plain inputs are whole
        return ColwiseParallel(input_layouts=Replicate())
    if label == "rowwise":
        # under SP the output joins the sequence-sharded residual stream: reduce-scatter
        return RowwiseParallel(output_layouts=Shard(1) if sequence else Replicate(), use_local_output=not sequence)
    if label == "vocab_parallel":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sequence else Replicate(),
                               use_local_output=not sequence)
    if label == "replicate" and in_gathered:
        # inside a module whose input is gathered once: a linear reads that Replicate DTensor as the
        # plain whole tensor (gradient whole on every rank too); a norm works on plain tensors already
        return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True) if linear_or_emb else None
    if label == "sequence" and in_gathered:
        raise LayoutError(f"module {fqn!r} is placed 'sequence' inside a module whose input the runtime gathers "
                          "whole (it holds column-parallel linears); a norm there runs on whole tokens: place it "
                          "'replicate', or re-plan with sp=False")
    if label == "sequence":
        # a DTensor output keeps the global shape, so the user's `B, T, _ = x.shape` stays right
        return SequenceParallel(use_local_output=False)
    if label == "replicate" and sequence and not linear_or_emb and any(True for _ in module.parameters()):
        if gathered_after:
            # a norm the ILP runs on whole tokens inside a sequence-parallel block, whose consumer
            # gathers its output once (see _gather_once): run it on the sequence shard instead and
            # gather after it - the same all-gather, a reduce-scatter (not an all-reduce per
            # column-parallel consumer) in backward, and 1/tp of the norm's work
            return SequenceParallel(use_local_output=False)
        # no consumer to gather at: gather the norm's input
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True)
    if label == "replicate" and sequence and linear_or_emb:
        raise LayoutError(f"module {fqn!r}: a replicated linear inside a sequence-parallel block is not "
                          "supported by the runtime yet; re-plan with sp=False")
    return None


def _gather_once(tp_mesh, sequence: bool, keeper: ShardKeeper | None = None):
    """Forward pre-hook on the module that holds a block's column-parallel linears (attention,
    feed-forward): its activation input becomes a Replicate DTensor once, so wq / wk / wv (or
    w1 / w3) see an input already in their layout and communicate nothing. torchtitan's
    `PrepareModuleInput` on `attention` / `feed_forward` does the same.

    Forward: one all-gather of the sequence shards (SP) or nothing (input already whole).
    Backward: the consumers' partial input gradients accumulate on that one DTensor and are
    reduced once (reduce-scatter under SP, all-reduce without), instead of once per consumer.
    `keeper`: the module's ShardKeeper, told of each all-gather so that backward keeps the shard.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def to_replicate(x):
        x = _cast_once(x)
        if isinstance(x, DTensor):
            if all(p.is_replicate() for p in x.placements):
                return x
            whole = x.redistribute(tp_mesh, [Replicate()])
        elif isinstance(x, torch.Tensor) and x.is_floating_point():
            layout = Shard(1) if sequence else Replicate()
            x = DTensor.from_local(x, tp_mesh, [layout], run_check=False)
            whole = x.redistribute(tp_mesh, [Replicate()])
            if not sequence:
                return whole
        else:
            return x
        if keeper is not None:
            keeper.gathered(x, whole)
        return whole

    def hook(module, args, kwargs):
        if args:
            return (to_replicate(args[0]),) + tuple(args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": to_replicate(kwargs["hidden_states"])}
        if "x" in kwargs:
            return args, {**kwargs, "x": to_replicate(kwargs["x"])}
        return None
    return hook


def _cast_once(x):
    """Under autocast, the shared input of a module's column-parallel linears in autocast's dtype
    before it is gathered: each linear would otherwise cast it itself and keep its own copy for
    backward (Q, K and V three, gate and up two), and the gather moves half the bytes. The
    values the linears see are the ones autocast gives them."""
    if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
        return x
    device = x.device.type if x.device.type != "meta" else "cpu"
    if not torch.is_autocast_enabled(device):
        return x
    dtype = torch.get_autocast_dtype(device)
    return x if x.dtype == dtype else x.to(dtype)


def _colwise_parents(placements: dict[str, str], blocks: tuple[str, ...], modules: dict) -> set[str]:
    """FQNs of the sub-modules of each block (attention, feed-forward) that hold column-parallel
    linears and whose first input is the activation those linears read. A block whose colwise
    linears hang directly off the block (no such sub-module) keeps the per-linear gather."""
    parents: set[str] = set()
    for fqn, label in placements.items():
        if label not in _COLWISE:
            continue
        parent = fqn.rpartition(".")[0]
        if parent and parent not in blocks and _block_of(parent, blocks) and parent in modules \
                and type(modules[parent]).__name__ != "_PassThrough":
            parents.add(parent)
    return parents


def _block_of(fqn: str, blocks: tuple[str, ...]) -> str | None:
    return next((b for b in blocks if fqn.startswith(b + ".")), None)


def _local_styles(placements: dict[str, str], blocks: tuple[str, ...], modules: dict, sequence: bool) -> dict:
    """The styles of meshplan.runtime.packed_projections: packed projections, and Conv1D
    (transposed-weight) linears labelled colwise / rowwise inside the blocks."""
    from meshplan.ir.tp_locality import is_conv1d
    from meshplan.runtime.packed_projections import PACKED_LABELS, ColwiseLocal, RowwiseConv1D, packed_parts
    out: dict = {}
    for fqn, label in placements.items():
        mod = modules.get(fqn)
        if mod is None or type(mod).__name__ in ("_PassThrough", "_ZeroEmbedding"):
            continue
        conv = is_conv1d(mod)
        if label in PACKED_LABELS:
            if not (isinstance(mod, nn.Linear) or conv):
                raise LayoutError(f"module {fqn!r} is a {type(mod).__name__}; the plan shards it {label}, "
                                  "which the runtime supports for linears only")
            attention = _attention_of(fqn, placements, blocks)
            out[fqn] = ColwiseLocal(packed_parts(label, mod, fqn, modules.get(attention) if attention else None))
        elif conv and label == "colwise" and _block_of(fqn, blocks):
            out[fqn] = ColwiseLocal()
        elif conv and label == "rowwise":
            out[fqn] = RowwiseConv1D(sequence)
    return out


def _head(sequence: bool, shard_vocab: bool):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel
    # shard_vocab: the default loss runs on the vocabulary slices (loss_parallel.py); otherwise
    # the logits are gathered, since the user's loss function expects whole tensors
    return ColwiseParallel(input_layouts=Shard(1) if sequence else Replicate(),
                           output_layouts=Shard(-1) if shard_vocab else Replicate())


def _vocab_shard(head: nn.Module, fqn: str, tp_mesh) -> VocabShard:
    """Where this rank's slice of the vocabulary lies, checked against the sharded head weight."""
    from torch.distributed.tensor import DTensor
    w = head.weight
    shard = VocabShard(group=tp_mesh.get_group(), rank=tp_mesh.get_local_rank(), size=tp_mesh.size(),
                       vocab=w.shape[0])
    rows = w.to_local().shape[0] if isinstance(w, DTensor) else w.shape[0]
    if rows != shard.width:
        raise LayoutError(f"{fqn}.weight holds {rows} vocabulary rows on this rank, expected {shard.width} "
                          f"of {shard.vocab} (torch.chunk's split over tp={shard.size}); pass parallelize(..., "
                         "loss_fn=...) to run on gathered logits")
    return shard


def _split_sequence_output(tp_mesh):
    """Forward hook: keep this rank's slice of the sequence (dim -2); backward all-gathers it."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def hook(module, args, out):
        dt = DTensor.from_local(out, tp_mesh, [Replicate()], run_check=False)
        return dt.redistribute(tp_mesh, [Shard(out.dim() - 2)])
    return hook


def _attention_of(fqn: str, placements: dict[str, str], blocks: tuple[str, ...]) -> str | None:
    """The attention module (label "heads") that reads linear `fqn`: its nearest labelled
    ancestor, else the only one in its block."""
    heads = [m for m, label in placements.items() if label == "heads"]
    up = fqn
    while "." in up:
        up = up.rpartition(".")[0]
        if up in heads:
            return up
    block = _block_of(fqn, blocks)
    mine = [m for m in heads if block and _block_of(m, blocks) == block]
    return mine[0] if len(mine) == 1 else None


def apply_tensor_parallel(stage: nn.Module, plan, tp_mesh, *, shard_vocab: bool = False) -> VocabShard | None:
    """Shard `stage` (a whole model or a pipeline stage of it) over `tp_mesh` as the plan's
    placements (module FQN -> label) say.

    `shard_vocab`: the default loss will run vocabulary-parallel, so the output layer keeps its
    logits sharded over the vocabulary; returns this rank's slice of it when `stage` holds the
    output layer (None otherwise, and when the logits are gathered)."""
    from torch.distributed.tensor.parallel import parallelize_module
    tp = tp_mesh.size()
    if tp == 1:
        return None
    placements, blocks = plan.placements, tuple(plan.blocks)
    modules = dict(stage.named_modules())
    sequence = plan.sequence_parallel
    unknown = sorted({v for v in placements.values() if v not in _SUPPORTED})
    if unknown:
        raise LayoutError(f"placements {unknown} are not supported by the runtime yet (it runs "
                          f"{list(_SUPPORTED)}); re-plan with ep=1 or for a dense model")
    parents = _colwise_parents(placements, blocks, modules)
    head: str | None = None
    local_styles = _local_styles(placements, blocks, modules, sequence)   # before head counts go local
    styles: dict = {}
    for fqn, label in placements.items():
        mod = modules.get(fqn)
        if mod is None or type(mod).__name__ in ("_PassThrough", "_ZeroEmbedding"):
            continue                # owned by another pipeline stage
        block = _block_of(fqn, blocks)
        if fqn in local_styles:
            continue
        if label == "heads":
            localise_heads(mod, fqn, tp)
        elif label == "seq_split":
            if sequence:
                mod.register_forward_hook(_split_sequence_output(tp_mesh))
        elif block is None and label == "colwise":       # the output layer (outside the blocks)
            styles[fqn] = _head(sequence, shard_vocab)
            head = fqn if shard_vocab else None
        else:
            style = _styles(label, sequence, mod, fqn,
                            gathered_after=any(p.startswith(block + ".") for p in parents) if block else False,
                            in_gathered=any(fqn.startswith(p + ".") for p in parents))
            if style is not None:
                styles[fqn] = style
    if styles:
        parallelize_module(stage, tp_mesh, styles)
    for fqn, style in local_styles.items():
        style.apply(modules[fqn], tp_mesh)
    for fqn in sorted(parents):
        keeper = ShardKeeper(tp_mesh) if sequence else None
        modules[fqn].register_forward_pre_hook(_gather_once(tp_mesh, sequence, keeper), with_kwargs=True)
        if keeper is not None:
            keeper.wrap(modules[fqn])
    _sum_shared_head_grads(modules, placements, tp_mesh)
    return _vocab_shard(modules[head], head, tp_mesh) if head is not None else None


class _SumColumnGrads(torch.autograd.Function):
    """Identity in forward; in backward, the gradient of columns `start:` all-reduced (summed) over
    `group`: those columns feed heads on every TP rank, so each rank holds a part of their gradient."""

    @staticmethod
    def forward(ctx, x, start: int, group):
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # a functional collective: traceable where the block is compiled
        from torch.distributed._functional_collectives import all_reduce
        shared = all_reduce(grad[..., ctx.start:].contiguous(), "sum", ctx.group)
        return torch.cat([grad[..., :ctx.start], shared], dim=-1), None, None


def _sum_shared_head_grads(modules: dict, placements: dict[str, str], tp_mesh) -> None:
    """For attention modules (label "heads") that name a `shared_rope_key` (linear, first column):
    sum the gradient of those output columns of that replicated linear over the TP group (MLA's
    rotary key, one head read by the heads of every rank)."""
    group = tp_mesh.get_group()
    for fqn, label in placements.items():
        mod = modules.get(fqn)
        shared = getattr(mod, "shared_rope_key", None) if label == "heads" else None
        if shared is None:
            continue
        name, start = shared
        linear = getattr(mod, name, None)
        if placements.get(f"{fqn}.{name}") != "replicate" or not isinstance(linear, nn.Linear):
            raise LayoutError(f"{fqn}.{name} computes the rotary key every head of {fqn} shares, so tensor "
                              f"parallelism keeps it whole ('replicate'); the plan places it "
                              f"{placements.get(f'{fqn}.{name}')!r}: re-plan, or use tp=1")
        linear.register_forward_hook(lambda m, args, out, _s=start: _SumColumnGrads.apply(out, _s, group))


def check_async_tp_hosts(tp_ranks: list[int], local_world_size: int) -> None:
    """Refuse async TP over a TP group whose ranks sit on more than one host. Symmetric memory maps
    the peers' buffers through CUDA IPC, which reaches only the GPUs of one host: the rendezvous would
    fail deep inside torch. torchrun numbers ranks host by host, `local_world_size` to a host."""
    hosts = sorted({r // local_world_size for r in tp_ranks})
    if len(hosts) > 1:
        raise LayoutError(
            f"tp_comm_overlap with a tensor-parallel group of {len(tp_ranks)} ranks on {len(hosts)} hosts "
            f"({local_world_size} processes per host): async TP runs on symmetric memory, which reaches only "
            f"the GPUs of one host. Use tp <= {local_world_size}, or tp_comm_overlap=False (plans made for "
            "a cluster by meshplan.plan already turn it off for a TP group across nodes)")


def enable_async_tp(stage: nn.Module, blocks: list[str], tp_mesh) -> bool:
    """Async tensor parallelism (the plan's `tp_comm_overlap`) with PyTorch's own machinery:
    symmetric memory on the TP group and inductor's micro-pipeline TP pass, which rewrites each
    compiled block's all-gather -> matmul and matmul -> reduce-scatter pairs into
    `symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter`, so the collective runs in
    chunks under the matmul (torchtitan's `enable_async_tensor_parallel`; it needs torch.compile).

    Only on CUDA: symmetric memory needs NVLink-connected GPUs. Elsewhere (CPU / gloo) it returns
    False and changes nothing, so numerics are those of synchronous TP. Blocks are compiled in
    place (`nn.Module.compile`): FQNs, hooks and FSDP wrapping are unchanged. Returns whether
    async TP is on.
    """
    if tp_mesh.size() == 1 or tp_mesh.device_type != "cuda":
        return False
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        check_async_tp_hosts(tp_mesh.mesh.flatten().tolist(), int(local))
    import torch._inductor.config as inductor_config
    from torch.distributed import _symmetric_memory as symm_mem
    inductor_config._micro_pipeline_tp = True
    if hasattr(symm_mem, "enable_symm_mem_for_group"):      # implicit in newer releases
        symm_mem.enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    for fqn in blocks:
        stage.get_submodule(fqn).compile()
    return True
