"""Per-GPU memory of training state (cost_models.md §3, §5): weights, gradients, optimizer.

Bytes per parameter with bf16 weights, fp32 main gradients and fp32 Adam (master, m, v):
  zero 0 (DDP)                 2 + 4 + 12     (gradients 2 instead of 4 with grad_dtype="bf16")
  zero 1 (distributed optim.)  2 + 4 + 12/d
  zero 2 (+ sharded grads)     2 + (4 + 12)/d
  zero 3 (FSDP full shard)     (2 + 4 + 12)/d + the unsharded working set of the layers in use
where d is the data-parallel group the optimizer is sharded over (dp*cp for dense weights, the
expert-data-parallel degree for experts).

Optimizer state by `Layout.optimizer_dtype` (the dtype of Adam's m and v) and the stack's main copy
of the weights (`Stack.master_weights`, master_bytes):
                                        master_weights="fp32"    master_weights="remainders"
  "fp32"  m, v fp32                     4 + 4 + 4 = 12           2 + 4 + 4 = 10
  "bf16"  m, v bf16                     4 + 2 + 2 =  8           0 + 2 + 2 =  4
"fp32" is Megatron-LM's distributed optimizer (K.OPTIMIZER_BYTES) and Transformer Engine's FusedAdam
(exp_avg_dtype=exp_avg_sq_dtype=bf16 for the "bf16" row; Megatron-Core --exp-avg-dtype/--exp-avg-sq-dtype
bf16). "remainders" is Apex's DistributedFusedAdam under NeMo 1.x (master_bytes).
"params" is torch.optim over fp32 parameters (meshplan's runtime): the fp32 parameters are the main
copy, counted in the optimizer term as "fp32" counts its copy (4 + 8 = 12 with fp32 moments), and no
bf16 parameters exist; what the "weights" term holds then is the bf16 compute copies the run makes of
them (weight_copy_bytes), and with one micro-batch a step the gradients exist only from the backward
on (peak_gradient_bytes).
With `Layout.optimizer="muon"` the hidden matrices hold fp32 master + momentum, 4 + 4 = 8 bytes per
parameter, and the embedding, head and final norm keep AdamW's bytes (cost_models/muon.py, which
also prices the step's transient buffers).
"""

from __future__ import annotations

from meshplan.cost_models import constants as K
from meshplan.cost_models.context import WHOLE_ON_TP_ROLES
from meshplan.cost_models.muon import MUON_MATRIX_BYTES
from meshplan.ir.support import runs_as_ddp

__all__ = ["master_bytes", "fp8_copies_held", "fp8_cache_bytes", "autocast_runs", "linear_weights_held",
           "weight_copy_bytes", "peak_gradient_bytes", "state_bytes", "grad_bytes", "grad_store_bytes",
           "optimizer_bytes", "adam_bytes", "zero3_working_bytes", "deepep_buffer_bytes"]

# Adam's two moments in the layout's optimizer_dtype
_MOMENT_BYTES = {"fp32": K.FP32, "bf16": K.BF16}


def master_bytes(layout, stack=None) -> float:
    """Bytes per parameter of the optimizer's main copy of the bf16 weights (Stack.master_weights;
    None: a full fp32 copy).

    "remainders" is NVIDIA/apex DistributedFusedAdam (apex/contrib/optimizers/
    distributed_fused_adam.py, StateBucket: params_shard in the state dtype only with store_params,
    param_remainders_shard int16 only with store_param_remainders, exp_avg/exp_avg_sq in the state
    dtype) as NeMo 1.x sets it up for a bf16 model (megatron_base_model.py setup_optimization, v1.23
    through v2.0: state dtype = optim.dtype, default fp32; equal to the model's dtype -> store_params
    False; fp32 state over a bf16 model -> store_param_remainders, the 16 bits a bf16 parameter lacks
    of its fp32 value). So 2 bytes with fp32 moments, none with bf16 moments."""
    if getattr(stack, "master_weights", "fp32") == "remainders":
        return K.BF16 if getattr(layout, "optimizer_dtype", "fp32") == "fp32" else 0.0
    # "fp32" and "params" (the fp32 parameters themselves are the main copy) alike
    return K.FP32


def adam_bytes(layout, stack=None) -> float:
    """AdamW's bytes per parameter: the main weights (master_bytes) + m and v in layout.optimizer_dtype."""
    dtype = getattr(layout, "optimizer_dtype", "fp32")
    return master_bytes(layout, stack) + 2 * _MOMENT_BYTES[dtype]


def optimizer_bytes(layout, stack=None) -> float:
    """Optimizer bytes per parameter: AdamW's (adam_bytes), or with layout.optimizer="muon" the
    hidden matrices' fp32 master + momentum (cost_models/muon.py, which adds the AdamW part back)."""
    if getattr(layout, "optimizer", "adamw") == "muon":
        return MUON_MATRIX_BYTES
    return adam_bytes(layout, stack)


def state_bytes(params: float, shard: int, zero: int, *, grad_bytes: float = K.GRAD_BYTES,
                optimizer_bytes: float = K.OPTIMIZER_BYTES) -> dict[str, float]:
    """Weights / gradients / optimizer bytes for `params` parameters held by a GPU (already
    divided by TP/EP), with optimizer state sharded `shard` ways as the ZeRO stage says.
    `grad_bytes`: bytes per gradient element of the gradient buffer (4 fp32, 2 bf16);
    `optimizer_bytes`: per parameter (12 with fp32 Adam moments, 8 with bf16: optimizer_bytes())."""
    d = max(1, shard)
    weights = K.PARAM_BYTES * params / (d if zero >= 3 else 1)
    grads = grad_bytes * params / (d if zero >= 2 else 1)
    opt = optimizer_bytes * params / (d if zero >= 1 else 1)
    return {"weights": weights, "gradients": grads, "optimizer": opt}


def grad_bytes(layout) -> float:
    """Bytes per element of the gradient reduction (layout.grad_dtype), and of the gradient buffer
    where the stack keeps it in that dtype (grad_store_bytes)."""
    return K.GRAD_BYTES if layout.grad_dtype == "fp32" else K.BF16


def grad_store_bytes(layout, stack) -> float:
    """Bytes per element of the gradients a rank holds between backward and the optimizer step: the
    reduction's dtype, or fp32 where the stack keeps gradients in the parameters' dtype (FSDP2 and
    DDP over fp32 parameters reduce in bf16 and store fp32: Stack.grads_in_param_dtype)."""
    return K.GRAD_BYTES if getattr(stack, "grads_in_param_dtype", False) else grad_bytes(layout)


def fp8_copies_held(dense_params: float, expert_params: float, layout) -> float:
    """Parameters whose FP8 copies (and transposes) a GPU keeps between a step's micro-batches: all it
    holds, or under ZeRO-3 its shards (Megatron-FSDP's --fp8-param-gather stores and all-gathers the
    weights in FP8; FSDP2's float8 all-gather casts the shard): dense weights over `layout.shard`
    ranks, experts over `layout.edp`. A layer's gathered FP8 weight lives only while the layer runs."""
    if layout.zero >= 3 and layout.shard > 1:
        return dense_params / layout.shard + expert_params / layout.edp
    return dense_params + expert_params


def fp8_cache_bytes(stack=None) -> float:
    """Bytes per FP8-run weight of the FP8 copies kept between a step's micro-batches: Transformer
    Engine's weight cache (the FP8 weight and its transpose, K.FP8_WEIGHT_CACHE_BYTES); none with
    torchao, whose Float8Linear casts the weight in each forward and saves the high-precision weight
    itself for backward (torchao/float8/float8_linear.py matmul_with_hp_or_float8_args; a compiled
    block keeps the parameter too, which torch/_functorch/config.py treat_parameters_as_free_to_save
    makes free to save: the fp32 weights were all a compiled torchao block kept of them on CPU)."""
    return 0.0 if getattr(stack, "fp8_impl", "te") == "torchao" else K.FP8_WEIGHT_CACHE_BYTES


def autocast_runs(layout) -> bool:
    """Whether meshplan's runtime gives this layout its mixed precision by autocast over fp32
    parameters rather than FSDP2's bf16 parameter copies: one data-parallel rank (runtime/ddp.py
    data_parallel_mode: no wrapper) or DDP (ir.support.runs_as_ddp); runtime/steps.py data_parallel
    applies ddp.autocast_forward in both cases."""
    return layout.dp * layout.cp == 1 or runs_as_ddp(zero=layout.zero, dp=layout.dp, tp=layout.tp, pp=layout.pp,
                                                      cp=layout.cp, ep=layout.ep, etp=layout.etp)


def linear_weights_held(block, layout) -> float:
    """Elements of `block`'s linear weights one GPU holds: dense ones over TP (those TP keeps whole
    on every rank in full), routed experts over EP x ETP."""
    n = 0.0
    for li in block.linears:
        if li.is_expert:
            n += li.in_features * li.out_features * li.count / (layout.ep * layout.etp)
        else:
            n += li.in_features * li.out_features * li.count / (1 if li.role in WHOLE_ON_TP_ROLES else layout.tp)
    return n


def weight_copy_bytes(blocks, layout, stack, *, fp8_weights: float = 0.0, head_weights: float = 0.0,
                      in_flight: float = 1.0) -> float:
    """Bytes of the bf16 compute copies of its weights a rank holds at its peak where the optimizer
    updates the fp32 parameters themselves (Stack.master_weights="params") and autocast gives the
    mixed precision (autocast_runs); `blocks`: the rank's layers in execution order.

    Autocast casts a weight at each use (runtime/ddp.py autocast_forward) and the matmul saves the
    bf16 copy for its backward, so a layer's linear weights are held in bf16 from its forward to its
    backward, once per micro-batch in flight; torch.compile of the block keeps them too (the
    partitioner saves the casts). Not held: the weights of FP8 linears (`fp8_weights`, elements:
    torchao saves the fp32 parameter itself), those of fully recomputed layers and of layers under
    meshplan's selective checkpointing (its policy saves only matmul outputs and re-runs the casts
    in backward: runtime/recompute.py), the embedding (a lookup, not cast: ddp.cast_embeddings casts
    its output) and the norms (kernels/lean.py computes with the fp32 weight). `head_weights`: the
    output layer's elements on this rank where its matmul runs eagerly under autocast and saves the
    copy (the fused linear + cross-entropy keeps its gradients, not the weight: kernels/linear_ce.py
    _setup; the caller passes 0 then). Where FSDP2 runs instead, its bf16 parameters are the weights
    term as state_bytes counts them."""
    sac = getattr(stack, "selective_sac", False)
    held = 0.0
    for j, b in enumerate(blocks):
        policy = layout.recompute_policy(j)
        if policy == "full" or policy == "selective" and sac:
            continue
        held += linear_weights_held(b, layout)
    return K.BF16 * (max(0.0, held - fp8_weights) + head_weights) * in_flight


def peak_gradient_bytes(full: float, first: float, freed: float, microbatches: int) -> float:
    """Gradient bytes a rank holds at its peak where the runtime frees the gradients after each
    optimizer step (ParallelModel.zero_grad sets every p.grad to None: runtime/model.py) and the step
    has one micro-batch: no gradient exists while the forward's activations are kept, and the backward
    allocates them as it frees activations. `full`: all the rank's gradient bytes; `first`: those the
    backward produces before it frees anything (the output layer's and final norm's); `freed`: the
    activation and compute-copy bytes the backward releases. The peak is either at the backward's
    start (activations + `first`) or at the optimizer step (all gradients, no activations): this
    returns what it adds to the activations, max(first, full - freed). With more micro-batches the
    earlier ones' gradients are held through the later forwards: `full`."""
    if microbatches > 1:
        return full
    return min(full, max(first, full - freed))


def zero3_working_bytes(layout, blocks, grad_elem_bytes: float) -> tuple[float, float]:
    """(weights, gradients) bytes of ZeRO-3's unsharded working set on a rank holding `blocks`.

    - "fsdp2" / "megatron": the unit is a transformer block. Forward holds the current and the
      prefetched block; backward also holds the current block's unsharded gradients before the
      reduce-scatter (bf16 for FSDP2, which casts to the reduce dtype per bucket; the gradient
      buffer's dtype for Megatron-FSDP, which reduces straight from its main-grad buffer).
    - "deepspeed": parameters are gathered per sub-module (nn.Linear) by a coordinator that keeps
      at most `stage3_max_live_parameters` live (a larger module is still gathered whole) and
      prefetches `stage3_prefetch_bucket_size` ahead; gradients leave through a bucket of
      `reduce_bucket_size` elements, the largest module's gradient being produced whole.
    """
    tp = layout.tp
    big = max((b.params - b.expert_params) / tp + b.expert_params / (layout.ep * layout.etp) for b in blocks)
    if layout.fsdp_impl == "deepspeed":
        largest = max((li.in_features * li.out_features for b in blocks for li in b.linears), default=0) / tp
        live = max(largest, min(K.DS_MAX_LIVE_PARAMS, largest + K.DS_PREFETCH_BUCKET))
        return K.PARAM_BYTES * live, K.PARAM_BYTES * max(largest, K.DS_REDUCE_BUCKET)
    g = grad_elem_bytes if layout.fsdp_impl == "megatron" else K.PARAM_BYTES
    return 2 * K.PARAM_BYTES * big, g * big


# ---- DeepEP dispatch/combine buffers --------------------------------------------------------------
# deepseek-ai/DeepEP (legacy/high-throughput mode) at dd758ca: csrc/legacy/config.hpp
# Config::get_nvl_buffer_size_hint / get_rdma_buffer_size_hint, with the per-EP-size configs of
# deep_ep/buffers/legacy.py Buffer.get_dispatch_config / get_combine_config (num_max_nvl_chunked_recv_tokens,
# num_max_rdma_chunked_send/recv_tokens) and Buffer.num_sms = 20 (Megatron-Core's historical
# moe_deepep_num_sms default). Megatron-Core allocates one buffer of the larger of the dispatch and
# combine hints (megatron/core/transformer/moe/fused_a2a.py get_buffer) with hidden_bytes =
# hidden * max(element size, 2). SourceMeta is 2 ints (8 bytes), topk_idx_t int64, kNumMaxTopK =
# kNumMaxScales = 128, 8 NVLink peers.
_DEEPEP_NUM_SMS = 20
_DEEPEP_NVL_PEERS = 8
_DEEPEP_META = 8
# num_ranks -> (nvl recv tokens, dispatch rdma send tokens, combine rdma send tokens, rdma recv tokens)
_DEEPEP_CONFIGS = {2: (256, 6, 6, 128), 4: (256, 6, 6, 128), 8: (256, 6, 6, 128), 16: (288, 20, 12, 128),
                   24: (288, 8, 8, 128), 32: (288, 8, 8, 128), 48: (288, 8, 8, 128), 64: (288, 8, 8, 128),
                   96: (480, 12, 8, 128), 128: (560, 12, 8, 128), 144: (720, 12, 8, 128), 160: (720, 12, 8, 128)}


def _align_up(a: int, b: int) -> int:
    return -(-a // b) * b


def deepep_buffer_bytes(hidden: int, ep: int) -> float:
    """Bytes of the NVLink + RDMA buffers DeepEP's high-throughput kernels keep on every GPU of an EP
    group of `ep` ranks (sizes above; EP sizes DeepEP has no config for take the next larger one)."""
    if ep <= 1:
        return 0.0
    key = min((k for k in _DEEPEP_CONFIGS if k >= ep), default=max(_DEEPEP_CONFIGS))
    nvl_recv, send_d, send_c, rdma_recv = _DEEPEP_CONFIGS[key]
    hb = hidden * 2
    channels = _DEEPEP_NUM_SMS // 2
    nvl_ranks, rdma_ranks = min(ep, _DEEPEP_NVL_PEERS), max(ep // _DEEPEP_NVL_PEERS, 1)
    per_token = hb + _DEEPEP_META + 128 * 8 + 128 * 4 + 128 * 4      # data, meta, topk idx/weights, scales
    nvl = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4 + channels * nvl_ranks * nvl_recv * per_token
    rdma = 0
    if ep > _DEEPEP_NVL_PEERS:
        recv = max(_align_up(rdma_recv, send_d), _align_up(rdma_recv, send_c))
        rdma = channels * rdma_ranks * (_DEEPEP_NVL_PEERS * 2 + 2) * 2 * 4 + \
            channels * rdma_ranks * recv * (per_token + 16) * 2
    return float(_align_up(nvl, 128) + _align_up(rdma, 128))
