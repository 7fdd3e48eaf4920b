"""The "norm_act" recompute policy end to end ("a plan is what runs"): Megatron-Core's
--recompute-granularity selective --recompute-modules layernorm moe_act as a Layout option, run by
meshplan's runtime (runtime/recompute.py), priced by the cost model (cost_models.layer.NORM_ACT),
offered by the search and mapped by the exports.

The memory tests measure what one block keeps for backward on CPU, in bf16 (the cost model counts
BF16 bytes), for each policy. Two views of "kept":
- live: every storage the block's forward created that is still alive once it returns (autograd's
  saved tensors, a checkpoint's inputs and selective-checkpoint cache), plus the block input, which
  every policy keeps; parameters, buffers and the block output (the next block's input) excluded.
- saved_tensors_hooks: what autograd packs for backward, deduplicated by storage. It sees through
  no recompute only: a checkpoint (and "norm_act") installs its own hooks inside the block, and the
  innermost hooks win, so there the live count is the one to read.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import meshplan as mp
import meshplan.runtime.recompute as rc
from meshplan import models
from meshplan.cluster import Cluster
from meshplan.cost_models.layer import NORM_ACT, Context, activation_bytes
from meshplan.errors import ConfigError
from meshplan.ir.layout import RECOMPUTE, Layout
from meshplan.ir.stack import STACKS
from meshplan.models.presets import PRESETS
from meshplan.profiling.analytic import profile_from_config

POLICIES = ("none", "selective", NORM_ACT, "full")
B, T = 2, 32


# ---- Layout -----------------------------------------------------------------------------------------
def test_layout_takes_norm_act():
    lay = Layout(recompute="norm_act")
    assert "norm_act" in RECOMPUTE and RECOMPUTE.index("norm_act") < RECOMPUTE.index("full")
    assert lay.recompute_policy(0) == lay.recompute_policy(7) == "norm_act"
    assert "rc=norm_act" in lay.short()
    assert Layout.from_dict(lay.to_dict()) == lay
    with pytest.raises(ConfigError, match="norm_act"):
        Layout(recompute="layernorm")


# ---- runtime numerics ---------------------------------------------------------------------------------
def _train_step(name: str, policy: str, dtype=torch.float32):
    torch.manual_seed(0)
    model = models.build(name, device="cpu", seq_len=T, dtype=dtype)
    blocks = [f"layers.{i}" for i in range(len(model.layers))]
    wrapped = rc.apply_recompute(model, blocks, Layout(recompute=policy))
    assert wrapped == (blocks if policy != "none" else [])
    torch.manual_seed(1)
    ids = torch.randint(0, model.config.vocab, (B, T))
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe"])
def test_norm_act_gives_the_loss_and_gradients_of_no_recompute(name):
    """Replaying the same ops on the same inputs is bit-identical: exactly the same loss and
    gradients (tolerance 0), MoE routing and balancing losses included."""
    loss0, grads0 = _train_step(name, "none")
    loss1, grads1 = _train_step(name, NORM_ACT)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    assert grads1.keys() == grads0.keys()
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=0, atol=0, msg=n)


def test_norm_act_in_bf16_matches_too():
    loss0, grads0 = _train_step("tiny-moe", "none", torch.bfloat16)
    loss1, grads1 = _train_step("tiny-moe", NORM_ACT, torch.bfloat16)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=0, atol=0, msg=n)


def test_norm_act_runs_eagerly_without_grad():
    """Under no_grad nothing is saved, so the block runs as is (no recorder)."""
    torch.manual_seed(0)
    model = models.build("tiny-moe", device="cpu", seq_len=T)
    ids = torch.randint(0, 256, (B, T))
    with torch.no_grad():
        ref = model(ids)
        rc.apply_recompute(model, [f"layers.{i}" for i in range(len(model.layers))], Layout(recompute=NORM_ACT))
        torch.testing.assert_close(model(ids), ref, rtol=0, atol=0)


# ---- what a block keeps for backward -------------------------------------------------------------------
class _Created(TorchDispatchMode):
    """Weak references to every storage an op creates while active."""

    def __init__(self):
        super().__init__()
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for y in tree_flatten(out)[0]:
            if isinstance(y, torch.Tensor):
                ref = StorageWeakRef(y.untyped_storage())
                self.made.setdefault(ref.cdata, (ref, y.untyped_storage().nbytes()))
        return out


def _key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


@dataclasses.dataclass
class Kept:
    live: int            # bytes alive after forward (see the module docstring)
    hooks: int           # bytes autograd packed, deduplicated (no recompute only)
    region: int = 0      # of `hooks`: tensors the norms / expert activation created (norm_act's to drop)
    outputs: int = 0     # of `region`: the norms' outputs and the activation outputs themselves
    replay_inputs: int = 0   # what a norm_act replay reads that no recompute does not keep


def _kept(name: str, policy: str, layer: int = -1) -> Kept:
    torch.manual_seed(0)
    model = models.build(name, device="cpu", seq_len=T, dtype=torch.bfloat16)
    block = model.layers[layer]
    if policy != "none":
        rc.apply_recompute(model, [f"layers.{len(model.layers) + layer if layer < 0 else layer}"],
                           Layout(recompute=policy))
    x = torch.randn(B, T, model.config.hidden, dtype=torch.bfloat16, requires_grad=True)
    rope = (model.rope_cos[:T], model.rope_sin[:T])
    fixed = {_key(t) for t in [*model.parameters(), *model.buffers()]}

    # no recompute: also classify what autograd packs with the norm_act recorder (packing nothing)
    rec = rc._Recorder() if policy == "none" else None
    norm_outs: set[int] = set()
    if rec is not None:
        rc._hook_modules(block)
        for m in rc.norm_modules(block):
            m.register_forward_hook(lambda _m, _a, out: norm_outs.add(_key(out)))
    packed: dict[int, int] = {}
    region: dict[int, int] = {}

    def pack(t):
        k = _key(t)
        if k not in fixed:
            packed[k] = t.untyped_storage().nbytes()
            if rec is not None and isinstance(rec.pack(t), rc._Handle):
                region[k] = packed[k]
        return t

    created = _Created()
    prev = getattr(rc._ACTIVE, "rec", None)
    rc._ACTIVE.rec = rec
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), created:
            if rec is not None:
                with rec:
                    out = block(x, rope)
            else:
                out = block(x, rope)
    finally:
        rc._ACTIVE.rec = prev
    k = Kept(live=0, hooks=sum(packed.values()), region=sum(region.values()))
    if rec is not None:
        k.outputs = sum(n for key, n in region.items() if key in norm_outs or key in _act_outputs(rec))
        # the tensors a norm_act replay reads that no recompute does not keep itself: the second
        # norm's input (the eager CPU norm saves its fp32 upcast instead; a fused norm saves the input)
        inputs = {_key(t): t.untyped_storage().nbytes() for reg in _regions(rec) for _f, leaves, _s in reg.ops
                  for t in leaves if isinstance(t, torch.Tensor)}
        block_input = _key(x)
        k.replay_inputs = sum(n for key, n in inputs.items() if key not in packed and key not in fixed
                              and key != block_input)
        del rec, inputs                   # the recorder keeps its regions' inputs alive
    gc.collect()
    # routing statistics the MoE keeps on itself (tokens_per_expert, the balancing loss, its routing
    # window) are not activations kept for backward
    stats = {_key(t) for m in block.modules() for t in _state_tensors(vars(m))}
    skip = fixed | stats | {_key(out)}
    live = sum(n for key, (ref, n) in created.made.items() if not ref.expired() and key not in skip)
    k.live = live + x.untyped_storage().nbytes()
    out.float().sum().backward()
    return k


def _state_tensors(x, depth: int = 6) -> list[torch.Tensor]:
    """Tensors held by module attributes, in containers and plain objects a few levels down."""
    if isinstance(x, torch.Tensor):
        return [x]
    if depth == 0 or isinstance(x, (torch.nn.Module, str, bytes, int, float)):
        return []
    if isinstance(x, dict):
        items = list(x.values())
    elif isinstance(x, (list, tuple, set)):
        items = list(x)
    elif hasattr(x, "__dict__"):
        items = list(vars(x).values())
    else:
        return []
    return [t for v in items for t in _state_tensors(v, depth - 1)]


def _regions(rec) -> list:
    seen = {}
    for _ref, entry in rec.produced.values():
        seen[id(entry.region)] = entry.region
    return list(seen.values())


def _act_outputs(rec) -> set[int]:
    """Storages of the last op of every expert-activation region (the SwiGLU product / GELU output)."""
    return {cdata for cdata, (_ref, entry) in rec.produced.items()
            if cdata in rec.acts and entry.op == len(entry.region.ops) - 1}


def _predicted(name: str, policy: str, layer: int = -1, stack: str = "reference") -> float:
    b = profile_from_config(PRESETS[name]).layer_blocks()[layer]
    c = Context.build(Cluster(gpu="h100-sxm", num_gpus=1), Layout(mbs=B), T, False, stack=STACKS[stack])
    return activation_bytes(b, c, policy=policy)


@pytest.fixture(scope="module")
def kept():
    return {(name, p): _kept(name, p) for name in ("tiny-llama", "tiny-moe") for p in POLICIES}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe"])
def test_kept_bytes_order_matches_the_cost_model(kept, name):
    """none > norm_act > full and none > selective > full, measured and predicted; on the dense
    block norm_act also keeps more than selective in both. (On the MoE block the runtime's
    "selective" keeps less than the cost model's Korthikanti count: it saves only GEMM outputs and
    re-runs the norms, rotary and token permutation too; see the report in
    test_selective_runtime_keeps_only_gemm_outputs.)"""
    m = {p: kept[name, p].live for p in POLICIES}
    pred = {p: _predicted(name, p) for p in POLICIES}
    for d in (m, pred):
        assert d["none"] > d[NORM_ACT] > d["full"]
        assert d["none"] > d["selective"] > d["full"]
    if name == "tiny-llama":    # the runtime's selective is meshplan's checkpointing (Stack.selective_sac)
        assert m[NORM_ACT] > m["selective"] and pred[NORM_ACT] > _predicted(name, "selective", stack="meshplan")
    # full recompute keeps the block input alone: exactly the cost model's count
    assert m["full"] == pred["full"] == 2 * B * T * 128


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe"])
def test_norm_act_drops_exactly_the_norm_and_activation_tensors(kept, name):
    """norm_act keeps what no recompute keeps minus the tensors the norms and the expert
    activation created, byte for byte, plus only what their replay reads and no recompute did not
    keep: the second norm's input (h wide, bf16), which a fused norm keeps anyway (the cost model
    counts both norm inputs under every policy but "full")."""
    none, na = kept[name, "none"], kept[name, NORM_ACT]
    # with no recompute, what stays alive is exactly what autograd packed plus the block input, which
    # the eager CPU norm does not pack (it saves its fp32 upcast) and the measurement adds
    assert none.live == none.hooks + 2 * B * T * PRESETS[name]["hidden"]
    assert 0 < none.region < none.hooks
    assert none.replay_inputs == 2 * B * T * PRESETS[name]["hidden"]
    assert na.live == none.live - none.region + none.replay_inputs


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe"])
def test_norm_act_saving_per_tensor_matches_the_cost_model(kept, name):
    """The cost model counts the tensors norm_act drops as the two norm outputs (the QKV and
    FC1 / router inputs) and, on an MoE block, the routed experts' activation outputs (FC2's
    input, topk rows per token): that is exactly the bytes of those outputs measured. The eager
    model drops more: CPU's nn.RMSNorm keeps fp32 intermediates (the upcast input, the normalised
    row) and SwiGLU keeps silu(gate), which a fused norm / SwiGLU kernel (what the cost model
    assumes, cost_models.layer.LAYER_FUSIONS) never stores."""
    none = kept[name, "none"]
    predicted = _predicted(name, "none") - _predicted(name, NORM_ACT)
    assert none.outputs == pytest.approx(predicted, rel=0, abs=0)
    assert none.region >= none.outputs
    cfg = PRESETS[name]
    expected = 2 * 2 * cfg["hidden"] * B * T
    if name == "tiny-moe":
        expected += cfg["topk"] * 2 * cfg["moe_ffn_hidden"] * B * T
    assert predicted == expected


def test_selective_runtime_keeps_only_gemm_outputs(kept):
    """The runtime's "selective" keeps the GEMM outputs (expert GEMMs included: meshplan::grouped_mm
    used to be re-run in backward) and the block input, nothing else."""
    cfg = PRESETS["tiny-moe"]
    h, fm, k = cfg["hidden"], cfg["moe_ffn_hidden"], cfg["topk"]
    q, kv = h, cfg["kv_heads"] * (h // cfg["heads"])
    rows = B * T
    gemms = (h + q + 2 * kv + h                   # input, q k v, attention out-projection
             + cfg["experts"]                     # router logits
             + k * (2 * fm + h)                   # expert w1, w3, w2 outputs (topk rows per token)
             + 2 * fm * cfg["shared_experts"] + h)   # shared expert w1, w3, w2
    assert kept["tiny-moe", "selective"].live == 2 * rows * gemms


# ---- planner and exports ------------------------------------------------------------------------------
def test_search_offers_norm_act_for_moe_and_long_sequences():
    from meshplan.planner.search import NORM_ACT_MIN_SEQ, _recompute_options
    moe = profile_from_config(PRESETS["tiny-moe"])
    dense = profile_from_config(PRESETS["tiny-llama"])
    assert _recompute_options(moe, 1, 4096)[:3] == ["none", NORM_ACT, "selective"]
    assert NORM_ACT not in _recompute_options(dense, 1, 4096)
    assert _recompute_options(dense, 1, NORM_ACT_MIN_SEQ)[:3] == ["none", NORM_ACT, "selective"]


def test_plan_picks_norm_act_where_it_fits_and_selective_does_not_pay():
    """Mixtral 8x7B on 64 H100s, tp1 ep8 pp4 mbs2: no recompute does not fit; norm_act fits with less
    memory and less recompute than Korthikanti's selective (the experts' activation outputs are its
    largest saving). (meshplan's own selective, which re-runs the norms too, keeps less than either.)"""
    cl = mp.Cluster(gpu="h100-sxm", num_gpus=64, gpus_per_node=8)
    fixed = dict(tp=1, ep=8, pp=4, mbs=2)
    kw = dict(seq_len=4096, global_batch=512, stack="reference")
    pl = mp.plan("mixtral-8x7b", cl, fixed=fixed, **kw)
    assert pl.layout.recompute == NORM_ACT
    sel = mp.plan("mixtral-8x7b", cl, fixed=dict(fixed, recompute="selective"), **kw)
    assert pl.estimate.step_time_s < sel.estimate.step_time_s
    assert pl.estimate.peak_memory_gb < sel.estimate.peak_memory_gb


def _moe_plan(recompute: str):
    cl = mp.Cluster(gpu="h100-sxm", num_gpus=64, gpus_per_node=8)
    pl = mp.plan("mixtral-8x7b", cl, seq_len=4096, global_batch=512, stack="megatron-core",
                 fixed=dict(tp=2, ep=8, pp=4, vp=1, mbs=1, zero=1, recompute="full", schedule="1f1b"))
    # the export reads the layout only: set the policy on a plan priced with another
    return dataclasses.replace(pl, layout=dataclasses.replace(pl.layout, recompute=recompute))


def test_exports_map_norm_act():
    pl = _moe_plan(NORM_ACT)
    flat = " ".join(pl.to_megatron_args("mixtral-8x7b"))
    assert "--recompute-granularity selective --recompute-modules layernorm moe_act" in flat
    assert "--recompute-method" not in flat
    nemo = pl.to_nemo("mixtral-8x7b")
    assert any(k.endswith("recompute_granularity") and v == "selective" for k, v in nemo.items())
    assert any(k.endswith("recompute_modules") and v == ["layernorm", "moe_act"] for k, v in nemo.items())
    with pytest.raises(ConfigError, match=r"torchtitan has no recompute mode.*norm_act.*'selective'.*Megatron-LM or NeMo"):
        pl.to_torchtitan("mixtral-8x7b")


def test_megatron_norm_act_on_a_dense_model_leaves_out_moe_act():
    from meshplan.export.megatron import _megatron_recompute
    from meshplan.export.shape import model_shape
    from meshplan.export.view import _View
    pl = _moe_plan(NORM_ACT)
    shape = dataclasses.replace(model_shape(pl, "mixtral-8x7b"), experts=0)
    v = _View(layout=pl.layout, stage_layers=(8, 8, 8, 8), blocks=(), shape=shape, notes=[])
    r = _megatron_recompute(v, NORM_ACT)
    assert (r.granularity, r.modules) == ("selective", ("layernorm",))


def test_validation_prices_norm_act_rows_as_norm_act():
    from meshplan.cost_models.validation import (
        DEFAULT_CSV,
        _layout,
        load_rows,
        model_config,
    )
    from meshplan.models import config as preset
    rows = [r for r in load_rows(DEFAULT_CSV) if "norm" in r.get("recompute").lower()
            and "act" in r.get("recompute").lower()]
    assert rows, "the published data has a Megatron-Core layernorm + moe_act row"
    for r in rows:
        cfg = model_config(r, preset)
        lay = _layout(r, cfg, r.num("num_gpus"))
        assert not isinstance(lay, str) and lay["recompute"] == NORM_ACT


# ---- a fused norm op (as meshplan's Triton rms_norm: a custom op with two outputs) -----------------------
@torch.library.custom_op("meshplan_test::rms_norm_rstd", mutates_args=())
def _fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + eps)
    return (x.float() * rstd[..., None]).to(x.dtype) * weight, rstd


@_fused_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _fused_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], output[1])     # x, weight, rstd (as the Triton op)


def _fused_backward(ctx, dy, _drstd):
    x, w, rstd = ctx.saved_tensors
    xhat = x.float() * rstd[..., None]
    g = dy.float() * w.float()
    dx = rstd[..., None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy.float() * xhat).flatten(0, -2).sum(0)
    return dx.to(x.dtype), dw.to(w.dtype), None


_fused_rms_norm.register_autograd(_fused_backward, setup_context=_fused_setup)


def _swap_fused_norms(model):
    import types
    for m in rc.norm_modules(model):
        m.forward = types.MethodType(lambda self, x: _fused_rms_norm(x, self.weight, self.eps or 1e-6)[0], m)


def test_norm_act_replays_a_fused_norm_custom_op(monkeypatch):
    """A norm that runs as one custom op with an extra saved output (rstd), as meshplan's Triton
    rms_norm does: its output and rstd are packed as handles and replayed exactly."""
    handles = []
    pack = rc._Recorder.pack

    def counting(self, t):
        h = pack(self, t)
        if isinstance(h, rc._Handle):
            handles.append(str(h.ref.region.ops[h.ref.op][0]))
        return h
    monkeypatch.setattr(rc._Recorder, "pack", counting)

    def step(policy):
        torch.manual_seed(0)
        model = models.build("tiny-llama", device="cpu", seq_len=T)
        _swap_fused_norms(model)
        rc.apply_recompute(model, [f"layers.{i}" for i in range(len(model.layers))], Layout(recompute=policy))
        ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss0, g0 = step("none")
    assert not handles
    loss1, g1 = step(NORM_ACT)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=0, atol=0, msg=n)
    # per block and norm: the output (saved by the q/k/v or w1/w3 GEMMs) and rstd (saved by the op)
    assert handles and set(handles) == {"meshplan_test.rms_norm_rstd.default"}
    assert len(handles) >= 4 * 2 * 2


def test_norm_act_refuses_a_norm_that_writes_its_input():
    """A replay repeats the region's ops in backward: a norm that scales its input in place would
    be applied twice, so the policy refuses it and names what would work."""
    import types
    torch.manual_seed(0)
    model = models.build("tiny-llama", device="cpu", seq_len=T)
    norm = model.layers[0].attention_norm
    norm.forward = types.MethodType(lambda self, x: torch.nn.functional.rms_norm(x.mul_(1.0), (x.shape[-1],),
                                                                                  self.weight), norm)
    rc.apply_recompute(model, ["layers.0"], Layout(recompute=NORM_ACT))
    x = torch.randn(B, T, 128, requires_grad=True)
    with pytest.raises(ConfigError, match=r"norm_act.*in place.*'selective' or 'full'"):
        model.layers[0](x.clone(), (model.rope_cos[:T], model.rope_sin[:T]))


@pytest.mark.usefixtures("one_process_group")     # tests/conftest.py
def test_a_norm_act_plan_runs_through_parallelize():
    """The plan's policy is what `parallelize` applies (one rank, gloo): a tiny MoE planned with
    recompute="norm_act" trains one step to exactly the loss and gradients of the same plan with
    no recompute."""
    from meshplan.runtime.parallel import parallelize
    cl = Cluster(gpu="cpu", num_gpus=1, gpus_per_node=1)

    def step(recompute):
        pl = mp.plan(models.build("tiny-moe", seq_len=T, device="meta"), cl, seq_len=T, global_batch=2,
                     fixed={"recompute": recompute, "mbs": 2})
        assert pl.layout.recompute == recompute
        torch.manual_seed(0)
        model = models.build("tiny-moe", seq_len=T, device="cpu")
        pm = parallelize(model, pl, compute_dtype=None)
        wrapped = ["forward" in pm.stages[0].get_submodule(b).__dict__ for b in pl.blocks]
        assert wrapped == [recompute != "none"] * len(pl.blocks)
        ids = torch.randint(0, 256, (2, T + 1), generator=torch.Generator().manual_seed(1))
        loss = pm.forward_backward(ids[:, :-1], ids[:, 1:])
        return loss, {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}

    loss0, g0 = step("none")
    loss1, g1 = step(NORM_ACT)
    assert loss1 == loss0
    assert g1.keys() == g0.keys() and g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=0, atol=0, msg=n)
