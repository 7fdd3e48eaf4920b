"""The test helpers' plan cache (worlds.py): a model planned at several layouts under `traced_once`
is traced once per sequence length, and every plan is the one a fresh trace gives."""

from __future__ import annotations

import json

import meshplan as mp
from meshplan import api
from worlds import planning_model, traced_once

SEQ, BATCH = 32, 8
LAYOUTS = [dict(dp=2, zero=3), dict(tp=2, sp=True), dict(pp=2, schedule="1f1b")]


def _json(plan) -> dict:
    """The plan as JSON without the seconds the search took (they differ run to run)."""
    out = json.loads(plan.to_json())
    out.get("notes", {}).pop("seconds", None)
    out.get("search", {}).pop("seconds", None)
    return out


def test_planning_model_is_built_once_per_key():
    built = []
    first = planning_model(("test_worlds", "once"), lambda: built.append(1) or object())
    assert planning_model(("test_worlds", "once"), lambda: built.append(1) or object()) is first
    assert built == [1]


def test_traced_once_traces_each_model_once_and_plans_alike(monkeypatch):
    cluster = mp.Cluster(gpu="cpu", num_gpus=2, gpus_per_node=2)
    model = mp.models.build("tiny-llama", seq_len=SEQ, device="meta")     # a model no cache has seen
    fresh = [_json(mp.plan(model, cluster, seq_len=SEQ, global_batch=BATCH, fixed=f)) for f in LAYOUTS]
    traces = []
    real = api.profile

    def counting(m, **kw):
        traces.append(kw.get("seq_len"))
        return real(m, **kw)
    monkeypatch.setattr(api, "profile", counting)
    with traced_once():
        cached = [_json(mp.plan(model, cluster, seq_len=SEQ, global_batch=BATCH, fixed=f)) for f in LAYOUTS]
        mp.plan(model, cluster, seq_len=SEQ // 2, global_batch=BATCH, fixed=LAYOUTS[0])   # another length
        with traced_once():                                                              # nested: same cache
            mp.plan(model, cluster, seq_len=SEQ, global_batch=BATCH, fixed=LAYOUTS[1])
    assert cached == fresh
    assert traces == [SEQ, SEQ // 2], traces
    assert api.profile is counting                  # put back on leaving
