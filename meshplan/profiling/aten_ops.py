"""Families of aten ops, by schema name ("aten::mul"): the one home of every op-name set the
tracer (`trace`, `trace_nodes`, `trace_patterns`, `block_analysis`, `op_costs`) and the sharding
ILP (`sharding_graph`) match ops against.

Plain data, no torch: the sharding ILP runs while planning, where `import torch` is not paid.
The tracer's graph names `operator.getitem` "getitem" (GETITEM), not an aten name. The sharding
ILP reads `OpInfo.target` strings ("aten.mul.Tensor") and compares bare names ("mul"): it takes
its sets through `bare()`.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "GETITEM", "bare", "schema_of", "RMS_CHAIN_OPS",
    "CAST_OPS", "DROPOUT_OPS", "SOFTMAX_OPS", "LOG_SOFTMAX_OPS", "SWAP_OPS", "PERMUTE_OPS",
    "LAYER_NORM_OPS", "RMS_NORM_OPS", "GROUP_NORM_OPS", "SUM_OPS", "SDPA_OPS",
    "VIEW_OPS", "COPY_OPS", "NORM_OPS", "DIM_REDUCING_OPS", "REDUCTION_OPS", "LOSS_OPS",
    "EMBEDDING_OPS", "DISPATCH_OPS", "MATMUL_OPS", "ADDMM_OPS", "ATTENTION_OPS", "ALIAS_CANDIDATE_OPS",
    "SKIP_OPS", "PARAM_PASS_OPS", "NON_DIFFERENTIABLE_OPS", "SCORE_OPS", "PROB_OPS",
    "KEY_TRANSPOSE_OPS", "PASS_FORWARD_OPS", "CAUSAL_MASK_OPS", "COMPARISON_OPS", "SLICE_OPS",
    "KV_STOP_OPS", "VARIANCE_OPS",
    "SHARD_LINEAR_OPS", "SHARD_MATMUL_OPS", "SHARD_VIEW_OPS", "ROW_OPS", "CONCAT_OPS",
]

GETITEM = "getitem"


def bare(ops: Iterable[str]) -> frozenset[str]:
    """The names without their namespace ("aten::mul" -> "mul"; "getitem" stays)."""
    return frozenset(op.rpartition("::")[2] for op in ops)


def schema_of(target: str) -> str:
    """An IR target string's schema name ("aten.mul.Tensor" -> "aten::mul")."""
    parts = target.split(".")
    return f"{parts[0]}::{parts[1]}" if len(parts) >= 2 else target


def _aten(*names: str) -> frozenset[str]:
    return frozenset(f"aten::{n}" for n in names)


# ---- building blocks ---------------------------------------------------------------------------

CAST_OPS = _aten("_to_copy", "to", "type_as")
DROPOUT_OPS = _aten("dropout", "native_dropout")
SOFTMAX_OPS = _aten("softmax", "_softmax", "_safe_softmax")
LOG_SOFTMAX_OPS = _aten("log_softmax", "_log_softmax")
SWAP_OPS = _aten("transpose", "t", "mT", "swapaxes", "swapdims", "adjoint")   # two dims trade places
PERMUTE_OPS = SWAP_OPS | _aten("permute", "movedim")
LAYER_NORM_OPS = _aten("layer_norm", "native_layer_norm")
RMS_NORM_OPS = _aten("rms_norm", "_fused_rms_norm")
GROUP_NORM_OPS = _aten("group_norm", "native_group_norm")
SUM_OPS = _aten("sum", "mean")          # linear in their input: a summed-away shard gives partial sums
# The fused attention kernels (what `F.scaled_dot_product_attention` exports as).
SDPA_OPS = _aten("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu")


# ---- the IR's op kinds (op_costs.op_kind; see profile.OP_KINDS) --------------------------------

VIEW_OPS = _aten(
    "view", "reshape", "_unsafe_view", "permute", "transpose", "t", "expand", "expand_as",
    "unsqueeze", "squeeze", "slice", "select", "split", "split_with_sizes", "chunk", "unbind",
    "alias", "detach", "flatten", "unflatten", "movedim", "as_strided", "narrow", "view_as",
    "diagonal", "tensor_split", "lift_fresh_copy", "numpy_T", "mT", "swapaxes", "unfold",
    "view_as_real", "view_as_complex", "_reshape_alias")
# Copies that move data without computing (their bytes count, their FLOPs do not).
COPY_OPS = CAST_OPS | _aten("clone", "contiguous", "cat", "stack", "copy", "copy_", "repeat", "pad",
                            "constant_pad_nd", "roll", "flip")
NORM_OPS = LAYER_NORM_OPS | RMS_NORM_OPS | GROUP_NORM_OPS | _aten(
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "instance_norm")
# Reductions over dims (the sharding ILP's too: std_mean, with two outputs, is not among them).
DIM_REDUCING_OPS = SUM_OPS | _aten("amax", "amin", "max", "min", "var", "std", "var_mean", "prod",
                                   "logsumexp", "linalg_vector_norm", "norm", "argmax", "argmin",
                                   "any", "all")
REDUCTION_OPS = (DIM_REDUCING_OPS | SOFTMAX_OPS | LOG_SOFTMAX_OPS
                 | _aten("std_mean", "cumsum", "cumprod"))
LOSS_OPS = _aten(
    "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss_nd", "mse_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "smooth_l1_loss",
    "l1_loss", "huber_loss")
EMBEDDING_OPS = _aten("embedding", "embedding_bag", "_embedding_bag")
# Ops that move tokens to and from experts when they depend on a router's top-k choice.
DISPATCH_OPS = _aten(
    "sort", "argsort", "histc", "bincount", "scatter", "scatter_add", "scatter_reduce", "index_add",
    "index_select", "gather", "index", "index_put", "index_put_", "index_copy", "repeat_interleave",
    "one_hot", "masked_scatter", "nonzero", "cumsum", "masked_select")
# Ops whose FLOPs are matrix products of their first two tensor arguments.
MATMUL_OPS = _aten("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "einsum", "_scaled_mm",
                   "addbmm", "mv", "dot")
ADDMM_OPS = _aten("addmm", "baddbmm", "addbmm")    # input + a @ b: the product's operands are args 1, 2
ATTENTION_OPS = SDPA_OPS | _aten("_scaled_dot_product_attention_math")
# Casts and reshapes that may return their input unchanged (op_costs.aliases_input decides).
ALIAS_CANDIDATE_OPS = CAST_OPS | _aten("contiguous", "reshape")


# ---- the tracer's graph passes -----------------------------------------------------------------

# Ops that produce no value the IR cares about (export's runtime assertions).
SKIP_OPS = _aten("_assert_tensor_metadata", "_assert_scalar", "_assert_async", "sym_constrain_range",
                 "sym_constrain_range_for_size", "_print")
# Ops through which a parameter stays "the parameter" (casts, views, expert-row selection).
PARAM_PASS_OPS = VIEW_OPS | CAST_OPS | {GETITEM} | _aten("clone", "contiguous", "index", "index_select", "t")
NON_DIFFERENTIABLE_OPS = _aten("detach", "argsort", "argmax", "argmin")
# Between q·kᵀ and softmax: scaling, soft-capping, masking, casts.
SCORE_OPS = CAST_OPS | _aten("mul", "div", "add", "sub", "masked_fill", "where", "tanh", "clone",
                             "contiguous", "masked_fill_", "add_", "div_", "mul_")
# Between softmax and probs·v: casts and dropout.
PROB_OPS = CAST_OPS | DROPOUT_OPS | {GETITEM} | _aten("mul", "div", "clone", "contiguous", "masked_fill")
# What may turn k into the kᵀ of an eager q·kᵀ.
KEY_TRANSPOSE_OPS = _aten("transpose", "permute", "t", "mT")
# Single-input pass-through ops between attention and its output projection.
PASS_FORWARD_OPS = VIEW_OPS | COPY_OPS | {GETITEM} | _aten("mul", "sigmoid", "dropout")
# Builders of a causal mask: tril/triu, or position indices compared with one another.
CAUSAL_MASK_OPS = _aten("tril", "triu", "tril_indices", "triu_indices")
COMPARISON_OPS = _aten("le", "lt", "ge", "gt")
# Where one part of a fused projection's output starts (the gated-MLP test).
SLICE_OPS = {GETITEM} | _aten("slice", "narrow", "select")
# Where the search for the key heads before a GQA repeat stops (besides computing ops).
KV_STOP_OPS = {GETITEM} | _aten("cat", "stack")
# A decomposed norm that computes these subtracts the mean: a LayerNorm.
VARIANCE_OPS = _aten("var", "var_mean", "std")


# ---- the sharding ILP's strategy templates (compared by bare name, see bare()) ----------------

SHARD_LINEAR_OPS = _aten("linear", "mm", "addmm", "matmul")     # with a 2-D weight: a linear layer
SHARD_MATMUL_OPS = _aten("bmm", "matmul", "mm")                 # activation x activation
# Output dims follow the first input's and no work is done.
SHARD_VIEW_OPS = PERMUTE_OPS | CAST_OPS | DROPOUT_OPS | {GETITEM} | _aten(
    "clone", "contiguous", "detach", "alias", "lift_fresh_copy", "expand", "expand_as", "slice",
    "select", "narrow", "split", "chunk", "unbind", "split_with_sizes", "view", "reshape",
    "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as")
# Along the last dim (the dim argument is not in the IR): never sharded there.
ROW_OPS = SOFTMAX_OPS | LOG_SOFTMAX_OPS | _aten("cumsum", "cumprod", "sort", "argsort", "logcumsumexp")
CONCAT_OPS = _aten("cat", "concat", "concatenate", "stack")
# the non-view ops an eager (decomposed) RMSNorm is made of, casts included
RMS_CHAIN_OPS = CAST_OPS | _aten("pow", "mean", "add", "rsqrt", "mul", "div", "sqrt", "reciprocal")
