"""Exports the real tools accept: torchtitan v0.2.2, Megatron-Bridge 067f987, NeMo 2 8cfedd7.

The rules below are the checks the tools themselves make on a config (cited per check); each
reported failure of an export is one of them. CI has none of the tools, so the rules are restated
here and applied to the exported TOML / overrides; where a tool is importable the test_export.py
parser tests run it for real.
"""

from __future__ import annotations

import math
import re
import shlex
import tomllib
import warnings

import pytest
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

import meshplan as mp
import meshplan.export as ex
from meshplan.api import Plan
from meshplan.errors import ConfigError
from meshplan.export.torchtitan import TITAN_FLAVORS
from meshplan.ir.stack import STACKS

H100 = mp.Cluster.preset("dgx-h100", nodes=8)


def _plan(model: str, cluster, *, seq_len: int, global_batch: int, stack: str, precision: str = "bf16",
          **fixed) -> Plan:
    return mp.plan(model, cluster, seq_len=seq_len, global_batch=global_batch, precision=precision, stack=stack,
                   fixed=fixed or None, top_k=1)


def _with(pl: Plan, **layout) -> Plan:
    """`pl` with layout fields replaced; a new pp x vp re-splits the blocks evenly over the stages."""
    d = pl.to_dict()
    lay = dict(d["layout"], **layout)
    n = lay["pp"] * (lay.get("vp") or 1)
    if n != len(d["stages"]):
        k = len(d["blocks"]) // n
        d["stages"] = [list(d["blocks"][i * k:(i + 1) * k]) for i in range(n)]
    if "mesh" in d and isinstance(d["mesh"], dict):
        d["mesh"] = {k: lay.get(k, v) for k, v in d["mesh"].items()}
    return Plan.from_dict(dict(d, layout=lay))


def _titan(pl: Plan, model=None) -> dict:
    """The TOML as torchtitan reads it (tomllib), checked against the in-memory export."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        text = ex.export_text(pl, "torchtitan", model)
        cfg = tomllib.loads(text)
        assert cfg == ex.to_torchtitan(pl, model)
    return cfg


# ---- torchtitan v0.2.2's own checks, restated -------------------------------------------------------
# [model] defaults (job_config.py Model: name "llama3", flavor "debugmodel", 6 layers)
_DEBUG_LAYERS = 6
_FLAVOR_LAYERS = {(f.name, f.flavor): f.layers for f in TITAN_FLAVORS}
_FLEX = {(f.name, f.flavor) for f in TITAN_FLAVORS if f.flex_attention}


def _titan_accepts(cfg: dict, world: int) -> None:
    """What torchtitan v0.2.2 checks before training (file: the check)."""
    model = cfg.get("model", {})
    key = (model.get("name", "llama3"), model.get("flavor", "debugmodel"))
    n_layers = _FLAVOR_LAYERS.get(key, _DEBUG_LAYERS)
    par, tr = cfg["parallelism"], cfg["training"]
    rep, shard = par.get("data_parallel_replicate_degree", 1), par.get("data_parallel_shard_degree", -1)
    tp, cp, pp = par.get("tensor_parallel_degree", 1), par.get("context_parallel_degree", 1), \
        par.get("pipeline_parallel_degree", 1)
    ep, etp = par.get("expert_parallel_degree", 1), par.get("expert_tensor_parallel_degree", 1)
    assert rep * shard * cp * tp * pp == world                                        # parallel_dims.py
    if ep > 1:
        assert (shard * cp * tp) % (ep * etp) == 0, "efsdp = dp_shard*cp*tp/(ep*etp)"  # parallel_dims.py
    # parallelize.py: DDP (replicate only) is 1-D: "DDP has not supported > 1D parallelism"
    if shard == 1 and cp == 1 and ep == 1 and rep > 1:
        assert rep == world, "DDP has not supported > 1D parallelism"
    assert tr["seq_len"] % (tp * 2 * cp) == 0                                         # parallelize.py
    if cp > 1:
        assert key not in _FLEX, "Context Parallel only supports SDPA attention"      # parallelize.py
    f8 = cfg.get("quantize", {}).get("linear", {}).get("float8", {})
    # components/quantization/float8.py asserts these two are not set together
    assert not (f8.get("recipe_name") and f8.get("enable_fsdp_float8_all_gather")), \
        "enable_fsdp_float8_all_gather together with float8_config.recipe_name is not supported"
    if key[0] == "deepseek_v3" and tp > 1 and "quantize.linear.float8" in model.get("converters", []):
        assert f8.get("recipe_name") in ("rowwise", "rowwise_with_gw_hp"), "float8 tensorwise TP (deepseek_v3)"
    if pp > 1:
        cls = get_schedule_class(par["pipeline_parallel_schedule"])
        single = issubclass(cls, PipelineScheduleSingle)
        lps = par.get("pipeline_parallel_layers_per_stage")
        if lps is not None:                                   # pipeline_parallel.py pipeline_llm
            stages = math.ceil((n_layers + par.get("pipeline_parallel_first_stage_less_layers", 1)
                                + par.get("pipeline_parallel_last_stage_less_layers", 1)) / lps)
            assert stages % pp == 0, f"Number of virtual stages ({stages}) must be divisible by pp ({pp})"
            assert (stages // pp == 1) if single else (stages // pp >= 2)
        parts = par["module_fqns_per_model_part"]
        assert len(parts) % pp == 0                           # pipeline_module_split
        assert (len(parts) // pp == 1) if single else (len(parts) // pp >= 1)
        if cls.__name__ == "ScheduleZBVZeroBubble":
            assert len(parts) // pp == 2
        # every layer of the model torchtitan builds is in exactly one part (a missing name is dropped silently)
        assert [m for p in parts for m in p if m.startswith("layers.")] == [f"layers.{i}" for i in range(n_layers)]
        n_mb = tr["local_batch_size"] // par.get("pipeline_parallel_microbatch_size", 1)
        if cls.__name__ in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
            assert n_mb % max(1, n_mb // pp) == 0                               # torch schedules.py
        if cls.__name__ == "Schedule1F1B":
            assert n_mb >= pp                                                   # torch schedules.py
        if cls.__name__ in ("ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble", "ScheduleDualPipeV"):
            assert not cfg.get("compile", {}).get("enable"), "zero-bubble schedules refuse compiled stages"
    batch = rep * (shard if shard > 0 else 1)
    assert tr["global_batch_size"] % (tr["local_batch_size"] * batch) == 0                 # train.py


# ---- plans --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tt() -> dict[str, Plan]:
    """Plans for the torchtitan stack, their layouts fixed (fast)."""
    return {
        "70b_pp4": _plan("llama3-70b", H100, seq_len=4096, global_batch=256, stack="torchtitan", tp=8, pp=4, vp=1,
                         schedule="1f1b", zero=3, recompute="full", mbs=1),
        "70b_vp": _plan("llama3-70b", H100, seq_len=4096, global_batch=256, stack="torchtitan", tp=8, pp=4, vp=2,
                        zero=3, recompute="op_sac", mbs=1),
        "8b_fp8": _plan("llama3-8b", mp.Cluster.preset("dgx-h100"), seq_len=8192, global_batch=64, stack="torchtitan",
                        precision="fp8", tp=2, zero=3, recompute="none"),
    }


@pytest.fixture(scope="module")
def mc() -> dict[str, Plan]:
    """Plans for the megatron-core stack (NeMo 2, Megatron-Bridge), their layouts fixed."""
    return {
        "70b_uneven": _plan("llama3-70b", H100, seq_len=4096, global_batch=512, stack="megatron-core", tp=8, pp=8,
                            vp=1, recompute="full", schedule="1f1b", stage_layers=(9, 10, 10, 10, 10, 10, 10, 11)),
        "70b_layout": _plan("llama3-70b", H100, seq_len=4096, global_batch=512, stack="megatron-core", tp=8, pp=4,
                            vp=2, recompute="full", stage_layers=(9, 10, 10, 10, 10, 10, 10, 11)),
        "moe": _plan("mixtral-8x7b", mp.Cluster.preset("dgx-h100", nodes=4), seq_len=4096, global_batch=256,
                     stack="megatron-core", ep=8, tp=2, etp=1, pp=2, vp=1, schedule="1f1b", zero=1,
                     recompute="norm_act"),
    }


# The planner's own top plans, per export stack (the reported failures): llama3-8b at 128k (the
# megatron-core one uses CP; a torchtitan one with CP fixed too) and DeepSeek-V3 on 1024 H100s.
TOP_CASES = [("llama3-8b", 8, 131072, None), ("llama3-8b", 8, 131072, {"cp": 4}), ("deepseek-v3", 128, 8192, None)]


@pytest.fixture(scope="module")
def top() -> dict[tuple, Plan]:
    out = {}
    for model, nodes, seq, extra in TOP_CASES:
        for stack in ("torchtitan", "megatron-core"):
            if extra and stack != "torchtitan":
                continue
            fmt = "torchtitan" if stack == "torchtitan" else "nemo"
            fixed, _ = ex.export_constraints(fmt, model, "bf16")   # what `meshplan plan --export` adds
            fixed.update(extra or {})
            out[(model, stack, bool(extra))] = _plan(model, mp.Cluster.preset("dgx-h100", nodes=nodes), seq_len=seq,
                                                     global_batch=128, stack=stack, **fixed)
    return out


# ---- the planner's top plan for an export stack exports ---------------------------------------------------
@pytest.mark.parametrize("fmt", ex.FORMATS)
def test_top_plan_of_each_export_stack_exports(top, fmt):
    """op_sac (torchtitan) and norm_moe / norm_act (megatron-core) are policies those stacks offer, so
    their exporters must write them; DeepSeek-V3 on torchtitan is planned without CP (FlexAttention)."""
    stack = ex.EXPORT_STACKS[fmt]
    for (model, st, _), pl in top.items():
        if st != stack:
            continue
        text = ex.export_text(pl, fmt)
        assert text.startswith("# meshplan plan for")
        if fmt == "torchtitan":
            cfg = tomllib.loads(text)
            _titan_accepts(cfg, pl.world_size)
            assert cfg["model"]["name"] == ("deepseek_v3" if model == "deepseek-v3" else "llama3")
    if fmt == "torchtitan":
        assert top[("llama3-8b", "torchtitan", True)].layout.cp == 4          # CP exported too
    else:
        assert top[("llama3-8b", "megatron-core", False)].layout.cp > 1


def test_every_policy_and_schedule_a_stack_offers_exports(tt, mc):
    """The stack presets offer only what the exporters write: each recompute policy and schedule of
    the torchtitan and megatron-core presets, on a pipelined plan, exports to the formats of that stack."""
    for fmt, stack in ex.EXPORT_STACKS.items():
        offer = STACKS[stack]
        base = tt["70b_pp4"] if stack == "torchtitan" else mc["moe"]      # norm_moe needs a MoE model
        for rc in offer.recompute:
            if rc == "mla_up":     # offered for latent attention only (search._recompute_options)
                with pytest.raises(ConfigError, match="no latent attention"):
                    ex.export_text(_with(base, recompute=rc), fmt)
                continue
            ex.export_text(_with(base, recompute=rc), fmt)
        for sched in offer.schedules:
            vp = 2 if sched in ("interleaved", "zbv") else 1
            ex.export_text(_with(base, schedule=sched, vp=vp, stage_layers=None), fmt)


def test_cli_plans_around_what_torchtitan_cannot_run(tt, monkeypatch, capsys):
    """`meshplan plan --export torchtitan` for DeepSeek-V3 plans with cp=1 (torchtitan runs its
    FlexAttention without context parallelism) unless the user fixed cp."""
    from meshplan import cli
    seen = {}

    def fake_plan(*a, **k):
        seen.update(k)
        return tt["70b_pp4"]

    monkeypatch.setattr(mp, "plan", fake_plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert cli.main(["plan", "--model", "deepseek-v3", "--nodes", "128", "--export", "torchtitan"]) == 0
    assert seen["fixed"]["cp"] == 1 and "FlexAttention" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "deepseek-v3", "--nodes", "128", "--export", "torchtitan",
                     "--fix", "cp=2"]) == 0
    assert seen["fixed"]["cp"] == 2                      # the user's choice is kept
    assert cli.main(["plan", "--model", "llama3-8b", "--export", "torchtitan"]) == 0
    assert "cp" not in (seen["fixed"] or {})


# ---- torchtitan --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model, name, flavor", [
    ("llama3-8b", "llama3", "8B"), ("llama3-70b", "llama3", "70B"), ("llama3-405b", "llama3", "405B"),
    ("deepseek-v3", "deepseek_v3", "671B"), ("qwen3-30b-a3b", "qwen3", "30B-A3B"),
    ("qwen3-235b-a22b", "qwen3", "235B-A22B"),
])
def test_torchtitan_names_the_model(tt, model, name, flavor):
    """Without [model], torchtitan trains its llama3 debugmodel (6 layers), whatever the plan was for."""
    from meshplan.export.shape import model_shape
    shape = model_shape(None, model)
    assert [(f.name, f.flavor) for f in TITAN_FLAVORS if f.matches(shape)] == [(name, flavor)]
    if model == "llama3-8b":
        cfg = _titan(tt["8b_fp8"])
        assert (cfg["model"]["name"], cfg["model"]["flavor"]) == (name, flavor)
        assert "written for [model] llama3 8B" in ex.export_text(tt["8b_fp8"], "torchtitan")


def test_torchtitan_warns_for_a_model_it_does_not_ship(mc):
    pl = _with(mc["moe"], recompute="full")                          # mixtral: not in torchtitan v0.2.2
    with pytest.warns(UserWarning, match=r"not a model torchtitan v0\.2\.2 ships.*llama3 8B.*debugmodel"):
        text = ex.export_text(pl, "torchtitan")
    assert "# NOTE: meshplan preset 'mixtral-8x7b' is not a model torchtitan" in text
    assert "name" not in tomllib.loads(text).get("model", {})


def test_torchtitan_pipeline_stages_are_explicit_and_consistent(tt):
    """The error 'Number of virtual stages (1) must be divisible by pipeline parallel size (4)' came
    from pipeline_parallel_layers_per_stage checked against torchtitan's default 6-layer model."""
    for name in ("70b_pp4", "70b_vp"):
        pl = tt[name]
        cfg = _titan(pl)
        par = cfg["parallelism"]
        assert "pipeline_parallel_layers_per_stage" not in par
        assert len(par["module_fqns_per_model_part"]) == pl.layout.pp * pl.layout.vp
        _titan_accepts(cfg, pl.world_size)
    assert _titan(tt["70b_vp"])["parallelism"]["pipeline_parallel_schedule"] == "Interleaved1F1B"
    # the old export: no [model] and layers_per_stage = 20 fails torchtitan's check
    old = {"parallelism": dict(_titan(tt["70b_pp4"])["parallelism"], pipeline_parallel_layers_per_stage=20,
                               pipeline_parallel_first_stage_less_layers=0, pipeline_parallel_last_stage_less_layers=0),
           "training": _titan(tt["70b_pp4"])["training"]}
    with pytest.raises(AssertionError, match=r"Number of virtual stages \(1\) must be divisible by pp \(4\)"):
        _titan_accepts(old, tt["70b_pp4"].world_size)


def test_torchtitan_interleaved_micro_batches_checked(tt):
    pl = tt["70b_vp"]                    # pp=4, dp=2, mbs=1
    assert (pl.layout.pp, pl.layout.dp, pl.layout.mbs) == (4, 2, 1)
    ok = Plan.from_dict(dict(pl.to_dict(), global_batch=2 * 6, num_microbatches=6))   # 6 % max(1, 6 // 4) == 0
    _titan_accepts(_titan(ok), pl.world_size)
    worse = Plan.from_dict(dict(pl.to_dict(), global_batch=2 * 11, num_microbatches=11))  # 11 % 2 != 0
    with pytest.raises(ConfigError, match=r"Interleaved1F1B.*multiple of"):
        ex.to_torchtitan(worse)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchtitan_fp8_recipe_and_fsdp_all_gather(tt, recipe):
    """torchtitan asserts `enable_fsdp_float8_all_gather` is not set with `recipe_name`: tensorwise is
    the recipe-less default (FSDP may all-gather in float8), rowwise names itself only."""
    pl = _with(tt["8b_fp8"], fp8_recipe=recipe)
    cfg = _titan(pl)
    f8 = cfg["quantize"]["linear"]["float8"]
    _titan_accepts(cfg, pl.world_size)
    if recipe == "tensorwise":
        assert "recipe_name" not in f8 and f8["enable_fsdp_float8_all_gather"] is True
    else:
        assert f8["recipe_name"] == "rowwise" and not f8.get("enable_fsdp_float8_all_gather")
        assert "precompute_float8_dynamic_scale_for_fsdp" not in f8
    assert cfg["model"]["converters"] == ["quantize.linear.float8"] and "output" in f8["filter_fqns"]


def test_torchtitan_zero0_with_tp_pp_is_fsdp(tt):
    """zero=0 next to TP/PP: torchtitan refuses DDP ('DDP has not supported > 1D parallelism'), so
    the export is FSDP keeping weights gathered (same traffic as DDP, less memory), said in a note."""
    pl = _with(tt["70b_pp4"], zero=0)
    exp = ex.torchtitan_export(pl)
    par = exp.data["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (1, pl.layout.dp)
    assert par["fsdp_reshard_after_forward"] == "never"
    assert any("DDP" in n and "FSDP" in n for n in exp.notes)
    assert "DDP (zero=0)" in ex.export_text(pl, "torchtitan")                    # a comment in the TOML
    _titan_accepts(exp.data, pl.world_size)
    # plain data parallelism stays DDP
    dp_only = _with(tt["8b_fp8"], zero=0, tp=1, dp=8)
    par = ex.to_torchtitan(dp_only)["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (8, 1)


def test_torchtitan_recompute_and_compile(tt):
    assert _titan(tt["70b_vp"])["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    # the torchtitan stack prices torch.compile'd blocks: the export compiles them
    assert _titan(tt["70b_vp"])["compile"] == {"enable": True, "components": ["model", "loss"]}
    # ZB-V refuses compiled stages (torch schedules.py): eager, with a note
    zbv = _with(tt["70b_vp"], schedule="zbv", stage_layers=None)
    exp = ex.torchtitan_export(zbv)
    assert exp.data["compile"]["enable"] is False and any("eager" in n for n in exp.notes)
    with pytest.raises(ConfigError, match=r"torchtitan has no recompute mode.*norm_moe.*op_sac"):
        ex.to_torchtitan(_with(tt["70b_vp"], recompute="norm_moe"))


def test_export_constraints_for_torchtitan():
    fixed, why = ex.export_constraints("torchtitan", "deepseek-v3", "fp8")
    assert fixed == {"cp": 1, "fp8_recipe": "rowwise"} and "FlexAttention" in why[0]
    assert ex.export_constraints("torchtitan", "llama3-8b") == ({}, [])
    assert ex.export_constraints("nemo", "deepseek-v3") == ({}, [])
    assert ex.export_constraints("torchtitan", "path/to/model.py:build") == ({}, [])

def test_torchtitan_refuses_cp_for_flex_attention_models(top):
    ds = top[("deepseek-v3", "torchtitan", False)]
    assert ds.layout.cp == 1 and ds.layout.dp % 2 == 0
    pl = _with(ds, cp=2, dp=ds.layout.dp // 2)
    with pytest.raises(ConfigError, match=r"FlexAttention.*cp=2.*fixed=\{'cp': 1\}"):
        ex.to_torchtitan(pl)


# ---- Megatron-Bridge -----------------------------------------------------------------------------------------
def _bridge_lines(pl: Plan) -> dict[str, str]:
    text = ex.export_text(pl, "megatron-bridge")
    body = [shlex.split(ln)[0] for ln in text.splitlines() if not ln.startswith("#")]
    for ln in body:      # Hydra override grammar: key=value, the value a primitive, quoted string or list
        assert re.fullmatch(r"[a-z_][a-z0-9_.]*=(null|true|false|-?[0-9.e-]+|[A-Za-z0-9_.\-]+|\".*\"|\[.*\])", ln), ln
    return dict(ln.split("=", 1) for ln in body)


def _megatron_split_ok(f: dict) -> None:
    """Megatron-Core TransformerConfig.__post_init__: first/last stage sizes or a layout cannot be
    set with account_for_embedding/loss_in_pipeline_split, nor a layout with first/last sizes."""
    acc = f["account_for_embedding_in_pipeline_split"] in ("true", True) or \
        f["account_for_loss_in_pipeline_split"] in ("true", True)
    first_last = f["num_layers_in_first_pipeline_stage"] not in ("null", None) or \
        f["num_layers_in_last_pipeline_stage"] not in ("null", None)
    layout = f["pipeline_model_parallel_layout"] not in ("null", None)
    assert not (first_last and acc) and not (layout and (acc or first_last))


def test_bridge_llama_recipes_are_builder_backed(mc):
    """The Llama recipes' cfg.model is AutoBridge.get_model_config() (a GPTModelConfig holding the
    TransformerConfig as `transformer`): Hydra in struct mode refuses model.tensor_model_parallel_size."""
    kv = _bridge_lines(mc["70b_uneven"])
    t = "model.transformer."
    assert kv[t + "tensor_model_parallel_size"] == "8" and kv[t + "pipeline_model_parallel_size"] == "8"
    assert kv[t + "recompute_granularity"] == "full" and kv["model.seq_length"] == "4096"
    assert not any(k.startswith("model.") and not k.startswith(t) and k != "model.seq_length" for k in kv)
    # uneven first/last stages, written with the recipe's account_for_* flags switched off
    assert (kv[t + "num_layers_in_first_pipeline_stage"], kv[t + "num_layers_in_last_pipeline_stage"]) == ("9", "11")
    assert kv[t + "account_for_embedding_in_pipeline_split"] == kv[t + "account_for_loss_in_pipeline_split"] == "false"
    assert kv[t + "pipeline_model_parallel_layout"] == "null"
    _megatron_split_ok({k[len(t):]: v for k, v in kv.items() if k.startswith(t)})
    assert "written for recipe llama3_70b_pretrain_config" in ex.export_text(mc["70b_uneven"], "megatron-bridge")


def test_bridge_provider_recipes_and_layout(mc, top):
    ds = top[("deepseek-v3", "megatron-core", False)]
    kv = _bridge_lines(ds)
    assert kv["model.tensor_model_parallel_size"] == str(ds.layout.tp)           # a GPTModelProvider recipe
    assert not any(k.startswith("model.transformer.") for k in kv)
    f = {k[len("model."):]: v for k, v in kv.items() if k.startswith("model.")}
    _megatron_split_ok(f)
    assert kv["model.mtp_num_layers"] == "1"             # the preset trains with DeepSeek-V3's one MTP depth
    # every split setting written, whether even or not (recipes set their own)
    for pl in (mc["70b_layout"], mc["moe"]):
        f = ex.to_nemo(pl, flavor="megatron-bridge")
        p = "model.transformer." if pl.model.startswith("llama") else "model."
        _megatron_split_ok({k[len(p):]: v for k, v in f.items() if k.startswith(p)})
        assert f[p + "account_for_embedding_in_pipeline_split"] is False
    assert ex.to_nemo(mc["70b_layout"], flavor="megatron-bridge")["model.transformer.pipeline_model_parallel_layout"] \
        == "Et*9|t*10|t*10|t*10|t*10|t*10|t*10|t*11L"
    # a model without a known recipe: provider paths, noted
    exp = ex.nemo_export(mc["moe"], flavor="megatron-bridge")
    assert any("no Megatron-Bridge recipe is known" in n for n in exp.notes)


def test_bridge_fp8_names_a_mixed_precision_recipe(tt):
    """Bridge recipes set mixed_precision to a recipe *name* ("bf16_mixed"): mixed_precision.fp8=...
    cannot be applied to a string, and its settings overwrite the model's, so the export names the recipe."""
    pl = tt["8b_fp8"]
    f = ex.to_nemo(pl, flavor="megatron-bridge")
    assert f["mixed_precision"] == "bf16_with_fp8_current_scaling_mixed"
    assert not any(k.startswith("mixed_precision.") for k in f)
    with pytest.raises(ConfigError, match="no mixed-precision recipe for FP8 scaling 'rowwise'"):
        ex.to_nemo(_with(pl, fp8_recipe="rowwise"), flavor="megatron-bridge")


def test_norm_moe_exports_to_megatron_core_targets(mc):
    pl = _with(mc["moe"], recompute="norm_moe")
    a = " ".join(pl.to_megatron_args())
    assert "--recompute-granularity selective --recompute-modules layernorm moe" in a
    assert ex.to_nemo(pl)["model.config.recompute_modules"] == ["layernorm", "moe"]
    with pytest.raises(ConfigError, match="Megatron-Core has no recompute setting.*'op_sac'"):
        _with(mc["moe"], recompute="op_sac").to_megatron_args()


# ---- NeMo 2 ---------------------------------------------------------------------------------------------
def test_nemo_expresses_an_uneven_split_it_used_to_flatten(top, mc):
    """61 layers over pp=32 cannot be an even split; NeMo 2's MegatronStrategy (8cfedd7) takes
    pipeline_model_parallel_layout and re-runs the model config's __post_init__, which parses it."""
    ds = top[("deepseek-v3", "megatron-core", False)]
    s = "trainer.strategy."
    # the planner's split as it comes (first / last stage sizes around an even middle, or a layout),
    # and a split with an uneven middle, which only a layout expresses
    sl = ds.layout.stage_layers
    uneven = _with(ds, stage_layers=(sl[0] - 1, sl[1] + 1) + tuple(sl[2:]))
    for pl in (ds, uneven):
        exp = ex.nemo_export(pl)
        o = exp.data
        assert o[s + "pipeline_model_parallel_size"] == pl.layout.pp
        assert not any("even split" in n for n in exp.notes)
        _megatron_split_ok({k[len(s):]: v for k, v in o.items() if k.startswith(s)})
        # the preset trains with DeepSeek-V3's MTP depth (models/presets.py), on the last stage
        assert (o["model.config.mtp_num_layers"], o["model.config.mtp_loss_scaling_factor"]) == (1, 0.3)
    layout = o[s + "pipeline_model_parallel_layout"]
    stages = layout.split("|")
    assert len(stages) == uneven.layout.pp * uneven.layout.vp and stages[0].startswith("E") and stages[-1].endswith("mL")
    count = sum(int(m.group(1) or 1) for st in stages for m in re.finditer(r"t(?:\*(\d+))?", st))
    assert count == 61
    text = ex.export_text(uneven, "nemo")
    assert "written for recipe deepseek_v3" in text and "pipeline_model_parallel_layout=\"Et" in text
    # first/last sizes override the recipe's (deepseek_v3 sets 3 and 2), with account_for_* off
    u = ex.to_nemo(mc["70b_uneven"])
    assert (u[s + "num_layers_in_first_pipeline_stage"], u[s + "num_layers_in_last_pipeline_stage"]) == (9, 11)
    assert u[s + "account_for_embedding_in_pipeline_split"] is False and u[s + "pipeline_model_parallel_layout"] is None


def test_torchtitan_reads_the_top_plans_toml(top, tmp_path):
    """With torchtitan <= 0.2 importable, its own ConfigManager loads each top plan's TOML (unknown
    keys are an error there)."""
    pytest.importorskip("torchtitan.config.job_config", reason="torchtitan <= 0.2 not installed")
    from torchtitan.config import ConfigManager
    for (model, stack, cp), pl in top.items():
        if stack != "torchtitan":
            continue
        path = tmp_path / f"{model}-{cp}.toml"
        path.write_text(ex.export_text(pl, "torchtitan"))
        cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
        assert (cfg.model.name, cfg.parallelism.context_parallel_degree) == \
            (_titan(pl)["model"]["name"], pl.layout.cp)
        assert cfg.parallelism.pipeline_parallel_layers_per_stage is None
