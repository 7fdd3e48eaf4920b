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


# model-parallel layouts asked of the planner on 4 processes (dp fills the rest); MoE models also
# with experts split, alone and folded with TP
FIXED = {"tp2": dict(tp=2, dp=2, pp=1, cp=1), "pp2": dict(pp=2, dp=2, tp=1, cp=1),
         "cp2": dict(cp=2, dp=2, tp=1, pp=1)}
FIXED_MOE = {"ep2": dict(ep=2, dp=4, tp=1, pp=1, cp=1), "ep2tp2": dict(ep=2, tp=2, dp=2, pp=1, cp=1)}
# what the runtime must run for these models (a refusal here is a regression, not a clean answer)
MUST_RUN = {"tiny-llama": {"tp2", "pp2", "cp2"}, "tiny-gpt": {"tp2", "pp2"}, "tiny-moe": {"tp2", "pp2", "ep2", "ep2tp2"},
            "hf-llama": {"tp2", "pp2"}, "hf-phi3": {"tp2", "pp2"}, "hf-gpt2": {"tp2", "pp2"},
            "hf-mixtral": {"ep2", "ep2tp2"}, "hf-qwen2-moe": {"tp2", "ep2", "ep2tp2"}}


def _step_batch(seq: int, batch: int):
    import torch
    ids = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(5))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _check_losses(cases: list, losses: dict) -> None:
    """Each case's loss on 4 ranks equals the single-device model's."""
    import torch.nn.functional as F

    from meshplan.runtime.pipeline import logits_of
    want = {}
    for name, kind, plan, seq, x, y in cases:
        if kind not in want:
            model = fake_world.step_model(kind, seq)
            want[kind] = float(F.cross_entropy(logits_of(model(x)).flatten(0, -2).float(), y.flatten()).detach())
        assert losses[name] == pytest.approx(want[kind], rel=1e-4), (name, plan.layout.short())


def test_small_plans_run_a_step_with_the_single_device_loss():
    """The plans the planner returns for the small models on 4 local CPU processes run a real
    training step on 4 gloo ranks (one spawn for all of them), with the single-device loss."""
    from meshplan.train.spawn import run_ranks
    seq, batch = 64, 8
    x, y = _step_batch(seq, batch)
    cases = []
    for kind in STEP_MODELS:
        plan = mp.plan(fake_world.build(kind, seq), mp.Cluster.preset("local-cpu"), seq_len=seq, global_batch=batch)
        cases.append((kind, kind, plan, seq, x, y))
    _check_losses(cases, run_ranks(4, fake_world.step_run, cases, timeout_s=400)[0])


def test_model_parallel_plans_run_a_step_with_the_single_device_loss():
    """The planner's free choice on 4 CPU processes is mostly DP4; here each small model is planned
    with tensor, pipeline, context and (MoE) expert parallelism fixed. Whatever plan comes back
    runs a step with the single-device loss; a layout the planner will not return must be refused
    by `plan` with the reason (never by the runtime), and the layouts in MUST_RUN must come back."""
    from meshplan.errors import MeshplanError
    from meshplan.train.spawn import run_ranks
    seq, batch = 64, 8
    x, y = _step_batch(seq, batch)
    cases, refused = [], {}
    for kind in STEP_MODELS:
        model = fake_world.build(kind, seq)
        layouts = {**FIXED, **(FIXED_MOE if "moe" in kind or "mixtral" in kind else {})}
        for name, fixed in layouts.items():
            try:
                plan = mp.plan(model, mp.Cluster.preset("local-cpu"), seq_len=seq, global_batch=batch, fixed=fixed)
            except MeshplanError as e:
                refused[f"{kind}/{name}"] = str(e)
                continue
            assert {k: getattr(plan.layout, k) for k in fixed} == fixed, (kind, name, plan.layout.short())
            cases.append((f"{kind}/{name}", kind, plan, seq, x, y))
    for kind, names in MUST_RUN.items():
        for name in names:
            assert f"{kind}/{name}" not in refused, (kind, name, refused.get(f"{kind}/{name}"))
    print("refused by the planner:", *(f"{k}: {v[:160]}" for k, v in sorted(refused.items())), sep="\n  ")
    _check_losses(cases, run_ranks(4, fake_world.step_run, cases, timeout_s=500)[0])
