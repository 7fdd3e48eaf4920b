"""Every plan `meshplan.plan` returns is accepted by `parallelize` at the world size it was
planned for: preset models (dense, MoE, GPT with tied embeddings), transformers models built
from configs, a user's model with a fused QKV projection; small CPU clusters and H100 clusters;
short and long sequences. Each plan is applied for rank 0 through torch's fake process group on
the meta device (fake_world.accepted). "no plan" (nothing fits, with the planner's reason) is a
clean answer; a refusal or crash of the runtime fails the test. The full matrix (14 models x 6
clusters x 3 lengths) runs with `python tests/runtime/fake_world.py`. The matrix here is planned
and applied in two processes side by side (planning is CPU-bound and single-threaded), and each
case reads its result.

The small models' plans for 4 local CPU processes then run a real training step on 4 gloo ranks:
one spawned group (`world4`) runs both the planner's free choices and the model-parallel layouts
(each test reads its own cases' losses)."""

from __future__ import annotations

import pytest

import fake_world
import meshplan as mp

MODELS = ["tiny-llama", "tiny-gpt", "tiny-moe", "hf-llama", "hf-phi3", "hf-gpt2", "hf-mixtral",
          "hf-qwen2-moe", "my_model", "llama3-8b", "mixtral-8x7b"]
CLUSTERS = {"local-cpu-4": lambda: mp.Cluster.preset("local-cpu"),
            "dgx-h100x8": lambda: mp.Cluster.preset("dgx-h100", nodes=8)}


SEQS = (4096, 131072)


def _matrix_case(item) -> dict:
    """fake_world.accepted's answer for one (model, cluster, sequence length)."""
    model, cluster, seq = item
    cl = CLUSTERS[cluster]()
    return fake_world.accepted(model, cl, seq_len=seq, global_batch=max(64, cl.num_gpus))


@pytest.fixture(scope="module")
def matrix():
    from worlds import in_processes
    items = [(model, cluster, seq) for model in MODELS for cluster in sorted(CLUSTERS) for seq in SEQS]
    return dict(zip(items, in_processes(_matrix_case, items)))


@pytest.mark.slow
@pytest.mark.parametrize("cluster", sorted(CLUSTERS))
@pytest.mark.parametrize("model", MODELS)
def test_every_plan_runs(matrix, model, cluster):
    for seq in SEQS:
        r = matrix[(model, cluster, seq)]
        assert "error" not in r, f"{model}, {cluster}, seq {seq}: {r['error']}\n{r['tb']}"
        assert r["ok"]["status"] in ("accepted", "no plan"), (model, cluster, seq, r["ok"])


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
        got = losses[name]
        assert not isinstance(got, dict), f"{name} ({plan.layout.short()}): {got['error']}\n{got['tb']}"
        if kind not in want:
            model = fake_world.step_model(kind, seq)
            want[kind] = float(F.cross_entropy(logits_of(model(x)).flatten(0, -2).float(), y.flatten()).detach())
        assert got == pytest.approx(want[kind], rel=1e-4), (name, plan.layout.short())


SEQ, BATCH = 64, 8


def _plans(kind: str) -> dict:
    """One small model's plans on 4 local CPU processes: the planner's free choice, and the model
    planned with tensor, pipeline, context and (MoE) expert parallelism fixed - the cases that
    came back, {case: the planner's reason} for the layouts it refused, and the cases whose plan
    has another layout than the one fixed."""
    from meshplan.errors import MeshplanError
    from worlds import traced_once
    x, y = _step_batch(SEQ, BATCH)
    model = fake_world.build(kind, SEQ)
    cluster = mp.Cluster.preset("local-cpu")
    with traced_once():             # one model, many layouts: traced once
        out = {"free": (f"free/{kind}", kind, mp.plan(model, cluster, seq_len=SEQ, global_batch=BATCH), SEQ, x, y),
               "parallel": [], "refused": {}, "other": []}
        layouts = {**FIXED, **(FIXED_MOE if "moe" in kind or "mixtral" in kind else {})}
        for name, fixed in layouts.items():
            try:
                plan = mp.plan(model, cluster, seq_len=SEQ, global_batch=BATCH, fixed=fixed)
            except MeshplanError as e:
                out["refused"][f"{kind}/{name}"] = str(e)
                continue
            if {k: getattr(plan.layout, k) for k in fixed} != fixed:
                out["other"].append((kind, name, plan.layout.short()))
            out["parallel"].append((f"{kind}/{name}", kind, plan, SEQ, x, y))
    return out


@pytest.fixture(scope="module")
def world4():
    """One spawned group of 4 gloo ranks runs a training step of every case of the two tests
    below: {case name: loss}, and the cases."""
    from meshplan.train.spawn import run_ranks
    from worlds import in_processes
    small, parallel, refused, other = [], [], {}, []
    for kind, r in zip(STEP_MODELS, in_processes(_plans, STEP_MODELS)):     # planning: two processes
        assert "error" not in r, f"planning {kind}: {r['error']}\n{r['tb']}"
        small.append(r["ok"]["free"])
        parallel += r["ok"]["parallel"]
        refused.update(r["ok"]["refused"])
        other += r["ok"]["other"]
    losses = run_ranks(4, fake_world.step_run, small + parallel, timeout_s=500)[0]
    return losses, small, parallel, refused, other


def test_small_plans_run_a_step_with_the_single_device_loss(world4):
    """The plans the planner returns for the small models on 4 local CPU processes run a real
    training step on 4 gloo ranks, with the single-device loss."""
    losses, small, _, _, _ = world4
    _check_losses(small, losses)


def test_model_parallel_plans_run_a_step_with_the_single_device_loss(world4):
    """The planner's free choice on 4 CPU processes is mostly DP4; here each small model is planned
    with tensor, pipeline, context and (MoE) expert parallelism fixed. Whatever plan comes back
    runs a step with the single-device loss; a layout the planner will not return must be refused
    by `plan` with the reason (never by the runtime), and the layouts in MUST_RUN must come back."""
    losses, _, cases, refused, other = world4
    assert not other, f"plans with another layout than the one fixed: {other}"
    for kind, names in MUST_RUN.items():
        for name in names:
            assert f"{kind}/{name}" not in refused, (kind, name, refused.get(f"{kind}/{name}"))
    print("refused by the planner:", *(f"{k}: {v[:160]}" for k, v in sorted(refused.items())), sep="\n  ")
    _check_losses(cases, losses)
