"""Feed the pipeline-stage ILP from the cost model and apply its split to a candidate layout.

`refine_stages` takes a layout the search found, prices every layer (time for one micro-batch
fwd + bwd + recompute, activation memory, weight/optimizer state) exactly as `estimate_profile`
does, adds the embedding to the first stage and the output layer + loss to the last, and asks
`stages.assign_stages` for the split that minimises the slowest pipeline rank under the
memory cap. The new split is kept only if the full estimate agrees it is faster.
"""

from __future__ import annotations

from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.tables import edge_costs, edge_state_bytes, in_flight_by_rank, layer_state_bytes, layer_table
from meshplan.errors import MeshplanError
from meshplan.ir.estimate import GB, Estimate
from meshplan.ir.layout import Layout
from meshplan.ir.profile import ModelProfile
from meshplan.planner.ilp.stages import assign_stages

__all__ = ["refine_stages"]


def _stage_inputs(profile: ModelProfile, cluster, L: Layout, seq_len: int, global_batch: int, fp8: bool,
                  fp8_modules: frozenset | None = None, stack=None) -> dict:
    # the layers priced exactly as the estimate prices them (one table, per-layer FP8 sets included)
    table = layer_table(profile, cluster, L, seq_len=seq_len, precision="fp8" if fp8 else "bf16",
                        fp8_modules=fp8_modules, stack=stack)
    policy = L.recompute
    blocks = profile.layer_blocks()
    m = global_batch // (L.dp * L.mbs)
    times, acts = [], []
    for i in range(len(blocks)):
        c = table.cost(i, policy)
        times.append(c.fwd_s + c.bwd_s + c.recompute_s)
        acts.append(table.act(i, policy) / GB)
    static = [nbytes / GB for nbytes in layer_state_bytes(profile, L, stack)]
    edge = edge_costs(profile, table)
    emb_state, head_state = edge_state_bytes(profile, L, stack)
    flights = in_flight_by_rank(L, m)
    # multi-token prediction: one more layer of the last layer's kind per depth on the last stage
    # (its output layer and loss are in the edge costs)
    mtp_t = mtp_act = mtp_state = 0.0
    if profile.mtp_depth and blocks:
        c, last = table.cost(len(blocks) - 1, "none"), len(blocks) - 1
        mtp_t = profile.mtp_depth * (c.fwd_s + c.bwd_s)
        mtp_act = profile.mtp_depth * table.act(last, "none") / GB
        mtp_state = profile.mtp_depth * static[last]
    return dict(layer_time_s=times, layer_memory_gb=acts, static_memory_gb=static, in_flight=flights,
                first_extra_time_s=edge.first_s, last_extra_time_s=edge.last_s + mtp_t,
                first_extra_memory_gb=emb_state / GB + edge.embedding_act_bytes * flights[0] / GB,
                last_extra_memory_gb=head_state / GB + edge.head_act_bytes / GB + mtp_act + mtp_state)


def refine_stages(profile: ModelProfile, cluster, est: Estimate, *, seq_len: int, global_batch: int,
                  time_limit_s: float = 1.0, fp8_modules: frozenset | None = None, stack=None) -> Estimate:
    """The estimate of `est`'s layout with the ILP's stage split, if that is faster; else `est`.
    fp8_modules: the FP8 set `est` was priced with (the search's), so the split is judged alike;
    stack: the stack it was priced for."""
    L = est.layout
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
    lay = L.replace(stage_layers=sa.stage_layers)
    new = estimate_profile(profile, cluster, lay, seq_len=seq_len, global_batch=global_batch,
                           precision=est.precision, fp8_modules=fp8_modules if est.precision == "fp8" else None,
                           stack=stack)
    return new if new.fits and new.step_time_s < est.step_time_s else est
