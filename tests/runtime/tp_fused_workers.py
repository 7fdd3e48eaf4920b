"""Workers for tests/runtime/test_tp_fused_projections.py (imported by spawned ranks).

Models with packed projections: a small one with a fused QKV (grouped-query: fewer KV heads than
query heads, with a bias) and a fused gate/up projection; transformers' Phi-3 (fused qkv_proj and
gate_up_proj) and GPT-2 (Conv1D: weights stored (in, out); fused c_attn) from tiny configs.

Each case runs the plan sharded and the same model unsharded (same weights and batch), and
compares loss, every full gradient and every parameter after one AdamW step (tolerances:
numerics.py). Gradients of weights kept in TP order (grouped-query fused QKV, see
meshplan.runtime.packed_projections) are put back in the model's order before comparing.
"""

from __future__ import annotations

import copy

import numerics
import torch
import torch.nn.functional as F
from torch import nn

from worlds import planning_model, plans

VOCAB = 256


class FusedAttention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.wqkv = nn.Linear(d, (heads + 2 * kv_heads) * self.head_dim, bias=True)
        self.wo = nn.Linear(heads * self.head_dim, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        hd = self.head_dim
        q, k, v = self.wqkv(x).split([self.n_heads * hd, self.n_kv_heads * hd, self.n_kv_heads * hd], dim=-1)
        q = q.view(B, T, self.n_heads, hd).transpose(1, 2)
        k, v = (t.view(B, T, self.n_kv_heads, hd).transpose(1, 2) for t in (k, v))
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, T, -1))


class FusedMLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w13 = nn.Linear(d, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attention = FusedAttention(d, heads, kv_heads)
        self.feed_forward = FusedMLP(d, hidden)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class FusedLM(nn.Module):
    def __init__(self, d: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, hidden: int = 96):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(Block(d, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.output = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build_model(kind: str, *, seq_len: int):
    torch.manual_seed(1234)
    if kind == "fused-gqa":
        return FusedLM()
    import transformers
    if kind == "hf-phi3":
        cfg = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq_len,
                                      tie_word_embeddings=False, attn_implementation="sdpa", pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2)
        model = transformers.Phi3ForCausalLM(cfg)
    elif kind == "hf-gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=seq_len,
                                      attn_implementation="sdpa", bos_token_id=1, eos_token_id=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(kind)
    model.config.use_cache = False
    return model


def plan_for(kind: str, world: int, fixed: dict, seq_len: int, global_batch: int):
    """meshplan's plan for `kind` on `world` CPU processes, the layout `fixed` (cached)."""
    return _plan(kind, world, tuple(sorted(fixed.items())), seq_len, global_batch)


def prefetch_plans(calls) -> None:
    """Make the plans plan_for(*call) for each call two at a time (worlds.prefetch)."""
    _plan.prefetch([(kind, world, tuple(sorted(fixed.items())), seq, batch)
                    for kind, world, fixed, seq, batch in calls])


@plans
def _plan(kind: str, world: int, fixed_items: tuple, seq_len: int, global_batch: int):
    import meshplan as mp
    from meshplan.cluster import Cluster
    model = planning_model(("tp_fused", kind, seq_len), lambda: build_model(kind, seq_len=seq_len))
    return mp.plan(model, Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world),
                   seq_len=seq_len, global_batch=global_batch, fixed=dict(fixed_items))


def equivalence(rank: int, world: int, case: dict) -> dict:
    import torch.distributed as dist

    from meshplan.runtime import parallelize
    from meshplan.runtime.packed_projections import from_tp_order, tp_order_params
    torch.manual_seed(0)
    model = build_model(case["model"], seq_len=case["seq_len"])
    ref = copy.deepcopy(model)
    x, y = numerics.batch(case["global_batch"], case["seq_len"], VOCAB)
    pm = parallelize(model, case["plan"], compute_dtype=None, fused_kernels=case.get("fused_kernels", True))
    _check_shards(pm, ref, case.get("shards", {}), rank, world)
    loss = pm.forward_backward(x, y)
    # every stage's TP-order parameters (full_grads gathers all stages' gradients)
    specs: list = [None] * world
    dist.all_gather_object(specs, {n: s for st in pm.stages for n, s in tp_order_params(st).items()})
    tp_order = {n: s for d in specs for n, s in d.items()}
    grads = pm.full_grads()
    ref_loss, ref_grads, ref_params = numerics.reference(ref, x, y)
    for n, spec in tp_order.items():
        # the runtime's full_grads gives these in TP order (until it undoes it: then they already
        # match the model's order; compared below either way)
        if not torch.allclose(grads[n], ref_grads[n], **numerics.GRAD_TOL):
            grads[n] = from_tp_order(grads[n], *spec)
    norm = pm.clip_grad_norm(None)
    opt = torch.optim.AdamW(pm.parameters(), lr=numerics.LR, eps=numerics.EPS)
    opt.step()
    params = pm.full_state_dict()
    # checkpoint round trip: state_dict gives packed weights in the model's order, load takes them back
    pm.load_state_dict(pm.state_dict())
    again = pm.full_state_dict()
    for n in params:
        torch.testing.assert_close(again[n], params[n], rtol=0, atol=0, msg=lambda m, n=n: f"reloaded {n}: {m}")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **numerics.GRAD_TOL, msg=lambda m, n=n: f"grad {n}: {m}")
    for n in ref_params:
        torch.testing.assert_close(params[n], ref_params[n], **numerics.PARAM_TOL, msg=lambda m, n=n: f"param {n}: {m}")
    ref_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())))
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7, msg=lambda m: f"grad norm: {m}")
    worst = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
    return {"loss": loss, "ref_loss": ref_loss, "max_grad_err": worst, "tp_order": sorted(tp_order)}


def _check_shards(pm, ref, shards: dict, rank: int, tp: int) -> None:
    """Each rank's local weight is its slice of every part: {param FQN: (part widths, dim)}."""
    from torch.distributed.tensor import DTensor
    params = dict(pm.named_parameters())
    whole = dict(ref.named_parameters())
    for name, (parts, dim) in shards.items():
        local = params[name].to_local() if isinstance(params[name], DTensor) else params[name]
        pieces, start = [], 0
        for p in parts:
            pieces.append(whole[name].detach().narrow(dim, start + rank * p // tp, p // tp))
            start += p
        torch.testing.assert_close(local.detach(), torch.cat(pieces, dim), rtol=0, atol=0,
                                   msg=lambda m, n=name: f"local shard of {n}: {m}")


def run_cases(rank: int, world: int, cases: dict) -> dict:
    """Every case in one process group: equivalence, or the kind the case names."""
    from worlds import each_case
    kinds = {"reshard_optimizer": reshard_optimizer, "deferred": deferred_fused}
    return each_case(rank, cases, lambda name, case: kinds.get(case.get("kind"), equivalence)(rank, world, case))


def _build(case: dict):
    """case["model"] from this module, or from the workers module case["workers"] names."""
    if case.get("workers"):
        import importlib
        return importlib.import_module(case["workers"]).build_model(case["model"])
    return build_model(case["model"], seq_len=case["seq_len"])


def reshard_optimizer(rank: int, world: int, case: dict) -> dict:
    """Checkpoint under one plan, resume under the other (case["plans"]: two), and back; step
    again: the weights equal two single-device AdamW steps. Packed projections' (and transformers'
    experts' under ETP) moments are rows in TP order inside the optimizer; a checkpoint must hold
    them in the model's order or they land on the wrong rows."""
    import torch.distributed as dist

    from meshplan.runtime import parallelize
    from meshplan.train import checkpoint
    x, y = numerics.batch(case["global_batch"], case["seq_len"], VOCAB)
    ref = _build(case)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=numerics.LR, eps=numerics.EPS)
    for _ in range(2):
        ref_opt.zero_grad()
        numerics.reference_loss(ref, x, y).backward()
        ref_opt.step()
    want = {n: p.detach().clone() for n, p in ref.state_dict().items()}
    out = {}
    first, second = case["plans"]
    for src, dst in ((first, second), (second, first)):
        pm = parallelize(_build(case), case["plans"][src], compute_dtype=None)
        opt = torch.optim.AdamW(pm.parameters(), lr=numerics.LR, eps=numerics.EPS)
        pm.forward_backward(x, y)
        opt.step()
        saved = checkpoint.save(f"{case['dir']}/{src}", 1, pm, opt, {})
        torch.manual_seed(7)            # other weights: the checkpoint must replace them all
        pm2 = parallelize(_build(case), case["plans"][dst], compute_dtype=None)
        opt2 = torch.optim.AdamW(pm2.parameters(), lr=numerics.LR, eps=numerics.EPS)
        checkpoint.load(saved, pm2, opt2)
        pm2.forward_backward(x, y)
        opt2.step()
        got = pm2.full_state_dict()
        for n in want:
            torch.testing.assert_close(got[n], want[n], **numerics.PARAM_TOL,
                                       msg=lambda m, n=n: f"{src} -> {dst}, {n} after the resumed step: {m}")
        out[f"{src}->{dst}"] = sorted(pm2.tp_orders() or pm.tp_orders())
        dist.barrier()
    return out


def deferred_fused(rank: int, world: int, case: dict) -> dict:
    """The fused-QKV / fused gate-up model built on the meta device under a seed, parallelised:
    its full weights (rank 0), to compare with the same model built on the CPU under that seed."""
    from meshplan.runtime import parallelize
    torch.manual_seed(case["seed"])
    with torch.device("meta"):
        model = FusedLM()
    pm = parallelize(model, case["plan"], compute_dtype=None)
    full = pm.full_state_dict()
    return {k: v.cpu() for k, v in full.items()} if rank == 0 else {}
