"""`Context`: what every per-layer cost needs, computed once per (profile, cluster, layout, shape,
stack); which of a layer's linears run in FP8; which per-layer fusions run eagerly."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from meshplan.cost_models.comm import Group, group
from meshplan.cost_models.constants import FITTED, Fitted
from meshplan.ir.profile import BlockProfile
from meshplan.ir.stack import STACKS, Stack

__all__ = ["Context", "is_fp8_linear", "unfused_of", "for_stack", "LAYER_FUSIONS", "COL_ROLES", "ROW_ROLES"]

# Fusions whose fused form the per-layer baseline already assumes (a norm is one read + one write,
# silu*mul reads two and writes one, rotary reads and writes q and k once), as Megatron and
# Transformer Engine run them; a model that runs one of them eagerly pays meshplan.kernels.fusion's
# extra bytes on top.
LAYER_FUSIONS = ("rms_norm", "swiglu", "rope")
COL_ROLES = ("attn_qkv", "mlp_in", "shared_in", "other")     # output dim split over TP
ROW_ROLES = ("attn_out", "mlp_out", "shared_out")             # input dim split over TP
# linears whose weights every TP rank holds whole: shared experts folded over TP, MLA's
# down-projections (meshplan.ir.support.TP_ROLE_PLACEMENT: "replicate")
WHOLE_ON_TP_ROLES = ("shared_folded", "attn_down")


@dataclass(frozen=True)
class Context:
    """Everything per-layer costs need, computed once per (profile, cluster, layout, shape)."""

    cluster: object
    layout: object
    seq_len: int
    fp8: bool
    tokens: float            # rows of the GEMMs on one GPU per micro-batch: mbs * seq / cp
    tp: Group
    cp: Group
    ep: Group
    etp: Group
    # the block's linears (by name) that run in FP8 when fp8; None: all but the router
    fp8_linears: frozenset | None = None
    unfused: frozenset = field(default_factory=frozenset)   # LAYER_FUSIONS the model runs eagerly
    fp8_recipe: str = "tensorwise"                           # constants.FP8_RECIPES
    stack: Stack = STACKS["reference"]                       # the software that runs the layer
    fitted: Fitted = FITTED                                  # the fitted constants it is priced with

    @classmethod
    def build(cls, cluster, layout, seq_len: int, fp8: bool, unfused: frozenset = frozenset(),
              fp8_recipe: str = "tensorwise", stack: Stack = STACKS["reference"],
              fp8_linears: frozenset | None = None, fitted: Fitted = FITTED) -> "Context":
        L = layout
        return cls(cluster=cluster, layout=L, seq_len=seq_len, fp8=fp8,
                   tokens=L.mbs * seq_len / L.cp,
                   tp=group(cluster, L.tp, 1), cp=group(cluster, L.cp, L.tp),
                   ep=group(cluster, L.ep, L.etp), etp=group(cluster, L.etp, 1), unfused=unfused,
                   fp8_recipe=fp8_recipe, stack=stack, fp8_linears=fp8_linears, fitted=fitted)

    @property
    def attn_kernel(self) -> str:
        """The attention kernel that runs: the layout's when it names one, else the stack's on this GPU."""
        k = self.layout.attn_kernel
        return self.stack.attention_kernel(self.cluster.gpu.id) if k == "flash" else k


def is_fp8_linear(li, c: "Context") -> bool:
    """Whether linear `li` runs its GEMMs in FP8 in context `c` (the router never does)."""
    return c.fp8 and li.role != "router" and (c.fp8_linears is None or li.name in c.fp8_linears)


def _fp8_share(b: BlockProfile, c: "Context", roles: tuple[str, ...] | None = None) -> bool:
    """Whether any of the block's linears (of `roles`) runs in FP8."""
    return any(is_fp8_linear(li, c) for li in b.linears if roles is None or li.role in roles)


def unfused_of(profile) -> frozenset:
    """The per-layer fusions a traced model runs in eager form (see ModelProfile.fusions)."""
    return frozenset(name for name, fused in profile.fusions if not fused and name in LAYER_FUSIONS)



def for_stack(profile, stack: Stack):
    """The profile as `stack` runs it: the fused kernels the tracer matched (ModelProfile.fusions) are
    swapped in by meshplan's runtime alone, so for another stack they are cleared and the cost model
    assumes that stack's own kernels (Stack.fused_elementwise, compile; the output layer and loss
    unfused, logits held), as the validation prices published runs."""
    if stack.runtime_checks or not profile.fusions:
        return profile
    return replace(profile, fusions=())
