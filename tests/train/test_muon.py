"""Muon (meshplan.train.muon): one process against a plain reference (muon_reference.py), and
layer-wise distributed runs on gloo ranks (workers: muon_workers.py) against single-device Muon.

Tolerances: one process runs the same float32 arithmetic as the reference but in another order
(the iteration's polynomial is grouped differently), so they agree to ~1e-6. Sharded runs reorder
the gradient sums (FSDP2 reduce-scatter, TP partial products): the orthogonalised update then
differs by rounding amplified a little by the iteration, rtol 1e-4 / atol 2e-5 on weights that move
by lr * 0.2 * sqrt(n) ~ 1e-3 per step; a wrong piece, a missed owner or a unit scattered to the
wrong shard gives errors of O(1e-3) or more.
"""

from __future__ import annotations

import copy

import muon_reference as ref
import pytest
import torch

from meshplan.errors import ConfigError
from meshplan.train.muon import Muon, is_muon_param, newton_schulz
from meshplan.train.optim import build_optimizer

LR, WD = 2e-2, 0.1


def _model():
    from meshplan import models
    torch.manual_seed(0)
    m = models.build("tiny-moe", seq_len=16, device="cpu")
    m.init_weights()
    return m


def test_default_rule_keeps_embeddings_head_router_norms_on_adamw():
    m = _model()
    muon = {n for n, p in m.named_parameters() if is_muon_param(n, p)}
    assert "layers.0.attention.wq.weight" in muon and "layers.1.feed_forward.experts.w1" in muon
    for n in ("tok_embeddings.weight", "output.weight", "norm.weight", "layers.1.feed_forward.router.weight",
              "layers.0.ffn_norm.weight"):
        assert n not in muon, n
    assert is_muon_param("model.layers.0.mlp.gate_proj.weight", torch.empty(4, 4))     # HF names
    assert not is_muon_param("model.layers.0.mlp.gate.weight", torch.empty(4, 4))      # HF router
    assert not is_muon_param("model.embed_tokens.weight", torch.empty(4, 4))
    assert is_muon_param("encoder.layer.0.attention.output.dense.weight", torch.empty(4, 4))


def test_newton_schulz_orthogonalises():
    g = torch.randn(48, 96, generator=torch.Generator().manual_seed(1))
    o = newton_schulz(g)
    s = torch.linalg.svdvals(o)
    assert 0.6 < float(s.min()) and float(s.max()) < 1.25      # the quintic's target band
    torch.testing.assert_close(newton_schulz(g.t()), o.t())


def test_two_steps_equal_the_reference():
    m = _model()
    named = dict(m.named_parameters())
    want = {n: p.detach().clone() for n, p in named.items()}
    muon_names = {n for n, p in named.items() if is_muon_param(n, p)}
    opt = build_optimizer(m.named_parameters(), optimizer="muon", lr=LR, weight_decay=WD)
    assert isinstance(opt, Muon) and [g["muon"] for g in opt.param_groups] == [True, False]
    state: dict = {}
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        grads = {n: torch.randn(p.shape, generator=g) for n, p in named.items()}
        for n, p in named.items():
            p.grad = grads[n].clone()
        opt.step()
        ref.muon_step(want, grads, state, lr=LR, wd=WD, muon_names=muon_names)
    for n, p in named.items():
        torch.testing.assert_close(p.detach(), want[n], rtol=1e-5, atol=1e-6, msg=lambda s, n=n: f"{n}: {s}")
    st = opt.state[named["layers.0.attention.wq.weight"]]
    assert set(st) == {"momentum_buffer"}
    assert set(opt.state[named["norm.weight"]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_adamw_part_equals_torch_adamw():
    m = _model()
    other = copy.deepcopy(m)
    opt = Muon(m.named_parameters(), lr=LR, weight_decay=WD, muon_params=lambda n, p: False)
    torch_opt = torch.optim.AdamW(other.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.95))
    for a, b in zip(m.parameters(), other.parameters()):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    opt.step()
    torch_opt.step()
    for (n, a), b in zip(m.named_parameters(), other.parameters()):
        torch.testing.assert_close(a, b, msg=lambda s, n=n: f"{n}: {s}")


def test_refusals():
    m = _model()
    with pytest.raises(ConfigError, match="name"):
        Muon(list(m.parameters()))
    with pytest.raises(ConfigError, match="optimizer"):
        build_optimizer(m.named_parameters(), optimizer="lion", lr=1e-3)


# ---- sharded runs (4 gloo ranks) -------------------------------------------------------------

SEQ, BATCH = 16, 8
# FSDP2 alone; ZeRO-1 under TP (FSDP2 over TP shards: _StridedShard dim-0 weights, column shards
# for the row-parallel ones); DDP (replicated: nothing to exchange); PP x TP (owners per stage)
CASES = {
    "fsdp4": (("dp", 4), ("zero", 3)),
    "tp2_dp2_zero1": (("tp", 2), ("dp", 2), ("zero", 1), ("sp", False)),
    "ddp4": (("dp", 4), ("zero", 0)),
    "pp2_tp2": (("pp", 2), ("tp", 2), ("dp", 1), ("vp", 1), ("schedule", "1f1b"), ("sp", False)),
}


# experts [E, out, in] over EP x EDP: 2 experts per EP rank, each sharded over 2 EDP ranks
MOE_CASE = (("ep", 2), ("dp", 4), ("tp", 1), ("zero", 3), ("mbs", 1))


def _moe_plan(world: int, fixed_items: tuple):
    import ep_workers

    import meshplan as mp
    from meshplan.cluster import Cluster
    model = ep_workers.build_model("moe", seq_len=SEQ, device="meta")
    return mp.plan(model, Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world), seq_len=SEQ,
                   global_batch=BATCH, fixed=dict(fixed_items))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    import muon_workers
    import numerics
    from worlds import spawn_cases
    items = {name: tuple(sorted(fixed)) for name, fixed in CASES.items()}
    numerics.plan_for.prefetch([("tiny-llama", 4, it, SEQ, BATCH) for it in items.values()])
    plans = {name: numerics.plan_for("tiny-llama", 4, it, SEQ, BATCH) for name, it in items.items()}
    cases = {name: dict(model="tiny-llama", plan=plans[name], seq_len=SEQ, global_batch=BATCH) for name in items}
    cases["moe_ep2_edp2"] = dict(model="moe", plan=_moe_plan(4, MOE_CASE), seq_len=SEQ, global_batch=BATCH)
    out = tmp_path_factory.mktemp("muon")
    for name, (base, options) in OVERLAP.items():
        cases[name] = dict(cases[base], kind="overlapped", out=str(out / name), **options)
    run = dict(kind="train", seq_len=SEQ, steps=4)
    cases |= {"full": dict(run, plan=plans["fsdp4"], out=str(out / "a")),
              "stop2": dict(run, plan=plans["tp2_dp2_zero1"], out=str(out / "b"), stop_at=2),
              "resume": dict(run, plan=plans["fsdp4"], out=str(out / "b")),
              "adamw_refused": dict(run, plan=plans["fsdp4"], out=str(out / "b"), optimizer="adamw",
                                    expect_error=True)}
    return spawn_cases(4, muon_workers.run_cases, cases, timeout_s=240)


@pytest.mark.parametrize("name", [*sorted(CASES), "moe_ep2_edp2"])
def test_sharded_muon_equals_single_device(world4, name):
    from worlds import ok
    runs = world4[name]
    ok(runs)
    assert runs[0]["moved"] > 1e-3                       # the steps did move the weights
    # every matrix has one owner, and the owners share the work
    replicas = {"pp2_tp2": 2, "ddp4": 1}.get(name, 4)   # ranks that share each matrix
    assert sum(r["owned"] for r in runs) == sum(r["units"] for r in runs) / replicas
    assert min(r["owned"] for r in runs) > 0


@pytest.mark.parametrize("name", [*sorted(CASES), "moe_ep2_edp2"])
def test_exchange_is_two_batched_calls_per_step(world4, name):
    runs = world4[name]
    if name == "ddp4":              # DDP replicas: every rank steps whole matrices, nothing to exchange
        assert all(r["calls"] == 0 and r["counts"] == [{}, {}] for r in runs), runs
        return
    for r in runs:
        assert r["calls"] == 4
        for counts in r["counts"]:                          # per step, whatever the number of matrices
            # two batched calls; inside them at most one message to and from each of the 3 peers
            # per phase; no other collective (no per-matrix gather, no DTensor redistribution)
            assert counts.pop("batch_isend_irecv") == 2, counts
            assert set(counts) <= {"functional.send", "functional.recv_"}, counts
            assert counts.get("functional.send", 0) <= 2 * 3 and counts.get("functional.recv_", 0) <= 2 * 3, counts


def test_resume_with_muon_under_another_plan_gives_the_same_losses(world4):
    from worlds import ok
    for name in ("full", "stop2", "resume"):
        ok(world4[name])
    full, first, second = (world4[n][0] for n in ("full", "stop2", "resume"))
    assert sorted(first["losses"]) == [1, 2] and second["start"] == 2 and sorted(second["losses"]) == [3, 4]
    for step in (1, 2, 3, 4):       # step 4's loss follows an update from the restored momentum
        got = (first if step <= 2 else second)["losses"][step]
        torch.testing.assert_close(got, full["losses"][step], rtol=1e-4, atol=1e-5)
    # `meshplan train` leaves each step's update in flight into the next forward; each metrics line
    # still reports the norm of its own step's weights (written once the next forward applied them)
    norms = full["param_norms"]
    assert sorted(norms) == [1, 2, 3, 4] and len(set(norms.values())) == 4, norms
    assert norms[4] == pytest.approx(full["final_norm"], rel=1e-6)
    assert norms[2] == pytest.approx(first["final_norm"], rel=1e-4)     # stop2 ran steps 1-2 on another plan
    assert first["param_norms"][2] == pytest.approx(first["final_norm"], rel=1e-6)
    refused = world4["adamw_refused"][0]
    assert refused["raised"] == "ConfigError" and "holds muon optimizer state" in refused["message"], refused


# ---- the update exchange left in flight into the next forward (muon_overlap.py) ----------------

# FSDP2 per-block units (explicit prefetch one unit ahead), PP x TP without FSDP (block hooks),
# ZeRO-1 under TP (one FSDP2 unit per stage on CPU processes: one group, before its all-gather)
# and expert units nested in the blocks over EDP (the last two without the checkpoint: its time)
OVERLAP = {"overlap_fsdp4": ("fsdp4", {"checkpoint": True, "profile": True}),
           "overlap_pp2_tp2": ("pp2_tp2", {"checkpoint": True}),
           "overlap_tp2_dp2_zero1": ("tp2_dp2_zero1", {}),
           "overlap_moe": ("moe_ep2_edp2", {})}


@pytest.mark.parametrize("name", sorted(OVERLAP))
def test_overlapped_update_equals_single_device_through_a_checkpoint(world4, name):
    """Three overlapped steps (with a DCP save while the first step's update is in flight and a
    load into a fresh model and optimizer): the weights equal single-device Muon's (the worker
    asserts it)."""
    from worlds import ok
    runs = world4[name]
    ok(runs)
    assert any(r["in_flight"] for r in runs)        # the save found slices in flight ...
    for r in runs:
        assert r["after_save"] is (False if OVERLAP[name][1].get("checkpoint") else None)   # ... and applied them
        assert not r["left"]                        # the forward applied every pending group
        assert r["at_end"] == bool(r["pending"])    # the last step's update left in flight ...
        assert not r["after_state_dict"]            # ... until the state_dict's pre-hook
        assert r["pending"] == sorted(set(r["pending"])) and len(r["pending"]) <= r["groups"]
        # forward groups: 4 FSDP2 block units; 2 blocks per pipeline stage; ZeRO-1's one stage unit
        assert r["groups"] == {"overlap_fsdp4": 4, "overlap_pp2_tp2": 2, "overlap_tp2_dp2_zero1": 1}.get(
            name, r["groups"]), r


def test_update_exchange_is_issued_in_the_step_and_waited_for_in_the_next_forward(world4):
    """torch.profiler ranges of one step and the next forward-backward (FSDP2 over 4 ranks, 4
    blocks: 4 forward groups): each group's exchange is issued once, inside the step; each is
    waited for once, inside the next forward, and the later groups only after the first block
    began computing (its pre-hook runs after FSDP2's all-gather and Muon's); the step issues its
    gradient exchange and one batched call per group, the forward no Muon exchange at all."""
    from worlds import ok
    runs = world4["overlap_fsdp4"]
    ok(runs)
    for r in runs:
        marks = r["marks"]
        (s0, s1), = marks["test.step"]
        (f0, f1), = marks["test.forward_backward"]
        issued, waited = marks["muon.update_exchange.issue"], marks["muon.update_exchange.wait"]
        layer0 = marks["test.layer0.compute"][0][0]
        assert r["groups"] == 4 and r["pending"] == [0, 1, 2, 3], r
        assert len(issued) == 4 and all(s0 <= a and b <= s1 for a, b in issued), (marks, s0, s1)
        assert len(waited) == 4 and all(f0 <= a and b <= f1 for a, b in waited), (marks, f0, f1)
        # block 0 prefetches block 1's all-gather: groups 0 and 1 before its compute, 2 and 3 after
        assert [a > layer0 for a, _ in waited] == [False, False, True, True], (waited, layer0)
        step, forward = r["counts"]
        assert step["batch_isend_irecv"] == 1 + 4, step
        assert step.get("functional.send", 0) <= (1 + 4) * 3 and step.get("functional.recv_", 0) <= (1 + 4) * 3
        assert "batch_isend_irecv" not in forward and "functional.send" not in forward, forward


# ---- the layout knob and its price -----------------------------------------------------------

def test_layout_knob_round_trips_and_is_validated():
    from meshplan.ir.layout import Layout
    lay = Layout(optimizer="muon", dp=2)
    assert Layout.from_dict(lay.to_dict()) == lay and " muon " in f" {lay.short()} "
    assert "muon" not in Layout(dp=2).short() and "adamw" not in Layout(dp=2).short()
    with pytest.raises(ConfigError, match="optimizer='sgd'"):
        Layout(optimizer="sgd")


def test_muon_is_priced_cheaper_state_plus_exchange_and_adamw_is_unchanged():
    import meshplan as mp
    from meshplan.cost_models.memory import optimizer_bytes
    from meshplan.ir.layout import Layout
    assert optimizer_bytes(Layout()) == 12 and optimizer_bytes(Layout(optimizer_dtype="bf16")) == 8
    assert optimizer_bytes(Layout(optimizer="muon")) == 8
    cl = mp.Cluster.preset("dgx-h100", nodes=1)
    base = dict(tp=2, pp=1, dp=4, zero=1, mbs=1)
    kw = dict(seq_len=4096, global_batch=64)
    adamw = mp.estimate("llama3-8b", cl, layout=base, **kw)
    muon = mp.estimate("llama3-8b", cl, layout={**base, "optimizer": "muon"}, **kw)
    # the adamw price is the one from before Muon existed (the default path is untouched)
    assert adamw.memory_gb["optimizer"] == pytest.approx(11.218145370483398, rel=1e-12)
    assert "optimizer_step" not in adamw.memory_gb
    # Muon: 8 bytes/param for the matrices, AdamW's 12 for embedding and head: between 8/12 and 1
    ratio = muon.memory_gb["optimizer"] / adamw.memory_gb["optimizer"]
    assert 8 / 12 < ratio < 0.75, ratio
    assert muon.memory_gb["optimizer_step"] >= 0
    # the owner exchange is data-parallel traffic; Newton-Schulz is optimizer time
    assert muon.comm_s["dp"] > adamw.comm_s["dp"] and muon.time_s["optimizer"] > adamw.time_s["optimizer"]


def test_update_exchange_is_charged_only_where_the_next_forward_cannot_hide_it():
    from meshplan.cost_models.muon import muon_update_exposed
    # 8 layers, 1 s of exchange (0.125 s a layer): a forward of 0.5 s a layer hides all but the
    # first layer's message (the second's too when FSDP prefetches one layer ahead)
    assert muon_update_exposed(1.0, 4.0, 8) == pytest.approx(0.125)
    assert muon_update_exposed(1.0, 4.0, 8, ahead=1) == pytest.approx(0.25)
    # a forward faster than the messages hides the forward of the layers before the last
    assert muon_update_exposed(1.0, 0.4, 8) == pytest.approx(1.0 - 0.05 * 7)
    assert muon_update_exposed(1.0, 0.4, 8, ahead=1) == pytest.approx(1.0 - 0.05 * 6)
    # brute force over every layer's wait agrees; one layer (ZeRO's one unit) hides nothing
    for u, f, g, ahead in ((2.0, 3.0, 5, 0), (2.0, 1.0, 5, 1), (1.0, 1.0, 3, 1), (3.0, 0.5, 2, 1)):
        want = max((j + 1) * u / g - max(0, j - ahead) * f / g for j in range(g))
        assert muon_update_exposed(u, f, g, ahead) == pytest.approx(want)
    assert muon_update_exposed(1.0, 100.0, 1) == 1.0 and muon_update_exposed(0.0, 1.0, 8) == 0.0


def test_plan_and_cli_take_the_optimizer():
    import argparse

    import meshplan as mp
    from meshplan.cli.train import _with_options
    from meshplan.cluster import Cluster
    from meshplan.train.loop import TrainConfig
    model = mp.models.build("tiny-llama", seq_len=32, device="meta")
    cl = Cluster(gpu="cpu", num_gpus=2, gpus_per_node=2)
    plan = mp.plan(model, cl, seq_len=32, global_batch=8, optimizer="muon")
    assert plan.layout.optimizer == "muon" and mp.Plan.from_json(plan.to_json()).layout.optimizer == "muon"
    assert mp.plan(model, cl, seq_len=32, global_batch=8).layout.optimizer == "adamw"
    back = _with_options(plan, argparse.Namespace(optimizer="adamw", optimizer_dtype=None, precision=None))
    assert back.layout.optimizer == "adamw"
    with pytest.raises(ConfigError, match="optimizer"):
        TrainConfig(optimizer="sgd")
