"""The cost tables the planner reads (cost_models/tables.py): each agrees with what the estimate
charges for the same thing, and prices its alternatives the way the hardware orders them."""

from __future__ import annotations

import math

import pytest

import meshplan as mp
from meshplan.cost_models import constants as K
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.tables import (
    LinearCostTable,
    OpCostTable,
    edge_costs,
    edge_state_bytes,
    in_flight_by_rank,
    layer_state_bytes,
    layer_table,
    pipeline_p2p_s,
)
from meshplan.ir.estimate import GB
from meshplan.ir.layout import Layout
from meshplan.profiling.analytic import profile_from_config

H100 = mp.Cluster.preset("dgx-h100", num_gpus=64)


@pytest.fixture(scope="module")
def llama():
    return profile_from_config(mp.models.config("llama3-8b"), seq_len=4096)


def test_pipeline_p2p_is_what_the_estimate_charges(llama):
    lay = Layout.from_dict({"tp": 2, "pp": 4, "vp": 2, "dp": 8, "sp": True, "schedule": "interleaved"})
    est = estimate_profile(llama, H100, lay, seq_len=4096, global_batch=256)
    m = est.num_microbatches
    exposed, total = pipeline_p2p_s(llama, H100, lay, m, layer_table(llama, H100, lay, seq_len=4096).ctx.tokens)
    assert exposed == est.time_s["pp"] and total == est.comm_s["pp"]
    assert 0 < exposed < total      # 8 micro-batches cross each boundary; fill and drain expose 7 hops
    flat = Layout.from_dict({"tp": 2, "dp": 32})
    assert pipeline_p2p_s(llama, H100, flat, m, 4096.0) == (0.0, 0.0)


def test_edges_and_layers_add_up_to_the_estimates_one_stage_step(llama):
    """One pipeline rank, one micro-batch: its busy time is the layers' forward + backward plus the
    embedding's and the output layer + loss's, as the tables give them (no TP: the output layer's
    sequence-parallel gather is the rank's own; gradient accumulation fused into the GEMMs)."""
    lay = Layout.from_dict({"dp": 64, "mbs": 1, "grad_accum_fusion": True})
    est = estimate_profile(llama, H100, lay, seq_len=4096, global_batch=64, stack="megatron-core")
    assert est.num_microbatches == 1
    table = layer_table(llama, H100, lay, seq_len=4096, stack="megatron-core")
    layers = sum(table.cost(i, "none").fwd_s + table.cost(i, "none").bwd_s for i in range(llama.num_layers))
    edge = edge_costs(llama, table)
    busy = est.time_s["compute"] + est.time_s["tp"] + est.time_s["cp"] + est.time_s["ep"]
    assert math.isclose(layers + edge.first_s + edge.last_s, busy, rel_tol=1e-9)
    assert edge.first_s == 3 * edge.embedding_fwd_s and edge.last_s == 3 * edge.head_gemm_fwd_s + 2 * edge.loss_s


def test_state_bytes_are_the_estimates_weights_gradients_and_optimizer(llama):
    for z in (0, 1, 3):
        lay = Layout.from_dict({"tp": 2, "dp": 32, "zero": z})
        est = estimate_profile(llama, H100, lay, seq_len=4096, global_batch=64)
        state = sum(layer_state_bytes(llama, lay)) + sum(edge_state_bytes(llama, lay))
        held = sum(est.memory_gb[k] for k in ("weights", "gradients", "optimizer")) * GB
        if z < 3:       # the estimate also holds the final norm's few weights; ZeRO-3 a layer's gathered copy
            assert math.isclose(state, held, rel_tol=1e-6), z
        else:
            assert state < held


def test_in_flight_follows_the_schedule():
    assert in_flight_by_rank({"pp": 4, "dp": 2}, 8) == [4.0, 3.0, 2.0, 1.0]
    assert in_flight_by_rank({"pp": 4, "dp": 2}, 2) == [2.0, 2.0, 2.0, 1.0]
    assert in_flight_by_rank({"pp": 4, "dp": 2, "schedule": "gpipe"}, 8) == [8.0] * 4
    inter = in_flight_by_rank({"pp": 4, "vp": 2, "dp": 2, "schedule": "interleaved"}, 8)
    # Megatron-Core's warm-up of (p - r - 1) * 2 + (v - 1) * p chunks, plus one, over v chunks a rank
    assert inter == [(6 + 4 + 1) / 2, (4 + 4 + 1) / 2, (2 + 4 + 1) / 2, (0 + 4 + 1) / 2]
    assert inter[0] == 4 * (1 + 3 / 8)


def test_linear_costs_order_bf16_and_fp8_as_the_hardware_does(llama):
    table = LinearCostTable(llama, H100, {"tp": 2, "dp": 32, "sp": True}, seq_len=4096)
    bi = llama.layers[0]
    b = llama.blocks[bi]
    by_role = {li.role: li for li in b.linears}
    big = table.linear(bi, by_role["mlp_in"])
    assert big.fp8_s < big.bf16_s < 2 * big.fp8_s         # FP8's rate is at most twice BF16's
    assert big.weight_cache_bytes == K.FP8_WEIGHT_CACHE_BYTES * big.weights > 0 and big.weight_cast_s > 0
    assert big.rows == table.tokens and big.k == b.hidden  # column-parallel: the output features split
    assert table.linear(bi, by_role["mlp_in"]) is big      # memoised
    out = table.linear(bi, by_role["mlp_out"])
    assert out.n == b.hidden                               # row-parallel: the input features split
    head = table.head()
    assert head.n == llama.vocab / 2 and head.k == llama.hidden and head.rows == table.tokens
    # a tiny GEMM gains nothing from FP8: the activation cast and fixed costs dominate
    small = LinearCostTable(llama, H100, {"tp": 8, "dp": 8}, seq_len=16).linear(bi, by_role["attn_out"])
    assert small.fp8_s >= small.bf16_s


def test_stored_inputs_follow_the_recompute_policy(llama):
    table = LinearCostTable(llama, H100, {"tp": 4, "dp": 16, "sp": True}, seq_len=4096)
    b = llama.layer_blocks()[0]
    assert table.stored_input("attn_qkv", b, "none") == ("attn_in", K.BF16 * b.hidden / 4)
    assert table.stored_input("attn_qkv", b, "full") == ("", 0.0)
    assert table.stored_input("attn_qkv", b, "norm_act") == ("", 0.0)
    assert table.stored_input("mlp_out", b, "selective") == ("", 0.0)
    assert table.stored_input("mlp_out", b, "none") == ("", K.BF16 * b.ffn_hidden / 4)
    assert table.head_input_bytes_per_token == K.BF16 * llama.hidden


def test_op_costs_on_a_tp_group():
    per_step = OpCostTable(H100, tp=4, microbatches=1)
    per_mb = OpCostTable(H100, tp=4, microbatches=8)
    assert per_step.grad_sync_s(1e6) > 0
    assert per_mb.grad_sync_s(1e6) * 8 == pytest.approx(per_step.grad_sync_s(1e6), rel=1e-12)
    # the three GEMMs of a linear: splitting one dimension over TP cuts their time
    assert per_step.linear_s(4096, 4096 / 4, 4096) < per_step.linear_s(4096, 4096, 4096)
    # an all-reduce is a reduce-scatter plus an all-gather
    nbytes = 64e6
    ar, rs, ag = (per_step.reshard_s(k, nbytes) for k in ("all_reduce", "reduce_scatter", "all_gather"))
    assert ar == pytest.approx(rs + ag, rel=0.05)
    assert OpCostTable(H100, tp=1, microbatches=1).reshard_s("all_reduce", nbytes) == 0.0
    assert per_step.attention_s(1e12) > per_step.attention_s(5e11) > 0
    assert per_step.elementwise_s(1e9) > 0 and per_step.roofline_s(1e12, 3) > per_step.roofline_s(1e12, 1)


@pytest.mark.parametrize("zero", [1, 3])
def test_fp8_weight_copies_are_held_as_the_estimate_holds_them(llama, zero):
    """The FP8 placement's per-linear cache is the estimate's: of the ZeRO-3 shard under FSDP (the
    ILP charged whole copies there, found every FP8 plan over budget and refused precision='auto')."""
    lay = Layout.from_dict({"tp": 2, "dp": 32, "zero": zero})
    table = LinearCostTable(llama, H100, lay, seq_len=4096)
    cached = sum(table.linear(llama.layers[i], li).weight_cache_bytes
                 for i in range(len(llama.layers)) for li in llama.blocks[llama.layers[i]].linears)
    cached += table.head().weight_cache_bytes
    est = estimate_profile(llama, H100, lay, seq_len=4096, global_batch=256, precision="fp8")
    # the estimate's cache also holds the embedding's and norms' copies (every parameter)
    assert cached / GB == pytest.approx(est.memory_gb["fp8_cache"], rel=0.1)
