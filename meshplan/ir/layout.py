"""`Layout`: the parallel degrees and execution choices that the cost model scores.

A layout is what a user (or the search) chooses; `check_layout` validates it against a model
profile, a cluster and a batch, raising `LayoutError` messages that say what would work.

Rank order (fastest-varying first) follows Megatron-LM's default "tp-cp-ep-dp-pp": a TP group is
`tp` consecutive ranks, a CP group has stride `tp`, the DP group stride `tp*cp`, PP stride
`tp*cp*dp`. Experts are folded over the same `dp*cp*tp` ranks (Megatron-Core "MoE parallel
folding"): an ETP group is `etp` consecutive ranks, an EP group has stride `etp`, and the rest of
those ranks form the expert-data-parallel (EDP) group.
"""

from __future__ import annotations

import functools
import math

from dataclasses import dataclass, fields
from typing import Any, Mapping

from meshplan.errors import ConfigError, LayoutError

__all__ = ["Layout", "SCHEDULES", "RECOMPUTE", "GRAD_DTYPES", "OPTIMIZER_DTYPES", "OPTIMIZERS", "MOE_DISPATCHERS", "FSDP_IMPLS", "ATTN_KERNELS",
           "FP8_RECIPES", "PER_TENSOR_FP8_RECIPES", "CP_COMM_TYPES", "divisors"]

# Pipeline schedules the cost model knows. "interleaved" needs vp > 1; "zb" is ZB-H1
# (Qi et al., ICLR'24): 1F1B memory, about a third of its bubble; "zbv" is ZB-V (zero bubble,
# 1x memory, two chunks per rank in a V); "gpipe" keeps every micro-batch in flight.
SCHEDULES = ("1f1b", "interleaved", "zb", "zbv", "gpipe")
# Activation recompute policies (cost_models.layer.activation_bytes prices each, runtime/recompute.py
# runs each): "selective" re-runs core attention and the MLP activation (Korthikanti et al. 2022);
# "norm_act" re-runs only the block's norms and the routed experts' activation function (Megatron-Core
# --recompute-granularity selective --recompute-modules layernorm moe_act): less memory saved than
# "selective" on a dense model, but almost free to recompute, so it pays where MoE or long-context
# activations are the limit; "norm_moe" re-runs the norms and the whole MoE layer, its token
# dispatch included (--recompute-modules layernorm moe: only the MoE layer's input is kept);
# "op_sac" is torchtitan's op-level selective checkpointing (it saves the outputs of every other
# matmul and of attention and re-runs the other matmuls and every other op); "mla_up" re-runs
# multi-head latent attention's up-projections and rotary embedding (Q, K, V are rebuilt from the
# saved latents in backward) and the dense MLP layers (Megatron-Core --recompute-granularity
# selective --recompute-modules mla_up_proj mlp); "full" keeps only each layer's input. Which of them
# a stack runs: meshplan.ir.stack.Stack.recompute.
RECOMPUTE = ("none", "selective", "norm_act", "norm_moe", "mla_up", "op_sac", "full")
# Gradient buffer / reduction dtype: "fp32" is Megatron-LM's default for bf16 training
# (accumulate_allreduce_grads_in_fp32); "bf16" is Megatron's --grad-reduce-in-bf16 and NeMo 1.x's
# distributed_fused_adam grad_sync_dtype=bf16. meshplan's runtime reduces in either (FSDP2
# reduce_dtype, DDP's bf16 all-reduce hook) and keeps the stored gradients fp32.
GRAD_DTYPES = ("fp32", "bf16")
# Adam moment (m, v) dtype; master weights stay fp32 either way. "bf16" is Transformer Engine's
# FusedAdam(exp_avg_dtype=bf16, exp_avg_sq_dtype=bf16) and Megatron-Core's --exp-avg-dtype bf16
# --exp-avg-sq-dtype bf16: 4 + 2 + 2 = 8 optimizer bytes per parameter instead of 12
# (cost_models/memory.py); meshplan's runtime runs it with runtime/optim.py.
OPTIMIZER_DTYPES = ("fp32", "bf16")
# The optimizer: "adamw", or "muon" (train/muon.py): Muon's momentum + Newton-Schulz update on the
# hidden matrices (fp32 master + momentum: 8 bytes per parameter), AdamW on embeddings, head,
# norms and routers; each matrix is orthogonalised whole on one owner rank, which costs a gather
# of gradient shards and a scatter of updates per step (cost_models/muon.py).
OPTIMIZERS = ("adamw", "muon")
# How MoE tokens reach their experts: "alltoall" sends one copy per (token, chosen expert) (NCCL
# all-to-all, Megatron's alltoall dispatcher); "deepep" sends one copy per (token, destination GPU)
# inside a scale-up domain and one per (token, destination domain) across it, forwarding inside the
# destination domain (DeepEP normal kernels; DeepSeek-V3 report §3.2.2).
MOE_DISPATCHERS = ("alltoall", "deepep")
# ZeRO-3 implementations (zero=3 only): "fsdp2" gathers one transformer block at a time and
# prefetches the next (PyTorch FSDP1/FSDP2, meshplan's runtime); "megatron" is Megatron-FSDP
# (same unit, Megatron's bucketed asynchronous collectives); "deepspeed" is DeepSpeed ZeRO-3,
# which gathers per sub-module under a live-parameter cap.
FSDP_IMPLS = ("fsdp2", "megatron", "deepspeed")
# Flash-attention implementation (flash_attention=True only): "flash" is the one the stack runs
# (meshplan.ir.stack.Stack.attention_kernel: PyTorch SDPA's FlashAttention-2, Transformer Engine's
# cuDNN attention on Hopper+, ...); a named one overrides it: "fa2" FlashAttention-2, "cudnn" cuDNN's
# fused attention, "fa3" FlashAttention-3 (Hopper), "triton" the Triton port of FlashAttention
# (llm-foundry attn_impl: triton). Speeds in constants.ATTN_KERNEL_RATE.
ATTN_KERNELS = ("flash", "fa2", "cudnn", "fa3", "triton")
# FP8 scaling recipes (precision "fp8"; cost_models/constants.py prices each): "tensorwise" one scale
# per tensor from the tensor's own amax (TE current scaling, torchao tensorwise), "delayed" one scale
# per tensor from the amax history of earlier steps (TE DelayedScaling, Megatron --fp8-recipe delayed),
# "rowwise" per-row scales (torchao), "blockwise" 1x128 / 128x128 tiles (DeepSeek-V3, TE
# Float8BlockScaling), "mxfp8" 32-element blocks (OCP MX, Blackwell tensor cores).
FP8_RECIPES = ("tensorwise", "delayed", "rowwise", "blockwise", "mxfp8")
# the recipes with one scale per tensor (the same GEMMs; they differ only in where the scale comes from)
PER_TENSOR_FP8_RECIPES = ("tensorwise", "delayed")
# Context-parallel attention (Megatron-Core --cp-comm-type): "p2p" the ring of K/V blocks overlapped
# with attention (meshplan's runtime), "all_gather" K/V gathered before attention (as Llama 3 ran
# it), "a2a" heads exchanged for sequence (Ulysses).
CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (O(sqrt n): the planner asks for those of 100,000-GPU counts)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n > 0 else []
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True, kw_only=True)
class Layout:
    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    vp: int | None = None    # None: 2 for schedule "zbv" (its V always holds two chunks), else 1
    dp: int = 1
    zero: int = 1            # 0 DDP, 1 distributed optimizer, 2 + sharded grads, 3 FSDP full shard
    mbs: int = 1
    recompute: str | int = "none"   # RECOMPUTE ("none" | "selective" | "norm_act" | "norm_moe" | "mla_up" | "op_sac" | "full") | N = full recompute of N layers per stage
    schedule: str | None = None     # None: "interleaved" when vp > 1, else "1f1b"; a named one is kept or refused
    sp: bool | None = None   # sequence parallel; default: on whenever tp > 1
    tp_comm_overlap: bool = False   # Megatron --tp-comm-overlap (userbuffers)
    # Megatron --overlap-moe-expert-parallel-comm: one micro-batch's expert all-to-all runs while
    # another's forward/backward computes (ir.stack.Stack.runs_ep_overlap says where it applies)
    ep_comm_overlap: bool = False
    flash_attention: bool = True    # False: attention scores are materialised (pre-2022 stacks)
    fsdp_shard: int = 0             # zero=3: ranks each parameter is sharded over (0 = all dp*cp: FSDP;
                                    # a divisor of dp*cp: HSDP, shards inside groups, replicas across)
    reshard_after_forward: bool = True   # zero=3: free gathered weights after forward (False ~ ZeRO-2 memory)
    stage_layers: tuple[int, ...] | None = None   # layers per virtual stage (pp*vp entries); None = even split
    grad_dtype: str = "fp32"        # gradient buffer and reduction dtype (GRAD_DTYPES)
    optimizer_dtype: str = "fp32"   # Adam moments' dtype (OPTIMIZER_DTYPES); master weights stay fp32
    optimizer: str = "adamw"        # OPTIMIZERS: "adamw", or "muon" for the hidden matrices
    moe_dispatcher: str = "alltoall"   # MoE token dispatch (MOE_DISPATCHERS)
    # MoE routing: None = dropless (an aux-loss-balanced router; the busiest EP rank gets more than the
    # mean: cost_models.layer.moe_load_factor); c > 0 = every expert padded / dropped to c x its mean
    # rows (Megatron --moe-expert-capacity-factor c --moe-pad-expert-input-to-capacity); round-robin
    # forced balance (meshplan's moe_force_balance) is priced as 1.0. meshplan's runtime routes dropless.
    moe_capacity_factor: float | None = None
    fsdp_impl: str = "fsdp2"        # zero=3 implementation (FSDP_IMPLS)
    attn_kernel: str = "flash"      # flash-attention implementation (ATTN_KERNELS)
    fp8_recipe: str = "tensorwise"  # FP8 scaling recipe (FP8_RECIPES), for precision "fp8"
    cp_comm_type: str = "p2p"       # context-parallel attention implementation (CP_COMM_TYPES)
    # False: the stack adds each micro-batch's gradients into the fp32 buffer in a separate pass
    # (Megatron-LM before 2022-02, commit 83b1e42f30 "gradient accumulation fusion"; MT-NLG, BLOOM)
    grad_accum_fusion: bool = True
    # True: each transformer block's tensors saved for backward (what its recompute policy keeps:
    # everything with "none", the block input with "full") are copied to host memory in forward and
    # back in backward (runtime/offload.py; priced by cost_models/offload.py)
    offload_activations: bool = False

    def __post_init__(self) -> None:
        # unset choices take their defaults; a value the caller set is validated, never rewritten
        if self.schedule is None:
            # vp only means something for a schedule that has several chunks per rank
            object.__setattr__(self, "schedule", "interleaved" if (self.vp or 1) > 1 else "1f1b")
        if self.vp is None:
            object.__setattr__(self, "vp", 2 if self.schedule == "zbv" else 1)
        for name in ("tp", "cp", "ep", "etp", "pp", "vp", "dp", "mbs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"layout {name}={v!r}: must be a positive integer")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"layout zero={self.zero!r}: must be 0 (DDP), 1 (sharded optimizer), "
                              "2 (+ sharded gradients) or 3 (FSDP full shard)")
        if isinstance(self.recompute, str):
            if self.recompute not in RECOMPUTE:
                raise ConfigError(f"layout recompute={self.recompute!r}: use one of {RECOMPUTE} "
                                  "(\"norm_act\": recompute the norms and the MoE activation only) "
                                  "or a number of fully recomputed layers per stage")
        elif isinstance(self.recompute, bool) or not isinstance(self.recompute, int) or self.recompute < 0:
            raise ConfigError(f"layout recompute={self.recompute!r}: a layer count must be >= 0")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"layout schedule={self.schedule!r}: use one of {SCHEDULES}")
        if self.vp > 1 and self.schedule not in ("interleaved", "zbv"):
            # a named schedule is kept or refused, never rewritten
            raise ConfigError(f"schedule {self.schedule!r} runs one model chunk per pipeline rank, but vp={self.vp} "
                              "virtual stages were asked for; use vp=1 with it, or schedule='interleaved' "
                              "(or 'zbv', vp=2) for virtual stages")
        if self.schedule == "interleaved" and self.vp == 1:
            raise ConfigError("schedule 'interleaved' needs vp > 1 (virtual stages per pipeline rank)")
        if self.schedule == "zbv" and self.vp != 2:
            raise ConfigError(f"schedule 'zbv' places exactly 2 chunks per rank: use vp=2 (or leave vp unset), "
                              f"not vp={self.vp}")
        if self.sp is None:
            object.__setattr__(self, "sp", self.tp > 1)
        if isinstance(self.fsdp_shard, bool) or not isinstance(self.fsdp_shard, int) or self.fsdp_shard < 0:
            raise ConfigError(f"layout fsdp_shard={self.fsdp_shard!r}: a non-negative integer (0 = shard over all of dp*cp)")
        if self.fsdp_shard and self.zero != 3:
            raise ConfigError(f"fsdp_shard={self.fsdp_shard} (HSDP) needs zero=3, not zero={self.zero}")
        for name, known in (("grad_dtype", GRAD_DTYPES), ("optimizer_dtype", OPTIMIZER_DTYPES),
                            ("optimizer", OPTIMIZERS),
                            ("moe_dispatcher", MOE_DISPATCHERS),
                            ("fsdp_impl", FSDP_IMPLS), ("attn_kernel", ATTN_KERNELS),
                            ("fp8_recipe", FP8_RECIPES), ("cp_comm_type", CP_COMM_TYPES)):
            if getattr(self, name) not in known:
                raise ConfigError(f"layout {name}={getattr(self, name)!r}: use one of {known}")
        if not isinstance(self.offload_activations, bool):
            raise ConfigError(f"layout offload_activations={self.offload_activations!r}: true or false")
        cap = self.moe_capacity_factor
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ConfigError(f"layout moe_capacity_factor={cap!r}: a positive number (None = dropless routing)")
        if self.fsdp_impl != "fsdp2" and self.zero != 3:
            raise ConfigError(f"fsdp_impl={self.fsdp_impl!r} names a ZeRO-3 implementation and needs zero=3, "
                              f"not zero={self.zero}; leave fsdp_impl='fsdp2' for zero={self.zero}")
        if self.stage_layers is not None:
            sl = tuple(int(x) for x in self.stage_layers)
            if len(sl) != self.pp * self.vp or min(sl) < 0:
                raise ConfigError(f"stage_layers has {len(sl)} entries; it needs pp*vp = {self.pp * self.vp} "
                                  "non-negative layer counts")
            object.__setattr__(self, "stage_layers", sl)

    # ---- derived ---------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: the dense part's dp*cp*tp ranks regrouped as ep*etp*edp."""
        return max(1, (self.dp * self.cp * self.tp) // (self.ep * self.etp))

    @property
    def shard(self) -> int:
        """Ranks the dense parameters' optimizer state (and, with zero=3, weights) are sharded over."""
        if self.zero == 0:
            return 1
        return self.fsdp_shard or self.dp * self.cp

    @property
    def stages(self) -> int:
        return self.pp * self.vp

    def recompute_policy(self, index_in_rank: int) -> str:
        """A RECOMPUTE policy for the `index_in_rank`-th layer a pipeline rank holds,
        counted over all of its virtual stages in execution order. The cost model prices and the
        runtime applies exactly this (an int N recomputes the first N layers of each rank)."""
        rc = self.recompute
        if isinstance(rc, str):
            return rc
        return "full" if index_in_rank < rc else "none"

    def to_dict(self) -> dict[str, Any]:
        # every field is a scalar but stage_layers (a tuple of ints): a shallow read, not asdict's
        # recursive copy (the search converts thousands of layouts)
        d = {name: getattr(self, name) for name in _field_names()}
        if d["stage_layers"] is not None:
            d["stage_layers"] = list(d["stage_layers"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Layout":
        _check_keys(d)
        d = dict(d)
        if d.get("stage_layers") is not None:
            d["stage_layers"] = tuple(d["stage_layers"])
        return cls(**d)

    @classmethod
    def coerce(cls, layout: "Layout | Mapping[str, Any]") -> "Layout":
        return layout if isinstance(layout, Layout) else cls.from_dict(layout)

    def replace(self, **changes: Any) -> "Layout":
        """This layout with `changes`, validated as a new one. The defaults it resolved (vp,
        schedule, sp) are kept as resolved: pass e.g. sp=None with a new tp to derive sp again."""
        _check_keys(changes)
        # what __init__ does (set every field, then __post_init__), at a third of its cost: the
        # search derives a layout per recompute option and micro-batch size of every candidate
        new = object.__new__(Layout)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        new.__post_init__()
        return new

    def short(self) -> str:
        parts = [f"tp{self.tp}", f"cp{self.cp}", f"pp{self.pp}"]
        if self.vp > 1:
            parts.append(f"vp{self.vp}")
        parts.append(f"dp{self.dp}")
        if self.ep > 1 or self.etp > 1:
            parts.append(f"ep{self.ep}")
            if self.etp > 1:
                parts.append(f"etp{self.etp}")
        if self.zero == 3 and self.fsdp_shard:
            parts.append(f"hsdp{self.fsdp_shard}")
        if self.zero == 3 and not self.reshard_after_forward:
            parts.append("keep-gathered")
        if self.zero == 3 and self.fsdp_impl != "fsdp2":
            parts.append(f"{self.fsdp_impl}-zero3")
        if self.grad_dtype != "fp32":
            parts.append(f"grads-{self.grad_dtype}")
        if self.optimizer_dtype != "fp32":
            parts.append(f"adam-{self.optimizer_dtype}")
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        if self.moe_dispatcher != "alltoall" and self.ep > 1:
            parts.append(self.moe_dispatcher)
        if self.ep_comm_overlap and self.ep > 1:
            parts.append("ep-overlap")
        if self.attn_kernel != "flash" and self.flash_attention:
            parts.append(f"{self.attn_kernel}-attn")
        if self.fp8_recipe != "tensorwise":
            parts.append(f"fp8-{self.fp8_recipe}")
        if self.cp_comm_type != "p2p" and self.cp > 1:
            parts.append(f"cp-{self.cp_comm_type}")
        if not self.grad_accum_fusion:
            parts.append("unfused-grad-accum")
        if self.offload_activations:
            parts.append("offload-act")
        parts += [f"z{self.zero}", f"mbs{self.mbs}", f"rc={self.recompute}", self.schedule]
        return " ".join(parts)


def _opts(n: int, limit: int | None = None) -> str:
    ds = divisors(n)
    if limit:
        ds = [d for d in ds if d <= limit]
    return ", ".join(map(str, ds[:12])) + (" ..." if len(ds) > 12 else "")


def split_layers(num_layers: int, stages: int) -> tuple[int, ...]:
    """Even contiguous split, remainder on the middle stages (the first holds embeddings and the
    most in-flight activations, the last holds the output layer and loss)."""
    base, rem = divmod(num_layers, stages)
    counts = [base] * stages
    order = sorted(range(stages), key=lambda i: (i in (0, stages - 1), abs(i - (stages - 1) / 2)))
    for i in order[:rem]:
        counts[i] += 1
    return tuple(counts)


def check_layout(layout: Layout, profile, cluster, *, seq_len: int, global_batch: int) -> tuple[int, ...]:
    """Validate `layout` for this model/cluster/batch. Returns the layers per virtual stage.

    Every failure is a LayoutError naming the quantity and listing values that would work.
    """
    L = layout
    n = cluster.num_gpus
    if L.world != n:
        rest = L.tp * L.cp * L.pp
        if n % rest == 0:
            hint = f"use dp={n // rest}"
        else:
            hint = f"tp*cp*pp = {rest} does not divide {n}; use tp, cp, pp whose product divides {n} ({{{_opts(n)}}})"
        raise LayoutError(f"tp={L.tp} * cp={L.cp} * pp={L.pp} * dp={L.dp} = {L.world}, but the cluster has {n} GPUs; "
                          f"the degrees must multiply to {n}: {hint}")
    if seq_len < 1 or global_batch < 1:
        raise LayoutError(f"seq_len ({seq_len}) and global_batch ({global_batch}) must be positive")
    blocks = [profile.blocks[i] for i in sorted(set(profile.layers))]     # each block once
    attn = [b for b in blocks if b.heads]
    if attn:
        heads = min(b.heads for b in attn)
        kv = min(b.kv_heads for b in attn)
        if heads % L.tp:
            raise LayoutError(f"tp={L.tp} does not divide the {heads} attention heads; use tp in {{{_opts(heads)}}}")
        if kv % L.tp:
            raise LayoutError(f"tp={L.tp} does not divide the {kv} key/value heads (GQA groups); "
                              f"use tp in {{{_opts(kv)}}}")
    for b in blocks:
        for width, what, name, tdeg in ((b.ffn_hidden, "MLP hidden size", "tp", L.tp),
                                        (b.moe_ffn_hidden, "expert hidden size", "etp", L.etp)):
            if width and width % tdeg:
                raise LayoutError(f"{name}={tdeg} does not divide the {what} {width}; "
                                  f"use one of {{{_opts(width, 64)}}}")
    if profile.vocab % L.tp:
        raise LayoutError(f"tp={L.tp} does not divide the vocabulary ({profile.vocab}); pad the vocabulary to a "
                          f"multiple of {L.tp} (Megatron pads to 128*tp) or use tp in {{{_opts(profile.vocab, 64)}}}")
    if L.fsdp_shard and (L.dp * L.cp) % L.fsdp_shard:
        raise LayoutError(f"fsdp_shard={L.fsdp_shard} must divide dp*cp = {L.dp * L.cp}; use one of "
                          f"{{{_opts(L.dp * L.cp)}}}")
    moe = [b for b in blocks if b.is_moe]
    if moe:
        e = min(b.experts for b in moe)
        if e % L.ep:
            raise LayoutError(f"ep={L.ep} does not divide the {e} experts; use ep in {{{_opts(e)}}}")
        fold = L.dp * L.cp * L.tp
        if fold % (L.ep * L.etp):
            raise LayoutError(f"ep*etp = {L.ep * L.etp} must divide dp*cp*tp = {fold} (experts are folded over "
                              f"the same ranks as the dense layers); use ep*etp in {{{_opts(fold)}}}")
    elif L.ep > 1 or L.etp > 1:
        raise LayoutError(f"ep={L.ep}, etp={L.etp} but the model has no MoE layers; use ep=1, etp=1")
    chunk = 2 * L.cp if L.cp > 1 else 1   # load-balanced causal CP splits the sequence into 2*cp chunks
    if seq_len % chunk:
        raise LayoutError(f"cp={L.cp} needs seq_len divisible by 2*cp = {chunk} (load-balanced causal split); "
                          f"seq_len {seq_len} is not")
    if L.sp and L.tp > 1 and (seq_len // L.cp) % L.tp:
        raise LayoutError(f"sequence parallelism needs seq_len/cp = {seq_len // L.cp} divisible by tp={L.tp}")
    if global_batch % (L.dp * L.mbs):
        ok = [m for m in divisors(global_batch // L.dp) if m <= 64] if global_batch % L.dp == 0 else []
        hint = f"use mbs in {{{', '.join(map(str, ok))}}}" if ok else \
            f"dp={L.dp} does not divide global_batch {global_batch}; choose dp among {{{_opts(global_batch)}}}"
        raise LayoutError(f"global_batch {global_batch} is not divisible by dp*mbs = {L.dp}*{L.mbs}; {hint}")
    m = global_batch // (L.dp * L.mbs)
    if L.schedule == "interleaved" and m < L.pp:
        raise LayoutError(f"the interleaved schedule needs at least pp={L.pp} micro-batches per step; "
                          f"global_batch/(dp*mbs) = {m}: lower mbs or dp, or use vp=1")
    nl = profile.num_layers
    if L.stage_layers is not None:
        if sum(L.stage_layers) != nl:
            raise LayoutError(f"stage_layers sums to {sum(L.stage_layers)} but the model has {nl} layers")
        return L.stage_layers
    stages = L.pp * L.vp
    if stages > nl:
        raise LayoutError(f"pp*vp = {stages} stages but the model has only {nl} layers; use pp*vp <= {nl}")
    if nl % stages:
        good = [d for d in divisors(nl) if d <= 128]
        raise LayoutError(f"{nl} layers do not split evenly into pp*vp = {L.pp}*{L.vp} = {stages} stages; use pp*vp in "
                          f"{{{', '.join(map(str, good))}}} or pass stage_layers=(...) for an uneven split")
    if isinstance(L.recompute, int) and not isinstance(L.recompute, bool) and L.recompute > nl // L.pp:
        raise LayoutError(f"recompute={L.recompute} layers per stage, but a pipeline rank holds only {nl // L.pp}")
    return (nl // stages,) * stages


@functools.lru_cache(maxsize=None)
def _field_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(Layout))


def _check_keys(d: Mapping[str, Any]) -> None:
    unknown = sorted(set(d).difference(_field_names()))
    if unknown:
        raise ConfigError(f"unknown layout key(s) {unknown}; known keys: {sorted(_field_names())}")
