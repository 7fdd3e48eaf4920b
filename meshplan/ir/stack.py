"""`Stack`: the software that runs a plan, as the cost model and the planner need to know it.

The same layout costs different time on different stacks: which attention kernel runs, whether
element-wise work is fused, how tensor-parallel and expert-parallel communication overlap compute,
how context parallelism is implemented, what "selective recompute" means, whether gradient
accumulation is fused into the weight-gradient GEMM, which FP8 recipes exist. A `Stack` names those
choices; `meshplan.plan(..., stack=...)` plans only what that stack runs and prices it as it runs,
`meshplan.estimate(..., stack=...)` prices a layout on it, and `meshplan plan --export X` plans for
X's stack.

Presets (each default from the stack's own documentation or source, cited at the preset):

| name            | what it is                                                                  |
|-----------------|-----------------------------------------------------------------------------|
| `meshplan`      | meshplan's own runtime (`meshplan.parallelize`, `meshplan train`)           |
| `torchtitan`    | PyTorch-native: FSDP2, DTensor TP (+ async TP), torch.compile, torchao FP8, PyTorch context parallelism, torch.distributed.pipelining |
| `megatron-core` | Megatron-Core with Transformer Engine (Megatron-LM today, NeMo 2, Megatron-Bridge) |
| `megatron-2021` | Megatron-LM as of 2021-22 (SC'21, Korthikanti et al.): no flash attention, unfused gradient accumulation |
| `megatron-deepspeed` | Megatron-DeepSpeed (BLOOM, MT-NLG): those layers under DeepSpeed's pipeline engine (blocking p2p, gradient all-reduce after the pipeline drains) |
| `llm-foundry`   | MosaicML llm-foundry: PyTorch FSDP, the Triton FlashAttention port          |
| `reference`     | the stack-neutral baseline the fitted constants describe: FlashAttention-2-class attention, fused element-wise kernels, everything else as the layout says |

A stack is a frozen value; `Stack.preset(name)` returns a preset, `stack.replace(compile=True)`
a variant (e.g. torchtitan with or without torch.compile).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from meshplan.errors import ConfigError
from meshplan.ir.gpu_arch import orders_kernels_by_queue
from meshplan.ir.layout import FP8_RECIPES

__all__ = ["Stack", "STACKS", "PARALLEL_DIMS", "FSDP_PASSES", "ATTENTION_IMPLS", "CP_IMPLS", "TP_OVERLAPS", "EP_OVERLAPS", "EXPERT_GEMMS", "RECOMPUTE_POLICIES",
           "MASTER_WEIGHTS", "FP8_IMPLS", "resolve_stack"]

# Attention implementations: "fa2" FlashAttention-2 class on every GPU (PyTorch SDPA's flash
# backend is FlashAttention-2); "te" Transformer Engine's choice, cuDNN fused attention on Hopper
# and newer, FlashAttention-2 before; "fa3" FlashAttention-3 (Hopper); "triton" the Triton port of
# FlashAttention; "eager" materialised scores (no flash kernel).
ATTENTION_IMPLS = ("fa2", "te", "fa3", "triton", "eager")
# Context-parallel implementations: "te" Transformer Engine's (p2p ring overlapped with attention,
# all_gather, a2a: Megatron --cp-comm-type); "torch" PyTorch's context_parallel (K/V all-gathered,
# then one SDPA call per chunk pair merged by log-sum-exp); "meshplan" meshplan's ring (runtime/
# context_parallel.py: fp32 score blocks per chunk pair, merged by log-sum-exp).
CP_IMPLS = ("te", "torch", "meshplan")
# Tensor-parallel communication overlap: "userbuffers" (Megatron --tp-comm-overlap), "async_tp"
# (PyTorch's micro-pipelined all-gather-matmul / matmul-reduce-scatter, torchtitan
# enable_async_tensor_parallel), "none".
TP_OVERLAPS = ("none", "userbuffers", "async_tp")
# Expert-parallel all-to-all overlap: "none" (the dispatch and combine wait for the experts),
# "a2a_1f1b" (Megatron --overlap-moe-expert-parallel-comm: one micro-batch's all-to-all runs while
# another's attention/experts compute, under interleaved 1F1B).
EP_OVERLAPS = ("none", "a2a_1f1b")
# Stack.parallel_dims values: tensor, context, expert and pipeline parallelism
PARALLEL_DIMS = ("tp", "cp", "ep", "pp")
# Stack.fsdp_passes values: PyTorch FSDP2's copies, FSDP1's flat-gradient passes, none
FSDP_PASSES = ("none", "fsdp2", "fsdp1")
# Stack.expert_gemm values
EXPERT_GEMMS = ("grouped", "per_expert")
# How a stack's benchmarking "forced balance" routes (Stack.forced_balance, for a profile whose
# moe_balance is "forced"): "round_robin" hands every expert exactly its mean rows (meshplan's
# moe_force_balance); "random_logits" replaces the router's logits by random ones and dispatches as
# usual (Megatron-Core --moe-router-force-load-balancing: router.py apply_random_logits), so tokens
# route independently and uniformly in expectation, the dispatch stays dropless (its split sizes are
# read on the host) and the busiest rank carries the statistical excess (cost_models.moe_load).
FORCED_BALANCES = ("round_robin", "random_logits")
# How the optimizer keeps the main copy of the bf16 parameters (Stack.master_weights): "fp32" a full
# fp32 copy beside them (Megatron-Core's distributed optimizer, Transformer Engine's FusedAdam with
# master_weights, torch.optim over fp32 parameters); "remainders" Apex's DistributedFusedAdam as NeMo
# 1.x configures it for a bf16 model (memory.master_bytes): with fp32 Adam state only the low 16 bits
# of each fp32 main weight, whose high 16 bits are the bf16 parameter itself; with bf16 Adam state
# nothing, the bf16 parameters being updated in place; "params" no bf16 parameters at all: the
# parameters are fp32 and the optimizer updates them (meshplan's runtime: torch.optim over the model's
# fp32 parameters, bf16 compute by autocast where no FSDP2 wrapper casts, runtime/ddp.py
# autocast_forward), so the "weights" a rank holds are the bf16 copies its layers keep for backward
# and, with one micro-batch a step, its gradients exist only from the backward on
# (memory.weight_copy_bytes, memory.peak_gradient_bytes).
MASTER_WEIGHTS = ("fp32", "remainders", "params")
# Who quantises FP8 linears' tensors (Stack.fp8_impl): "te" Transformer Engine's fused CUDA cast
# kernels, the same with or without torch.compile; "torchao" torchao's float8 training, whose casts
# are PyTorch ops that only torch.compile fuses (eager, each is a chain of separate kernels:
# cost_models.constants.FP8_EAGER_QUANT_BYTES).
FP8_IMPLS = ("te", "torchao")
# Every recompute policy some stack offers (meshplan.ir.layout.RECOMPUTE holds those the Layout takes).
RECOMPUTE_POLICIES = ("none", "selective", "norm_act", "norm_moe", "mla_up", "op_sac", "full")


@dataclass(frozen=True, kw_only=True)
class Stack:
    name: str
    attention: str = "fa2"                 # ATTENTION_IMPLS
    cp_impl: str = "te"                    # CP_IMPLS
    cp_kinds: tuple[str, ...] = ("p2p",)   # cp_comm_type values the stack runs (ir.layout.CP_COMM_TYPES)
    fp8_recipes: tuple[str, ...] = ("tensorwise",)
    fp8_impl: str = "te"                   # FP8_IMPLS: whose kernels quantise the FP8 linears' tensors
    # torchao FP8 under FSDP2 (fp8_impl "torchao"): whether TP-sharded weights are all-gathered in FP8 too
    # (torchtitan; meshplan's runtime gathers a TP-sharded DTensor weight in BF16: runtime/fp8.py), and
    # whether the stack calls precompute_float8_dynamic_scale_for_fsdp after each optimizer step
    # (torchtitan; meshplan's runtime does not: each gather takes its shard's amax again)
    fp8_gather_under_tp: bool = True
    fp8_precompute_scales: bool = True
    # FP8 recipes under which the stack keeps the parameters themselves in FP8 (no BF16 working copy):
    # Megatron-Core's --fp8-param-gather, which Megatron-Bridge's MXFP8 precision recipe turns on
    # (bf16_with_mxfp8_mixed: fp8_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=True)
    fp8_param_gather: tuple[str, ...] = ()
    # the parallel dimensions beside data parallelism / ZeRO the stack runs (PARALLEL_DIMS); the
    # planner keeps the others at 1
    parallel_dims: tuple[str, ...] = ("tp", "cp", "ep", "pp")
    recompute: tuple[str, ...] = ("none", "selective", "full")   # policies offered (RECOMPUTE_POLICIES)
    tp_overlap: str = "none"               # TP_OVERLAPS: the mechanism Layout.tp_comm_overlap switches on
    ep_overlap: str = "none"               # EP_OVERLAPS
    moe_dispatchers: tuple[str, ...] = ("alltoall",)
    schedules: tuple[str, ...] = ("1f1b", "interleaved")
    fsdp_impls: tuple[str, ...] = ("fsdp2",)
    fused_elementwise: bool = True         # norms, SwiGLU, rotary as fused kernels (TE / compile)
    compile: bool = False                  # torch.compile fuses element-wise work (implies fused)
    cuda_graphs: bool = False              # MoE layers captured in CUDA graphs (no per-kernel launch gaps)
    # how routed experts' GEMMs run: "grouped" = one grouped kernel per expert linear (torch._grouped_mm);
    # "per_expert" = one GEMM launch per local expert, as Transformer Engine's GroupedLinear runs them by
    # default on every released TE 2.x (common/gemm/cublaslt_gemm.cu multi_stream_cublas_gemm: cuBLASLt
    # per expert over 4 streams; its single-kernel grouped paths are opt-in), with per-expert FP8 casts
    expert_gemm: str = "grouped"           # EXPERT_GEMMS
    # dropless token dispatch makes the host wait for the GPU once per MoE layer (the all-to-all's split
    # sizes and the grouped GEMM's per-expert row counts are read on the CPU: Megatron-Core's
    # token_dispatcher cuda_sync_point "before_ep_alltoall", TEGroupedMLP tokens_per_expert.tolist(),
    # DeepEP's and HybridEP's received-count waits), so the host cannot run ahead of the GPU there
    moe_host_sync: bool = False
    forced_balance: str = "round_robin"    # FORCED_BALANCES
    grad_accum_fusion: bool = True         # wgrad GEMM adds into the fp32 gradient buffer (beta = 1)
    # "selective" as PyTorch selective activation checkpointing over every op of the block, saving
    # the matmul and reduced-collective outputs (meshplan's runtime/recompute.py): the norms and the
    # attention core are re-run too, so their outputs are not kept, the MLP's reduced output is, and
    # the attention output projection's GEMM runs again in backward. False: Korthikanti's selective
    # (only core attention re-run: the MLP activation's input and output stay stored; Megatron-Core's
    # --recompute-granularity selective, whose default --recompute-modules is core_attn).
    selective_sac: bool = False
    # gradients held from backward to the optimizer step are in the (fp32) parameters' dtype whatever
    # grad_dtype reduces in: FSDP2 casts each reduced shard back to the sharded parameter's dtype, DDP
    # keeps param.grad; Megatron-Core's --grad-reduce-in-bf16 makes the buffer itself bf16 (False)
    grads_in_param_dtype: bool = False
    master_weights: str = "fp32"           # MASTER_WEIGHTS
    # the attention output projection keeps for backward the attention kernel's output itself, not a
    # copy: PyTorch SDPA's flash output is laid out (batch, seq, heads, head dim), so the projection's
    # (tokens, heads x head dim) input is a view of it (meshplan's runtime without CP, eager and
    # compiled; counted by tests/cost_models/test_meshplan_runtime_memory.py). False: Korthikanti's
    # count, the projection's input apart from the kernel's saved output (2 bytes per element each).
    attn_out_shared: bool = False
    runtime_checks: bool = False           # the planner applies meshplan.ir.support (meshplan's runtime)
    pp_min_microbatches: bool = False      # torch.distributed.pipelining: at least pp micro-batches a step
    # torch.distributed.pipelining drives FSDP2 under PP: each micro-batch's backward runs without
    # gradient sync or resharding, and one reduce-scatter per stage follows the last micro-batch
    # (PipelineStage.backward_maybe_with_nosync / perform_reduce_grad)
    pp_fsdp_deferred: bool = False
    # each TP rank sends only its 1/tp slice of the activation to the next stage, which all-gathers
    # it over the TP group (Megatron-LM 2021 scatter_gather_tensors_in_pipeline, SC'21 Sec. 4.1;
    # DeepSpeed's PipelineEngine pipe_partitioned / grad_partitioned, on by default); with sequence
    # parallelism every stack sends the 1/tp sequence shard anyway
    pp_scatter_gather: bool = False
    # pipeline sends and receives block the compute stream at every micro-batch: DeepSpeed's
    # PipelineEngine (runtime/pipe/p2p.py send/recv refuse async_op; TrainSchedule exchanges before
    # each forward and backward), so every slot of the pipeline pays its transfers, not only the
    # fill and drain (cost_models.tables.pipeline_p2p_s)
    pp_blocking_p2p: bool = False
    # the data-parallel gradient reduction (and ZeRO-1/2's parameter all-gather) overlaps the last
    # micro-batch's backward (first forward); False: it runs after the pipeline has drained, as
    # DeepSpeed's TrainSchedule issues ReduceTiedGrads / ReduceGrads / OptimizerStep after its last step
    dp_overlap: bool = True
    # the highest ZeRO stage the stack runs together with pipeline parallelism (DeepSpeed's
    # PipelineEngine asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism")
    max_zero_with_pp: int = 3
    # the element-wise passes PyTorch FSDP runs around its collectives (cost_models.estimate.
    # fsdp_passes), by generation: "fsdp2" copies each all-gather's output into the unsharded
    # parameters and the gradients into the reduce-scatter buffer; "fsdp1" gathers into its flat
    # parameters' own storage but builds each unit's unsharded gradient (the views' gradients
    # concatenated, cast to the reduce dtype, pre-divided) before reduce-scattering it; "none"
    fsdp_passes: str = "none"
    # activations saved for backward offloaded to host memory per block (Layout.offload_activations):
    # meshplan's runtime/offload.py; Megatron-Core --cpu-offloading (Transformer Engine's
    # cpu_offload.py); not torchtitan's eager trainer (its activation offloading is an experimental
    # graph pass of the GraphTrainer only: pytorch/torchtitan#3064; eager request #2379 open)
    activation_offload: bool = False
    # offloading composes with recompute and pipeline parallelism; False: Megatron's --cpu-offloading
    # (--cpu-offloading-num-layers N), which needs pp=1 and refuses activation recomputation
    # (TransformerConfig's checks), so the search offers it only at pp=1 without recompute
    offload_composes: bool = True
    # whether blocks whose activations are offloaded still run compiled (meshplan's runtime runs them
    # eagerly: its offload hooks are not traced by torch.compile)
    compile_offloaded: bool = True
    # GPU seconds a step costs beyond its kernels, communication and optimizer (the loss and
    # gradient-norm syncs, the launch queue refilling after them, logging); None:
    # cost_models.constants.STEP_OVERHEAD_S. CPU processes price their host work instead.
    step_overhead_s: float | None = None
    sources: str = ""

    def __post_init__(self) -> None:
        for name, allowed in (("attention", ATTENTION_IMPLS), ("cp_impl", CP_IMPLS), ("tp_overlap", TP_OVERLAPS),
                              ("ep_overlap", EP_OVERLAPS), ("expert_gemm", EXPERT_GEMMS),
                              ("master_weights", MASTER_WEIGHTS), ("fp8_impl", FP8_IMPLS),
                              ("forced_balance", FORCED_BALANCES), ("fsdp_passes", FSDP_PASSES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"stack {self.name!r}: {name}={getattr(self, name)!r}; use one of {allowed}")
        odd = [d for d in self.parallel_dims if d not in PARALLEL_DIMS]
        if odd:
            raise ConfigError(f"stack {self.name!r}: parallel_dims {odd} unknown; known: {PARALLEL_DIMS}")
        bad = [p for p in self.recompute if p not in RECOMPUTE_POLICIES]
        if bad:
            raise ConfigError(f"stack {self.name!r}: recompute policies {bad} unknown; known: {RECOMPUTE_POLICIES}")

    # ---- derived ---------------------------------------------------------------------------
    @property
    def elementwise_fused(self) -> bool:
        """Whether norms, activation and rotary run as fused kernels (TE's, or torch.compile's)."""
        return self.fused_elementwise or self.compile

    def attention_kernel(self, gpu_id: str) -> str:
        """The attention kernel family that runs on `gpu_id` (constants.ATTN_KERNEL_SPEEDUP keys):
        Transformer Engine takes cuDNN's fused attention on Hopper and newer and FlashAttention-2
        before (NeMo docs, memory_optimizations.rst, NVIDIA/NeMo#9188: "Transformer Engine prefers
        cuDNN flash attention on Hopper+ architectures, and Tri Dao flash attention on pre-Hopper")."""
        if self.attention == "te":
            return "cudnn" if not gpu_id.startswith(("a100", "l40s", "mi", "cpu")) else "fa2"
        if self.attention == "fa3" and gpu_id.startswith(("a100", "l40s", "mi", "cpu")):
            return "fa2"                    # FlashAttention-3 is Hopper-only
        return self.attention

    def runs_ep_overlap(self, layout) -> bool:
        """Whether `layout`'s expert all-to-all overlaps compute on this stack: the layout asks for it
        (ep_comm_overlap), the stack has the mechanism, and the schedule lets it pair micro-batches.
        Megatron-Core's --overlap-moe-expert-parallel-comm merges one micro-batch's forward with another's
        backward layer by layer (its "combined 1F1B"), so under pipeline parallelism it needs the
        interleaved schedule, and a fully recomputed layer has no separate forward to pair."""
        if not getattr(layout, "ep_comm_overlap", False) or self.ep_overlap == "none" or layout.ep == 1:
            return False
        if layout.pp > 1 and (layout.vp or 1) == 1:
            return False
        return layout.recompute != "full" and not isinstance(layout.recompute, int)

    def kernel_queues(self, layout, gpu_id: str) -> int | None:
        """The CUDA_DEVICE_MAX_CONNECTIONS a Megatron-Core run of `layout` on `gpu_id` takes (None:
        left unset). With tensor or context parallelism on GPUs before Blackwell its communication
        overlap needs kernels in issue order, one hardware queue (Megatron-LM refuses anything else
        there without FSDP or the expert all-to-all overlap); Megatron-FSDP wants it unset. The expert
        all-to-all overlap needs several queues to run beside compute (Megatron-LM PR #6311 measured
        its gain halved with one), so Megatron-Bridge sets 32 where it is on (scripts/performance/
        perf_plugins.py), and the TP userbuffers overlap then loses its order (layer._tp_hidden)."""
        if layout.zero >= 2 or (layout.tp == 1 and layout.cp == 1):
            return None
        if self.runs_ep_overlap(layout) and orders_kernels_by_queue(gpu_id):
            return 32
        return 1

    def offers_recompute(self, policy) -> bool:
        """Whether the stack runs recompute `policy` (a layer count means full recompute of N layers)."""
        return isinstance(policy, int) and "full" in self.recompute or policy in self.recompute

    def check_fp8_recipe(self, recipe: str) -> None:
        """Raise a ConfigError unless the stack runs FP8 linears with scaling `recipe` (fp8_recipes)."""
        if recipe in self.fp8_recipes:
            return
        if not self.fp8_recipes:
            raise ConfigError(f"the {self.name} stack runs no FP8; plan it with precision 'bf16', or for a stack "
                              "with FP8 (megatron-core, torchtitan, meshplan)")
        raise ConfigError(f"the {self.name} stack has no FP8 scaling recipe {recipe!r}; it runs "
                          f"{', '.join(self.fp8_recipes)}: set fp8_recipe to one of them")

    # ---- construction ----------------------------------------------------------------------
    def replace(self, **changes: Any) -> "Stack":
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ConfigError(f"stack fields {unknown} unknown; fields: {[f.name for f in fields(self)]}")
        return replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> "Stack":
        try:
            return STACKS[name]
        except KeyError:
            raise ConfigError(f"unknown stack {name!r}; presets: {', '.join(STACKS)}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Stack":
        d = dict(d)
        if "fsdp_copies" in d and "fsdp_passes" not in d:     # the field's name and type before 2026-11-28
            d["fsdp_passes"] = "fsdp2" if d.pop("fsdp_copies") else "none"
        for k in ("cp_kinds", "fp8_recipes", "fp8_param_gather", "parallel_dims", "recompute", "moe_dispatchers",
                  "schedules", "fsdp_impls"):
            if k in d:
                d[k] = tuple(d[k])
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"malformed stack: {e}") from None


STACKS: dict[str, Stack] = {s.name: s for s in (
    Stack(name="reference", attention="fa2", cp_impl="te", cp_kinds=("p2p", "all_gather", "a2a"),
          fp8_recipes=FP8_RECIPES,
          recompute=("none", "selective", "norm_act", "norm_moe", "mla_up", "op_sac", "full"),
          tp_overlap="userbuffers", moe_dispatchers=("alltoall", "deepep"),
          schedules=("1f1b", "interleaved", "zb", "zbv", "gpipe"), fsdp_impls=("fsdp2", "megatron", "deepspeed"),
          activation_offload=True,
          sources="the baseline of meshplan/cost_models/constants.py (fitted on published runs)"),
    # meshplan's runtime: PyTorch SDPA (its CUDA flash backend is FlashAttention-2), meshplan's own
    # CP ring (runtime/context_parallel.py), torchao FP8 (runtime/fp8.py: tensorwise, rowwise), the
    # recompute policies of runtime/recompute.py, torch.distributed.pipelining schedules
    # (runtime/pipeline.py), FSDP2 / DDP, torch.compile per block on CUDA (runtime/compile.py), no TP or
    # EP overlap, PyTorch's AccumulateGrad (a separate add per micro-batch).
    Stack(name="meshplan", attention="fa2", cp_impl="meshplan", cp_kinds=("p2p",),
          fp8_recipes=("tensorwise", "rowwise"), fp8_impl="torchao", fp8_gather_under_tp=False,
          fp8_precompute_scales=False, recompute=("none", "selective", "norm_act", "full"),
          schedules=("1f1b", "interleaved", "zb", "zbv", "gpipe"), fsdp_impls=("fsdp2",),
          # tp_comm_overlap runs PyTorch's async TP on CUDA (runtime/tensor_parallel.enable_async_tp)
          tp_overlap="async_tp",
          fused_elementwise=False, compile=True, grad_accum_fusion=False, grads_in_param_dtype=True,
          selective_sac=True, runtime_checks=True, pp_min_microbatches=True, pp_fsdp_deferred=True, fsdp_passes="fsdp2",
          activation_offload=True,
          # fp32 parameters updated by torch.optim, autocast where no FSDP2 casts (runtime/ddp.py),
          # SDPA's output kept once for the output projection (cost_models/memory.py)
          master_weights="params", attn_out_shared=True,
          compile_offloaded=False,
          # measured: one-GPU steps on an H100 (2026-11-24) and an H200 (2026-11-27) left +16 ms and
          # -5 ms beside the rest of the model (benchmarks/results/gpu_suite-*): about 5 ms
          step_overhead_s=5e-3,
          sources="meshplan/runtime (parallel.py, context_parallel.py, fp8.py, recompute.py, pipeline.py, compile.py, "
                  "offload.py)"),
    # torchtitan (arXiv 2410.06511; torchtitan/models/llama3/infra/parallelize.py, distributed/
    # activation_checkpoint.py): SDPA (FlashAttention-2 backend), PyTorch context_parallel (K/V
    # all-gathered, per-chunk SDPA, log-sum-exp merge), torchao float8 (tensorwise with FP8
    # all-gather, rowwise), activation checkpointing "selective" = op-level SAC (saves matmul and
    # attention outputs, recomputes every second matmul and all other ops) or "full", async TP,
    # torch.compile per block (optional; eager element-wise otherwise), FSDP2,
    # torch.distributed.pipelining schedules (1F1B, interleaved 1F1B, GPipe, ZBV).
    Stack(name="torchtitan", attention="fa2", cp_impl="torch", cp_kinds=("all_gather",),
          fp8_recipes=("tensorwise", "rowwise"), fp8_impl="torchao", recompute=("none", "op_sac", "full"),
          tp_overlap="async_tp", schedules=("1f1b", "interleaved", "gpipe", "zbv"), fsdp_impls=("fsdp2",),
          fused_elementwise=False, compile=True, grad_accum_fusion=False, grads_in_param_dtype=True,
          pp_min_microbatches=True, pp_fsdp_deferred=True, fsdp_passes="fsdp2",
          sources="torchtitan arXiv 2410.06511; torchtitan parallelize.py / activation_checkpoint.py"),
    # Megatron-Core + Transformer Engine (Megatron-LM, NeMo 2, Megatron-Bridge): TE attention (cuDNN
    # fused on Hopper+), CP p2p / all_gather / a2a (--cp-comm-type), TE FP8 (delayed / current
    # tensorwise, blockwise, MXFP8 on Blackwell), --recompute-granularity selective (core attention),
    # --recompute-modules (layernorm, moe_act, moe, mla_up_proj, mlp, ...), full; --tp-comm-overlap (userbuffers),
    # --overlap-moe-expert-parallel-comm, DeepEP dispatch, CUDA graphs (optional), gradient
    # accumulation fusion, distributed optimizer, Megatron-FSDP.
    Stack(name="megatron-core", attention="te", cp_impl="te", cp_kinds=("p2p", "all_gather", "a2a"),
          fp8_recipes=("tensorwise", "delayed", "blockwise", "mxfp8"), fp8_param_gather=("mxfp8",),
          recompute=("none", "selective", "norm_act", "norm_moe", "mla_up", "full"),
          tp_overlap="userbuffers", ep_overlap="a2a_1f1b", moe_dispatchers=("alltoall", "deepep"),
          expert_gemm="per_expert", moe_host_sync=True, forced_balance="random_logits",
          schedules=("1f1b", "interleaved"), fsdp_impls=("megatron", "fsdp2"), activation_offload=True,
          offload_composes=False,
          sources="Megatron-LM arguments.py (--recompute-modules, --cp-comm-type, --tp-comm-overlap, "
                  "--overlap-moe-expert-parallel-comm, --moe-token-dispatcher-type, --cpu-offloading); "
                  "NVIDIA/NeMo#9188"),
    # Megatron-LM 2021-22 (the code of Narayanan et al. SC'21 and Korthikanti et al. 2022): attention
    # scores materialised (no flash kernel), gradient accumulation in a separate pass before commit
    # 83b1e42f30, selective recompute from Korthikanti et al.
    Stack(name="megatron-2021", attention="eager", cp_impl="te", cp_kinds=(), fp8_recipes=(),
          parallel_dims=("tp", "pp"),      # context parallelism and MoE layers came to Megatron later
          recompute=("none", "selective", "full"), schedules=("1f1b", "interleaved"),
          fsdp_impls=("deepspeed",), grad_accum_fusion=False, pp_scatter_gather=True,
          sources="Megatron-LM at cdde43385e (SC'21; arguments.py --no-scatter-gather-tensors-in-pipeline); "
                  "Korthikanti et al. arXiv 2205.05198"),
    # Megatron-DeepSpeed (BLOOM's bigscience-workshop fork, MT-NLG): Megatron-LM 2021's layers under
    # DeepSpeed's PipelineEngine (runtime/pipe/engine.py, schedule.py, p2p.py): blocking p2p with the
    # activations partitioned over TP, the gradient all-reduce after the last micro-batch, 1F1B only
    Stack(name="megatron-deepspeed", attention="eager", cp_impl="te", cp_kinds=(), fp8_recipes=(),
          parallel_dims=("tp", "pp"), recompute=("none", "full"), schedules=("1f1b",), fsdp_impls=("deepspeed",),
          grad_accum_fusion=False, pp_scatter_gather=True, pp_blocking_p2p=True, dp_overlap=False, max_zero_with_pp=1,
          sources="microsoft/DeepSpeed deepspeed/runtime/pipe/{engine,schedule,p2p}.py, runtime/config.py "
                  "(pipe_partitioned, grad_partitioned default True); bigscience-workshop/Megatron-DeepSpeed"),
    # MosaicML llm-foundry (the MPT benchmark yamls: attn_impl triton, FSDP FULL_SHARD; Composer's FSDP is
    # its only model parallelism, the benchmark table's "FSDP-only (no TP/PP used)"). Composer wraps
    # PyTorch's FullyShardedDataParallel (FSDP1, flat parameters), mixed precision "DEFAULT": bf16
    # parameters gathered, gradients reduced in fp32 (composer v0.16 trainer/mosaic_fsdp_utils.py
    # get_mixed_precision; llm-foundry's benchmark table lists MP Mode DEFAULT).
    Stack(name="llm-foundry", attention="triton", cp_impl="te", cp_kinds=(), fp8_recipes=(), parallel_dims=(),
          recompute=("none", "full"), schedules=("1f1b",), fsdp_impls=("fsdp2",), fsdp_passes="fsdp1",
          sources="mosaicml/llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml, scripts/train/benchmarking/"
                  "README.md; mosaicml/composer v0.16 trainer/dist_strategy.py, mosaic_fsdp_utils.py"),
)}


def resolve_stack(stack: "Stack | str | dict | None", default: str = "meshplan") -> Stack:
    """A Stack from a preset name, a Stack, a dict (Stack.to_dict) or None (the default preset)."""
    if stack is None:
        return Stack.preset(default)
    if isinstance(stack, Stack):
        return stack
    if isinstance(stack, str):
        return Stack.preset(stack)
    if isinstance(stack, dict):
        return Stack.from_dict(stack)
    raise ConfigError(f"stack must be a preset name ({', '.join(STACKS)}) or a Stack, not {type(stack).__name__}")
