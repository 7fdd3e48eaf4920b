"""Named constants of the cost model, each with where it comes from.

"derived" = follows from a formula or a spec; "measured" = a published measurement;
"fitted" = chosen by `benchmarks/validate_published.py --fit` (2026-11-22, traced profiles; re-run
after the stack mechanisms: grad dtype, DeepEP dispatch, ZeRO-3 flavours, TE weight
caching) on the FIT split of
meshplan/data/published_runs.csv (rows are split by a hash of their id; the error on the other
rows is reported separately). Re-fit by running that script; never tune to a single row.
"""

from __future__ import annotations

# ---- bytes ----------------------------------------------------------------------------------
BF16 = 2
FP32 = 4
FP8 = 1

# Mixed-precision training state per parameter (Megatron-LM defaults, cost_models.md §3, §5):
PARAM_BYTES = BF16            # bf16 working weights
GRAD_BYTES = FP32             # fp32 main gradients (Megatron accumulates and reduces grads in fp32)
OPTIMIZER_BYTES = 12          # fp32 master weights + Adam m + v

# Adam step: reads grad (4) + master (4) + m (4) + v (4), writes master, m, v (12) and the
# bf16 weight (2) => 30 bytes per parameter shard of HBM traffic (derived).
OPTIMIZER_STEP_BYTES = 30

# ---- compute --------------------------------------------------------------------------------
# Achieved fraction of the MAMF (best large-GEMM) rate inside real training steps: GEMMs of
# transformer shapes, interleaved with other kernels (cache/clock effects, no autotuned shapes).
# Megatron-LM's H100 table (cost_models.md §9) reaches 41-49% MFU while MAMF is 80% of peak.
TRAINING_GEMM_EFF = 0.82                                                            # fitted

# Time a GEMM kernel needs beyond FLOPs/achieved-peak: launch, prologue/epilogue and wave
# quantisation make small GEMMs inefficient (Calculon's step table, cost_models.md §1, shows
# efficiency falling from 0.95 to 0.6 below ~1 GFLOP on A100). Modelled as a fixed time per GEMM.
GEMM_FIXED_S = 12e-6                                                              # estimate

# Row tile of the tensor-core GEMM kernels: CUTLASS's SM90 TMA warp-specialized GEMMs (and the grouped
# GEMMs built on them: torch._grouped_mm, Megatron-Core --moe-grouped-gemm) tile the output 128 rows at
# a time (TileShape 128 x {64,128,256} x 64), so a group of m rows costs ceil(m/128) row tiles of
# math. Matters for MoE experts at small per-expert token counts.
GEMM_TILE_M = 128                                                                   # derived

# Flash-attention PLATEAU rate (a long call: attention.shape_penalty -> 1) as a share of the GPU's
# MAMF, for FlashAttention-2 at head dim 128. Measured by this project on an H200
# (benchmarks/results/gpu_rates-2026-11-27-h200.md: PyTorch SDPA's FlashAttention-2 backend, 16k
# tokens per call, 16 heads of 128, sequences 512-64k, causal and not): the plateau that fits
# attention.call_efficiency to the 14 points of each direction (3.3% / 1.8% mean error) is 381 / 318
# TFLOP/s, 0.480 / 0.401 of the 794 TFLOP/s BF16 matmul measured on the same GPU. The FlashAttention-3
# paper's FA2 curves on an H100 agree (370 / 322 TFLOP/s at 16k: 0.466 / 0.405 of its MAMF). Shorter
# calls, causal diagonal tiles, CP chunks and few CTAs land below the plateau (attention.py; the
# constants at the end of this file). In a training step an attention kernel runs at
# training_gemm_eff of its isolated rate, as the GEMMs do (compute.attention_time multiplies both):
# the same clocks under the step's power draw, the same interleaving with other kernels.
ATTN_FWD_EFF = 0.480                                                                # measured (own H200)
ATTN_BWD_EFF = 0.401                                                                # measured (own H200)
# FlashAttention's backward does 5 of the forward's 2 matmul-equivalents => 2.5x fwd FLOPs
# (Dao et al. 2022, Alg. 2/4), vs Megatron's 2x model-FLOP convention.
ATTN_BWD_FLOP_RATIO = 2.5                                                           # derived
# Flash-attention kernels differ by stack. ATTN_FWD/BWD_EFF above are fitted on the stacks that run
# FlashAttention-2 class CUDA kernels (FA2, cuDNN/Transformer Engine fused attention). The Triton port of
# FlashAttention that llm-foundry's `attn_impl: triton` runs (the MosaicML MPT benchmark yamls set it,
# scripts/train/yamls/pretrain/mpt-*.yaml at b2a43a147) is slower: FlashAttention-2 is 1.3-2.5x faster
# than "FlashAttention in Triton" (Dao 2023, FlashAttention-2 paper, Sec. 4.1 benchmarks, A100). The low
# end of that range is taken (measured, not fitted); it divides both efficiencies.
ATTN_KERNEL_SLOWDOWN = {"flash": 1.0, "triton": 1.3}                                # measured
# Hopper attention kernels against FlashAttention-2 at the plateau (head dim 128). cuDNN's fused
# attention (what Transformer Engine runs on Hopper) measured by this project on an H200 beside FA2
# (gpu_rates-2026-11-27-h200.md, PyTorch SDPA's CUDNN backend, torch 2.11 + CUDA 13): plateau 0.884 /
# 0.726 of the MAMF forward / backward (fitted to its 14 points per direction as for FA2 above, 2.4% /
# 3.4% mean error), 1.84x / 1.81x FA2's. Earlier cuDNN releases reached less: the FlashAttention-3
# paper (Shah et al. 2024, arXiv 2407.08608, Fig. 5/6, H100, cuDNN 9.x of mid-2024) has 595 / 370 (no
# mask) and 539 / 335 (causal) forward, 1.61x; cuDNN's own benchmark (NVIDIA/cudnn-frontend
# benchmark/benchmark_results.csv, H200, against SDPA's FA2) 1.60-1.74x backward with 9.1.0. FA3 (H100,
# same paper): forward 648 / 370, backward 561 / 322 against FA2. (fwd, bwd) rate multipliers; "flash"
# = "fa2". A kernel a GPU cannot run (FA3 and cuDNN's Hopper kernels before sm90) is resolved by
# meshplan.ir.stack.Stack.attention_kernel.
ATTN_KERNEL_RATE = {"fa2": (1.0, 1.0), "flash": (1.0, 1.0), "cudnn": (1.84, 1.81),
                    "fa3": (1.75, 1.74), "triton": (1 / ATTN_KERNEL_SLOWDOWN["triton"],) * 2}   # measured (kernel curves)
# Head dim 64 against 128, at the plateau (the per-call FLOPs halve, the per-tile overheads do not):
# measured on the same H200 (32 heads of 64 at the same sequences and tokens, fitted as above): FA2
# 0.86 / 0.90, cuDNN 0.71 / 0.79 forward / backward. Interpolated in log2(head dim) between 64 and
# 128, held below 64 and at 1 above 128 (no measurement there). The Triton port follows FA2; FA3 is
# priced like cuDNN, the other Hopper-native (wgmma) kernel: an assumption, not a measurement.
ATTN_HEAD_DIM_64_RATE = {"fa2": (0.86, 0.90), "flash": (0.86, 0.90), "triton": (0.86, 0.90),
                         "cudnn": (0.71, 0.79), "fa3": (0.71, 0.79)}                 # measured (own H200)

# FlashAttention-2-class kernels reach a different share of the GEMM rate on each GPU generation:
# FA2 is written for Ampere's mma.sync tensor-core instructions and uses none of Hopper's (wgmma,
# TMA), so on Hopper it falls far below the GEMMs cuBLAS runs there. Plateau rates (head dim 128,
# long sequences, no mask): A100 forward up to 73% and backward up to 63% of the 312 TFLOP/s peak
# (Dao 2023, FlashAttention-2, arXiv 2307.08691, Sec. 4.1: 228 / 197 TFLOP/s); H100 SXM forward 370,
# backward 322 TFLOP/s (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, Fig. 5/6, the FA2
# curves). Against each GPU's MAMF (271.2 A100, 794.5 H100; meshplan/data/hardware.csv): A100
# 0.840 / 0.726, H100 0.466 / 0.405, so an FA2-class kernel on Ampere runs at 1.80x (forward) and
# 1.79x (backward) the share of the GEMM rate it reaches on Hopper. ATTN_FWD_EFF / ATTN_BWD_EFF are
# the Hopper shares (most rows with flash attention ran on H100); these multiply them per
# generation. Ada (L40S) runs the same mma.sync kernels as Ampere. Blackwell and AMD parts keep the
# Hopper share: no FA2-class plateau measured there is transcribed (Blackwell stacks run cuDNN).
ATTN_GENERATION_RATE = {"ampere": (0.840 / 0.466, 0.726 / 0.405), "hopper": (1.0, 1.0),
                        "blackwell": (1.0, 1.0), "other": (1.0, 1.0)}           # measured (kernel curves)

# Unfused ("eager") attention materialises the b*a*s*s score tensor: QK^T writes it (2 B), the
# scale+mask+softmax reads and writes it (4 B), dropout reads/writes it and a 1-byte mask (5 B),
# PV reads it (2 B) => ~13 bytes per score element forward, twice that backward (derived);
# activation memory stores scores, softmax, dropout output and mask: 5 bytes per element
# (Korthikanti et al. Table 2, the 5as/h term).
EAGER_ATTN_BYTES_PER_SCORE = 13.0
EAGER_ATTN_STORED_BYTES_PER_SCORE = 5.0

HBM_EFF = 0.80       # achieved fraction of HBM bandwidth by streaming kernels (STREAM-like copies reach 80-90% on H100) # measured range

# FP8 linears. A linear's three GEMMs (forward y = x W, input gradient dx = dy W^T, weight gradient
# dW = x^T dy) read FP8 copies of its input x (m x k), its output gradient dy (m x n) and its weight
# W (k x n), each in the layouts of the two GEMMs that read it. FP8_QUANT_BYTES: HBM bytes moved per
# element of each of those tensors to make its copies, by scaling recipe (Layout.fp8_recipe,
# meshplan/ir/layout.py), in fused kernels (Transformer Engine's, or torchao's under torch.compile;
# eager torchao is FP8_EAGER_QUANT_BYTES below). x and dy are quantised every micro-batch
# (roofline.fp8_cast_time). W (compute.fp8_weight_casts): Transformer Engine casts it once per step
# (on the first micro-batch, `is_first_microbatch`) and keeps the copies (FP8_WEIGHT_CACHE_BYTES);
# torchao keeps no cache and casts it in every micro-batch's forward and again in its backward
# (roofline.torchao_weight_cast_bytes), or, gathered by FSDP2 in FP8, casts the shard at each all-gather
# (FP8_GATHER_*).
# - "tensorwise" (current scaling: torchao's default, Transformer Engine's Float8CurrentScaling):
#   one scale serves both layouts, but it needs the tensor's amax first: an amax pass reads the bf16
#   tensor (2), the cast reads it again (2) and writes FP8 (1), the transposed copy where a GEMM needs
#   one written by the same cast: 5 (derived). Measured by this project on an H200
#   (benchmarks/results/gpu_rates-2026-11-27-h200.md, "FP8 linear layers": torchao float8 under
#   torch.compile, one linear's forward + backward at Llama-3 8B shapes, 8192 tokens): the layer's time
#   less its three GEMMs at the measured tensorwise kernel rate ("GEMMs per FP8 recipe") is 0.539 ms at
#   gate_up (x + dy + W = 386M elements) and 0.302 ms at down (210M): 5.2 bytes per element at the
#   model's HBM rate, plus 0.02 ms per linear (least squares over the two), so the derivation stands.
# - "delayed" (Transformer Engine's DelayedScaling, the only recipe of TE 1.x and NeMo 1.x's fp8 knobs:
#   fp8_amax_history_len, fp8_amax_compute_algo): the scale comes from the amax history of earlier
#   steps, known before the tensor exists, and the cast kernel records the tensor's amax for later
#   steps as it goes (TE's fused cast-transpose kernels), so the amax pass is gone: the cast reads 2
#   and writes 1, 3 (derived: tensorwise's derivation less its amax read).
# - "rowwise" (torchao's rowwise recipe, per-row scales in the layout each GEMM reads): each tensor is
#   quantised along both axes; the row-scaled copy fuses its amax into the cast (read 2, write 1), the
#   column-scaled copy's scales span every row, so it needs its own amax pass, then a cast (2 + 2 + 1):
#   8 derived. Measured (same runs, less the tensorwise layers' 0.02 ms): 13.7 (gate_up) and 27.6
#   (down) bytes per element, 16.5 by least squares: twice the derivation. What the other half is the
#   data cannot split: inductor's column-wise amax reductions and the rowwise GEMMs in the transposed
#   dgrad / wgrad shapes (only the forward shapes were timed alone) are both in it. Priced as measured.
# - "blockwise" (DeepSeek-V3 report arXiv 2412.19437 §3.3.2: 1x128 activation tiles, 128x128 weight
#   blocks; TE Float8BlockScaling): tiles are local, so one pass (amax and cast per tile) writes both
#   copies and their fp32 scales: 2 + 1 + 1 + 2 * 4/128. The weight's 128x128 block scales serve W and
#   W^T alike. Not measured.
# - "mxfp8" (OCP Microscaling v1.0: 32-element blocks, one E8M0 byte each; Blackwell tensor cores apply
#   the block scales in the MMA): one pass, both copies: 2 + 1 + 1 + 2 * 1/32. Not measured.
# The Llama-3 8B qkv linear (8192 x 4096 x 6144) is left out of both fits: its GEMMs take only 1.1 ms
# and the layer called alone is bound by the host (its compiled BF16 layer is 0.12 ms slower than the
# eager one: the compiled call's guards and wrappers, which a compiled block pays once for all its
# linears). How close the model then comes per shape: docs/cost_model_mechanisms.md ("FP8 recipes").
FP8_QUANT_BYTES = {"tensorwise": 5.0, "delayed": 3.0, "rowwise": 16.5, "blockwise": 4.0 + 2 * 4 / 128,
                   "mxfp8": 4.0 + 2 / 32}                 # tensorwise derived = measured, rowwise measured (own H200), rest derived
# Eager torchao (Stack.fp8_impl "torchao" where the stack does not compile: Stack.compile False, or
# meshplan's offloaded blocks): each cast is a chain of unfused PyTorch ops (abs, amax, scale, clamp,
# convert, transpose copies), each a full pass over bf16 or fp32 intermediates, plus a kernel launch
# each. Measured (same runs, torch.compile off): the layer's time less its three GEMMs at the kernel
# rates, least squares over the three shapes (qkv 3.57 / 4.00 ms, gate_up 11.45 / 11.01, down 6.31 /
# 6.93, tensorwise / rowwise), as bytes per element of x, dy and W plus a fixed time per linear
# (forward + backward): tensorwise 110 B + 0.40 ms (about 36 element-wise launches at the 11 us one
# launch measured on the same H200 takes), rowwise 96 B + 1.42 ms; each shape's cast time within 2% / 4%.
# The layer ran 1.9-3.0x its BF16 time. Recipes torchao does not have are not priced eagerly.
FP8_EAGER_QUANT_BYTES = {"tensorwise": 110.0, "rowwise": 96.0}                      # measured (own H200)
FP8_EAGER_LINEAR_FIXED_S = {"tensorwise": 0.40e-3, "rowwise": 1.42e-3}              # measured (own H200)
# Per-GEMM fixed cost is larger for FP8 (scaling-factor updates, extra kernels): estimate. The H200
# layers above agree: 0.02 ms per linear beyond its GEMMs and casts, 3 x (20 - 12) us here.
FP8_GEMM_FIXED_S = 20e-6                                                          # estimate
# The FP8 GEMM rate each recipe's kernels reach, as a share of the tensorwise (cuBLAS) FP8 rate.
# Measured by this project on an H200 (gpu_rates-2026-11-27-h200.md, "GEMMs per FP8 recipe":
# torch._scaled_mm at Llama-3 8B / 70B shapes and 8192^3, 8192 tokens, use_fast_accum off as torchao
# runs the gradient GEMMs; two runs on two H200 machines, the second adding the ~1.2B Llama's shapes):
# rowwise (per-row scales applied in the CUTLASS kernel's epilogue) 0.90-1.06 of tensorwise, mean
# 0.967 / 0.991 in the two runs; blockwise (1x128 activation and 128x128 weight scales, cuBLAS through
# F.scaled_mm) 0.74-0.99, mean 0.860 / 0.838, its kernels rescaling partial sums every 128 of K.
# (use_fast_accum adds 2-10% to either.) A rowwise training step runs well below its GEMMs'
# rate (an H100 step +21.9% over tensorwise: gpu_suite-2026-11-24-nvidia-h100-80gb-hbm3-fp8-runtime.md)
# because of its casts (FP8_QUANT_BYTES), not its GEMMs. MXFP8 (scales applied by Blackwell's MMA)
# keeps the tensorwise rate: not measured. Delayed scaling runs the same per-tensor-scaled GEMMs as
# tensorwise (only where the scale comes from differs).
FP8_RECIPE_GEMM_RATE = {"tensorwise": 1.0, "delayed": 1.0, "rowwise": 0.98, "blockwise": 0.85, "mxfp8": 1.0}   # measured (own H200)
# torchao's weight casts (torchao/float8/float8_linear.py, matmul_with_hp_or_float8_args): the
# forward casts the weight (hp_tensor_to_float8_dynamic: amax, then the cast) and saves the
# high-precision weight, not its FP8 copy, for backward, whose input-gradient GEMM casts it again
# (cast_config_weight_for_grad_input). Under torch.compile the partitioner may keep what is cheapest
# instead, but parameters cost it nothing to save (torch/_functorch/config.py
# treat_parameters_as_free_to_save, on by default) and amax reductions
# are never recomputed (partitioners.py, "reduction op"): backward keeps the forward's scale and
# re-runs only the cast. For a weight of w bytes per element: forward amax (w) + cast (w read, 1
# written), backward cast (w + 1); bf16 (w = 2, as the layers FP8_QUANT_BYTES was measured on): 5 + 3.
# The measured rate (fitted on torchao layers whose every forward + backward cast W) is what both
# together cost; a weight torchao reads in fp32 (autocast over fp32 parameters: meshplan's runtime
# without FSDP2, Stack.master_weights "params") costs (9 + 5) / (5 + 3) of it (derived;
# roofline.torchao_weight_cast_bytes).
# FSDP2 all-gathering torchao's FP8 weights (roofline.fp8_weight_gathered): the GEMMs find the weight
# already FP8 (tensor_already_casted_to_fp8) and cast nothing; each all-gather first casts the rank's
# shard of the fp32 parameter (FSDP2's MixedPrecisionPolicy keeps the shards fp32, both torchtitan and
# meshplan's runtime; fsdp_utils.py fsdp_pre_all_gather) and sends 1 byte per element. With the
# scales precomputed after the optimizer step (precompute_float8_dynamic_scale_for_fsdp: one
# _foreach_norm read of every shard, FP8_GATHER_PRECOMPUTE_BYTES once a step) a gather's cast reads 4
# and writes 1; without, it takes the shard's amax first (hp_tensor_to_float8_dynamic with
# reduce_amax: 4 + 4 + 1, and a scalar all-reduce per weight, not priced).
# FP8_GATHER_CAST_BYTES is keyed by whether the scales are precomputed.
FP8_GATHER_CAST_BYTES = {True: FP32 + FP8, False: 2 * FP32 + FP8}                   # derived (torchao code)
FP8_GATHER_PRECOMPUTE_BYTES = FP32                                                  # derived (torchao code)
# The gathered FP8 weight is row-major (out x in); the forward GEMM reads it transposed as is, but the
# input-gradient GEMM needs the other layout and torchao copies it (float8_ops.py preprocess_addmm:
# b_data.t().contiguous().t()): read 1, write 1 per element of the gathered weight, every backward.
FP8_GATHERED_TRANSPOSE_BYTES = 2 * FP8                                              # derived (torchao code)
# GPUs whose tensor cores take MX block scales (Blackwell, sm_100): meshplan.cluster ids
MXFP8_GPUS = ("b200", "gb200")

# ---- communication --------------------------------------------------------------------------
# nccl-tests busbw factors (cost_models.md §7).
# Bandwidth for small groups on an NVSwitch: ring busbw is flat from 2 to 8 GPUs (~370 GB/s on H100,
# NVIDIA/nccl #1455); NVLS only helps all-reduce at >= 5 GPUs.
NVLS_MIN_GPUS = 5
# xGMI full mesh: a group of n GPUs uses n-1 links of per_peer_gb_s each; measured 312.9 GB/s busbw
# on 8x MI300X and 47.7 GB/s on 2 (cost_models.md §7) => efficiency 312.9/(7*64)=0.70, 47.7/64=0.75.
XGMI_EFF = 0.72                                                                     # derived
# Point-to-point send/recv achieves about the ring busbw fraction of line rate (~80%, nccl #1442).
P2P_EFF = 0.80                                                                      # measured

# Fraction of a rank's backward (forward) time that the DP gradient reduce-scatter / all-reduce
# (parameter all-gather) can hide behind when overlap is on (Megatron --overlap-grad-reduce /
# --overlap-param-gather, FSDP2 prefetch): exposed = max(0, t_comm - 0.95 * t_backward). 0.95 means
# almost all of it hides; the 5% left stands for the SMs NCCL kernels take from compute (Calculon's
# processor_usage 0.15 on NVLink, 0.02 on IB) and the last bucket, which starts only when the backward
# ends. The fit puts it at the upper bound of its range (0.1-0.95): the published runs show no exposed
# DP time beyond that.
DP_OVERLAP_EFF = 0.95                                                               # fitted (at its upper bound)
# The same for ZeRO-3 / FSDP, whose per-micro-batch all-gathers are prefetched one layer ahead
# (FSDP2 prefetch, DeepSpeed stage-3 prefetch buckets): a different mechanism, fitted separately.
# Only MosaicML's FSDP1 rows constrain it (torchtitan's FSDP2 rows move < 0.1% over its range); with
# FSDP1's gradient passes priced (estimate.fsdp_passes) the fit split puts it at 0.22 (0.11 without).
FSDP_OVERLAP_EFF = 0.22                                                             # fitted
# TP comm hidden by --tp-comm-overlap (userbuffers ring-exchange; Megatron docs report most of
# it hidden on H100). Without that flag TP comm is fully exposed.
TP_OVERLAP_HIDDEN = 0.95                                                            # fitted
# Expert all-to-all overlapped with another micro-batch's compute (Megatron-Core
# --overlap-moe-expert-parallel-comm: one micro-batch's forward merged with another's backward layer
# by layer, the dispatch/combine of one on a side stream under the other's attention and experts;
# DeepSeek-V3 report §3.2.1 designs DualPipe on the same pairing). While the transfer runs, its kernels
# hold SMs: DeepEP's normal kernels take 20 SMs (DeepSeek-V3 report §3.2.2: "only 20 SMs are sufficient
# to fully utilize the bandwidths of IB and NVLink"; Megatron-Core's --moe-deepep-num-sms default) and so
# does NCCL's all-to-all here (its channel count is of the same order). Compute running beside the
# transfer slows by that share of the GPU's SMs (cost_models.layer._ep_overlapped).
EP_COMM_SMS = 20                                                                    # measured (report)
SM_COUNT = {"ampere": 108, "hopper": 132, "blackwell": 148, "other": 0}            # datasheets (A100, H100/H200 SXM, B200)

# Share of the backward's TP transfers PyTorch's async TP hides (layer._tp_hidden): none. Its
# micro-pipelining rewrote the forward's all-gather -> matmul and matmul -> reduce-scatter pairs; on
# Llama 3 70B it made the forward ~20% faster and the step ~8% (PyTorch dev-discuss, "Introducing
# Async Tensor Parallelism in PyTorch", 2024; torchtitan's 256-GPU table: 829 -> 876 tokens/s), what
# hiding the forward's (and a full recompute's) transfers alone gives.
ASYNC_TP_BWD_HIDDEN = 0.0                                                           # measured (sources)

# ---- step-level overheads -------------------------------------------------------------------
# Per-step fixed cost: data loading, logging, grad-norm/clip reductions, launch gaps at the
# start and end of the step, for the stacks that ran the published rows (a stack that measured its
# own says so: Stack.step_overhead_s; meshplan's runtime ~5 ms on one GPU).
STEP_OVERHEAD_S = 0.05                                                            # estimate (GPUs; CPU processes: host.step_host_time)
# Per-layer, per-micro-batch launch/synchronisation overhead not in any kernel (CPU launch gaps,
# small kernels): visible when layers are tiny.
LAYER_OVERHEAD_S = 5.5e-6                                                            # fitted
# Host (CPU) time to issue one kernel from eager PyTorch: a tiny GPU op costs ~7 us of wall time
# (FlagGems issue #4812; ~1-2 us of it is PyTorch's dispatcher, pytorch/pytorch#41383, and ~5 us the
# driver's launch, cuLaunchKernel 4.9 us measured in JuliaGPU/CUDAdrv.jl#15).
HOST_LAUNCH_S = 7e-6                                                                  # measured (sources)
# Host time of one expert's GEMM on Transformer Engine's per-expert path (Stack.expert_gemm
# "per_expert": input split, output allocation, per-expert quantisation launches, cuBLASLt call):
# NVIDIA/TransformerEngine PR #3134 timed 8 experts x 128 tokens (N = K = 2048) at 0.267-0.272 ms on
# that path against 0.069 ms for one grouped kernel: ~25 us more per expert GEMM at a size where the
# GPU work is negligible.
TE_EXPERT_GEMM_HOST_S = 25e-6                                                         # measured (source)

# ---- memory ---------------------------------------------------------------------------------
# (The CUDA context, NCCL buffers and allocator fragmentation are the cluster's memory_reserved_gb.)
# Transformer Engine keeps the FP8 copy of each weight and its transpose between the micro-batches of
# a step (cast once on the first micro-batch, see compute.fp8_weight_casts): 1 + 1 bytes/param (derived).
# (torchao keeps none: its FP8 weights live only inside one linear's forward and backward.)
FP8_WEIGHT_CACHE_BYTES = 2
# DeepSpeed ZeRO-3 parameter coordinator defaults (deepspeed.ai/docs/config-json, "ZeRO
# optimizations": stage3_max_live_parameters 1e9, stage3_prefetch_bucket_size 5e8,
# reduce_bucket_size 5e8 elements): bound the unsharded working set of DeepSpeed's ZeRO-3.
DS_MAX_LIVE_PARAMS = 1e9
DS_PREFETCH_BUCKET = 5e8
DS_REDUCE_BUCKET = 5e8

# ---- CPU processes (local-cpu): compute a GPU-oriented model does not charge -------------------
# Measured 2026-11-24 on the 2-core AMD EPYC VM of meshplan/cluster/constants.py's local-cpu figures,
# torch 2.13.0 CPU, ONE thread (torch.set_num_threads(1)), while other sessions shared the host: a
# bf16 matmul ran at CPU_MICRO_MATMUL_GFLOPS_1T in the same minutes (96-102 GFLOP/s at the default
# job's 512x128x{128,256,384} shapes, 80 at 2048^3; 188 on an idle host). The rates below are
# therefore used RELATIVE to that matmul rate: a process's CPU-specific rates are scaled by its
# own matmul rate (local-cpu's constant, or what `meshplan calibrate` measured), so a loaded or a
# faster host moves them together.
CPU_MICRO_MATMUL_GFLOPS_1T = 95.0                                                   # measured
# - causal SDPA (torch.nn.functional.scaled_dot_product_attention, the CPU flash kernel) at the
#   default job's shape (b 4, heads 4, s 128, d 32), bf16: forward 1.9 ms = 8.8 GFLOP/s of forward
#   FLOPs; backward 11.8 ms = 1.42 GFLOP/s of forward FLOPs (3.5 counting 2.5x backward FLOPs): the
#   backward takes 6x the forward, not 2.5x. (fp32: 10.1 / 4.4 GFLOP/s of forward FLOPs.)
CPU_SDPA_FWD_GFLOPS_1T = 8.8                                                        # measured
CPU_SDPA_BWD_GFLOPS_1T = 1.42                                                       # measured (forward FLOPs per s)
# - element-wise bf16: a binary mul streams 11 GB/s (2 reads + 1 write), SiLU only 2.8 GB/s (bf16
#   transcendental ops convert to fp32 and back per element); a block's element-wise work (norms:
#   pow/mean/rsqrt/mul; rotary: mul/add/cat; SwiGLU: silu/mul; residual adds) is about half of each
#   kind by bytes: harmonic mean of 11 and 2.8 = 4.5 GB/s.
CPU_ELEMENTWISE_GB_S_1T = 4.5                                                       # measured (mix derived)
# - the MoE token permutation (MoE.routed: index_select gather, routing-weight mul, index_add
#   scatter; backward their transposes), priced on layer._elementwise_bytes' permute term (4 k h T
#   bf16 bytes forward, twice that backward): `python benchmarks/cpu_moe_permute.py`
#   (results/cpu_moe_permute-2026-11-25.txt): 3.7 GB/s at the reference rate for tiny-moe's 512
#   tokens x 128, top-2 of 4, in two runs (3.1 and 4.7 at 2048 x 512, top-2 of 8), where a plain
#   bf16 mul streams 13.
CPU_PERMUTE_GB_S_1T = 3.7                                                           # measured
# - per-op host overhead (dispatch, autograd recording, allocator) of small ops: a chain of 60
#   multiplies of an 8x8 tensor costs 7.7 us per op forward with autograd on, 18.4 us forward +
#   backward; a view/transpose/reshape chain 3.5 us forward, 10.9 us forward + backward.
CPU_OP_FWD_S = 7.7e-6                                                               # measured
CPU_OP_BWD_S = 10.7e-6                                                              # measured
CPU_VIEW_FWD_S = 3.5e-6                                                             # measured
CPU_VIEW_BWD_S = 7.4e-6                                                             # measured
# Cores of that host: local-cpu's rates are host totals over 2 threads; a process gets at most one
# thread, and nproc processes on 2 cores get 2/nproc of one each.
CPU_HOST_CORES = 2                                                                  # measured host
# - the small-op chain above (60 muls of an 8x8 tensor, autograd on) in each of 4 one-thread
#   processes at once on that host when quiet (2026-11-24, `meshplan calibrate --nproc 4`, load
#   from other sessions below 1): 7.2 us per op, i.e. 3.6 us on a core of its own. A calibration's
#   own measurement of it (GPUSpec.cpu_op_us) scales the host-work rates by the ratio
#   (host.cpu_rate_scale).
CPU_QUIET_OP_US_1T = 3.6                                                            # measured
# ---- CPU processes: host work outside the traced plain ops (meshplan.cost_models.host) ---------
# CPU seconds at the reference matmul rate (CPU_MICRO_MATMUL_GFLOPS_1T above): each was measured as
# process CPU time (time.process_time, robust to the other sessions' load) with one thread per
# process, and scaled by (matmul rate measured in the same minutes) / 95 GFLOP/s. Measured
# 2026-11-24 19:10-20:00 UTC on the same 2-core VM (torch 2.13.0 CPU, gloo), host load 6-9 from
# other sessions; the bf16 matmul (512x128x384, process time) ran at 119 GFLOP/s then, so the raw
# times below were multiplied by 119/95 = 1.25.
# - One traced op run on DTensors (the TP-sharded linears; under SP also norms and residual adds),
#   (forward, backward) seconds beyond the same plain op, as the runtime runs them: autocast bf16 (the
#   weight's cast is a DTensor op too, forward and backward), the default job's shapes (4 x 128
#   tokens, hidden 128, FFN 384), torch's ColwiseParallel (input made a Replicate DTensor, local
#   output), RowwiseParallel (Shard(1) DTensor output), SequenceParallel norms on Shard(1) DTensors
#   and a Shard(1) residual add, on a 1-rank mesh (no data moves; the collectives are the next item).
#   Process CPU time at 2026-11-24 22:55 UTC with the matmul at 207 GFLOP/s (x 2.18 to reference):
#   colwise 487 / 1190 us, rowwise 653 / 1003 us (forward / backward), SP rms_norm 320 / 1068,
#   add 145 / 332. The linear is the mean of colwise and rowwise. (The earlier constants, 59 / 153,
#   183 / 480 and 36 / 50 us, came from fp32 chains of 8x8 ops: no cast, no autocast dispatch, and
#   left ~60 ms of the default job's TP step unpriced.) Redistribution is in the collective below.
CPU_DTENSOR_LINEAR_S = (570e-6, 1097e-6)                                            # measured
CPU_DTENSOR_NORM_S = (320e-6, 1068e-6)                                              # measured
CPU_DTENSOR_OP_S = (145e-6, 332e-6)                                                 # measured
# - One collective as the runtime issues it: the issuing process's own CPU (loopback syscalls, gloo's
#   worker-thread hand-offs, DTensor redistribution / functional-collective wrapping), which competes
#   for the cores like compute; comm.py's alpha-beta time stays the (wall) wait for the data.
#   * A/B `tp=2` against `dp=2` on 2 processes (tiny-llama, 16 x 128 tokens, the same FLOPs per
#     rank, 2 micro-batches of 8): TP adds 180 ms of CPU per step per rank; minus its DTensor ops
#     (above, 21 ms), over the 74 TP collectives of the step (torch.profiler: 38 all-gathers + 36
#     reduce-scatters): 2.15 ms each.
#   * A/B `ep=2,dp=2` against `dp=2` on 2 processes (tiny-moe): EP adds 40 ms of CPU per step; minus
#     the DTensor optimizer parameters (7 ms, below), over its 21 collectives (15 all-to-alls:
#     counts + rows, 6 expert FSDP-unit gathers / reduce-scatters): 1.57 ms.
#   * check at 4 processes (19:50 UTC, load 1.8-3): tp2dp2 against dp4 adds 78 ms of forward +
#     backward CPU per rank: minus 8 ms of DTensor ops, over ~47 collectives: 1.5 ms.
#   * raw gloo, no DTensor (an all-gather / all-reduce of 64 B - 512 KiB between 2 of 4 processes,
#     ~0.4 ms of matmul between calls): 0.2-0.65 ms at load 1.7, 0.69-1.0 ms at load 7.
#   1.86 ms (mean of the two 2-process A/Bs) x 1.25.
CPU_COLLECTIVE_HOST_S = 2.3e-3                                                      # measured (A/B)
# - One action (a stage's forward or backward of one micro-batch) of torch.distributed.pipelining's
#   schedule: A/B `pp=2` (8 micro-batches of 2) against `dp=2` (1 of 8) on 2 processes, the same
#   FLOPs per rank: PP adds 78 ms of CPU per step; minus the extra per-op overhead of 8x more,
#   smaller micro-batches that host.cpu_op_overhead already charges (10 ms) and the 16 sends /
#   receives (16 x 1.86 ms), over the 16 actions: 2.4 ms each (torch.profiler at 4 processes agrees:
#   the PP:<stage><F|B><mb> record functions' self time is ~2.8 ms an action); x 1.25.
CPU_PP_ACTION_HOST_S = 3.0e-3                                                       # measured (A/B)
# - One FSDP unit per step beyond its collectives (FSDP2's pre/post forward and backward hooks,
#   the all-gather's copy-in / copy-out and the reduce-scatter's, the bf16 parameter casts):
#   A/B of dp4 ZeRO-3 (5 units: root + 4 blocks, kept gathered) against dp4 ZeRO-1 (1 unit) on
#   4 processes, tiny-llama at seq 64 x 32 sequences (not the default job's shapes), process CPU
#   scaled to the reference rate, 3 runs at 2026-11-24 22:40-23:05 UTC: +30.7, +37.9, +36.6 ms a
#   step for 4 more units = 8.8 ms a unit, minus what the cost model charges a unit without this
#   term (its all-gather's and reduce-scatter's host work, 2 x CPU_COLLECTIVE_HOST_S, and wire time:
#   +24.4 ms over the 4 units, 6.1 a unit) = 2.7 ms.
CPU_FSDP_UNIT_HOST_S = 2.7e-3                                                       # measured (A/B)
# - One call of a Python custom op (torch.library.custom_op; meshplan::grouped_mm, the experts'
#   grouped GEMM off Hopper), (forward, backward) host seconds beyond its aten ops: torch.profiler
#   of tiny-moe's MoE feed-forward (512 tokens, bf16, 1 thread; matmul 118 GFLOP/s then), self time
#   of meshplan::grouped_mm 97 us a call, of grouped_mm_backward + its two generated autograd
#   nodes 106 + 113 + 24 us; x 1.25 (see above).
CPU_PY_CUSTOM_OP_S = (121e-6, 304e-6)                                               # measured
# - One bf16 GEMM call's own fixed work on CPU (oneDNN's primitive lookup, operand packing, thread
#   set-up), beyond the dispatch CPU_OP_* charges per traced op: small GEMMs run far below the large
#   ones' rate (tiny-moe's 256 x 128 x 96 expert GEMMs at ~145 GFLOP/s on a thread that runs
#   512^3 at ~220). `python benchmarks/cpu_gemm_shapes.py` (results/cpu_gemm_shapes-2026-11-25.txt)
#   fits t = flops / rate + fixed to 14 shapes on one thread (every shape within 8%; 2% in a second
#   run): 217 GFLOP/s and 15.1 us a call, minus a plain op's 2.8 us dispatch = 12.3 us, x 217/95 to
#   the reference rate.
CPU_GEMM_CALL_S = 28e-6                                                             # measured
# - Per parameter tensor per step: torch.optim.AdamW on CPU runs its single-tensor loop (~10 ops
#   per parameter, DTensor ops where the parameters are FSDP2 / TP / EP shards), and the gradient
#   norm's per-parameter ops (ParallelModel.clip_grad_norm). Measured in the regime the model prices
#   them, 4 one-thread gloo processes on the 2 cores (`python benchmarks/cpu_host_costs.py`,
#   results/cpu_host_costs-2026-11-25.txt: tiny-llama under meshplan.parallelize at dp4 ZeRO-0 and
#   ZeRO-1, main-thread CPU per parameter tensor x 4/2 x cpu_rate_scale 0.95; median of 3 runs at
#   2026-11-25 01:10 UTC). Earlier values (112, 248, 58 us) came from 2 processes scaled by 1.25.
CPU_ADAMW_PARAM_S = 141e-6                                                          # measured
CPU_ADAMW_DTENSOR_PARAM_S = 322e-6                                                  # measured
CPU_GRAD_NORM_PARAM_S = 63e-6                                                       # measured
CPU_GRAD_NORM_DTENSOR_PARAM_S = 129e-6                                              # measured

# ---- attention shape dependence on GPUs (meshplan.cost_models.attention) ----------------
# ATTN_FWD_EFF / ATTN_BWD_EFF above are the kernels' plateau efficiency (a long call); these set how
# far below it a given call lands. Reference curves (H100 SXM5, B*S = 16k tokens, 16 heads of 128,
# TFLOP/s of masked FLOPs), Shah et al. 2024 (FlashAttention-3, arXiv 2407.08608) Fig. 5/6, at seq
# 512 / 1k / 2k / 4k / 8k / 16k:
#   FA3 fwd, no mask:  467 565 625 638 646 648     FA2 fwd, no mask:  309 350 362 368 370 370
#   FA3 fwd, causal:   292 423 521 579 602 616     FA2 fwd, causal:   191 260 298 319 333 335
#   FA3 bwd, no mask:  316 424 501 542 559 561     FA2 bwd, no mask:  214 260 291 310 318 322
# (the pytorch/benchmark FA3 run of PR #2391, the same shapes, reads 430 517 566 590 614 621 fwd).
# Score tile of the kernels: FA2 picks blocks from {64, 128} x {64, 128} (Dao 2023, arXiv
# 2307.08691, §3.3); FA3's hd128 kernels use 128-row tiles.
ATTN_TILE = 128                                                                     # derived
# Per-CTA work outside the inner loop (load Q, write O + log-sum-exp, pipeline fill and drain), in
# inner-loop iterations (forward, backward), per kernel. FA3: least squares of attention.call_efficiency
# (each curve scaled by its own plateau) against the paper's curves above: 1.25 / 2.5 (2.9% / 2.6% mean
# error). FlashAttention-2 and cuDNN as PyTorch runs them, from this project's H200 curves
# (gpu_rates-2026-11-27-h200.md, head dims 64 and 128, causal and not): 2.0 / 4.0 fit both kernels to
# 2-3% mean error at head dim 128 (FA2 alone 1.75 / 4.0, cuDNN 2.0 / 4.25); the backward's dQ
# accumulation and dK/dV epilogues weigh more.
ATTN_CTA_FIXED_TILES = {"fa3": (1.25, 2.5), "fa2": (2.0, 4.0), "flash": (2.0, 4.0), "cudnn": (2.0, 4.0),
                        "triton": (2.0, 4.0)}                                       # fitted (to the kernel curves)
# Kernels whose causal forward issues its unequal CTAs longest first: FA3's persistent tile scheduler.
# FA2 and cuDNN launch them in grid order, the longest query rows of the last (sequence, head) last,
# which then run their whole length after the rest: the measured causal/no-mask forward ratio at 16k
# is 0.89 (FA2) and 0.92 (cuDNN) on the H200 and recovers to 0.98 at 64k, as that tail predicts.
ATTN_LPT_KERNELS = ("fa3",)                                                         # measured (own H200)
# Launch + prologue of one attention kernel; FA2's backward runs three (softmax-gradient
# preprocessing dot(dO, O), the main dQ/dK/dV loop, the fp32 dQ conversion: flash_bwd_launch_template.h).
ATTN_KERNEL_FIXED_S = 5e-6                                                          # estimate
ATTN_BWD_KERNELS = 3                                                                # derived
# Streaming multiprocessors per GPU (AMD: compute units): NVIDIA A100 / H100 architecture whitepapers
# (A100 SXM4 108; H100 SXM5 132, PCIe 114; H800, H200 and GH200 are H100 dies, 132), Blackwell B200 148,
# L40S 142 (datasheet); AMD CDNA 3 whitepaper (MI300X / MI325X: 304 CUs).
GPU_SM_COUNT = {"a100-40gb": 108, "a100-80gb": 108, "h100-sxm": 132, "h100-pcie": 114, "h800": 132,
                "h200": 132, "gh200": 132, "b200": 148, "gb200": 148, "mi300x": 304, "mi325x": 304, "l40s": 142}  # measured (spec)
GPU_SM_COUNT_DEFAULT = 132                                                          # estimate (H100-class)


# ---- the fitted constants as one value -------------------------------------------------------
from dataclasses import dataclass, fields as _fields  # noqa: E402


@dataclass(frozen=True)
class Fitted:
    """The constants marked "fitted" above, as one value the cost model is given
    (`estimate_profile(..., fitted=...)`; default FITTED, the shipped fit). A fit builds a new one
    (`dataclasses.replace(FITTED, ...)`) and prices with it: nothing global changes, and the layer
    cost cache keys on it."""

    training_gemm_eff: float = TRAINING_GEMM_EFF
    dp_overlap_eff: float = DP_OVERLAP_EFF
    fsdp_overlap_eff: float = FSDP_OVERLAP_EFF
    tp_overlap_hidden: float = TP_OVERLAP_HIDDEN
    layer_overhead_s: float = LAYER_OVERHEAD_S

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in _fields(cls))


FITTED = Fitted()
