"""FP8 recipes priced from this project's H200 kernel measurements
(benchmarks/results/gpu_rates-2026-11-27-h200.md): the recipes' GEMM rates, the bytes their casts
move per element of a linear's input, output gradient and weight, and eager torchao's unfused casts,
which the estimate and the planner's FP8 placement see on a stack that does not compile."""

from __future__ import annotations

import math
import warnings

import pytest

import meshplan as mp
from meshplan.cost_models import constants as K
from meshplan.cost_models.compute import fp8_eager, fp8_weight_cast_time, gemm_time
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.roofline import (
    fp8_cast_time,
    fp8_quant_bytes,
    gemm_roofline,
    hbm_rate,
)
from meshplan.errors import ConfigError
from meshplan.ir.stack import Stack

# one linear's forward + backward under torchao float8 on an H200 at 8192 tokens (m, k, n): measured
# ms, and the three GEMMs' measured kernel ms alone, by recipe and compile (gpu_rates part 5 and 4)
H200_LAYERS = {
    "8b.gate_up": ((8192, 4096, 28672), {("tensorwise", True): 5.272, ("rowwise", True): 6.301,
                                         ("tensorwise", False): 16.187, ("rowwise", False): 15.929},
                   {"tensorwise": 3 * 1.5777, "rowwise": 3 * 1.6404}),
    "8b.down": ((8192, 14336, 4096), {("tensorwise", True): 2.604, ("rowwise", True): 3.815,
                                      ("tensorwise", False): 8.613, ("rowwise", False): 9.234},
                {"tensorwise": 3 * 0.7674, "rowwise": 3 * 0.7676}),
    "8b.qkv": ((8192, 4096, 6144), {("tensorwise", False): 4.605, ("rowwise", False): 5.064},
               {"tensorwise": 3 * 0.3455, "rowwise": 3 * 0.3559}),
}


@pytest.fixture(scope="module")
def h200():
    return mp.Cluster(gpu="h200", gpus_per_node=1, nodes=1)


def _layer_casts_s(m, k, n, cluster, recipe, *, eager=False):
    """The model's quantisation time of one linear's forward + backward: its three GEMMs' shares of
    the input and output gradient's casts, and the weight's cast."""
    stack = Stack.preset("meshplan").replace(compile=not eager)
    return (3 * fp8_cast_time(m, n, k, cluster, recipe, eager=eager)
            + fp8_weight_cast_time(k * n, cluster, recipe, stack=stack))


def test_recipe_gemm_rates_are_the_measured_kernel_shares(h200):
    # the H200's torch._scaled_mm: rowwise 0.91-1.00 of tensorwise, blockwise 0.82-0.89
    assert 0.9 < K.FP8_RECIPE_GEMM_RATE["rowwise"] < 1.0 and 0.8 < K.FP8_RECIPE_GEMM_RATE["blockwise"] < 0.9
    m, n, k = 8192, 28672, 4096
    tw = gemm_roofline(m, n, k, h200, fp8=True)
    for recipe in ("rowwise", "blockwise"):
        assert gemm_roofline(m, n, k, h200, fp8=True, recipe=recipe) == pytest.approx(
            tw / K.FP8_RECIPE_GEMM_RATE[recipe])


@pytest.mark.parametrize("shape,recipe,eager,tol", [
    ("8b.gate_up", "tensorwise", False, 0.03), ("8b.down", "tensorwise", False, 0.03),
    # rowwise compiled: one byte count for two shapes that measured 13.7 and 27.6 bytes per element
    ("8b.gate_up", "rowwise", False, 0.06), ("8b.down", "rowwise", False, 0.17),
    ("8b.gate_up", "tensorwise", True, 0.02), ("8b.down", "tensorwise", True, 0.02),
    ("8b.qkv", "tensorwise", True, 0.02), ("8b.gate_up", "rowwise", True, 0.04),
    ("8b.down", "rowwise", True, 0.04), ("8b.qkv", "rowwise", True, 0.04)])
def test_casts_reproduce_the_measured_layers(h200, shape, recipe, eager, tol):
    """The measured layer is its three GEMMs at the measured kernel rates plus its casts: the model's
    cast bytes (and eager torchao's fixed time per linear) added to those GEMMs reproduce it."""
    (m, k, n), layers, gemms = H200_LAYERS[shape]
    model = gemms[recipe] + _layer_casts_s(m, k, n, h200, recipe, eager=eager) * 1e3
    assert model == pytest.approx(layers[(recipe, not eager)], rel=tol)


def test_eager_torchao_is_slower_than_bf16_and_compiled_is_faster(h200):
    """One 8B gate_up linear: eager torchao FP8 (its casts as separate kernels) costs more than the
    BF16 layer (measured 1.93x), compiled FP8 less (0.62x): the model's layer prices say the same."""
    m, k, n = H200_LAYERS["8b.gate_up"][0]
    compiled, eager = Stack.preset("meshplan"), Stack.preset("meshplan").replace(compile=False)
    bf16 = 3 * gemm_time(m, n, k, h200)

    def fp8(stack):
        return 3 * gemm_time(m, n, k, h200, fp8=True, stack=stack) + fp8_weight_cast_time(k * n, h200, stack=stack)
    assert fp8(compiled) < 0.8 * bf16
    assert 1.5 * bf16 < fp8(eager) < 2.5 * bf16


def test_who_runs_the_casts_eagerly(h200):
    meshplan = Stack.preset("meshplan")
    assert meshplan.fp8_impl == "torchao" and Stack.preset("torchtitan").fp8_impl == "torchao"
    assert not fp8_eager(h200, meshplan) and fp8_eager(h200, meshplan.replace(compile=False))
    # Transformer Engine's casts are fused CUDA kernels, compiled or not; no stack: the reference
    assert not fp8_eager(h200, Stack.preset("megatron-core").replace(compile=False))
    assert not fp8_eager(h200, None)
    # CPU processes run the model as traced, but price FP8 as the host device does
    assert not fp8_eager(mp.Cluster.preset("local-cpu", nproc=1), meshplan.replace(compile=False))
    with pytest.raises(ConfigError, match="fp8_impl"):
        meshplan.replace(fp8_impl="cublas")
    # torchao has no blockwise recipe: an eager blockwise price is refused, naming the recipes it has
    with pytest.raises(ValueError, match="tensorwise"):
        fp8_quant_bytes("blockwise", eager=True)
    assert math.isclose(fp8_quant_bytes("tensorwise") * 1e9 / hbm_rate(h200), fp8_weight_cast_time(1e9, h200))


def test_eager_fp8_plan_keeps_bf16(h200):
    """1.2B Llama on one H200 (benchmarks/gpu_suite.py's model): compiled, the FP8 placement puts the
    middle blocks' linears in FP8 and precision="auto" takes it; on the same stack without
    torch.compile no linear gains, so the placement keeps every one in BF16 and "auto" plans BF16."""
    meta = mp.models.build(mp.models.config("llama3-8b", layers=6, hidden=2048, heads=16, kv_heads=8,
                                            ffn_hidden=8192), device="meta")
    kw = {"seq_len": 2048, "global_batch": 4}
    eager = Stack.preset("meshplan").replace(compile=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled8 = mp.plan(meta, h200, precision="fp8", **kw)
        eager8 = mp.plan(meta, h200, precision="fp8", stack=eager, **kw)
        auto = mp.plan(meta, h200, precision="auto", stack=eager, **kw)
    assert len(compiled8.fp8_modules) >= 20 and eager8.fp8_modules == ()
    assert auto.precision == "bf16"
    # priced with the compiled plan's FP8 linears anyway, the eager step is far slower than BF16
    prof = mp.profile(meta, seq_len=2048)
    mods = frozenset(compiled8.fp8_modules)
    b = estimate_profile(prof, h200, compiled8.layout, precision="bf16", stack=eager, **kw).step_time_s
    f = estimate_profile(prof, h200, compiled8.layout, precision="fp8", fp8_modules=mods, stack=eager, **kw).step_time_s
    assert f > 1.3 * b
