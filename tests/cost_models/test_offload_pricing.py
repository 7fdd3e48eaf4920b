"""Activation offloading in the layout, the cost model and the search (cost_models/offload.py).

- Layout: the field's validation, its short name, the dict round trip;
- offload_rank against hand arithmetic (working set, host bytes, exposed copies);
- an estimate with offloading: GPU activations down to the working set, the rest in the
  "host_offload" category (not counted against the GPU), the step longer by exactly the exposed
  copies; a host too small for the offloaded bytes makes the layout not fit, and says so;
- the search: where nothing fits on a GPU without offloading, the plan offloads; fixed
  offload_activations=True is honoured, with the recompute policies the runtime offloads; a stack
  that does not offload refuses it.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.ir.stack import resolve_stack

from meshplan.cluster import Cluster
from meshplan.cost_models.estimate import estimate_profile
from meshplan.cost_models.offload import (
    HOST_CATEGORY,
    OFFLOAD_OVERLAP_EFF,
    OFFLOAD_WORKING_BLOCKS,
    host_capacity_gb,
    offload_rank,
)
from meshplan.errors import ConfigError
from meshplan.ir.estimate import GB
from meshplan.ir.layout import Layout
from meshplan.profiling.analytic import profile_from_config
from meshplan.planner.search import search

SMALL = dict(layers=16, hidden=1024, heads=8, kv_heads=8, vocab=32000, ffn_hidden=2816)
SEQ = 4096


def test_layout_field_validates_and_round_trips():
    lay = Layout(offload_activations=True, recompute="full")
    assert "offload-act" in lay.short() and "offload-act" not in Layout().short()
    assert Layout.from_dict(lay.to_dict()) == lay and Layout().offload_activations is False
    with pytest.raises(ConfigError, match="offload_activations"):
        Layout(offload_activations="yes")


def test_offload_rank_hand_arithmetic():
    o = offload_rank(saved_bytes=10e9, largest_block_bytes=1e9, held=3, t_f=0.1, t_b=0.3, link_gb_s=50.0,
                     overlap=0.9)
    assert o.transfer_s == pytest.approx(0.2)                       # 10 GB at 50 GB/s, each way
    assert o.gpu_bytes == OFFLOAD_WORKING_BLOCKS * 1e9             # the block computing + the one in transfer
    assert o.host_bytes == 30e9                                     # every micro-batch in flight
    assert o.fwd_s == pytest.approx(0.2 - 0.9 * 0.1) and o.bwd_s == 0.0   # backward hides its copies
    # a rank with one block has no working set to shrink to
    assert offload_rank(saved_bytes=1e9, largest_block_bytes=1e9, held=1, t_f=1, t_b=1, link_gb_s=50,
                        overlap=0.9).gpu_bytes == 1e9


def _one_gpu(**gpu_changes) -> Cluster:
    base = Cluster(gpu="h100-sxm", num_gpus=1)
    if not gpu_changes:
        return base
    return Cluster(gpu=dataclasses.replace(base.gpu, **gpu_changes), num_gpus=1,
                   memory_reserved_gb=base.memory_reserved_gb)


def _est(cluster, stack="meshplan", **layout):
    return estimate_profile(profile_from_config(SMALL), cluster, dict(dict(mbs=1, recompute="none"), **layout),
                            seq_len=SEQ, global_batch=4, stack=stack)


def test_estimate_moves_activations_to_host_and_charges_exposed_copies():
    gpu = _one_gpu()
    # meshplan's runtime runs offloaded blocks eagerly (Stack.compile_offloaded): its eager price is
    # the compiled stack's with compile off; the copies are then the only difference
    eager = resolve_stack("meshplan").replace(compile=False)
    no, off = _est(gpu, stack=eager), _est(gpu, offload_activations=True)
    compiled = _est(gpu)
    assert compiled.step_time_s < no.step_time_s
    assert HOST_CATEGORY not in no.memory_gb and "offload" not in no.time_s
    host = off.memory_gb[HOST_CATEGORY]
    # what left the GPU is on the host, less the working set kept for the blocks in use
    assert off.memory_gb["activations"] < no.memory_gb["activations"]
    assert no.memory_gb["activations"] - off.memory_gb["activations"] == pytest.approx(
        host * (1 - OFFLOAD_WORKING_BLOCKS / SMALL["layers"]), rel=1e-9)
    assert off.peak_memory_gb == pytest.approx(no.peak_memory_gb - (no.memory_gb["activations"]
                                                                    - off.memory_gb["activations"]), rel=1e-9)
    # one GPU: no data-parallel traffic hides behind the longer passes, so the step grows by the
    # exposed copies exactly; at most both directions' whole transfer, at least what compute cannot hide
    transfer = host * GB / (gpu.gpu.host_link_gb_s * 1e9)          # one micro-batch in flight
    m = off.num_microbatches
    assert off.step_time_s - no.step_time_s == pytest.approx(off.time_s["offload"], rel=1e-9)
    assert 0 < off.time_s["offload"] <= 2 * m * transfer
    assert off.time_s["offload"] >= m * 2 * (transfer - OFFLOAD_OVERLAP_EFF * no.step_time_s / m)
    assert off.fits and sum(off.time_s.values()) == pytest.approx(off.step_time_s, rel=1e-9)


def test_host_memory_must_hold_the_offloaded_bytes():
    off = _est(_one_gpu(), offload_activations=True)
    need = off.memory_gb[HOST_CATEGORY]
    small = _one_gpu(host_mem_gb=need * GB / 1e9 * 8 / 2)       # a server of 8 with room for half of it each
    assert host_capacity_gb(small) < need
    tight = _est(small, offload_activations=True)
    assert not tight.fits and tight.bottleneck.startswith("host memory")
    assert tight.peak_memory_gb <= tight.capacity_gb               # the GPU itself has room


def test_search_offloads_where_nothing_fits_without():
    prof = profile_from_config(SMALL)
    base = _one_gpu()
    leanest = _est(base, recompute="full")                       # the least memory without offloading
    offloaded = _est(base, recompute="full", offload_activations=True)
    assert offloaded.peak_memory_gb < leanest.peak_memory_gb
    gb = base.memory_reserved_gb + (offloaded.peak_memory_gb + leanest.peak_memory_gb) / 2
    tight = _one_gpu(hbm_gb=gb)
    res = search(prof, tight, seq_len=SEQ, global_batch=4, precisions=("bf16",), stack="meshplan")
    assert res.ranked, "nothing fits even with offloading"
    assert all(e.layout.offload_activations for e in res.ranked)
    assert res.ranked[0].layout.recompute not in ("selective", "norm_act")   # the runtime offloads it
    # with room for the leanest layout without it, the search does not offload
    roomy = search(prof, _one_gpu(hbm_gb=gb + leanest.peak_memory_gb), seq_len=SEQ, global_batch=4,
                   precisions=("bf16",), stack="meshplan")
    assert roomy.ranked and not any(e.layout.offload_activations for e in roomy.ranked)


def test_fixed_offload_is_honoured_and_refused_where_not_run():
    prof = profile_from_config(SMALL)
    res = search(prof, _one_gpu(), seq_len=SEQ, global_batch=4, precisions=("bf16",), stack="meshplan",
                 fixed={"offload_activations": True})
    assert res.ranked and all(e.layout.offload_activations for e in res.ranked)
    assert {e.layout.recompute for e in res.ranked}.isdisjoint({"selective", "norm_act"})
    with pytest.raises(ConfigError, match="torchtitan stack does not offload"):
        search(prof, _one_gpu(), seq_len=SEQ, global_batch=4, precisions=("bf16",), stack="torchtitan",
               fixed={"offload_activations": True})
    with pytest.raises(ConfigError, match="offload_activations with recompute='selective'"):
        search(prof, _one_gpu(), seq_len=SEQ, global_batch=4, precisions=("bf16",), stack="meshplan",
               fixed={"offload_activations": True, "recompute": "selective"})
