"""Workers for the expert-parallel tests (imported by spawned ranks; see test_expert_parallel.py).

Tolerances are numerics.py's (fp32; sums reordered by sharding, micro-batching and the EP
regroup, never a different computation).
"""

from __future__ import annotations

import copy
import tempfile

import torch

import numerics

SEQ, BATCH = 32, 8
MOE = dict(layers=2, hidden=64, ffn_hidden=128, heads=4, kv_heads=2, vocab=256, experts=4, topk=2,
           moe_ffn_hidden=32)
MOE_SHARED = dict(MOE, layers=4, shared_experts=1, dense_layers=1)
# moe-shared-3l: the dense layer and two MoE layers (the MoE layer's kind still repeats, as the
# tracer needs to find it as a block): for cases that shard inside a layer, where a third MoE
# layer would repeat the same check
CONFIGS = {"moe": MOE, "moe-shared": MOE_SHARED, "moe-shared-3l": dict(MOE_SHARED, layers=3)}


def build_model(kind: str, *, seq_len: int = SEQ, device: str = "cpu"):
    """The tests' tiny MoEs (same weights on every rank), or Hugging Face Mixtral."""
    torch.manual_seed(1234)
    if kind == "hf-mixtral":
        import transformers
        cfg = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2, max_position_embeddings=seq_len,
                                         tie_word_embeddings=False)
        model = transformers.MixtralForCausalLM(cfg)
        model.config.use_cache = False
        return model
    from meshplan import models
    model = models.build("moe", seq_len=seq_len, device=device, **CONFIGS[kind])
    if device != "meta":
        model.init_weights()
    return model


# ---- the dispatch alone ----------------------------------------------------------------------

# rows rank r sends to each of the 4 experts (world 2: rank 0 owns experts 0-1, rank 1 experts
# 2-3; world 4: rank r owns expert r): expert 2 gets nothing from anyone (with 4 ranks, rank 2
# receives no row at all), rank 1 sends nothing to rank 0's experts, rank 0 sends a lopsided
# 7:1 load, and with 4 ranks rank 3 sends no row at all
DISPATCH_COUNTS = {2: [[7, 1, 0, 3], [0, 0, 0, 5]],
                   4: [[7, 1, 0, 3], [0, 0, 0, 5], [2, 2, 0, 0], [0, 0, 0, 0]]}


def experts_alone_over_ep(ref, world: int):
    """A copy of the experts module `ref`, alone in a holder module, made expert-parallel over a
    1-D "ep" mesh of `world` ranks (the dispatch tested without the rest of a model)."""
    from torch.distributed.device_mesh import init_device_mesh

    from meshplan.runtime.expert_parallel import apply_expert_parallel
    holder = torch.nn.Module()
    holder.experts = copy.deepcopy(ref)
    holder.experts.zero_grad()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    assert apply_expert_parallel(holder, mesh) == ["experts"]
    return holder.experts


def dispatch(rank: int, world: int) -> dict:
    """EP forward and backward of a GroupedExperts vs the whole module on every rank's rows."""
    from torch.distributed.tensor import DTensor

    from meshplan.models import GroupedExperts
    torch.manual_seed(7)
    ref = GroupedExperts(4, 16, 8, activation="swiglu")
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.3)
    counts = [torch.tensor(c) for c in DISPATCH_COUNTS[world]]
    xs = [torch.randn(int(c.sum()), 16, requires_grad=True) for c in counts]
    gs = [torch.randn(int(c.sum()), 16) for c in counts]           # upstream gradients
    for x, c, g in zip(xs, counts, gs):
        ref(x, c).backward(g)

    experts = experts_alone_over_ep(ref, world)
    w1 = experts.w1
    assert isinstance(w1, DTensor) and w1.to_local().shape == (4 // world, 8, 16)
    x = xs[rank].detach().clone().requires_grad_(True)
    out = experts(x, counts[rank])
    want = ref(xs[rank].detach(), counts[rank])
    torch.testing.assert_close(out, want, **numerics.GRAD_TOL)
    out.backward(gs[rank])
    torch.testing.assert_close(x.grad, xs[rank].grad, **numerics.GRAD_TOL)
    for n, p in ref.named_parameters():
        full = getattr(experts, n).grad.full_tensor()
        torch.testing.assert_close(full, p.grad, **numerics.GRAD_TOL, msg=lambda m, n=n: f"grad {n}: {m}")
    return {"rows": int(x.shape[0]), "local_experts": int(w1.to_local().shape[0])}


# ---- whole models --------------------------------------------------------------------------------

def step_and_compare(model, plan):
    """One training step of `model` under `plan` against the single-device model: the loss, every
    full gradient, the gradient norm and the weights after an AdamW step must agree.
    Returns (parallel model, loss, norm, single-device loss, single-device norm)."""
    from meshplan.runtime import parallelize
    ref = copy.deepcopy(model)
    x, y = numerics.batch(BATCH, SEQ)
    pm = parallelize(model, plan, compute_dtype=None)
    loss = pm.forward_backward(x, y)
    grads = pm.full_grads()
    norm = pm.clip_grad_norm(None)
    opt = torch.optim.AdamW(pm.parameters(), lr=numerics.LR, eps=numerics.EPS)
    opt.step()
    params = pm.full_state_dict()
    ref_loss, ref_grads, ref_params = numerics.reference(ref, x, y)
    numerics.assert_matches_reference(loss, grads, params, ref_loss, ref_grads, ref_params)
    ref_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())))
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7)
    return pm, loss, norm, ref_loss, ref_norm


def equivalence(rank: int, world: int, case: dict) -> dict:
    """step_and_compare for the EP models, plus the experts each rank holds and the MoE stats."""
    torch.manual_seed(0)
    pm, loss, norm, ref_loss, ref_norm = step_and_compare(build_model(case["model"]), case["plan"])
    local_experts = {n: tuple(_local(p).shape) for n, p in pm.named_parameters() if n.endswith("experts.w1")}
    stats = [tuple(m.tokens_per_expert.tolist()) for st in pm.stages for m in st.modules()
             if getattr(m, "tokens_per_expert", None) is not None]
    return {"loss": loss, "ref_loss": ref_loss, "norm": norm, "ref_norm": ref_norm, "local_experts": local_experts,
            "tokens_per_expert": stats, "data_parallel": pm.data_parallel}


def _local(p):
    # an expert weight's shard on this rank (plain weights: not sharded), after FSDP's edp shard
    return p.to_local() if hasattr(p, "to_local") else p


def reshard(rank: int, world: int, case: dict) -> dict:
    """Save with DCP under plan `save`, load under plan `load`: every full tensor must survive."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from meshplan.runtime import parallelize
    model = build_model(case["model"])
    torch.manual_seed(5)
    with torch.no_grad():                       # weights the fresh model cannot have by chance
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    pm = parallelize(model, case["save"], compute_dtype=None)
    want = pm.full_state_dict()
    path = [tempfile.mkdtemp(prefix="ep_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(path)
    dcp.save(pm.state_dict(), checkpoint_id=path[0])
    other = parallelize(build_model(case["model"]), case["load"], compute_dtype=None)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path[0])
    other.load_state_dict(state)
    got = other.full_state_dict()
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=lambda m, n=n: f"{n}: {m}")
    return {"tensors": len(want)}


def train(rank: int, world: int, case: dict) -> dict:
    """A few AdamW steps on one repeated batch in the plan's precision: the loss must fall."""
    from meshplan.runtime import parallelize
    pm = parallelize(build_model(case["model"]), case["plan"])
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    x, y = numerics.batch(BATCH, SEQ, pad=False)
    losses = []
    for _ in range(case.get("steps", 6)):
        losses.append(pm.forward_backward(x, y))
        pm.clip_grad_norm(1.0)
        opt.step()
        pm.zero_grad()
    return {"losses": losses, "dtype": str(next(iter(pm.parameters())).dtype)}


def each_case(rank: int, cases: dict, run_one) -> dict:
    """Several cases in one process group (worlds.each_case)."""
    from worlds import each_case as each
    return each(rank, cases, run_one)


def run_cases(rank: int, world: int, cases: dict) -> dict:
    def one(name, case):
        kind = case.get("kind")
        if kind == "dispatch":
            return dispatch(rank, world)
        if kind == "reshard":
            return reshard(rank, world, case)
        if kind == "train":
            return train(rank, world, case)
        if kind == "error":
            return _expect_error(case)
        if kind == "balance":           # global aux loss, z-loss and expert bias (moe_workers.py)
            import moe_workers
            return moe_workers.balance(rank, world, case)
        if kind == "deferred":          # deferred initialisation of case["model"] (deferred_workers.py)
            import deferred_workers
            return deferred_workers.deferred_run(rank, world, {**case, "kind": case["model"]})
        if kind == "dense":             # a dense model's case (numerics.py) in the same group
            return numerics.equivalence(rank, world, case)
        return equivalence(rank, world, case)
    return each_case(rank, cases, one)


def _expect_error(case: dict) -> dict:
    from meshplan.runtime import parallelize
    try:
        parallelize(build_model(case["model"]), case["plan"], compute_dtype=None)
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None}
