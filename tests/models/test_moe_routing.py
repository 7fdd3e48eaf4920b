"""MoE routing options on one device: balancing losses reach the router, capacity dropping,
forced balance, the fp32 expert bias, recomputation, and the refusals of bad options."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from meshplan.errors import ConfigError
from meshplan.models import ModelConfig
from meshplan.models.moe import MoE

BASE = dict(family="moe", layers=1, hidden=16, heads=2, vocab=32, experts=4, topk=2, moe_ffn_hidden=8)


def _moe(**options) -> MoE:
    torch.manual_seed(0)
    moe = MoE(ModelConfig(**BASE, **options))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return moe


def _x(n: int = 24) -> torch.Tensor:
    return torch.randn(2, n // 2, 16, generator=torch.Generator().manual_seed(1))


def _router_grad(moe: MoE, x: torch.Tensor, *, recompute: bool = False) -> torch.Tensor:
    moe.zero_grad()
    out = checkpoint(moe, x, use_reentrant=False) if recompute else moe(x)
    out.square().mean().backward()
    return moe.router.weight.grad.clone()


def test_aux_and_z_losses_are_trained_with_their_coefficients():
    x = _x()
    plain = _router_grad(_moe(), x)
    aux = _moe(moe_aux_loss_coeff=0.1)
    with_aux = _router_grad(aux, x)
    # the added gradient is exactly the coefficient times the gradient of the Switch loss
    ref = _moe()
    ref.zero_grad()
    out = ref(x)
    (out.square().mean() + 0.1 * ref.aux_loss).backward()
    torch.testing.assert_close(with_aux, ref.router.weight.grad)
    assert (with_aux - plain).abs().max() > 1e-4
    z = _moe(moe_z_loss_coeff=0.01)
    z.zero_grad()
    logits = z.router(x.reshape(-1, 16)).float()
    zl = 0.01 * torch.logsumexp(logits, -1).square().mean().detach()
    out = z(x)
    out.square().mean().backward()
    ref_z = _moe()
    ref_z.zero_grad()
    (ref_z(x).square().mean() + 0.01 * torch.logsumexp(
        ref_z.router(x.reshape(-1, 16)).float(), -1).square().mean()).backward()
    torch.testing.assert_close(z.router.weight.grad, ref_z.router.weight.grad)
    assert z.step_stats()["z_loss"] == pytest.approx(float(zl) / 0.01, rel=1e-5)


def test_recomputation_replays_the_step_statistics():
    x = _x()
    a, b = _moe(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01), _moe(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    for m in (a, b):
        m.num_microbatches = 2
    for _ in range(2):                      # two micro-batches: the second uses the running mean
        ga, gb = _router_grad(a, x), _router_grad(b, x, recompute=True)
        torch.testing.assert_close(ga, gb)
    assert a.window.microbatches == b.window.microbatches == 2
    assert a.window.replay and not b.window.replay      # replayed entries are consumed
    torch.testing.assert_close(a.window.counts, b.window.counts)


def test_capacity_factor_drops_copies_past_capacity():
    moe = _moe(moe_capacity_factor=0.5)
    x = _x(24)                              # 48 copies over 4 experts: capacity ceil(0.5 * 12) = 6
    moe(x)
    stats = moe.step_stats()
    kept = sum(min(c, 6) for c in stats["tokens_per_expert"])
    assert stats["dropped"] == pytest.approx(1 - kept / 48)
    assert stats["dropped"] > 0
    # a generous capacity drops nothing and equals dropless routing
    free, dropless = _moe(moe_capacity_factor=4.0), _moe()
    torch.testing.assert_close(free(x), dropless(x))


def test_forced_balance_loads_every_expert_equally():
    moe = _moe(moe_force_balance=True)
    moe(_x(24))
    assert moe.step_stats()["tokens_per_expert"] == [12.0] * 4


def test_expert_bias_stays_fp32_and_steers_routing():
    moe = _moe(moe_expert_bias=True, moe_bias_update_rate=0.1)
    moe.to(torch.bfloat16)
    assert moe.expert_bias.dtype == torch.float32 and moe.router.weight.dtype == torch.bfloat16
    moe.float().eval()                      # statistics of no-grad forwards count in eval mode
    with torch.no_grad():                   # expert 0 wins every token at first
        moe.router.weight[0].fill_(0.3)
    x = _x(48) + 1.0
    with torch.no_grad():
        moe(x)
    first = moe.step_stats(reset=False)["imbalance"]
    moved = 0.0
    for _ in range(30):
        moe.update_expert_bias()
        moved = max(moved, float(moe.expert_bias.abs().max()))
        moe.step_stats()
        with torch.no_grad():
            moe(x)
    assert first == 2.0 and moe.step_stats()["imbalance"] < 1.75
    assert moved > 0 and moe.expert_bias.dtype == torch.float32


@pytest.mark.parametrize("bad, match", [
    (dict(family="llama", moe_aux_loss_coeff=0.01), r"moe_aux_loss_coeff=0.01 .*dense model.*moe_aux_loss_coeff=0.0"),
    (dict(family="gpt", moe_expert_bias=True), r"moe_expert_bias=True .*dense"),
    (dict(moe_capacity_factor=0.0), r"moe_capacity_factor must be > 0 .*1.25"),
    (dict(moe_capacity_factor=-1), r"moe_capacity_factor must be > 0"),
    (dict(moe_aux_loss_coeff=-0.1), r"moe_aux_loss_coeff must be a number >= 0"),
    (dict(moe_aux_loss_scope="batch"), r"moe_aux_loss_scope='batch' is not supported; use one of global, local"),
])
def test_bad_options_are_refused(bad, match):
    cfg = dict(BASE)
    if bad.get("family", "moe") != "moe":
        cfg = dict(family=bad["family"], layers=1, hidden=16, heads=2, vocab=32)
    cfg.update({k: v for k, v in bad.items() if k != "family"})
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**cfg)


@pytest.mark.parametrize("router, bias", [("softmax", False), ("softmax", True), ("sigmoid", False)])
def test_fused_router_kernel_matches_the_eager_router(router, bias):
    from meshplan.runtime.fused import apply_router_kernel
    holder = torch.nn.Module()
    holder.moe = _moe(router=router, moe_expert_bias=bias, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    if holder.moe.expert_bias is not None:
        holder.moe.expert_bias.copy_(torch.tensor([0.0, 0.05, -0.05, 0.1]))
    eager = _moe(router=router, moe_expert_bias=bias, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    eager.load_state_dict(holder.moe.state_dict())
    assert apply_router_kernel(holder) == ["moe"]
    x = _x()
    for m in (holder.moe, eager):
        m.zero_grad()
        m(x).square().mean().backward()
    assert holder.moe.tokens_per_expert.tolist() == eager.tokens_per_expert.tolist()
    for (n, p), q in zip(holder.moe.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    assert holder.moe.step_stats()["aux_loss"] == pytest.approx(eager.step_stats()["aux_loss"], rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs a Hopper GPU for torch._grouped_mm")
def test_torch_grouped_mm_matches_the_loop_on_gpu():
    import importlib
    gm = importlib.import_module("meshplan.models.grouped_mm")
    counts = torch.tensor([0, 70, 30, 100, 9, 0, 100, 90])
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    x = torch.randn(int(counts.sum()), 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(x.shape[0], 128, device="cuda", dtype=torch.bfloat16)
    assert gm.torch_grouped_mm_supported(x, w)
    results = []
    for flag in (True, False):
        gm.USE_TORCH_GROUPED_MM = flag
        x.grad = w.grad = None
        y = gm.grouped_mm(x, w, offs)
        y.backward(g)
        results.append((y.float(), x.grad.float(), w.grad.float()))
    gm.USE_TORCH_GROUPED_MM = True
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_statistics_deferred_to_the_step_end_match_the_per_microbatch_ones(microbatches):
    """Without a loss that reads global counts in the forward, the routing statistics are summed
    locally and reduced once when read; the step's counts, load and drops are the same as when
    every micro-batch reduces them (a global aux loss forces that path), and at one micro-batch the
    aux / z values too."""
    deferred = _moe()
    eager = _moe(moe_aux_loss_coeff=1e-12)
    assert deferred._defers_statistics() and not eager._defers_statistics()
    for moe in (deferred, eager):
        moe.num_microbatches = microbatches
        for i in range(microbatches):
            moe(_x(24) + i)
    assert deferred.window.pending is not None and eager.window.pending is None
    a, b = deferred.step_stats(), eager.step_stats()
    assert a["tokens_per_expert"] == b["tokens_per_expert"]
    assert a["imbalance"] == b["imbalance"] and a["dropped"] == b["dropped"]
    if microbatches == 1:
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-9)
        assert a["z_loss"] == pytest.approx(b["z_loss"], rel=1e-9)
    assert deferred.window.pending is None and deferred.step_stats() == {}


def test_deferred_statistics_of_several_layers_are_reduced_in_one_collective(monkeypatch):
    """flush_windows reduces every layer's pending statistics with one all-reduce (the layers'
    vectors concatenated) and leaves each layer the statistics a flush of its own gives; here the
    'all-reduce' doubles the vector, as two ranks with the same tokens would."""
    from meshplan.models.moe import flush_windows
    calls = []

    def fake_reduce(self, local):
        calls.append(local.numel())
        local.mul_(2)
        return 2

    monkeypatch.setattr(MoE, "_all_reduce_statistics", fake_reduce)

    def layers():
        out = [_moe(), _moe(moe_z_loss_coeff=0.0)]
        torch.nn.init.normal_(out[1].router.weight, std=1.0)     # different routing in layer 2
        for moe in out:
            moe(_x(24))
        return out

    alone = [m.step_stats() for m in layers()]                  # one reduce per layer
    assert len(calls) == 2
    calls.clear()
    together = layers()
    flush_windows(together)
    assert len(calls) == 1 and calls[0] == 2 * (2 * 4 + 4)       # [counts E, probs E, z, tokens, dropped, aux] x 2
    assert all(m.window.pending is None for m in together)
    got = [m.step_stats() for m in together]
    assert len(calls) == 1                                      # nothing left to reduce
    assert got == alone
    assert got[0]["tokens_per_expert"] != got[1]["tokens_per_expert"]
