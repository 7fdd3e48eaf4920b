"""Workers for the runtime's numerical-equivalence tests (imported by spawned ranks).

Each case runs the sharded model and, on every rank, the same single-device model with the same
weights and batch, and compares loss, every full gradient and every parameter after one AdamW
step with `torch.testing.assert_close`.

Tolerances (fp32 everywhere): sharding changes the order of floating-point sums (a row-parallel
matmul sums tp partial products, FSDP and micro-batching sum gradients in another order), so
results agree to rounding, not bit for bit. With values O(1) and sums of a few hundred terms, the
fp32 reordering error is ~1e-6 relative; rtol=1e-4 / atol=1e-5 leaves two orders of margin while
any real mistake (a missing reduction, a wrong shard, a gradient scaled by tp or dp) gives errors
of O(1e-1) or more. AdamW's first step moves a weight by lr * g / (|g| + eps): with the default
eps=1e-8 a gradient of ~1e-8 (there are a few among 10^5) turns a 1e-9 reordering difference into
a visible step difference, so the tests use eps=1e-4, which bounds the step difference by
lr * |dg| / eps (~1e-7 here) while every other weight still moves by ~lr.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from worlds import planning_model, plans

GRAD_TOL = dict(rtol=1e-4, atol=1e-5)
PARAM_TOL = dict(rtol=1e-4, atol=2e-5)
LR = 1e-3
EPS = 1e-4


# test-only models: a preset with overrides. tiny-mla: tiny-llama with DeepSeek-V3's multi-head
# latent attention (4 heads of 16 + 8 rotary channels, values of 16, latents of 48 and 32)
VARIANTS = {"tiny-mla": ("tiny-llama", dict(kv_heads=None, attention="mla", q_lora_rank=48, kv_lora_rank=32,
                                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16))}
# tiny-swa: GPT-OSS's attention on tiny-llama: 8-token windows on layers 0 and 2 (sequences of 32),
# biases; tiny-swa-sinks adds the per-head sink logits
VARIANTS["tiny-swa"] = ("tiny-llama", dict(sliding_window=8, sliding_window_pattern="alternate", bias=True))
VARIANTS["tiny-swa-sinks"] = ("tiny-llama", dict(sliding_window=8, attention_sinks=True, bias=True))
# "<kind>-2l": the same model with 2 layers instead of 4. Every layer of these models has the same
# structure and shapes, so a case that shards within a layer (TP, SP, FSDP, DDP, recompute) checks
# the same thing on 2 layers at half the ranks' work; pipeline cases keep 4 (pp * vp stages of at
# least one layer each). tiny-swa-2l keeps one layer of each kind (windowed, then global): the
# tracer makes each a block of its own. hf-llama-2l: the transformers Llama with 2 layers (HF_LAYERS).
TWO_LAYERS = "-2l"
VARIANTS.update({f"{kind}{TWO_LAYERS}": (base, dict(overrides, layers=2))
                 for kind, (base, overrides) in [("tiny-llama", ("tiny-llama", {})), ("tiny-gpt", ("tiny-gpt", {})),
                                                 ("tiny-mla", VARIANTS["tiny-mla"]), ("tiny-swa", VARIANTS["tiny-swa"]),
                                                 ("tiny-swa-sinks", VARIANTS["tiny-swa-sinks"])]})
HF_LAYERS = {"hf-llama": 4, f"hf-llama{TWO_LAYERS}": 2}
# 5 layers: pp2 vp2 splits them unevenly (2, 1, 1, 1), as the search does for 126-layer Llama 3 405B
VARIANTS["tiny-llama-5l"] = ("tiny-llama", dict(layers=5))


def _build(kind: str, **kw):
    from meshplan import models
    name, overrides = VARIANTS.get(kind, (kind, {}))
    return models.build(name, **overrides, **kw)


def build_meta(kind: str, *, seq_len: int):
    """Model `kind` on the meta device, for planning (a transformers model: on the CPU)."""
    return build_model(kind, seq_len=seq_len) if kind in HF_LAYERS else _build(kind, seq_len=seq_len, device="meta")


def layers_of(kind: str) -> int:
    """How many transformer layers model `kind` has."""
    if kind in HF_LAYERS:
        return HF_LAYERS[kind]
    return _build(kind, seq_len=32, device="meta").config.layers


def build_model(kind: str, *, seq_len: int):
    torch.manual_seed(1234)
    if kind in HF_LAYERS:
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160,
                                       num_hidden_layers=HF_LAYERS[kind], num_attention_heads=4,
                                       num_key_value_heads=2,
                                       max_position_embeddings=seq_len, tie_word_embeddings=False,
                                       attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(cfg)
        model.config.use_cache = False
        return model
    model = _build(kind, seq_len=seq_len, device="cpu")
    model.init_weights()
    return model


@plans
def plan_for(kind: str, world: int, fixed_items: tuple, seq_len: int, global_batch: int):
    """meshplan's plan for model `kind` on `world` CPU processes, the layout fixed by `fixed_items`
    (cached; `plan_for.prefetch([(kind, world, fixed_items, seq_len, global_batch), ...])` makes
    many at once in two processes)."""
    import meshplan as mp
    from meshplan.cluster import Cluster
    # one model object per kind and length: traced once for all its layouts (worlds.traced_once)
    model = planning_model(("numerics", kind, seq_len), lambda: build_meta(kind, seq_len=seq_len))
    return mp.plan(model, Cluster(gpu="cpu", num_gpus=world, gpus_per_node=world), seq_len=seq_len,
                   global_batch=global_batch, fixed=dict(fixed_items))


def batch(global_batch: int, seq_len: int, vocab: int = 256, *, pad: bool = True):
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    if pad:
        y[0, -5:] = -100        # padding: the global mean must skip it on whichever rank holds it
    return x, y


def reference_loss(model, x, y) -> torch.Tensor:
    """The single-device model's loss: mean cross-entropy over the non-padding targets."""
    from meshplan.runtime.pipeline import logits_of
    logits = logits_of(model(x))
    return F.cross_entropy(logits.flatten(0, -2).float(), y.flatten(), ignore_index=-100)


def reference(model, x, y):
    loss = reference_loss(model, x, y)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    opt.step()
    params = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return float(loss.detach()), grads, params


class _CountCollectives:
    """Counts collectives, forward and backward: functional ones (what DTensor redistributions
    issue) and c10d ones (FSDP2's all-gathers and reduce-scatters).
    (CommDebugMode's module tracker fails on modules with hooks that replace their inputs.)"""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        counts: dict[str, int] = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace in ("_c10d_functional", "c10d") and func.__name__.split(".")[0] != "wait_tensor":
                    name = func.__name__.split(".")[0]
                    counts[name] = counts.get(name, 0) + 1
                return func(*args, **(kwargs or {}))
        self.counts, self._mode = counts, Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def assert_matches_reference(loss, grads: dict, params: dict, ref_loss, ref_grads: dict, ref_params: dict) -> None:
    """A sharded step's loss, full gradients and updated parameters equal the single-device step's."""
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **GRAD_TOL, msg=lambda m, n=n: f"grad {n}: {m}")
    for n in ref_params:
        torch.testing.assert_close(params[n], ref_params[n], **PARAM_TOL, msg=lambda m, n=n: f"param {n}: {m}")


def step_matches_reference(pm, ref, x, y, loss) -> dict:
    """After `pm.forward_backward(x, y)` gave `loss`: one AdamW step on `pm`, the same step of the
    single-device `ref` on the same batch, and assert_matches_reference; the full gradients."""
    grads = pm.full_grads()
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    opt.step()
    params = pm.full_state_dict()
    ref_loss, ref_grads, ref_params = reference(ref, x, y)
    assert_matches_reference(loss, grads, params, ref_loss, ref_grads, ref_params)
    return {"grads": grads, "ref_loss": ref_loss}


def equivalence(rank: int, world: int, case: dict) -> dict:
    """Run one plan sharded and unsharded; raise AssertionError on any mismatch."""
    from meshplan.runtime import parallelize
    torch.manual_seed(0)
    model = build_model(case["model"], seq_len=case["seq_len"])
    ref = copy.deepcopy(model)
    x, y = batch(case["global_batch"], case["seq_len"])
    # fused_kernels=True: swap every kernel the plan lists (on CPU "auto" swaps none: slower)
    pm = parallelize(model, case["plan"], compute_dtype=None, overlap=case.get("overlap", True),
                     fused_kernels=case.get("fused_kernels", True))
    if case.get("count_comm"):
        with _CountCollectives() as counter:
            loss = pm.forward_backward(x, y)
        counts = counter.counts
    else:
        loss, counts = pm.forward_backward(x, y), None
    grads = pm.full_grads()
    norm = pm.clip_grad_norm(None)          # measures only: the optimizer step below is unchanged
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS)
    opt.step()
    params = pm.full_state_dict()
    ref_loss, ref_grads, ref_params = reference(ref, x, y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads), (sorted(set(grads) ^ set(ref_grads)))
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **GRAD_TOL, msg=lambda m, n=n: f"grad {n}: {m}")
    for n in ref_params:
        torch.testing.assert_close(params[n], ref_params[n], **PARAM_TOL, msg=lambda m, n=n: f"param {n}: {m}")
    # the global gradient norm counts every shard once (tied weights once, as named_parameters does)
    ref_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())))
    torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-7, msg=lambda m: f"grad norm: {m}")
    worst = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
    return {"loss": loss, "ref_loss": ref_loss, "max_grad_err": worst, "fused": list(pm.fused_modules),
            "data_parallel": pm.data_parallel, "comm": counts}


def expect_error(rank: int, world: int, case: dict) -> dict:
    """parallelize must refuse a mismatched plan before any collective (no hang)."""
    from meshplan.runtime import parallelize
    model = build_model(case["model"], seq_len=case["seq_len"])
    if case.get("change_model"):
        model.layers[0].attention.wq = torch.nn.Linear(model.config.hidden, model.config.hidden + 8, bias=False)
    try:
        parallelize(model, case["plan"], compute_dtype=None)
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None}


def train_steps(rank: int, world: int, case: dict) -> dict:
    """A few optimizer steps on one repeated batch with the plan's own precision: loss must fall."""
    from meshplan.runtime import parallelize
    model = build_model(case["model"], seq_len=case["seq_len"])
    pm = parallelize(model, case["plan"])
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    x, y = batch(case["global_batch"], case["seq_len"], pad=False)
    losses = []
    for _ in range(case.get("steps", 6)):
        losses.append(pm.forward_backward(x, y))
        opt.step()
        pm.zero_grad()
    return {"losses": losses, "data_parallel": pm.data_parallel}


def run_cases(rank: int, world: int, cases: dict) -> dict:
    """Several cases in one process group (spawning costs seconds); errors are reported per case."""
    from worlds import each_case
    kinds = {"error": expect_error, "train": train_steps}
    return each_case(rank, cases, lambda name, case: kinds.get(case.get("kind"), equivalence)(rank, world, case))
