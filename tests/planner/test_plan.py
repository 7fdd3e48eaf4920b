"""meshplan.plan: search, Plan JSON round trip, fixed keys, explain, no-fit errors."""

from __future__ import annotations

import dataclasses

import pytest

import meshplan as mp
from meshplan.api import plan
from meshplan.cost_models.estimate import estimate_profile
from meshplan.errors import ConfigError, DoesNotFitError
from meshplan.profiling.analytic import profile_from_config
from meshplan.api import Plan

LLAMA70B = profile_from_config(dict(layers=80, hidden=8192, ffn_hidden=28672, heads=64, kv_heads=8, vocab=128256,
                                    name="llama3-70b"))
LLAMA8B = profile_from_config(dict(layers=32, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, vocab=128256,
                                   name="llama3-8b"))
MIXTRAL = profile_from_config(dict(layers=32, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, vocab=32000,
                                   experts=8, topk=2, moe_ffn_hidden=14336, name="mixtral-8x7b"))


@pytest.fixture(scope="module")
def p70():
    return plan(LLAMA70B, mp.Cluster.preset("dgx-h100", nodes=8), seq_len=8192, global_batch=512)


def test_plan_is_best_of_what_it_saw_and_fits(p70):
    est = p70.estimate
    assert est.fits and est.step_time_s > 0
    # a faster runner-up only when its gain is inside the uncertainty band (the planner
    # then keeps the simpler, better-validated layout and says so)
    assert all(r.step_time_s >= est.step_time_s or ("inside the band" in r.reason and p70.notes.band_choice)
               for r in p70.runner_ups if r.fits)
    assert p70.world_size == 64
    assert sum(len([m for m in s if m.startswith("layers.")]) for s in p70.stages) == 80


def test_plan_json_round_trip(p70):
    again = Plan.from_json(p70.to_json())
    assert again == p70
    assert again.to_json() == p70.to_json()


def test_fixed_layout_reproduces_estimate(p70):
    fixed = {k: getattr(p70.layout, k) for k in ("tp", "cp", "pp", "vp", "dp", "mbs", "recompute", "zero", "schedule")}
    again = plan(LLAMA70B, mp.Cluster.preset("dgx-h100", nodes=8), seq_len=8192, global_batch=512, fixed=fixed)
    direct = estimate_profile(LLAMA70B, mp.Cluster.preset("dgx-h100", nodes=8), p70.layout, seq_len=8192,
                              global_batch=512, stack=p70.stack)
    assert again.estimate.step_time_s == pytest.approx(direct.step_time_s)


def test_fixed_tp_is_honoured():
    pl = plan(LLAMA8B, mp.Cluster.preset("dgx-h100", nodes=1), seq_len=4096, global_batch=64, fixed={"tp": 4})
    assert pl.layout.tp == 4


def test_contradictory_fixed_named():
    cl = mp.Cluster.preset("dgx-h100", nodes=1)
    with pytest.raises(ConfigError, match="vp > 1 contradicts fixed pp = 1"):
        plan(LLAMA8B, cl, seq_len=4096, global_batch=64, fixed={"pp": 1, "vp": 2})
    with pytest.raises(ConfigError, match="does not divide the 8 GPUs"):
        plan(LLAMA8B, cl, seq_len=4096, global_batch=64, fixed={"tp": 3})
    with pytest.raises(ConfigError, match="fixable keys"):
        plan(LLAMA8B, cl, seq_len=4096, global_batch=64, fixed={"tensor": 2})


def test_no_fit_error_says_what_would_fit():
    huge = profile_from_config(dict(layers=126, hidden=16384, ffn_hidden=53248, heads=128, kv_heads=8,
                                    vocab=128256, name="llama3-405b"))
    with pytest.raises(DoesNotFitError) as e:
        plan(huge, mp.Cluster.preset("dgx-h100", nodes=1), seq_len=8192, global_batch=64)
    msg = str(e.value)
    assert "llama3-405b" in msg and "GB" in msg and "more GPUs" in msg


def test_no_mesh_error_names_the_divisibility_and_counts_that_work():
    """37 nodes of 8: no tp (dividing 8 KV heads) x cp x pp (<= 32 layers) leaves a data-parallel
    degree dividing the batch; the error says so (not "does not fit") and names counts that work."""
    from meshplan.errors import LayoutError
    cl = mp.Cluster(gpu="h100-sxm", num_gpus=296, gpus_per_node=8)
    with pytest.raises(LayoutError) as e:
        plan(LLAMA8B, cl, seq_len=4096, global_batch=64)
    msg = str(e.value)
    assert "can be formed on 296" in msg and "does not divide 64" in msg
    counts = [int(x) for x in msg.split("What would work: ")[1].split(" GPUs")[0].split(" or ")]
    assert counts and all(c % 8 == 0 and abs(c - 296) <= 64 for c in counts)
    for c in counts:     # each suggestion plans
        assert plan(LLAMA8B, mp.Cluster(gpu="h100-sxm", num_gpus=c, gpus_per_node=8), seq_len=4096,
                    global_batch=64).layout.world == c


def test_explain_mentions_breakdown_memory_runnerups(p70):
    text = p70.explain()
    for needle in ("Predicted step", "Memory per GPU", "Bottleneck", "Runner-ups", "compute"):
        assert needle in text


def test_auto_precision_on_h100_considers_fp8():
    pl = plan(LLAMA8B, mp.Cluster.preset("dgx-h100", nodes=1), seq_len=4096, global_batch=64, precision="auto")
    assert pl.precision == "fp8" and pl.fp8_modules


def test_moe_plan_uses_expert_parallelism():
    pl = plan(MIXTRAL, mp.Cluster.preset("dgx-h100", nodes=2), seq_len=4096, global_batch=128)
    assert pl.estimate.fits
    # the runtime runs EP only without TP (meshplan.ir.support), so the experts of every layer
    # are labelled for expert parallelism, by module name
    assert pl.layout.ep > 1 and pl.layout.tp == 1
    experts = {k for k, v in pl.placements.items() if v == "expert"}
    assert experts == {f"layers.{i}.moe.experts.{w}" for i in range(32) for w in ("w1", "w2", "w3")}


def test_plan_refuses_other_model_or_cluster(p70):
    with pytest.raises(ConfigError, match="made for model"):
        p70.check_matches(model_fingerprint="deadbeef")
    with pytest.raises(ConfigError, match="made for cluster"):
        p70.check_matches(cluster=mp.Cluster.preset("dgx-a100", nodes=8))
    with pytest.raises(ConfigError, match="needs 64 processes"):
        p70.check_matches(world_size=8)


def test_cli_plan_user_model_file_and_hf_config(tmp_path, capsys):
    from pathlib import Path

    from meshplan.cli import main
    root = Path(__file__).resolve().parents[2]
    out_json = tmp_path / "plan.json"
    assert main(["plan", "--model", f"{root}/examples/my_model.py:build", "--cluster", "dgx-h100", "--nodes", "1",
                 "--seq-len", "2048", "--global-batch", "32", "--json", str(out_json)]) == 0
    assert "Plan for GPT" in capsys.readouterr().out
    assert Plan.load(out_json).world_size == 8
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,'
                   ' "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024}')
    assert main(["plan", "--model", str(cfg), "--nodes", "1", "--seq-len", "1024", "--global-batch", "16"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    assert main(["plan", "--model", f"{root}/examples/my_model.py:nope"]) == 2
    assert "no function 'nope'" in capsys.readouterr().err


def test_partial_recompute_is_in_the_search_space():
    from meshplan.planner.search import _recompute_options
    opts = _recompute_options(LLAMA70B, pp=4)
    assert opts[0] == "none" and opts[-1] == "full" and any(isinstance(o, int) for o in opts)
    pl = plan(LLAMA70B, mp.Cluster.preset("dgx-h100", nodes=4), seq_len=4096, global_batch=64,
              fixed={"tp": 8, "pp": 4, "recompute": 10, "mbs": 1})
    assert pl.layout.recompute == 10


def test_stage_ilp_refinement_never_slower(p70):
    """The plan keeps the ILP's stage split only when the full estimate agrees it is faster."""
    from meshplan.planner.ilp.stage_refine import refine_stages
    lay = dataclasses.replace(p70.layout, stage_layers=None)
    even = estimate_profile(LLAMA70B, mp.Cluster.preset("dgx-h100", nodes=8), lay, seq_len=8192,
                            global_batch=512, stack=p70.stack)
    refined = refine_stages(LLAMA70B, mp.Cluster.preset("dgx-h100", nodes=8), even, seq_len=8192, global_batch=512,
                            stack=p70.stack)
    assert refined.step_time_s <= even.step_time_s and refined.fits
    assert p70.estimate.step_time_s <= even.step_time_s


def test_fp8_plan_keeps_first_last_blocks_and_head_in_bf16():
    pl = plan(LLAMA8B, mp.Cluster.preset("dgx-h100", nodes=1), seq_len=4096, global_batch=64, precision="fp8")
    assert pl.fp8_modules
    assert not any(m.startswith(("layers.0.", "layers.31.")) for m in pl.fp8_modules)
    assert "output" not in pl.fp8_modules


def test_traced_plan_placements_come_from_the_sharding_ilp():
    model = mp.models.build("llama3-8b", device="meta")
    pl = plan(model, mp.Cluster.preset("dgx-h100", nodes=1), seq_len=8192, global_batch=64,
              fixed={"tp": 8, "pp": 1, "cp": 1})
    # every layer's modules carry the ILP's labels, by FQN
    assert {v for k, v in pl.placements.items() if k.endswith(".attention.wq")} == {"colwise"}
    by_module = {k.split(".", 2)[2]: v for k, v in pl.placements.items() if k.startswith("layers.0.")}
    assert by_module["attention.wq"] == "colwise" and by_module["feed_forward.w1"] == "colwise"
    assert by_module["attention.wo"] == "rowwise" and by_module["feed_forward.w2"] == "rowwise"
    assert by_module["attention_norm"] == "sequence"


def test_fp8_estimate_costs_only_the_chosen_fp8_layers():
    cl = mp.Cluster.preset("dgx-h100", nodes=1)
    lay = {"tp": 1, "dp": 8, "mbs": 1}
    full = estimate_profile(LLAMA8B, cl, lay, seq_len=4096, global_batch=64, precision="fp8")
    bf16 = estimate_profile(LLAMA8B, cl, lay, seq_len=4096, global_batch=64, precision="bf16")
    some = estimate_profile(LLAMA8B, cl, lay, seq_len=4096, global_batch=64, precision="fp8",
                            fp8_modules=frozenset(f"layers.{i}.attention.wq" for i in range(1, 31)))
    none = estimate_profile(LLAMA8B, cl, lay, seq_len=4096, global_batch=64, precision="fp8", fp8_modules=frozenset())
    assert full.step_time_s < some.step_time_s < none.step_time_s
    assert none.time_s["compute"] == pytest.approx(bf16.time_s["compute"], rel=1e-6)


def test_sharding_ilp_failure_is_recorded_not_swallowed(monkeypatch):
    """An ILP that fails leaves the Megatron pattern in the plan AND says so (a silent fallback
    would hide that the placements are not the ILP's)."""
    from meshplan.errors import LayoutError
    from meshplan.planner import build

    def failing(*args, **kwargs):
        raise LayoutError("no feasible sharding for this block")
    monkeypatch.setattr(build, "shard_profile", failing)
    model = mp.models.build("tiny-llama", seq_len=64, device="meta")
    pl = plan(model, mp.Cluster.preset("local-cpu"), seq_len=64, global_batch=8, fixed={"tp": 2, "dp": 2})
    assert "sharding ILP" in pl.notes.placement_note and "no feasible sharding" in pl.notes.placement_note
    assert pl.placements["layers.0.attention.wq"] == "colwise" and pl.placements["layers.3.feed_forward.w2"] == "rowwise"
    assert "placements follow the runtime's Megatron pattern" in pl.explain()


def test_planner_chooses_bf16_adam_moments_only_when_nothing_else_fits():
    """~5.4B parameters on one H100: fp32 Adam state does not fit (on the meshplan stack the fp32
    parameters, gradients and moments held at the optimizer step, 16 bytes/param), bf16 moments do
    (12); the planner falls back to them and says so. A fixed dtype is honoured either way."""
    cl = mp.Cluster(gpu="h100-sxm", num_gpus=1, gpus_per_node=1)
    big = dict(layers=20, hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, vocab=128256)
    pl = plan(big, cl, seq_len=1024, global_batch=4)
    assert pl.layout.optimizer_dtype == "bf16" and pl.estimate.fits
    assert "no layout fits with fp32 moments" in pl.notes.optimizer_note
    assert "Adam moments in bf16" in pl.explain()
    with pytest.raises(DoesNotFitError):
        plan(big, cl, seq_len=1024, global_batch=4, fixed={"optimizer_dtype": "fp32"})
    small = dict(big, layers=8)          # fits with fp32 moments: they stay
    assert plan(small, cl, seq_len=1024, global_batch=4).layout.optimizer_dtype == "fp32"
    forced = plan(small, cl, seq_len=1024, global_batch=4, fixed={"optimizer_dtype": "bf16"})
    assert forced.layout.optimizer_dtype == "bf16" and not forced.notes.optimizer_note
