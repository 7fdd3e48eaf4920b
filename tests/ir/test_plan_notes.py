"""A plan's notes (how the search arrived at it) are a typed value that survives JSON, and plans saved
with the earlier untyped "search" dict still load."""

from __future__ import annotations

import json

import pytest

import meshplan as mp
from meshplan.errors import ConfigError
from meshplan.ir.plan import Plan, PlanNotes


@pytest.fixture(scope="module")
def plan():
    return mp.plan("tiny-llama", "local-cpu", seq_len=64, global_batch=8)


def test_notes_are_typed_and_round_trip(plan):
    assert isinstance(plan.notes, PlanNotes)
    assert plan.notes.meshes > 0 and plan.notes.estimates >= plan.notes.meshes and plan.notes.seconds > 0
    assert Plan.from_json(plan.to_json()).notes == plan.notes
    assert "Searched" in plan.explain()


def test_plans_saved_with_a_search_dict_still_load(plan):
    d = json.loads(plan.to_json())
    old = d.pop("notes")
    d["search"] = dict(old, some_retired_counter=3)       # keys no longer kept are dropped
    assert Plan.from_dict(d).notes == plan.notes


def test_unknown_note_is_named(plan):
    d = json.loads(plan.to_json())
    d["notes"]["colour"] = "blue"
    with pytest.raises(ConfigError, match="colour"):
        Plan.from_dict(d)
