"""FP8 weight casts priced as the stack's library runs them (compute.fp8_weight_casts): Transformer
Engine once per step from its weight cache; torchao's Float8Linear in every micro-batch's forward and
again in its backward; and under FSDP2's float8 all-gather, a cast of the shard at each gather, a
1-byte all-gather and a transposed copy of the gathered weight in backward."""

from __future__ import annotations

import pytest

import meshplan as mp
from meshplan.cost_models.comm import collective_time, group
from meshplan.cost_models.compute import fp8_weight_cast_time, fp8_weight_casts
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.roofline import fp8_quant_bytes, fp8_weight_gathered, hbm_rate
from meshplan.cost_models.tables import GEMMS_PER_PASS, LinearCostTable
from meshplan.ir.layout import Layout
from meshplan.ir.stack import Stack
from meshplan.profiling.analytic import profile_from_config

SEQ = 2048
TITAN = Stack.preset("torchtitan")
TITAN_TE = TITAN.replace(fp8_impl="te")       # the same stack with Transformer Engine's weight cache


@pytest.fixture(scope="module")
def h200():
    return mp.Cluster(gpu="h200", gpus_per_node=1, nodes=1)


@pytest.fixture(scope="module")
def h100x8():
    return mp.Cluster(gpu="h100-sxm", gpus_per_node=8, nodes=1)


@pytest.fixture(scope="module")
def prof():
    cfg = mp.models.config("llama3-8b", layers=4, hidden=1024, heads=8, kv_heads=4, ffn_hidden=4096)
    return profile_from_config(cfg, seq_len=SEQ)


def _fp8_weights(prof) -> float:
    """The FP8 linears' weight elements of every layer (no TP: one GPU holds them all)."""
    return sum(li.in_features * li.out_features * li.count
               for bi in prof.layers for li in prof.blocks[bi].linears if li.role != "router")


def test_torchao_casts_every_weight_in_every_microbatch(prof, h200):
    """Four micro-batches on one GPU: torchao's step pays the weight casts three more times than
    Transformer Engine's (which casts on the first micro-batch and reuses its cache). The old charge,
    once per step for both, makes the two steps equal."""
    lay = Layout(dp=1, zero=1, mbs=1)
    hbm = hbm_rate(h200)
    one_cast = _fp8_weights(prof) * fp8_quant_bytes("tensorwise") / hbm
    for micro in (1, 4):
        kw = {"seq_len": SEQ, "global_batch": micro, "precision": "fp8"}
        ao = estimate_profile(prof, h200, lay, stack=TITAN, **kw).step_time_s
        te = estimate_profile(prof, h200, lay, stack=TITAN_TE, **kw).step_time_s
        assert ao - te == pytest.approx((micro - 1) * one_cast, rel=1e-6, abs=1e-9)
    assert one_cast > 1e-5       # far above the tolerance: the old charge's 3 x one_cast gap shows


def test_torchao_weight_casts_split_between_forward_and_backward(h200):
    w = 1e9
    per = w * fp8_quant_bytes("tensorwise") / hbm_rate(h200)
    lay = Layout(dp=1, zero=1)
    ao = fp8_weight_casts(w, 0.0, h200, lay, "tensorwise", TITAN)
    # forward: amax + cast (5 bytes); backward: the cast again with the saved scale (3)
    assert ao.step_s == 0.0
    assert ao.fwd_s == pytest.approx(per * 5 / 8) and ao.bwd_s == pytest.approx(per * 3 / 8)
    assert ao.per_step(6) == pytest.approx(6 * per)
    te = fp8_weight_casts(w, 0.0, h200, lay, "tensorwise", Stack.preset("megatron-core"))
    assert (te.step_s, te.fwd_s, te.bwd_s) == (pytest.approx(per), 0.0, 0.0)
    assert te.per_step(6) == pytest.approx(per)
    # uncompiled torchao pays its unfused passes per element, every micro-batch
    eager = fp8_weight_casts(w, 0.0, h200, lay, "rowwise", TITAN.replace(compile=False))
    assert eager.per_step(2) == pytest.approx(2 * w * fp8_quant_bytes("rowwise", eager=True) / hbm_rate(h200))
    assert fp8_weight_cast_time(w, h200, "tensorwise", TITAN, layout=lay, microbatches=3) == pytest.approx(3 * per)


def test_which_weights_fsdp_gathers_in_fp8():
    fsdp = Layout(dp=8, zero=3)
    assert fp8_weight_gathered(fsdp, "tensorwise", TITAN)
    assert fp8_weight_gathered(fsdp, "tensorwise", Stack.preset("meshplan"))
    # torchao's float8 all-gather takes tensorwise scales only; Transformer Engine gathers BF16 under FSDP2
    assert not fp8_weight_gathered(fsdp, "rowwise", TITAN)
    assert not fp8_weight_gathered(fsdp, "tensorwise", TITAN_TE)
    # nothing sharded to gather: ZeRO-1, or FSDP over one rank
    assert not fp8_weight_gathered(Layout(dp=8, zero=1), "tensorwise", TITAN)
    assert not fp8_weight_gathered(Layout(dp=1, zero=3), "tensorwise", TITAN)
    # torchtitan gathers TP-sharded weights in FP8 too; meshplan's runtime gathers those in BF16
    fsdp_tp = Layout(dp=4, tp=2, zero=3)
    assert fp8_weight_gathered(fsdp_tp, "tensorwise", TITAN)
    assert not fp8_weight_gathered(fsdp_tp, "tensorwise", Stack.preset("meshplan"))


def test_fsdp_float8_all_gather_casts_the_shard(h100x8):
    w, hbm = 8e9, hbm_rate(h100x8)
    lay = Layout(dp=8, zero=3)
    shard = w / 8
    titan = fp8_weight_casts(w, 0.0, h100x8, lay, "tensorwise", TITAN)
    # scales precomputed after the optimizer step (one read of each fp32 shard), then each gather's
    # cast of the fp32 shard (read 4, write 1) in forward and again in backward, plus backward's
    # transposed copy of the gathered FP8 weight (read 1, write 1)
    assert titan.step_s == pytest.approx(shard * 4 / hbm)
    assert titan.fwd_s == pytest.approx(shard * 5 / hbm)
    assert titan.bwd_s == pytest.approx(shard * 5 / hbm + w * 2 / hbm)
    # meshplan's runtime does not precompute: each gather takes the shard's amax (4 + 4 + 1 bytes)
    mesh = fp8_weight_casts(w, 0.0, h100x8, lay, "tensorwise", Stack.preset("meshplan"))
    assert mesh.step_s == 0.0 and mesh.fwd_s == pytest.approx(shard * 9 / hbm)
    # kept gathered after forward: no second gather, no second cast
    kept = fp8_weight_casts(w, 0.0, h100x8, lay.replace(reshard_after_forward=False), "tensorwise", TITAN)
    assert kept.bwd_s == pytest.approx(w * 2 / hbm)
    # under torch.distributed.pipelining kept gathered for the whole step: one cast a step
    pp = fp8_weight_casts(w, 0.0, h100x8, Layout(dp=4, pp=2, zero=3, reshard_after_forward=False),
                          "tensorwise", TITAN)
    assert pp.fwd_s == 0.0 and pp.step_s == pytest.approx((w / 4) * (4 + 5) / hbm)
    # routed experts are not Float8Linear weights FSDP2 gathers: cast in each micro-batch as without FSDP
    ex = fp8_weight_casts(0.0, w, h100x8, lay, "tensorwise", TITAN)
    assert ex.per_step(1) == pytest.approx(w * fp8_quant_bytes("tensorwise") / hbm)


def test_autocast_over_fp32_parameters_casts_fp32_weights(h200):
    """meshplan's runtime on one GPU (or DDP) keeps fp32 parameters and runs autocast: torchao casts
    the fp32 weight, reading 4 bytes where the measured bf16 layers read 2 (forward 9 + backward 5
    bytes against 5 + 3)."""
    w, hbm = 1e9, hbm_rate(h200)
    per = w * fp8_quant_bytes("tensorwise") / hbm
    meshplan = Stack.preset("meshplan")
    one = fp8_weight_casts(w, 0.0, h200, Layout(dp=1, zero=1), "tensorwise", meshplan)
    assert one.fwd_s == pytest.approx(per * 9 / 8) and one.bwd_s == pytest.approx(per * 5 / 8)
    # torchtitan's FSDP2 hands the linears bf16 weights (param_dtype): the measured rate
    titan = fp8_weight_casts(w, 0.0, h200, Layout(dp=1, zero=1), "tensorwise", TITAN)
    assert titan.per_step(1) == pytest.approx(per)


def test_fsdp_float8_all_gather_moves_one_byte_per_weight(prof, h100x8):
    """torchtitan FSDP over 8 GPUs: each all-gather (forward, and backward after resharding) moves 1
    byte per FP8 weight instead of 2, the rest (embedding, norms, output layer) in BF16; with
    Transformer Engine (BF16 gathers under FSDP2) the traffic is the BF16 step's."""
    lay = Layout(dp=8, zero=3, mbs=1)
    micro = 2
    kw = {"seq_len": SEQ, "global_batch": 8 * micro}

    def dp(precision, stack):
        return estimate_profile(prof, h100x8, lay, precision=precision, stack=stack, **kw).comm_s["dp"]
    bf16, ao = dp("bf16", TITAN), dp("fp8", TITAN)
    assert dp("fp8", TITAN_TE) == pytest.approx(bf16)
    # one collective per block plus the root unit, each carrying an equal share of the bytes
    units, g = len(prof.layers) + 1, group(h100x8, 8, 1)
    params, fp8 = prof.total_params, _fp8_weights(prof)

    def gathers(nbytes):          # a micro-batch's two passes of all-gathers
        return 2 * units * collective_time("all_gather", nbytes / units, g, h100x8)
    saved = micro * (gathers(2 * params) - gathers(2 * (params - fp8) + fp8))
    assert bf16 - ao == pytest.approx(saved, rel=1e-6)
    assert saved > 0.03 * bf16      # the 128k-token embedding and output layer gather in BF16


def test_the_fp8_placement_sees_torchao_casts_per_pass(prof, h200):
    """The planner's per-linear table carries torchao's casts in the FP8 price of each GEMM pass (so
    the ILP multiplies them by the micro-batches), Transformer Engine's in the once-a-step cast."""
    lay = Layout(dp=1, zero=1, mbs=1)
    bi = prof.layers[1]
    li = next(x for x in prof.blocks[bi].linears if x.role != "router")
    ao = LinearCostTable(prof, h200, lay, seq_len=SEQ, stack=TITAN).linear(bi, li)
    te = LinearCostTable(prof, h200, lay, seq_len=SEQ, stack=TITAN_TE).linear(bi, li)
    cast = li.in_features * li.out_features * li.count * fp8_quant_bytes("tensorwise") / hbm_rate(h200)
    assert ao.weight_cast_s == 0.0 and te.weight_cast_s == pytest.approx(cast)
    assert ao.fp8_s - te.fp8_s == pytest.approx(cast / GEMMS_PER_PASS)


def test_unknown_recipe_is_refused_naming_the_known_ones(h200):
    with pytest.raises(ValueError, match="tensorwise"):
        fp8_weight_casts(1e6, 0.0, h200, Layout(dp=1, zero=1), "fp4", TITAN)
