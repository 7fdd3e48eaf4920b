"""The memory the cost model charges on the meshplan stack, term by term, against the bytes meshplan's
runtime holds: a small Llama (the GPU suite's llama3-8b shape at a small width) planned on one rank,
parallelized and trained one step on CPU (gloo, one process), its tensors counted.

- optimizer: the fp32 parameters (the main copy, Stack.master_weights="params") + AdamW's moments;
- gradients: all of them after backward, and those alive when the backward reaches the last block
  (with one micro-batch a step the estimate charges only those beside the activations);
- weights: the bf16 copies of the weights the blocks save for backward under autocast, in a BF16 plan
  and in one whose first layer runs torchao FP8 linears (which save the fp32 parameter instead);
- activations: what each block saves for backward, within a few %.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.distributed as dist

import meshplan as mp
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.memory import grad_store_bytes, state_bytes
from meshplan.cost_models.tables import layer_table
from meshplan.ir.estimate import GB
from meshplan.ir.precision import Precision
from meshplan.ir.stack import Stack

SHAPE = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn_hidden": 1024, "vocab": 2048}
SEQ, BATCH = 128, 4
LAYOUT = {"dp": 1, "zero": 1, "mbs": BATCH, "recompute": "none"}
STACK = Stack.preset("meshplan")
LAYER0_LINEARS = tuple(f"layers.0.{n}" for n in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _run_step(plan, cfg, *, fp8: bool = False) -> dict:
    """One forward + backward + AdamW step of `plan` through meshplan's runtime; what it held."""
    torch.manual_seed(0)
    model = mp.models.build(cfg, device="cpu")
    model.init_weights()
    kw = {"fp8_backend": "torchao"} if fp8 else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)        # "FP8 is emulated" on CPU
        pm = mp.parallelize(model, plan, **kw)
    stage = pm.stages[0]
    params = list(pm.parameters())
    param_keys = {_storage(p) for p in params}
    buffer_keys = {_storage(b) for b in stage.buffers()}     # rotary tables: model state, not activations
    blocks = dict(stage.layers.named_children())
    weight_shapes = {name: {tuple(m.weight.shape) for m in blk.modules() if isinstance(m, torch.nn.Linear)}
                     for name, blk in blocks.items()}
    saved: dict[str, dict[int, tuple[int, torch.dtype, tuple]]] = {}
    where = ["outside"]
    hooks = []
    for name, blk in blocks.items():
        hooks.append(blk.register_forward_pre_hook(lambda _m, _a, n=name: where.__setitem__(0, n)))
        hooks.append(blk.register_forward_hook(lambda _m, _a, _o: where.__setitem__(0, "outside")))
    grads_at_last_block: list[int] = []

    def on_last_output(_m, _a, out):
        # fires when the backward reaches the last block's output: the head's gradients are in by then
        out.register_hook(lambda g: grads_at_last_block.append(
            sum(p.grad.nbytes for p in params if p.grad is not None)))
    hooks.append(blocks[max(blocks, key=int)].register_forward_hook(on_last_output))

    def pack(t):
        data = getattr(t, "_data", t)       # a torchao FP8 tensor's payload
        key = _storage(data)
        if key not in param_keys and key not in buffer_keys:
            saved.setdefault(where[0], {})[key] = (data.untyped_storage().nbytes(), data.dtype, tuple(t.shape))
        return t

    ids = torch.randint(0, cfg.vocab, (BATCH, SEQ + 1))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm.forward_backward(ids[:, :-1], ids[:, 1:])
    for h in hooks:
        h.remove()
    grads = sum(p.grad.nbytes for p in params if p.grad is not None)
    opt.step()
    moments = sum(s[k].nbytes for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    pm.zero_grad()
    copies, activations = {}, {}
    for name, held in saved.items():
        if name == "outside":
            continue
        is_copy = [v for v in held.values() if v[1] == torch.bfloat16 and len(v[2]) == 2
                   and (v[2] in weight_shapes[name] or v[2][::-1] in weight_shapes[name])]
        copies[name] = sum(v[0] for v in is_copy)
        activations[name] = sum(v[0] for v in held.values()) - copies[name]
    return {"params": sum(p.nbytes for p in params), "param_dtypes": {p.dtype for p in params},
            "grads": grads, "moments": moments, "grads_at_last_block": grads_at_last_block[0],
            "copies": copies, "activations": activations, "elements": sum(p.numel() for p in params)}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1),
                            rank=0, world_size=1)
    cfg = mp.models.config("llama3-8b", **SHAPE)
    meta = mp.models.build(cfg, device="meta")
    plan = mp.plan(meta, mp.Cluster.preset("local-cpu", nproc=1), seq_len=SEQ, global_batch=BATCH,
                   precision="bf16", fixed=LAYOUT, stack=STACK)
    prof = mp.profile(meta, seq_len=SEQ)
    yield {"cfg": cfg, "plan": plan, "profile": prof, "bf16": _run_step(plan, cfg),
           "fp8": _run_step(dataclasses.replace(plan, precision=Precision.FP8, fp8_modules=LAYER0_LINEARS),
                            cfg, fp8=True)}
    dist.destroy_process_group()


def _estimate(world, precision: str = "bf16", fp8_modules=None) -> dict[str, float]:
    # an FP8-capable GPU prices the FP8 variant; the memory terms compared do not depend on the GPU
    est = estimate_profile(world["profile"], mp.Cluster(gpu="h200", gpus_per_node=1, nodes=1),
                           world["plan"].layout, seq_len=SEQ, global_batch=BATCH, precision=precision,
                           fp8_modules=fp8_modules, stack=STACK)
    return {k: v * GB for k, v in est.memory_gb.items()}


def test_the_plan_runs_on_autocast_over_fp32_parameters(world):
    # the runtime path these terms describe: one data-parallel rank, no FSDP wrapper
    assert world["plan"].layout.dp == 1 and world["plan"].layout.recompute == "none"
    assert world["bf16"]["param_dtypes"] == {torch.float32}


def test_optimizer_term_is_the_fp32_parameters_and_adamw_moments(world):
    held = world["bf16"]["params"] + world["bf16"]["moments"]
    assert _estimate(world)["optimizer"] == pytest.approx(held, rel=1e-12)


def test_gradient_terms_are_the_held_gradients(world):
    run, L = world["bf16"], world["plan"].layout
    # all of them, in the fp32 parameters' dtype, after backward
    full = state_bytes(run["elements"], 1, L.zero, grad_bytes=grad_store_bytes(L, STACK))["gradients"]
    assert full == run["grads"]
    # beside the activations (one micro-batch a step): only the output layer's and final norm's
    assert _estimate(world)["gradients"] == pytest.approx(run["grads_at_last_block"], rel=1e-12)
    assert 0 < run["grads_at_last_block"] < run["grads"] / 2


def test_weights_term_is_the_bf16_copies_the_blocks_keep(world):
    assert _estimate(world)["weights"] == pytest.approx(sum(world["bf16"]["copies"].values()), rel=1e-12)
    assert all(world["bf16"]["copies"].values())


def test_torchao_fp8_linears_keep_no_weight_copy(world):
    run = world["fp8"]
    assert run["copies"]["0"] == 0 and run["copies"]["1"] == world["bf16"]["copies"]["1"]
    est = _estimate(world, "fp8", frozenset(LAYER0_LINEARS))
    assert est["weights"] == pytest.approx(sum(run["copies"].values()), rel=1e-12)
    assert est["fp8_cache"] == 0.0


def test_each_block_saves_what_the_activation_term_charges(world):
    table = layer_table(world["profile"], mp.Cluster(gpu="h200", gpus_per_node=1, nodes=1),
                        world["plan"].layout, seq_len=SEQ, stack=STACK)
    for i, got in world["bf16"]["activations"].items():
        assert got == pytest.approx(table.act(int(i), "none"), rel=0.01), i
