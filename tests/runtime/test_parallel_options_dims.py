"""`parallelize`'s inputs: ParallelOptions (checked on construction, each bad value named with what
works) and ParallelDims (a plan's degrees and the DeviceMeshes built from them, on torch's fake
process group: one process stands for one rank of the plan's world)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshplan.errors import ConfigError
from meshplan.ir.layout import Layout
from meshplan.runtime.dims import ParallelDims
from meshplan.runtime.options import ParallelOptions
from meshplan.runtime.parallel import parallelize


@pytest.mark.parametrize("field_, value, allowed", [
    ("compute_dtype", "bf16", "'plan' (the plan's precision), None or torch.float32"),
    ("compute_dtype", torch.int8, "torch.bfloat16 or torch.float16"),
    ("overlap", "yes", "True or False"),
    ("fp8", 1, "True or False"),
    ("materialize", None, "True or False"),
    ("loss_fn", "cross_entropy", "None (cross entropy) or a callable"),
    ("fused_kernels", "always", "'auto', True or False"),
    ("compile", "on", "'auto', True or False"),
    ("fp8_backend", "cublas", "('auto', 'torchao', 'te')"),
    ("fp8_recipe", "blockwise", "'tensorwise', 'rowwise', 'delayed'"),
    ("fp32_grads", 3, "parameter-name patterns"),
])
def test_bad_option_is_named_with_what_works(field_, value, allowed):
    with pytest.raises(ConfigError) as e:
        ParallelOptions(**{field_: value})
    assert f"ParallelOptions.{field_}={value!r}" in str(e.value) and allowed in str(e.value), str(e.value)


def test_options_defaults_overrides_and_normal_forms():
    base = ParallelOptions()
    assert (base.compute_dtype, base.fused_kernels, base.compile, base.fp8, base.materialize) == (
        "plan", "auto", "auto", True, True)
    assert ParallelOptions(fp32_grads="router, norm,").fp32_grads == ("router", "norm")
    assert ParallelOptions(fp32_grads=["router"]).fp32_grads == ("router",)
    assert ParallelOptions(compute_dtype=None).compute_dtype is None
    one = ParallelOptions.of(base, compute_dtype=torch.bfloat16, overlap=False)
    assert (one.compute_dtype, one.overlap, base.overlap) == (torch.bfloat16, False, True)    # base unchanged
    assert ParallelOptions.of(None) == base and ParallelOptions.of(one) is one
    with pytest.raises(ConfigError, match="unknown option.*materialise.*the options are compute_dtype, overlap"):
        ParallelOptions.of(materialise=False)
    with pytest.raises(ConfigError, match="pass a ParallelOptions"):
        ParallelOptions.of({"compile": False})


def test_parallelize_refuses_a_bad_option_before_anything_else():
    # checked before the process group is looked at: the error is the option's, not the launch's
    with pytest.raises(ConfigError, match="ParallelOptions.compile='sometimes'"):
        parallelize(nn.Linear(2, 2), None, compile="sometimes")
    with pytest.raises(ConfigError, match="unknown option.*fp8_backends"):
        parallelize(nn.Linear(2, 2), None, ParallelOptions(), fp8_backends="te")


@dataclass
class _Plan:
    """What ParallelDims reads of a Plan: its layout, mesh and placements."""

    layout: Layout
    placements: dict = field(default_factory=dict)

    @property
    def mesh(self) -> dict[str, int]:
        return {a: getattr(self.layout, a) for a in ("pp", "dp", "cp", "tp")}


_MOE = {"layers.0.moe.experts": "expert", "layers.0.attention.wq": "colwise"}


@pytest.mark.parametrize("layout, placements, degrees", [
    (Layout(tp=2, pp=2, dp=2), {}, dict(pp=2, dp=2, cp=1, tp=2, ep=1, etp=1, edp=4, shard=2, replicate=1,
                                        folded=False)),
    (Layout(tp=2, pp=2, dp=2, ep=2), _MOE, dict(pp=2, dp=2, tp=2, ep=2, etp=1, edp=2, folded=True)),
    (Layout(dp=2, cp=2, tp=2, ep=2, etp=2), _MOE, dict(pp=1, dp=2, cp=2, tp=2, ep=2, etp=2, edp=2, folded=True)),
    (Layout(dp=8, zero=3, fsdp_shard=2), {}, dict(dp=8, shard=2, replicate=4, folded=False)),
])
def test_degrees_come_from_the_plan(layout, placements, degrees):
    dims = ParallelDims.from_plan(_Plan(layout, placements))
    assert {k: getattr(dims, k) for k in degrees} == degrees
    assert dims.world == 8 and dims.hsdp == (dims.replicate > 1) and dims.meshes is None
    with pytest.raises(ConfigError, match="degrees only.*ParallelDims.build"):
        dims.tp_mesh


def test_experts_that_do_not_divide_the_ranks_are_refused():
    with pytest.raises(ConfigError, match="ep=4 x etp=1 does not divide its dp x cp x tp = 2 ranks"):
        ParallelDims.from_plan(_Plan(Layout(dp=2, ep=4), _MOE))


@pytest.fixture
def fake_world():
    """A fake process group of `world` ranks seen from `rank` (collectives are no-ops)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    opened = []

    def open_(world: int, rank: int = 0):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        opened.append(True)
    yield open_
    if opened:
        dist.destroy_process_group()


def test_meshes_have_the_plan_shapes(fake_world):
    fake_world(8, rank=5)
    plan = _Plan(Layout(dp=2, cp=2, tp=2, ep=2, etp=2), _MOE)
    dims = ParallelDims.build(plan, "cpu")
    assert dims.root.mesh_dim_names == ("pp", "dp", "cp", "tp") and tuple(dims.root.shape) == (1, 2, 2, 2)
    assert (dims.tp_mesh.size(), dims.cp_mesh.size(), dims.pp_mesh.size()) == (2, 2, 1)
    assert dims.fsdp_mesh.size() == 4             # FSDP shards and reduces over dp x cp together
    assert dims.expert_mesh.mesh_dim_names == ("edp", "ep", "etp") and tuple(dims.expert_mesh.shape) == (2, 2, 2)
    assert (dims.ep_mesh.size(), dims.expert_fsdp_mesh.size()) == (2, 2)
    # rank 5 = (dp 1, cp 0, tp 1) with tp fastest; folded as (edp, ep, etp) with etp fastest: (1, 0, 1)
    assert list(dims.root.get_coordinate()) == [0, 1, 0, 1] and list(dims.expert_mesh.get_coordinate()) == [1, 0, 1]


def test_hsdp_meshes_split_data_parallel_ranks(fake_world):
    fake_world(8)
    dims = ParallelDims.build(_Plan(Layout(dp=8, zero=3, fsdp_shard=2)), "cpu")
    assert dims.root.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert tuple(dims.root.shape) == (1, 4, 2, 1, 1) and tuple(dims.fsdp_mesh.shape) == (4, 2)
    assert dims.expert_mesh is None and dims.ep_mesh is None


def test_a_custom_loss_under_tp_says_what_it_costs_over_the_plan():
    """The plan prices the vocabulary-parallel loss (each TP rank's 1/tp of the logits); a user's
    loss_fn gets whole logits, so parallelize says so, with the factor and the way back."""
    from meshplan.ir.layout import Layout
    from meshplan.runtime.parallel import whole_logits_note
    summed = lambda logits, labels: logits.sum()            # noqa: E731
    note = whole_logits_note(Layout(tp=4, dp=2), ParallelOptions(loss_fn=summed))
    assert "tp=4" in note and "4x the planned logits memory" in note and "leave loss_fn unset" in note
    assert whole_logits_note(Layout(tp=1, dp=8), ParallelOptions(loss_fn=summed)) is None
    assert whole_logits_note(Layout(tp=4, dp=2), ParallelOptions()) is None
