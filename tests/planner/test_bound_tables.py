"""The search's lower bound (planner/bound.py) is arithmetic on the cost model's tables: for a
one-stage mesh it is the tables' cheapest layers plus the edges plus the unfused gradient
accumulation, and a candidate given as a Layout is bounded as the same layout given as a dict."""

from __future__ import annotations

import meshplan as mp
from meshplan.cost_models.tables import edge_costs, grad_accumulation_s, layer_table, pipeline_floor_s
from meshplan.ir.layout import Layout
from meshplan.ir.stack import resolve_stack
from meshplan.planner.bound import MeshBound
from meshplan.profiling.analytic import profile_from_config


def test_bound_is_the_tables_sum_and_takes_a_layout():
    prof = profile_from_config(mp.models.config("llama3-8b"), seq_len=4096)
    cl = mp.Cluster.preset("dgx-h100", num_gpus=16)
    stack = resolve_stack("torchtitan")
    policies = ("none", "full")
    bound = MeshBound(prof, cl, seq_len=4096, global_batch=64, precisions=("bf16",), policies=policies,
                      fp8_modules=None, stack=stack)
    cand = {"tp": 2, "dp": 8, "sp": True}
    lb = bound(cand, [1, 2])

    expected = []
    for mbs in (1, 2):
        lay = Layout.from_dict(dict(cand, mbs=mbs))
        table = layer_table(prof, cl, lay, seq_len=4096, stack=stack)
        layers = sum(min(c.fwd_s + c.bwd_s + c.recompute_s for c in (table.cost(i, p) for p in policies))
                     for i in range(prof.num_layers))
        edge = edge_costs(prof, table)
        total = layers + 3 * edge.embedding_fwd_s + 3 * edge.head_gemm_fwd_s + 2 * edge.loss_s
        weights = sum((b.params - b.expert_params) / 2 + b.expert_params for b in prof.layer_blocks())
        acc = grad_accumulation_s(weights, lay, stack, cl)     # torchtitan accumulates unfused
        assert acc > 0
        m = 64 // (8 * mbs)
        expected.append(pipeline_floor_s(cl, lay, m, total + acc))
    assert abs(lb - min(expected)) <= 1e-12 * lb
    # a Layout candidate (mbs and recompute ignored) is bounded alike
    assert bound(Layout.from_dict(dict(cand, mbs=4, recompute="full")), [1, 2]) == lb
