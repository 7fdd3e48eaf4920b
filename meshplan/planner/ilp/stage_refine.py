"""Feed the pipeline-stage ILP from the cost model and apply its split to a candidate layout.

`refine_stages` takes a layout the search found, prices every layer (time for one micro-batch
fwd + bwd + recompute, activation memory, weight/optimizer state) exactly as `estimate_profile`
does, adds the embedding to the first stage and the output layer + loss to the last, and asks
`stages.assign_stages` for the split that minimises the slowest pipeline rank under the
memory cap. The new split is kept only if the full estimate agrees it is faster.
"""

from __future__ import annotations

from meshplan.cost_models import constants as K
from meshplan.cost_models.estimate import (
    GB,
    Estimate,
    embedding_time,
    estimate_profile,
    head_activation_bytes,
    head_times,
    layer_table,
)
from meshplan.ir.layout import Layout
from meshplan.cost_models.memory import optimizer_bytes, state_bytes
from meshplan.cost_models.pipeline import in_flight
from meshplan.errors import MeshplanError
from meshplan.planner.ilp.stages import assign_stages
from meshplan.ir.profile import ModelProfile

__all__ = ["refine_stages"]


def _stage_inputs(profile: ModelProfile, cluster, L: Layout, seq_len: int, global_batch: int, fp8: bool,
                  fp8_modules: frozenset | None = None, stack=None) -> dict:
    # the layers priced exactly as the estimate prices them (one table, per-layer FP8 sets included)
    table = layer_table(profile, cluster, L, seq_len=seq_len, precision="fp8" if fp8 else "bf16",
                        fp8_modules=fp8_modules, stack=stack)
    policy = L.recompute
    blocks = profile.layer_blocks()
    T, sp_div = table.ctx.tokens, (L.tp if L.sp else 1)
    m = global_batch // (L.dp * L.mbs)
    times, acts, static = [], [], []
    for i, b in enumerate(blocks):
        c = table.cost(i, policy)
        times.append(c.fwd_s + c.bwd_s + c.recompute_s)
        acts.append(table.act(i, policy) / GB)
        ob = optimizer_bytes(L)
        sd = state_bytes((b.params - b.expert_params) / L.tp, L.dp * L.cp, L.zero, optimizer_bytes=ob)
        se = state_bytes(b.expert_params / (L.ep * L.etp), L.edp, L.zero, optimizer_bytes=ob)
        static.append((sum(sd.values()) + sum(se.values())) / GB)
    ob = optimizer_bytes(L)
    emb_state = sum(state_bytes(profile.embedding_params / L.tp, L.dp * L.cp, L.zero, optimizer_bytes=ob).values()) / GB
    head_params = profile.head_params or (profile.embedding_params if profile.tied_embeddings else 0)
    head_state = sum(state_bytes(head_params / L.tp, L.dp * L.cp, L.zero, optimizer_bytes=ob).values()) / GB
    e = embedding_time(profile, cluster, T, sp_div)
    g, ce = head_times(profile, cluster, T, L.tp, table.ctx.fitted)
    flights = [in_flight(L.schedule, m, L.pp, L.vp, r) for r in range(L.pp)]
    # multi-token prediction: one more layer of the last layer's kind per depth on the last stage
    # (ranks._add_mtp; its output layer and loss are in head_times)
    mtp_t = mtp_act = mtp_state = 0.0
    if profile.mtp_depth and blocks:
        c, last = table.cost(len(blocks) - 1, "none"), len(blocks) - 1
        mtp_t = profile.mtp_depth * (c.fwd_s + c.bwd_s)
        mtp_act = profile.mtp_depth * table.act(last, "none") / GB
        mtp_state = profile.mtp_depth * static[last]
    return dict(layer_time_s=times, layer_memory_gb=acts, static_memory_gb=static, in_flight=flights,
                first_extra_time_s=3 * e, last_extra_time_s=3 * g + 2 * ce + mtp_t,
                first_extra_memory_gb=emb_state + K.BF16 * profile.hidden * T / sp_div * flights[0] / GB,
                last_extra_memory_gb=head_state + head_activation_bytes(profile, T, L.tp) / GB + mtp_act + mtp_state)


def refine_stages(profile: ModelProfile, cluster, est: Estimate, *, seq_len: int, global_batch: int,
                  time_limit_s: float = 1.0, fp8_modules: frozenset | None = None, stack=None) -> Estimate:
    """The estimate of `est`'s layout with the ILP's stage split, if that is faster; else `est`.
    fp8_modules: the FP8 set `est` was priced with (the search's), so the split is judged alike;
    stack: the stack it was priced for."""
    L = Layout.from_dict(est.layout)
    if L.pp == 1 or not isinstance(L.recompute, str):
        return est
    try:
        inputs = _stage_inputs(profile, cluster, L, seq_len, global_batch, est.precision == "fp8", fp8_modules,
                               stack)
        sa = assign_stages(**inputs, pp=L.pp, vp=L.vp, memory_cap_gb=cluster.usable_memory_gb,
                           time_limit_s=time_limit_s)
    except MeshplanError:
        return est
    if L.stage_layers == sa.stage_layers:
        return est
    lay = dict(est.layout, stage_layers=sa.stage_layers)
    new = estimate_profile(profile, cluster, lay, seq_len=seq_len, global_batch=global_batch,
                           precision=est.precision, fp8_modules=fp8_modules if est.precision == "fp8" else None,
                           stack=stack)
    return new if new.fits and new.step_time_s < est.step_time_s else est
