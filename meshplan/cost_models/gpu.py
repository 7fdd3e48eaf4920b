"""GPU pricing behind the device seam (cost_models.device): kernel launch and prologue costs, the
grouped expert GEMM, attention kernels at their measured rates, HBM-bound element-wise passes.
Nothing host-side is charged per op: on a GPU the host runs ahead of the kernels, and the
per-step host work is constants.STEP_OVERHEAD_S. Every formula here is validated against the
published runs (cost_models.validation)."""

from __future__ import annotations

from meshplan.cost_models import constants as K
from meshplan.cost_models.attention import AttnShape, generation_rate, head_dim_rate, shape_penalty, sm_count
from meshplan.cost_models.roofline import fp8_cast_time, gemm_roofline, hbm_rate, matmul_rate
from meshplan.cost_models.pipeline import pipeline_time_lower_bound
from meshplan.ir.profile import EXPERT_ROLES

__all__ = ["GpuDevice", "GPU"]

_NO_HOST = (0.0, 0.0)


class GpuDevice:
    """Pricing of work on a GPU. Stateless: every method takes the cluster it prices."""

    kind = "gpu"
    # the published runs validate this device's formulas (their regimes' bands apply)
    validated_by_published_runs = True
    ring_ops_on_host = False

    def runs_compile(self, stack) -> bool:
        """Whether `stack` compiles the model here (torch.compile fuses the element-wise work)."""
        return bool(stack.compile)

    # -- kernels ----------------------------------------------------------------------------
    def gemm_fixed_s(self, cluster, fp8: bool) -> float:
        """A GEMM kernel's launch, prologue and last wave, beyond its FLOPs."""
        return K.FP8_GEMM_FIXED_S if fp8 else K.GEMM_FIXED_S

    def grouped_gemm_time(self, rows: float, n: float, k: float, cluster, *, groups: float, fp8: bool,
                          recipe: str, fitted: K.Fitted) -> float:
        """`groups` GEMMs of (rows x k) @ (k x n) in ONE grouped kernel (torch._grouped_mm; TE
        GroupedLinear under Megatron-Core --moe-grouped-gemm): each group's rows occupy whole
        GEMM_TILE_M-row tiles for the math; HBM traffic, the FP8 input cast and the fixed per-kernel
        cost are paid on the real rows and once per kernel."""
        padded = -(-rows // K.GEMM_TILE_M) * K.GEMM_TILE_M if rows >= 1 else K.GEMM_TILE_M
        one = gemm_roofline(rows, n, k, cluster, fp8=fp8, math_rows=padded, fitted=fitted, recipe=recipe)
        extra = fp8_cast_time(rows, n, k, cluster, recipe) if fp8 else 0.0
        return groups * (one + extra) + self.gemm_fixed_s(cluster, fp8)

    def attention_time(self, flops_fwd: float, cluster, *, backward: bool, kernel: str, shape: AttnShape | None,
                       fitted: K.Fitted) -> float:
        """The attention kernel `kernel` at its plateau share of the MAMF (FlashAttention-2's
        constants.ATTN_FWD_EFF / ATTN_BWD_EFF times the kernel's ATTN_KERNEL_RATE, the GPU
        generation's and the head dim's rate), slowed in a step as the GEMMs are
        (training_gemm_eff, inside matmul_rate), divided by `shape`'s penalty
        (attention.shape_penalty), plus a fixed cost per kernel launched; without `shape`, the
        plateau rate at head dim 128 alone."""
        try:
            speed = K.ATTN_KERNEL_RATE[kernel][1 if backward else 0]
        except KeyError:
            raise ValueError(f"unknown attention kernel {kernel!r}; known: {sorted(K.ATTN_KERNEL_RATE)}") from None
        rate = matmul_rate(cluster, False, fitted) * speed * generation_rate(cluster.gpu.id, backward=backward)
        if shape is not None:
            rate *= head_dim_rate(kernel, shape.head_dim, backward=backward)
        if backward:
            t = flops_fwd * K.ATTN_BWD_FLOP_RATIO / (rate * K.ATTN_BWD_EFF)
        else:
            t = flops_fwd / (rate * K.ATTN_FWD_EFF)
        if shape is None:
            return t
        launches = shape.kernels * (K.ATTN_BWD_KERNELS if backward else 1)
        return t * shape_penalty(shape, sm_count(cluster), backward=backward, kernel=kernel) + \
            launches * K.ATTN_KERNEL_FIXED_S

    def elementwise_time(self, nbytes: float, cluster) -> float:
        return nbytes / hbm_rate(cluster)

    def permute_time(self, nbytes: float, cluster) -> float:
        """A MoE token permutation: memory-bound like any element-wise pass."""
        return self.elementwise_time(nbytes, cluster)

    # -- per-layer and per-step host work: none on a GPU beyond the fitted constants ---------
    def op_overhead(self, ops, cluster, fitted: K.Fitted) -> tuple[float, float]:
        """(forward, backward) fixed seconds per layer beyond its kernels (launch gaps)."""
        return fitted.layer_overhead_s, fitted.layer_overhead_s

    def layer_host(self, b, layout, cluster, policy: str) -> dict[str, tuple[float, float]]:
        return {}

    def moe_host_wait(self, b, layout, stack, fp8_recipe: str | None = None) -> tuple[float, float]:
        """(forward, backward) host seconds of a MoE layer that the GPU waits through: where the
        stack's dropless dispatch makes the host wait for the GPU once per MoE layer
        (Stack.moe_host_sync), the launch queue is empty after each wait and the host cannot run
        ahead again, so the time it takes to issue the layer's kernels adds to their GPU time. Padded
        dispatch (a capacity factor: sizes known in advance) does not wait.

        Kernels issued: each traced op that launches one (views launch none), the routed experts as
        one GEMM per local expert on a per-expert stack (Megatron-Core runs the gated experts' gate
        and up projections as one fc1 GEMM) at TE_EXPERT_GEMM_HOST_S each, else one grouped launch
        per expert linear; a backward issues about two per forward kernel (dgrad and wgrad GEMMs, the
        gradient kernels of element-wise ops). With FP8 experts (`fp8_recipe`) under current scaling
        ("tensorwise"), Transformer Engine quantises each expert's slice on its own, three launches
        each (amax, scale, cast: pytorch/csrc/quantizer.cpp Float8CurrentScalingQuantizer; only
        delayed scaling has the one multi-tensor cast kernel), for the two expert inputs in forward
        and the two output gradients in backward."""
        if not (b.is_moe and stack.moe_host_sync and layout.moe_capacity_factor is None):
            return _NO_HOST
        experts = [li for li in b.linears if li.is_expert]
        plain = sum(1 for op in b.ops if op.kind != "view" and op.role not in EXPERT_ROLES)
        if not b.ops:                  # a block priced from a config: its linears are what is known
            plain = len(b.linears) - len(experts)
        if stack.expert_gemm == "per_expert":
            local = max(1.0, b.experts / layout.ep)
            gemms = (1 if any(li.role == "expert_in" for li in experts) else 0) + \
                sum(1 for li in experts if li.role == "expert_out")
            expert_host = gemms * local * K.TE_EXPERT_GEMM_HOST_S
            cast = gemms * 3 * local * K.HOST_LAUNCH_S if fp8_recipe == "tensorwise" else 0.0
        else:
            expert_host, cast = len(experts) * K.HOST_LAUNCH_S, 0.0
        fwd = plain * K.HOST_LAUNCH_S + expert_host
        return fwd + cast, 2 * fwd + cast

    def edge_host(self, profile, layout, cluster, *, first: bool, last: bool) -> tuple[float, float]:
        return _NO_HOST

    def fsdp_copy_time(self, nbytes: float, cluster) -> float:
        """FSDP2's copies around its collectives on the compute stream: HBM-bound passes."""
        return self.elementwise_time(nbytes, cluster)

    def expert_fsdp_units(self, n_moe_layers: int, layout) -> int:
        """Units whose expert weights are gathered / reduce-scattered apart: one bucket on a GPU."""
        return 1

    def pipeline_bubble(self, cluster, layout, busy: float, bubble: float) -> float:
        return bubble

    def pipeline_lower_bound(self, layout, m: int, total_fb: float) -> float:
        """A lower bound on the step's busy + bubble time (pipeline.pipeline_time_lower_bound): a
        GPU idles in the schedule's bubble."""
        return pipeline_time_lower_bound(layout.schedule, m, layout.vp, layout.pp, total_fb)

    def pp_host_time(self, layout, cluster, m: int) -> float:
        return 0.0

    def step_overhead(self, profile, cluster, layout, ranks, stack) -> float:
        """The step's fixed cost beyond its kernels: the stack's where known (Stack.step_overhead_s)."""
        return K.STEP_OVERHEAD_S if stack.step_overhead_s is None else stack.step_overhead_s


GPU = GpuDevice()
