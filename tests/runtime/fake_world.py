"""Run `parallelize` for a real plan at its real world size in one process (torch's fake process
group: collectives are no-ops, the model stays on the meta device), and count what one rank holds."""

from __future__ import annotations

import torch
import torch.distributed as dist


def local_state(model, plan, rank: int) -> dict:
    """Parameters this rank holds after `parallelize` (elements), and its pipeline rank."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshplan.runtime.parallel import parallelize
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        pm = parallelize(model, plan, materialize=False)
        held = 0
        for st in pm.stages:
            for p in st.parameters():
                held += (p.to_local() if hasattr(p, "to_local") else p).numel()
        pp_rank = pm.mesh["pp"].get_local_rank()
    finally:
        dist.destroy_process_group()
    return {"params": held, "pp_rank": pp_rank}


def predicted_optimizer_bytes(plan, pp_rank: int) -> float:
    """The cost model's optimizer state (fp32 master + Adam moments) on pipeline rank `pp_rank`."""
    return plan.estimate.memory_by_stage[pp_rank]["optimizer"] * 2**30


def optimizer_bytes_per_param(plan) -> int:
    return 4 + 2 * (2 if plan.layout.optimizer_dtype == "bf16" else 4)


def check(model_name: str, cluster, *, seq_len: int, global_batch: int, ranks=(0, -1), fixed=None,
          tol: float = 0.05, overrides: dict | None = None) -> list[dict]:
    import meshplan as mp
    overrides = overrides or {}
    model = mp.models.build(model_name, device="meta", **overrides)
    plan = mp.plan(model, cluster, seq_len=seq_len, global_batch=global_batch, fixed=fixed)
    out = []
    for r in ranks:
        rank = r % plan.world_size
        got = local_state(mp.models.build(model_name, device="meta", **overrides), plan, rank)
        runtime = got["params"] * optimizer_bytes_per_param(plan)
        predicted = predicted_optimizer_bytes(plan, got["pp_rank"])
        out.append(dict(model=model_name, world=plan.world_size, layout=plan.layout.short(),
                        rank=rank, runtime_gb=runtime / 1e9, predicted_gb=predicted / 1e9,
                        error=abs(runtime - predicted) / predicted))
    return out


# ---- the plan matrix: every plan the planner returns must be accepted by the runtime ---------
def hf_model(kind: str, *, device: str = "meta", seq_len: int = 4096):
    """Small transformers models of the families users bring, built from configs (no download)."""
    import transformers as tf
    common = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
                  max_position_embeddings=seq_len, tie_word_embeddings=False, pad_token_id=0)
    cfgs = {
        "hf-llama": lambda: tf.LlamaConfig(intermediate_size=384, num_key_value_heads=4, **common),
        "hf-qwen2": lambda: tf.Qwen2Config(intermediate_size=384, num_key_value_heads=4, **common),
        "hf-mistral": lambda: tf.MistralConfig(intermediate_size=384, num_key_value_heads=4, **common),
        "hf-phi3": lambda: tf.Phi3Config(intermediate_size=384, num_key_value_heads=8, **common),
        "hf-gpt2": lambda: tf.GPT2Config(vocab_size=512, n_embd=128, n_layer=4, n_head=8, n_positions=seq_len,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "hf-mixtral": lambda: tf.MixtralConfig(intermediate_size=256, num_key_value_heads=4, num_local_experts=4,
                                               num_experts_per_tok=2, **common),
        "hf-qwen2-moe": lambda: tf.Qwen2MoeConfig(intermediate_size=256, moe_intermediate_size=128,
                                                  shared_expert_intermediate_size=256, num_experts=4,
                                                  num_experts_per_tok=2, num_key_value_heads=4, **common),
    }
    cfg = cfgs[kind]()
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg)
    model.config.use_cache = False
    return model


def user_model(device: str = "meta"):
    """examples/my_model.py: a user's GPT with a fused QKV projection."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "examples" / "my_model.py"
    spec = importlib.util.spec_from_file_location("my_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with torch.device(device):
        return mod.build()


def build(kind: str, seq_len: int):
    import meshplan as mp
    if kind.startswith("hf-"):
        return hf_model(kind, seq_len=seq_len)
    if kind == "my_model":
        return user_model()
    return mp.models.build(kind, device="meta", **({"seq_len": seq_len} if kind.startswith("tiny") else {}))


def accepted(kind: str, cluster, *, seq_len: int, global_batch: int) -> dict:
    """Plan `kind` for `cluster`; run `parallelize` for rank 0 at the plan's world size (fake
    process group, meta device). {"status": "accepted"|"no plan"|"refused", ...}."""
    import meshplan as mp
    from meshplan.errors import MeshplanError
    try:
        plan = mp.plan(build(kind, seq_len), cluster, seq_len=seq_len, global_batch=global_batch)
    except MeshplanError as e:        # nothing fits / nothing runs: a clean answer, not a contract break
        return {"status": "no plan", "why": str(e)[:200]}
    layout = plan.layout.short()
    try:
        local_state(build(kind, seq_len), plan, 0)
    except Exception as e:  # noqa: BLE001 - any refusal or crash is a contract break
        return {"status": "refused", "layout": layout, "why": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"status": "accepted", "layout": layout}


# ---- small plans run a real training step on gloo ---------------------------------------------

def step_model(kind: str, seq_len: int):
    """`kind` built on the CPU with seeded initial weights (the same on every rank and in the test)."""
    import meshplan as mp
    torch.manual_seed(0)
    if kind.startswith("hf-"):
        return hf_model(kind, device="cpu", seq_len=seq_len)
    if kind == "my_model":
        return user_model("cpu")
    model = mp.models.build(kind, device="cpu", seq_len=seq_len)
    model.init_weights()
    return model


def step_run(rank: int, world: int, cases: list) -> dict:
    """One forward/backward of each (name, kind, plan, seq_len, x, y) case on this group; losses by
    name (a case that raised: {"error", "tb"}, see worlds.each_case)."""
    from meshplan.runtime.parallel import parallelize
    from worlds import each_case

    def one(name, case):
        _, kind, plan, seq_len, x, y = case
        pm = parallelize(step_model(kind, seq_len), plan, compute_dtype=None, fused_kernels=False)
        return pm.forward_backward(x, y)
    return each_case(rank, {c[0]: c for c in cases}, one)


if __name__ == "__main__":      # the full matrix, one JSON line per case and a summary
    import collections
    import json
    import time

    import meshplan as mp
    models = ["tiny-llama", "tiny-gpt", "tiny-moe", "llama3-8b", "llama3-70b", "mixtral-8x7b", "hf-llama",
              "hf-qwen2", "hf-mistral", "hf-phi3", "hf-gpt2", "hf-mixtral", "hf-qwen2-moe", "my_model"]
    clusters = {"local-cpu-4": lambda: mp.Cluster.preset("local-cpu"),
                "local-cpu-8": lambda: mp.Cluster.preset("local-cpu", nproc=8),
                "dgx-h100x1": lambda: mp.Cluster.preset("dgx-h100", nodes=1),
                "dgx-h100x8": lambda: mp.Cluster.preset("dgx-h100", nodes=8),
                "dgx-h100x64": lambda: mp.Cluster.preset("dgx-h100", nodes=64),
                "gb200-nvl72": lambda: mp.Cluster.preset("gb200-nvl72", nodes=18)}
    counts = collections.Counter()
    for m in models:
        for name, make in clusters.items():
            for seq in (4096, 32768, 131072):
                t0 = time.time()
                cl = make()
                r = accepted(m, cl, seq_len=seq, global_batch=max(64, cl.num_gpus))
                counts[r["status"]] += 1
                print(json.dumps(dict(model=m, cluster=name, seq=seq, s=round(time.time() - t0, 1), **r)), flush=True)
    print(f"{sum(counts.values())} cases: {dict(counts)}")
