"""Intra-block sharding ILP: choose how every op of a block is split over the TP group.

    sharding = shard_block(block, cluster, tp=8, tokens=8192)     # -> BlockSharding
    sharding.placements    # {"attention.wq": "colwise", ..., "attention_norm": "sequence"}
    problem = build_problem(block, cluster, tp=8, tokens=8192)
    problem.evaluate({"attention.wq": "replicate"})               # best cost with that fixed

It reads the traced op graph of one block (`BlockProfile.ops`, edges = `OpInfo.inputs`), so any
traceable model is handled, not only known classes: Megatron-LM's pattern (QKV and FC1
column-parallel, output and FC2 row-parallel, norms sequence-parallel) is an outcome, not an input.

How: `sharding_graph` labels the block's tensors (which dim holds tokens, which features:
`sharding_labels`) and lists each op's strategies over the layouts R, S, F, P; `sharding_problem`
builds and solves the ILP over them (its docstring has the formulation); `sharding_results`
holds what comes back. This module is the entry point.

Results are cached per (block signature, tp, tokens, options, cluster fingerprint): repeated
blocks share one solution.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict

from meshplan.errors import ConfigError, TraceError
from meshplan.ir.profile import BlockProfile, ModelProfile
from meshplan.planner.ilp.sharding_graph import BlockAnalysis
from meshplan.planner.ilp.sharding_problem import ShardingProblem
from meshplan.planner.ilp.sharding_results import LAYOUTS, PLACEMENTS, BlockSharding, OpChoice, Reshard
from meshplan.planner.ilp.solver import resolve_solver

__all__ = ["PLACEMENTS", "LAYOUTS", "OpChoice", "Reshard", "BlockSharding", "ShardingProblem",
           "build_problem", "shard_block", "shard_profile"]

# Default allowance over the smallest reachable per-GPU model state (the memory family in
# sharding_problem): lets small weights (norms, router, biases) stay replicated, but not a
# projection matrix.
DEFAULT_STATE_SLACK = 0.05
_CACHE_SIZE = 512


# ---- entry points ------------------------------------------------------------------------------

def build_problem(block: BlockProfile, cluster, *, tp: int, tokens: int, seq_len: int | None = None,
                  sp_allowed: bool = True, microbatches: int = 1,
                  state_budget_bytes: float | None = None, state_slack: float = DEFAULT_STATE_SLACK,
                  solver: str = "auto", time_limit_s: float = 5.0,
                  io_layout: str | None = None) -> ShardingProblem:
    """The sharding problem of one block (its formulation: sharding_problem).

    tokens: tokens per micro-batch (mbs x seq_len). seq_len: for attention's quadratic cost and
    the divisibility of sequence shards (default: the length the block was traced at).
    microbatches: micro-batches per optimizer step, over which weight-gradient traffic is spread.
    state_budget_bytes: cap on one instance's per-GPU parameter state (default: see memory).
    solver: "auto" (HiGHS if installed), "highs" or "cbc".
    io_layout: force the block's input/output layout ("sequence" when the layout says sp;
    "replicate"); None lets the ILP choose.
    """
    if not isinstance(block, BlockProfile):
        raise ConfigError(f"expected a BlockProfile (from meshplan.profiling.trace), got {type(block).__name__}")
    for label, v in (("tp", tp), ("tokens", tokens), ("microbatches", microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{label} must be a positive int, got {v!r}")
    if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1):
        raise ConfigError(f"seq_len must be a positive int or None, got {seq_len!r}")
    if not (time_limit_s > 0) or not (state_slack >= 0):
        raise ConfigError(f"time_limit_s must be > 0 and state_slack >= 0, got {time_limit_s!r}, "
                          f"{state_slack!r}")
    if state_budget_bytes is not None and not (state_budget_bytes >= 0):
        raise ConfigError(f"state_budget_bytes must be >= 0 bytes, got {state_budget_bytes!r}")
    if not block.ops:
        raise TraceError(f"block {block.signature} has no traced ops (an analytic profile?); trace "
                         f"the model with meshplan.profiling.trace.trace to shard its blocks")
    resolve_solver(solver)   # an unknown or missing solver fails here, before any work
    analysis = BlockAnalysis(block, cluster, tp=tp, tokens=tokens, seq_len=seq_len,
                             sp_allowed=sp_allowed, microbatches=microbatches)
    if io_layout not in (None, "replicate", "sequence"):
        raise ConfigError(f"io_layout must be 'replicate', 'sequence' or None, got {io_layout!r}")
    return ShardingProblem(analysis, state_budget_bytes=state_budget_bytes, state_slack=state_slack,
                           solver=solver, time_limit_s=time_limit_s, io_layout=io_layout)


_CACHE: OrderedDict[tuple, BlockSharding] = OrderedDict()


def _tp_fabric(cluster, tp: int) -> tuple:
    """What the ILP sees of `cluster`: the GPU and fabric figures and the TP group's geometry, not
    the node count (a what-if sweep over cluster sizes solves each block once per TP degree)."""
    fields = dataclasses.asdict(cluster)
    del fields["nodes"], fields["name"]
    per, domains = cluster.placement(tp, 1) if tp > 1 else (1, 1)
    return json.dumps(fields, sort_keys=True, default=str), per, domains


def shard_block(block: BlockProfile, cluster, *, tp: int, tokens: int, sp_allowed: bool = True,
                time_limit_s: float = 5.0, **options) -> BlockSharding:
    """Solve the sharding ILP of one unique block (cached; `options` as in `build_problem`)."""
    key = (block.signature, tuple((o.name, o.input_shapes) for o in block.ops[:1]), len(block.ops),
           tp, tokens, sp_allowed, time_limit_s, tuple(sorted(options.items())), _tp_fabric(cluster, tp))
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    result = build_problem(block, cluster, tp=tp, tokens=tokens, sp_allowed=sp_allowed,
                           time_limit_s=time_limit_s, **options).solve()
    _CACHE[key] = result
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return result


def shard_profile(profile: ModelProfile, cluster, *, tp: int, tokens: int,
                  **options) -> dict[str, BlockSharding]:
    """One BlockSharding per unique block of `profile`, keyed by block signature."""
    if not isinstance(profile, ModelProfile):
        raise ConfigError(f"shard_profile takes a ModelProfile, got {type(profile).__name__}")
    options.setdefault("seq_len", profile.seq_len)
    return {b.signature: shard_block(b, cluster, tp=tp, tokens=tokens, **options)
            for b in profile.blocks}
