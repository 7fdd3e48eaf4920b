"""The plan's device mesh has one home, its layout: derived on read, checked against a saved file."""

from __future__ import annotations

import json

import pytest

import meshplan as mp
from meshplan.errors import ConfigError
from meshplan.ir.plan import MESH_AXES, Plan
from meshplan.ir.precision import Precision


@pytest.fixture(scope="module")
def plan():
    return mp.plan("tiny-llama", mp.Cluster.preset("local-cpu", nproc=4), seq_len=64, global_batch=8,
                   fixed={"tp": 2, "pp": 2})


def test_mesh_is_derived_from_the_layout(plan):
    lay = plan.layout
    assert tuple(plan.mesh) == MESH_AXES
    assert plan.mesh == {"pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "tp": lay.tp} == {"pp": 2, "dp": 1, "cp": 1,
                                                                                        "tp": 2}
    assert plan.world_size == 4


def test_saved_plan_keeps_the_mesh_for_readers_and_refuses_a_hand_edited_one(plan, tmp_path):
    d = json.loads(plan.to_json())
    assert d["mesh"] == plan.mesh
    assert Plan.from_dict(d).mesh == plan.mesh
    d.pop("mesh")                      # a file without it still loads: the layout says it all
    assert Plan.from_dict(d).mesh == plan.mesh
    d["mesh"] = {"pp": 1, "dp": 2, "cp": 1, "tp": 2}
    with pytest.raises(ConfigError, match="disagrees with its layout"):
        Plan.from_dict(d)


def test_precision_is_a_precision_on_both_sides_of_a_file(plan):
    assert type(plan.precision) is Precision and plan.precision is Precision.BF16
    d = json.loads(plan.to_json())
    assert d["precision"] == "bf16"                     # the file keeps the plain name
    assert Plan.from_dict(d).precision is Precision.BF16
    d["precision"] = "int4"
    with pytest.raises(ConfigError, match="plan precision 'int4': use one of fp32, bf16, fp16, fp8"):
        Plan.from_dict(d)
