"""Multi-token prediction (meshplan.models.mtp): the module, its loss, its pricing, its exports.

One process throughout (the sharded runs are in tests/runtime/test_mtp_parallel.py):

- the training objective equals a reference assembled here from the module's parts (the main
  model's layers, the shifted tokens' embedding, the norms, the concatenation projection, the
  MTP block, the shared output layer), loss and every gradient;
- mtp_depth=0 (every preset's default; deepseek-v3 takes mtp_depth=1) leaves the logits bit for bit as they were, and
  the main logits of a model with MTP are those of the same model without it;
- the cost model prices the MTP depth on the last pipeline stage only, Megatron-LM's FLOPs count
  it, the runtime's limits refuse no layout for it, and DeepSeek-V3 (one depth) plans with EP;
- the Megatron-LM and Megatron-Bridge exports carry the depth and the loss weight.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import meshplan as mp
from meshplan import models as mm
from meshplan.errors import ConfigError
from meshplan.models.mtp import mtp_causal_lm_loss, mtp_targets, split_logits

SEQ, BATCH = 12, 2
SMALL = dict(layers=2, seq_len=SEQ)


def _model(**overrides):
    torch.manual_seed(7)
    return mm.build("tiny-llama", device="cpu", **{**SMALL, **overrides})


def _batch(vocab: int = 256):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:].clone()
    y[0, -3:] = -100            # padding is skipped by both losses
    return x, y


def _reference_loss(model, x, y) -> torch.Tensor:
    """The DeepSeek-V3 objective (arXiv 2412.19437 eq. 21-25) written from the model's parts."""
    cfg = model.config
    rope = (model.rope_cos[:SEQ], model.rope_sin[:SEQ])
    h = model.tok_embeddings(x)
    for layer in model.layers:
        h = layer(h, rope)
    main = model.output(model.norm(h))
    loss = F.cross_entropy(main.flatten(0, 1), y.flatten(), ignore_index=-100)
    depth = model.mtp._modules["0"]
    nxt = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)            # token i + 1
    joined = torch.cat([depth.hnorm(h), depth.enorm(model.tok_embeddings(nxt))], dim=-1)
    h1 = depth.block(depth.proj(joined), rope)
    logits1 = model.output(depth.norm(h1))
    # position i predicts token i + 2 = y[:, i + 1]; the last position has no target
    target1 = torch.cat([y[:, 1:], torch.full_like(y[:, :1], -100)], dim=1)
    mtp = F.cross_entropy(logits1.flatten(0, 1), target1.flatten(), ignore_index=-100)
    return loss + cfg.mtp_loss_weight * mtp


def test_mtp_loss_and_gradients_match_a_reference_built_from_the_parts():
    model = _model(mtp_depth=1, mtp_loss_weight=0.3)
    x, y = _batch()
    logits = model(x)
    assert logits.shape == (BATCH, 2 * SEQ, 256)          # main, then depth 1, along the sequence
    loss = mtp_causal_lm_loss(logits, y, model.config)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = _reference_loss(model, x, y)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=lambda m, n=n: f"grad {n}: {m}")
    # the MTP module is trained, and shares the embedding and output layer with the main model
    assert grads["mtp.0.proj.weight"].abs().sum() > 0 and grads["mtp.0.block.attention.wq.weight"].abs().sum() > 0
    assert not any(n.startswith("mtp.") and ("embed" in n or "output" in n) for n in grads)


def test_without_mtp_the_logits_are_unchanged_and_eval_drops_the_depths():
    for name in mm.presets():
        cfg = mm.config(name)
        if name == "deepseek-v3":       # trains with one depth (arXiv 2412.19437 Sec. 2.2)
            assert cfg.mtp_depth == 1 and cfg.num_mtp_params() > 0
            assert mm.config(name, mtp_depth=0).num_mtp_params() == 0
        else:
            assert cfg.mtp_depth == 0 and cfg.num_mtp_params() == 0, name
    x, _ = _batch()
    plain, explicit, with_mtp = _model(), _model(mtp_depth=0), _model(mtp_depth=2)
    assert plain.mtp is None and explicit.mtp is None
    base = plain(x)
    assert torch.equal(base, explicit(x))
    # the MTP modules are initialised after the main model's: same seed, same main weights (the
    # output layer then runs on 3x the rows: a different GEMM shape may round differently)
    torch.testing.assert_close(split_logits(with_mtp(x), 2, SEQ)[0], base)
    with_mtp.eval()
    assert torch.equal(with_mtp(x), base)                  # inference: (B, T, vocab), no depths
    cfg = with_mtp.config
    assert sum(p.numel() for p in with_mtp.parameters()) == cfg.num_params() + cfg.num_mtp_params()
    assert cfg.num_mtp_params() == 2 * (3 * 128 + 2 * 128 * 128 + sum(
        p.numel() for p in with_mtp.layers[-1].parameters()))


def test_targets_shift_and_config_checks():
    y = torch.tensor([[5, 6, 7, -100]])
    assert mtp_targets(y, 1).tolist() == [[6, 7, -100, -100]]
    assert mtp_targets(y, 2).tolist() == [[7, -100, -100, -100]]
    with pytest.raises(ConfigError, match="mtp_loss_weight"):
        mm.config("tiny-llama", mtp_depth=1, mtp_loss_weight=-1.0)
    with pytest.raises(ConfigError, match="mtp_depth"):
        mm.config("tiny-llama", mtp_depth=-1)
    with pytest.raises(ConfigError, match="returns 36"):
        split_logits(torch.zeros(1, 30, 4), 2, 12)


def test_cost_model_prices_the_mtp_depth_on_the_last_stage_only():
    from meshplan.cost_models.estimate import estimate_profile
    from meshplan.cost_models.flops import model_flops_per_step
    from meshplan.profiling.analytic import profile_from_config
    cfg = dict(layers=8, hidden=1024, heads=8, kv_heads=8, vocab=32000, ffn_hidden=2816, seq_len=2048)
    plain, mtp = profile_from_config(cfg), profile_from_config(dict(cfg, mtp_depth=1))
    assert mtp.fingerprint != plain.fingerprint and mtp.mtp_depth == 1
    block = plain.blocks[0].params
    assert mtp.total_params - plain.total_params == 3 * 1024 + 2 * 1024 * 1024 + block
    cluster = mp.Cluster.preset("dgx-h100", nodes=1)
    layout = dict(tp=2, pp=2, dp=2, mbs=1, zero=1)
    a, b = (estimate_profile(p, cluster, layout, seq_len=2048, global_batch=64) for p in (plain, mtp))
    first_a, last_a = (sum(m.values()) for m in a.memory_by_stage)
    first_b, last_b = (sum(m.values()) for m in b.memory_by_stage)
    assert first_b == pytest.approx(first_a, rel=1e-9) and last_b > last_a
    assert b.step_time_s > a.step_time_s
    # Megatron-LM's count: one more layer, the 2h x h projection and one more logits GEMM per depth
    extra = model_flops_per_step(mtp, 2048, 1) - model_flops_per_step(plain, 2048, 1)
    per_layer = model_flops_per_step(profile_from_config(dict(cfg, layers=9)), 2048, 1) - \
        model_flops_per_step(plain, 2048, 1)
    assert extra == pytest.approx(per_layer + 3 * 2048 * (4 * 1024 * 1024 + 2 * 1024 * 32000))


def test_runtime_runs_mtp_under_every_layout_and_deepseek_v3_plans_with_ep():
    """The runtime's limits refuse no layout for MTP (tests/runtime/test_mtp_parallel.py runs them),
    and planning the DeepSeek-V3 preset, whose MTP block is a MoE block, keeps expert parallelism."""
    from meshplan.cluster import Cluster
    from meshplan.ir.support import ModelTraits, runtime_limits
    from meshplan.profiling.analytic import profile_from_config
    traits = ModelTraits(mtp=1)
    for layout in (dict(tp=2, sp=False, dp=2, pp=2), dict(tp=2, sp=True, pp=2, cp=2, ep=2),
                   dict(tp=2, sp=True, etp=2, ep=4, cp=2)):
        assert runtime_limits(layout, traits) == [], layout
    cfg = mm.config("deepseek-v3")
    assert cfg.mtp_depth == 1
    cluster = Cluster.preset("dgx-h100", nodes=32)
    # tp and pp fixed to keep the search short; ep, cp, dp, recompute, ... are the planner's
    plan = mp.plan(profile_from_config(cfg, seq_len=4096), cluster, seq_len=4096, global_batch=512,
                   fixed=dict(tp=8, pp=16))
    assert plan.layout.ep > 1, plan.layout
    # the cost model charges the depth on the last stage: the same layout without it is cheaper
    plain = mp.plan(profile_from_config(cfg.replace(mtp_depth=0), seq_len=4096), cluster, seq_len=4096,
                    global_batch=512, fixed=plan.layout.to_dict())
    assert plain.estimate.step_time_s < plan.estimate.step_time_s
    last, last_plain = plan.estimate.memory_by_stage[-1], plain.estimate.memory_by_stage[-1]
    assert last["weights"] > last_plain["weights"]
    assert plan.estimate.memory_by_stage[0] == plain.estimate.memory_by_stage[0]


def test_exports_carry_the_mtp_depth_and_loss_weight():
    from meshplan.export import megatron as meg
    from meshplan.export.megatron import _megatron_model
    v = _view_of(mm.config("deepseek-v3", mtp_depth=1))
    assert (v.shape.mtp_depth, v.shape.mtp_loss_weight) == (1, 0.3)
    args = _megatron_model(v, 4096)
    i = args.index("--mtp-num-layers")
    assert args[i + 1] == "1" and args[args.index("--mtp-loss-scaling-factor") + 1] == "0.3"
    assert "--mtp-num-layers" not in _megatron_model(_view_of(mm.config("tiny-llama")), 256)
    assert meg._pipeline_layout_string((2, 3), mtp=1) == "Et*2|t*3mL"


def _view_of(cfg):
    from meshplan.export.shape import ModelShape

    class View:
        shape = ModelShape.from_config(cfg)
    return View()
