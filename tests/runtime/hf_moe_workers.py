"""Workers for expert parallelism on transformers MoE models (imported by spawned ranks; see
test_hf_moe_ep.py). Tolerances are numerics.py's (fp32; sums reordered by the EP regroup)."""

from __future__ import annotations


import ep_workers
import numerics
import torch

SEQ, BATCH = 32, 8


def build_model(kind: str):
    """Tiny transformers MoEs (4 experts, top-2, hidden 64, 2 layers, SDPA), the same weights on
    every rank."""
    import transformers as tf
    torch.manual_seed(1234)
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=SEQ, tie_word_embeddings=False)
    if kind == "hf-mixtral":
        cfg = tf.MixtralConfig(intermediate_size=32, num_local_experts=4, **common)
    elif kind == "hf-qwen2-moe":
        cfg = tf.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                num_experts=4, **common)
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "sdpa"
    model = tf.AutoModelForCausalLM.from_config(cfg)
    model.config.use_cache = False
    return model


def experts_alone(rank: int, world: int) -> dict:
    """One experts module split over ep ranks vs the whole module: output, input and weight
    gradients, with an uneven routing (one expert gets no token)."""
    from torch.distributed.tensor import DTensor
    model = build_model("hf-mixtral")
    ref = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(7 + 3 * rank, 64, generator=g)
    idx = torch.randint(0, 3, (x.shape[0], 2), generator=g)        # expert 3 never chosen
    w = torch.rand(x.shape[0], 2, generator=g)
    up = torch.randn(x.shape[0], 64, generator=g)
    xr = x.clone().requires_grad_(True)
    ref(xr, idx, w).backward(up)
    experts = ep_workers.experts_alone_over_ep(ref, world)
    gu = experts.gate_up_proj
    assert isinstance(gu, DTensor) and gu.to_local().shape == (4 // world, 64, 64)
    xe = x.clone().requires_grad_(True)
    out = experts(xe, idx, w)
    torch.testing.assert_close(out, ref(x, idx, w), **numerics.GRAD_TOL)
    out.backward(up)
    torch.testing.assert_close(xe.grad, xr.grad, **numerics.GRAD_TOL)
    # every rank's tokens reach every expert: the full weight gradient sums the ranks' references
    import torch.distributed as dist
    for n, p in ref.named_parameters():
        want = p.grad.clone()
        dist.all_reduce(want)
        got = getattr(experts, n).grad.full_tensor()
        torch.testing.assert_close(got, want, **numerics.GRAD_TOL, msg=lambda m, n=n: f"grad {n}: {m}")
    return {"local_experts": int(gu.to_local().shape[0])}


def equivalence(rank: int, world: int, case: dict) -> dict:
    """Loss, every full gradient, the gradient norm and the weights after one AdamW step vs the
    single-device model."""
    from torch.distributed.tensor import DTensor
    torch.manual_seed(0)
    pm, loss, norm, ref_loss, ref_norm = ep_workers.step_and_compare(build_model(case["model"]), case["plan"])
    # the experts' weights are DTensors over the ep mesh: this rank's block of experts
    local, shared = {}, []
    for n, p in pm.named_parameters():
        if n.endswith("experts.gate_up_proj"):
            assert isinstance(p, DTensor), (n, type(p))
            local[n] = tuple(ep_workers._local(p).shape)
        if ".mlp.shared_expert" in n:
            # replicated over TP: no tp dim among its placements (FSDP may still cut it over dp)
            names = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else ()
            shared.append("tp" not in (names or ()) or p.placements[names.index("tp")].is_replicate())
    return {"loss": loss, "ref_loss": ref_loss, "norm": norm, "local_experts": local,
            "shared_whole": bool(shared) and all(shared)}


def run_cases(rank: int, world: int, cases: dict) -> dict:
    def one(name, case):
        if case.get("kind") == "experts":
            return experts_alone(rank, world)
        return equivalence(rank, world, case)
    return ep_workers.each_case(rank, cases, one)
