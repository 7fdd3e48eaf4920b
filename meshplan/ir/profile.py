"""Graph IR and per-block profiles: what the tracer produces and the cost model reads.

The tracer (`meshplan.profiling.trace`) turns any single-device nn.Module into a
`ModelProfile`. The cost model never looks at an nn.Module: it reads only these frozen
dataclasses, so a 405B model is planned from a few kilobytes of numbers.

Conventions
- FLOPs count a multiply-add as 2. `fwd_flops`/`bwd_flops` are for ONE instance of a block and
  ONE sequence of `ModelProfile.seq_len` tokens (micro-batch 1), as measured on the traced graph
  (attention counted in full, i.e. not halved for causal masking).
- Sizes (hidden, heads, ...) are the architecture as found in the trace, not as declared in a
  config, so a user's own model is described by what it computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshplan.errors import ConfigError

__all__ = ["OpInfo", "LinearInfo", "BlockProfile", "ModelProfile", "MOE_BALANCES", "EXPERT_ROLES", "MOE_ROLES"]

# How the model keeps its routers balanced while it trains (ModelProfile.moe_balance): the cost model
# prices a dropless MoE layer at the busiest EP rank's load, which depends on it.
#   "aux_loss"     a load-balancing loss joins the training loss (Switch / Megatron-Core aux loss,
#                  transformers' router_aux_loss_coef with output_router_logits)
#   "expert_bias"  auxiliary-loss-free balancing: a per-expert bias steering top-k, updated from the
#                  loads every step (DeepSeek-V3; meshplan's moe_expert_bias)
#   "forced"       routing ignores the router (benchmarking mode): meshplan's moe_force_balance
#                  round-robin, exactly equal loads; Megatron-Core --moe-router-force-load-balancing
#                  random logits, equal in expectation (Stack.forced_balance)
#   "none"         nothing balances the router: an untrained one can send most tokens to few experts
#   "unknown"      not recorded (a model meshplan cannot read it from); priced as balanced
MOE_BALANCES = ("aux_loss", "expert_bias", "forced", "none", "unknown")

# Op kinds the tracer assigns. The planner's ILPs reason per kind.
OP_KINDS = (
    "linear",      # matmul with a parameter (nn.Linear, F.linear, expert weight slices)
    "attention",   # scaled_dot_product_attention or an eager softmax(QK^T)V pattern
    "matmul",      # activation x activation matmul outside attention
    "embedding",   # table lookup
    "norm",        # layer/rms norm (fused or decomposed)
    "elementwise", # activations, adds, muls, casts, rope
    "reduction",   # sums, means, softmax outside attention
    "router",      # topk / routing logic of MoE layers
    "moe_dispatch",# gathers/scatters/index ops that move tokens to experts
    "loss",        # cross entropy
    "view",        # reshapes, permutes, slicing (no data movement cost counted)
    "other",
)


# the linear roles of routed experts (a stacked weight per expert, sharded over EP x ETP), and of
# everything a MoE layer adds to a block (router, routed and shared experts)
EXPERT_ROLES = ("expert_in", "expert_out")
MOE_ROLES = ("router", *EXPERT_ROLES, "shared_in", "shared_out", "shared_folded")

@dataclass(frozen=True, kw_only=True)
class OpInfo:
    """One node of the graph IR."""

    name: str                                  # fx node name
    target: str                                # e.g. "aten.linear.default"
    kind: str                                  # one of OP_KINDS
    module: str                                # FQN of the owning module in the ORIGINAL model ("" = root)
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    dtype: str                                 # dtype of the first output, e.g. "bfloat16"
    fwd_flops: float
    bwd_flops: float
    bytes: float                               # bytes read + written by the forward op
    params: tuple[str, ...] = ()               # parameter FQNs (original model) this op reads
    inputs: tuple[str, ...] = ()               # names of the ops / graph inputs whose outputs it reads (the edges)
    role: str = ""                             # for kind "linear": its LinearInfo role ("attn_qkv", ...)
    scalars: tuple[float, ...] = ()            # numeric constants among its arguments (an eps, an exponent)


@dataclass(frozen=True, kw_only=True)
class LinearInfo:
    """A GEMM with a weight, relative to its block.

    `role`: "attn_qkv" (q, k, v or fused qkv), "attn_out", "mlp_in" (fc1 / gate / up),
    "mlp_out" (fc2 / down), "router", "expert_in", "expert_out", "shared_in", "shared_out",
    "shared_folded" (a shared expert's linear that TP keeps whole, run on each TP rank's tokens:
    a MoE layer without routed(x), meshplan.profiling.traits.fold_shared_roles), "other".
    `count`: how many such weights the block holds (E for routed experts, 1 otherwise).
    `tokens_per_token`: average rows that ONE weight of this kind multiplies per block input token
    (1 for dense; topk/E for a routed expert under balanced routing).
    """

    name: str
    in_features: int
    out_features: int
    role: str
    count: int = 1
    tokens_per_token: float = 1.0
    bias: bool = False

    @property
    def params(self) -> int:
        return self.count * (self.in_features * self.out_features + (self.out_features if self.bias else 0))

    @property
    def is_expert(self) -> bool:
        """A routed expert's linear (EXPERT_ROLES)."""
        return self.role in EXPERT_ROLES

    @property
    def flops_per_token(self) -> float:
        """Forward FLOPs per block-input token summed over all `count` weights."""
        return 2.0 * self.in_features * self.out_features * self.count * self.tokens_per_token


@dataclass(frozen=True, kw_only=True)
class BlockProfile:
    """One unique repeated block (a transformer layer), traced once, reused for every instance."""

    signature: str                 # structural fingerprint shared by all instances
    instances: tuple[str, ...]     # FQNs of every instance in the original model, in execution order
    hidden: int
    # attention (0 / None when the block has none)
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0            # value width per head when it differs from head_dim (MLA); 0: head_dim
    causal: bool = True
    # sliding-window attention: each query attends its last `attn_window` keys (itself included);
    # 0 = the whole causal prefix. Blocks of different windows are different block signatures.
    attn_window: int = 0
    attn_sinks: bool = False       # attention sinks: a learned logit per head in the softmax denominator
    # dense MLP
    ffn_hidden: int = 0            # inner width of the dense MLP (0 if none)
    gated: bool = False            # SwiGLU-style (two input projections) vs GELU-style
    # MoE
    experts: int = 0               # routed experts (0 = dense block)
    topk: int = 0
    moe_ffn_hidden: int = 0        # inner width of one routed expert
    shared_ffn_hidden: int = 0     # total inner width of the shared experts (0 if none)
    norm: str = "rmsnorm"          # "rmsnorm" | "layernorm"
    linears: tuple[LinearInfo, ...] = ()
    params: int = 0                # every parameter of one instance
    expert_params: int = 0         # routed-expert parameters of one instance (subset of params)
    fwd_flops: float = 0.0         # traced, one instance, one sequence of ModelProfile.seq_len
    bwd_flops: float = 0.0
    ops: tuple[OpInfo, ...] = field(default=(), repr=False)

    @property
    def count(self) -> int:
        return len(self.instances)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """Value width of all key/value heads (the attention output's is heads x the same)."""
        return self.kv_heads * (self.v_head_dim or self.head_dim)

    @property
    def o_dim(self) -> int:
        """Width of the attention output (the out-projection's input)."""
        return self.heads * (self.v_head_dim or self.head_dim)

    @property
    def latent_dim(self) -> int:
        """Width of the low-rank down-projections feeding the Q/K/V up-projections (MLA's
        wq_a and wkv_a outputs, role "attn_down"), whole on every TP rank; 0 without."""
        return sum(li.out_features for li in self.linears if li.role == "attn_down")


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """Everything the cost model knows about a model."""

    name: str
    fingerprint: str               # hash of the structure + parameter shapes (plans are tied to it)
    seq_len: int                   # sequence length the profile was traced at
    vocab: int
    hidden: int
    dtype: str = "bfloat16"
    embedding_params: int = 0      # token (+ learned position) embeddings
    head_params: int = 0           # output projection; 0 when tied to the embedding
    tied_embeddings: bool = False
    other_params: int = 0          # parameters outside blocks, embedding and head (final norm, ...)
    blocks: tuple[BlockProfile, ...] = ()
    layers: tuple[int, ...] = ()   # execution order: index into `blocks` for each layer
    pre_ops: tuple[OpInfo, ...] = field(default=(), repr=False)    # ops before the first block
    post_ops: tuple[OpInfo, ...] = field(default=(), repr=False)   # ops after the last block
    embedding_fqn: str = ""        # module FQNs, for stage assignment
    head_fqn: str = ""
    # parameter-owning modules outside the blocks, in execution order: those that run before
    # the first block go to the first pipeline stage, the rest to the last (final norm, head)
    pre_modules: tuple[str, ...] = ()
    post_modules: tuple[str, ...] = ()
    # fusion name (meshplan.kernels.fusion) -> True when meshplan's runtime swaps a fused kernel
    # in, False when the model's eager form runs; absent = the pattern does not occur, or the
    # profile was not traced (then the cost model assumes a framework's usual fused kernels).
    # Set by the tracer from meshplan.profiling.fusions.find_fusions.
    fusions: tuple[tuple[str, bool], ...] = ()
    # MoE routing balance while training (MOE_BALANCES), read by the tracer from the model
    # (meshplan.profiling.traits.moe_balance); meaningless for a dense model
    moe_balance: str = "unknown"
    # the model's own expert capacity (tokens beyond cf x an expert's mean rows are dropped), which
    # bounds how far an unbalanced router can load one EP rank; None = dropless
    moe_capacity_factor: float | None = None
    # multi-token-prediction depths (models/mtp.py) trained on the last pipeline stage: each one
    # block of the last layer's kind, a (2h -> h) projection and one more pass of the output layer
    # and loss (cost_models/ranks.py); their parameters are in other_params
    mtp_depth: int = 0

    def __post_init__(self) -> None:
        if self.moe_balance not in MOE_BALANCES:
            raise ConfigError(f"moe_balance {self.moe_balance!r}: one of {', '.join(MOE_BALANCES)}")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise ConfigError(f"moe_capacity_factor {self.moe_capacity_factor!r}: a positive number or None")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total_params(self) -> int:
        return (self.embedding_params + self.head_params + self.other_params
                + sum(b.params * b.count for b in self.blocks) + self.mtp_block_params)

    @property
    def mtp_block_params(self) -> int:
        """Parameters of the MTP depths' blocks, each of the last layer's kind (not in other_params)."""
        return self.mtp_depth * self.blocks[self.layers[-1]].params if self.mtp_depth and self.layers else 0

    @property
    def active_params(self) -> int:
        """Parameters a token touches (routed experts counted topk/E)."""
        active = self.total_params
        for b in self.blocks:
            if b.is_moe:
                active -= b.count * b.expert_params * (1 - b.topk / b.experts)
        last = self.blocks[self.layers[-1]] if self.mtp_depth and self.layers else None
        if last is not None and last.is_moe:
            active -= self.mtp_depth * last.expert_params * (1 - last.topk / last.experts)
        return int(active)

    def layer_blocks(self) -> list[BlockProfile]:
        return [self.blocks[i] for i in self.layers]
