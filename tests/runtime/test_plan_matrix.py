"""Every plan `meshplan.plan` returns is accepted by `parallelize` at the world size it was
planned for: preset models (dense, MoE, GPT with tied embeddings), transformers models built
from configs, a user's model with a fused QKV projection; small CPU clusters and H100 clusters;
short and long sequences. Each plan is applied for rank 0 through torch's fake process group on
the meta device (fake_world.accepted). "no plan" (nothing fits, with the planner's reason) is a
clean answer; a refusal or crash of the runtime fails the test. The full matrix (14 models x 6
clusters x 3 lengths) runs with `python tests/runtime/fake_world.py`."""

from __future__ import annotations

import pytest

import fake_world
import meshplan as mp

MODELS = ["tiny-llama", "tiny-gpt", "tiny-moe", "hf-llama", "hf-phi3", "hf-gpt2", "hf-mixtral",
          "hf-qwen2-moe", "my_model", "llama3-8b", "mixtral-8x7b"]
CLUSTERS = {"local-cpu-4": lambda: mp.Cluster.preset("local-cpu"),
            "dgx-h100x8": lambda: mp.Cluster.preset("dgx-h100", nodes=8)}


@pytest.mark.slow
@pytest.mark.parametrize("cluster", sorted(CLUSTERS))
@pytest.mark.parametrize("model", MODELS)
def test_every_plan_runs(model, cluster):
    cl = CLUSTERS[cluster]()
    for seq in (4096, 131072):
        r = fake_world.accepted(model, cl, seq_len=seq, global_batch=max(64, cl.num_gpus))
        assert r["status"] in ("accepted", "no plan"), (model, cluster, seq, r)


STEP_MODELS = ["tiny-llama", "tiny-gpt", "tiny-moe", "hf-llama", "hf-phi3", "hf-gpt2", "hf-mixtral",
               "hf-qwen2-moe"]


def test_small_plans_run_a_step_with_the_single_device_loss():
    """The plans the planner returns for the small models on 4 local CPU processes run a real
    training step on 4 gloo ranks (one spawn for all of them), with the single-device loss."""
    import torch
    import torch.nn.functional as F

    from meshplan.runtime.pipeline import logits_of
    from meshplan.train.spawn import run_ranks
    seq, batch = 64, 8
    ids = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(5))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    cases, layouts = [], {}
    for kind in STEP_MODELS:
        plan = mp.plan(fake_world.build(kind, seq), mp.Cluster.preset("local-cpu"), seq_len=seq, global_batch=batch)
        layouts[kind] = plan.layout.short()
        cases.append((kind, plan, seq, x, y))
    losses = run_ranks(4, fake_world.step_run, cases, timeout_s=400)[0]
    for kind in STEP_MODELS:
        model = fake_world.step_model(kind, seq)
        want = F.cross_entropy(logits_of(model(x)).flatten(0, -2).float(), y.flatten())
        assert losses[kind] == pytest.approx(float(want), rel=1e-4), (kind, layouts[kind])
