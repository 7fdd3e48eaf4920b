"""Expert all-to-all overlap (Megatron-Core --overlap-moe-expert-parallel-comm), latent attention's
up-projection recompute (--recompute-modules mla_up_proj mlp) and FP8 primary weights
(--fp8-param-gather): each priced as its stack runs it, exported with the flag that runs it."""

from __future__ import annotations

import pytest

import meshplan as mp
from meshplan.cost_models import constants as K
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.flops import recompute_flops_per_step
from meshplan.errors import ConfigError
from meshplan.ir.layout import Layout, split_layers
from meshplan.profiling.analytic import profile_from_config
from meshplan.ir.stack import STACKS
from meshplan.models.presets import config as preset_config


def _preset_profile(name):
    return profile_from_config(preset_config(name), seq_len=4096)     # analytic: no tracing


@pytest.fixture(scope="module")
def qwen():
    return _preset_profile("qwen3-235b-a22b")


@pytest.fixture(scope="module")
def deepseek():
    return _preset_profile("deepseek-v3")


# Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md, 256 H100, cross-node EP: TP2 PP8 VP4 EP32,
# DeepEP, recompute layernorm + moe_act, GBS 2048: 19.7 s a step, 17.6 s "+1f1b overlap" (the same run
# with --overlap-moe-expert-parallel-comm).
QWEN_XNODE = dict(tp=2, pp=8, vp=4, ep=32, dp=16, zero=1, mbs=1, recompute="norm_act", moe_dispatcher="deepep",
                  stage_layers=split_layers(94, 32))


DS_SPLIT = split_layers(61, 16)       # DeepSeek-V3's 61 layers over pp8 x vp2


def _qwen(qwen, stack="megatron-core", **changes):
    cl = mp.Cluster.preset("dgx-h100", nodes=32)
    return estimate_profile(qwen, cl, dict(QWEN_XNODE, **changes), seq_len=4096, global_batch=2048,
                            stack=stack)


def test_a2a_overlap_on_the_model_zoo_pair(qwen):
    """The same bytes move; the transfers hide under the paired chunks. The measured pair saved 10.7%
    of the step; the model, which lets each transfer hide fully under its chunk, saves more (see
    docs/cost_model.md, 'Expert all-to-all overlap'): it must save, and not more than the exposed
    all-to-all it started from. The dropless dispatch's host wait (Stack.moe_host_sync) stays: the
    overlap saves the same seconds with it as without."""
    no_wait = STACKS["megatron-core"].replace(moe_host_sync=False)
    off, on = _qwen(qwen, no_wait), _qwen(qwen, no_wait, ep_comm_overlap=True)
    assert on.comm_s["ep"] == pytest.approx(off.comm_s["ep"])
    assert on.time_s["ep"] < 0.5 * off.time_s["ep"]
    saved = off.step_time_s - on.step_time_s
    assert 0.107 * off.step_time_s < saved <= off.time_s["ep"]
    waited, waited_on = _qwen(qwen), _qwen(qwen, ep_comm_overlap=True)
    wait = waited.step_time_s - off.step_time_s
    assert wait > 0 and waited.step_time_s - waited_on.step_time_s == pytest.approx(saved, rel=0.02)


def test_a2a_overlap_needs_a_schedule_that_pairs_micro_batches(qwen):
    st = STACKS["megatron-core"]
    assert st.runs_ep_overlap(Layout(**QWEN_XNODE, ep_comm_overlap=True))
    assert not st.runs_ep_overlap(Layout(**dict(QWEN_XNODE, vp=1, stage_layers=None), ep_comm_overlap=True))  # 1F1B
    assert not st.runs_ep_overlap(Layout(**dict(QWEN_XNODE, recompute="full"), ep_comm_overlap=True))
    assert not STACKS["meshplan"].runs_ep_overlap(Layout(**QWEN_XNODE, ep_comm_overlap=True))
    plain = _qwen(qwen, vp=1, stage_layers=split_layers(94, 8))
    assert _qwen(qwen, vp=1, stage_layers=split_layers(94, 8), ep_comm_overlap=True).step_time_s == plain.step_time_s


def test_a2a_overlap_leaves_the_warm_up_and_cool_down_steps_unpaired():
    """The merged schedule pairs one micro-batch's forward of a chunk with another's backward; its
    warm-up forwards and as many cool-down backwards run alone (2(pp-1) + (vp-1)pp + 1 steps on the
    first rank), so what the overlap hides shrinks with the micro-batch count, to nothing once every
    step is a warm-up or cool-down one."""
    from meshplan.cost_models.pipeline import ep_unpaired_steps
    assert ep_unpaired_steps(8, 4, 128, 0) == 2 * 7 + 3 * 8 + 1 and ep_unpaired_steps(8, 4, 128, 7) == 25
    assert ep_unpaired_steps(8, 4, 8, 0) == 32 and ep_unpaired_steps(1, 1, 32, 0) == 1
    mixtral = _preset_profile("mixtral-8x7b")       # 32 layers: one per chunk at pp8 x vp4
    lay = dict(tp=1, pp=8, vp=4, ep=8, dp=8, zero=1, mbs=1, recompute="none")
    hidden = {}
    for m in (128, 16, 8):
        kw = dict(seq_len=4096, global_batch=8 * m, stack="megatron-core")
        off = estimate_profile(mixtral, mp.Cluster.preset("dgx-h100", nodes=8), lay, **kw)
        on = estimate_profile(mixtral, mp.Cluster.preset("dgx-h100", nodes=8), dict(lay, ep_comm_overlap=True), **kw)
        hidden[m] = 1 - on.time_s["ep"] / off.time_s["ep"]
    # 39 of 512 steps unpaired at m = 128, 39 of 64 at m = 16, all 32 at m = 8
    assert hidden[16] / hidden[128] == pytest.approx((1 - 39 / 64) / (1 - 39 / 512), rel=1e-6)
    assert hidden[8] == pytest.approx(0.0, abs=1e-12) and hidden[128] > 0.5


def test_overlapped_compute_loses_the_communication_kernels_sms():
    """A hidden transfer still costs the share of SMs its kernels hold; a longer one shows the rest."""
    from meshplan.cost_models.layer import _ep_overlapped

    class C:
        cluster = mp.Cluster.preset("dgx-h100", nodes=1)
    share = K.EP_COMM_SMS / K.SM_COUNT["hopper"]
    assert _ep_overlapped(C, 1.0, 10.0) == pytest.approx(share)
    assert _ep_overlapped(C, 10.0, 1.0) == pytest.approx(9.0)
    assert _ep_overlapped(C, 0.0, 1.0) == 0.0


def test_mla_up_recompute_keeps_the_latents_not_q_k_v(deepseek):
    cl = mp.Cluster.preset("dgx-b200", nodes=32)
    lay = dict(tp=1, pp=8, vp=2, ep=32, dp=32, zero=1, mbs=1, moe_dispatcher="deepep", stage_layers=DS_SPLIT)
    kw = dict(seq_len=4096, global_batch=4096, stack="megatron-core")
    none = estimate_profile(deepseek, cl, dict(lay, recompute="none"), **kw)
    up = estimate_profile(deepseek, cl, dict(lay, recompute="mla_up"), **kw)
    full = estimate_profile(deepseek, cl, dict(lay, recompute="full"), **kw)
    assert full.memory_gb["activations"] < up.memory_gb["activations"] < none.memory_gb["activations"]
    assert none.step_time_s < up.step_time_s < full.step_time_s
    # what it saves per MLA layer and token: Q, K, V of all 128 heads (192 + 192 + 128 wide), bf16
    blk = next(b for b in deepseek.blocks if b.latent_dim and b.is_moe)     # no dense MLP to re-run
    from meshplan.cost_models.layer import activation_bytes
    from meshplan.cost_models.context import Context
    ctx = Context.build(cl, Layout(**dict(lay, recompute="mla_up")), 4096, False, stack=STACKS["megatron-core"])
    saved = activation_bytes(blk, ctx, policy="none") - activation_bytes(blk, ctx, policy="mla_up")
    assert saved == pytest.approx(2 * (blk.q_dim + blk.kv_dim + blk.v_dim) * 4096)
    # its recompute FLOPs are the up-projections' (and the dense MLPs')
    extra = recompute_flops_per_step(deepseek, 4096, 1, Layout(**dict(lay, recompute="mla_up")))
    per_layer = {id(b): (sum(li.flops_per_token for li in b.linears if li.role == "attn_qkv") if b.latent_dim else 0)
                 + sum(li.flops_per_token for li in b.linears if li.role in ("mlp_in", "mlp_out"))
                 for b in deepseek.blocks}
    expect = 4096 * sum(per_layer[id(deepseek.blocks[i])] for i in deepseek.layers)
    assert extra == pytest.approx(expect) and extra > 0


def test_mla_up_is_offered_for_latent_attention_only(deepseek):
    from meshplan.export.megatron import _megatron_recompute
    from meshplan.planner.search import _recompute_options
    llama = _preset_profile("llama3-8b")
    assert "mla_up" in _recompute_options(deepseek, 8, 4096, STACKS["megatron-core"])
    assert "mla_up" not in _recompute_options(llama, 8, 4096, STACKS["megatron-core"])
    assert "mla_up" not in _recompute_options(deepseek, 8, 4096, STACKS["meshplan"])   # the runtime does not run it

    class Dense:
        mla, experts = False, 0
    view = type("View", (), {"layout": Layout(), "shape": Dense(), "notes": []})()
    with pytest.raises(ConfigError, match="no latent attention"):
        _megatron_recompute(view, "mla_up")


def test_fp8_primary_weights_replace_the_bf16_copies(deepseek):
    cl = mp.Cluster.preset("dgx-b200", nodes=32)
    lay = dict(tp=1, pp=8, vp=2, ep=32, dp=32, zero=1, mbs=1, recompute="mla_up", fp8_recipe="mxfp8",
               stage_layers=DS_SPLIT)
    kw = dict(seq_len=4096, global_batch=4096, precision="fp8")
    te = estimate_profile(deepseek, cl, lay, stack="megatron-core", **kw)
    ref = estimate_profile(deepseek, cl, lay, stack="reference", **kw)      # keeps BF16 weights beside FP8
    assert te.memory_gb["fp8_cache"] == pytest.approx(ref.memory_gb["fp8_cache"])
    assert te.memory_gb["weights"] < 0.01 * ref.memory_gb["weights"]
    assert te.peak_memory_gb < ref.peak_memory_gb


def test_exports_carry_the_flags_that_run_what_was_priced(deepseek):
    from meshplan.export.megatron import MEGATRON_CORE
    lay = Layout(tp=1, pp=8, vp=2, ep=32, dp=32, zero=1, mbs=1, recompute="mla_up", fp8_recipe="mxfp8",
                 moe_dispatcher="deepep", ep_comm_overlap=True, stage_layers=DS_SPLIT)
    assert MEGATRON_CORE.runs_ep_overlap(lay)
    plan = mp.plan(deepseek, mp.Cluster.preset("dgx-b200", nodes=32), seq_len=4096, global_batch=4096,
                   precision="fp8", stack="megatron-core", top_k=1,
                   fixed=dict(tp=1, pp=8, vp=2, ep=32, recompute="mla_up", fp8_recipe="mxfp8",
                              moe_dispatcher="deepep", mbs=1, zero=1, stage_layers=DS_SPLIT))
    assert plan.layout.ep_comm_overlap          # the search turns the stack's overlap on where it runs
    args = plan.to_megatron_args()
    assert "--overlap-moe-expert-parallel-comm" in args and "--fp8-param-gather" in args
    i = args.index("--recompute-modules")
    assert args[i + 1:i + 3] == ["mla_up_proj", "mlp"]


def test_a2a_overlap_takes_the_tp_overlap_its_kernel_queues_cost(qwen):
    """Before Blackwell, Megatron's userbuffers TP overlap needs one hardware queue
    (CUDA_DEVICE_MAX_CONNECTIONS=1) and the expert all-to-all overlap several: with both asked for,
    the run sets 32 (as Megatron-Bridge does) and the TP transfers hide nothing; on Blackwell both
    work. The Megatron-LM export sets the variable the price assumes."""
    mc = STACKS["megatron-core"].replace(moe_host_sync=False)
    both = dict(ep_comm_overlap=True, tp_comm_overlap=True)
    h_tp, h_both = _qwen(qwen, mc, tp_comm_overlap=True), _qwen(qwen, mc, **both)
    assert h_tp.time_s["tp"] < h_both.time_s["tp"] == pytest.approx(_qwen(qwen, mc, ep_comm_overlap=True).time_s["tp"])
    lay = Layout(**dict(QWEN_XNODE, **both))
    assert mc.kernel_queues(lay, "h100-sxm") == 32 and mc.kernel_queues(lay, "b200") == 1
    assert mc.kernel_queues(Layout(**dict(QWEN_XNODE, tp_comm_overlap=True)), "h100-sxm") == 1
    assert mc.kernel_queues(Layout(**dict(QWEN_XNODE, tp=1, dp=32)), "h100-sxm") is None
    b200 = mp.Cluster.preset("dgx-b200", nodes=32)
    kw = dict(seq_len=4096, global_batch=2048, stack=mc)
    a2a_only = estimate_profile(qwen, b200, dict(QWEN_XNODE, ep_comm_overlap=True), **kw)
    assert estimate_profile(qwen, b200, dict(QWEN_XNODE, **both), **kw).time_s["tp"] < a2a_only.time_s["tp"]
