"""A plan whose later pipeline stage holds no block is refused on every rank before any collective
(a rank that found out only while building its stage would leave the others hanging)."""

from __future__ import annotations

import pytest

import meshplan as mp
from meshplan.errors import LayoutError
from meshplan.runtime import pipeline as pp


def test_planner_refuses_more_stages_than_layers():
    model = mp.models.build("tiny-llama", layers=3, seq_len=32, device="meta")
    with pytest.raises(LayoutError, match="4 pipeline stages for 3 layers"):
        mp.plan(model, mp.Cluster(gpu="cpu", num_gpus=2, gpus_per_node=2), seq_len=32, global_batch=8,
                fixed={"pp": 2, "vp": 2, "schedule": "interleaved", "tp": 1, "dp": 1})


def test_stage_without_block_is_refused_before_building():
    """A plan made without the runtime's limits (or edited by hand): the runtime refuses it too."""
    model = mp.models.build("tiny-llama", layers=3, seq_len=32, device="meta")
    plan = mp.plan(model, mp.Cluster(gpu="cpu", num_gpus=2, gpus_per_node=2), seq_len=32, global_batch=8,
                   fixed={"pp": 2, "vp": 2, "schedule": "interleaved", "tp": 1, "dp": 1}, stack="megatron-core")
    specs = pp.stage_specs(plan.stages)
    if all(s.is_first or any(m.startswith("layers.") for m in s.owned) for s in specs):
        pytest.skip(f"the planner gave every stage a block: {plan.stages}")
    with pytest.raises(LayoutError, match="owns no block"):
        pp.check_stage_entries(model, specs)


def test_planned_stages_with_blocks_pass():
    model = mp.models.build("tiny-llama", seq_len=32, device="meta")
    plan = mp.plan(model, mp.Cluster(gpu="cpu", num_gpus=2, gpus_per_node=2), seq_len=32, global_batch=8,
                   fixed={"pp": 2, "vp": 1, "tp": 1, "dp": 1})
    pp.check_stage_entries(model, pp.stage_specs(plan.stages))
