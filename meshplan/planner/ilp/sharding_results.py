"""What the sharding ILP answers: the layouts and placement names, and the result records
(`BlockSharding` per unique block, with an `OpChoice` per op and a `Reshard` per collective).

The layouts (see sharding_graph): R replicated, S sharded on the token (sequence) dim, F sharded
on the feature dim, P partial sums awaiting a reduction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshplan.errors import ConfigError

__all__ = ["LAYOUTS", "PLACEMENTS", "LAYOUT_LABELS", "OpChoice", "Reshard", "BlockSharding"]

LAYOUTS = ("R", "S", "F", "P")
# What the runtime applies per module: linears colwise / rowwise / replicate / sequence (tokens
# sharded, weight replicated); attention modules heads / replicate; norms sequence / replicate /
# feature (hidden-sharded, weight sliced); routed experts "expert" (sharded by the EP axis).
PLACEMENTS = ("colwise", "rowwise", "replicate", "sequence", "heads", "feature", "expert")
LAYOUT_LABELS = {"R": "replicate", "S": "sequence", "F": "feature", "P": "partial"}


@dataclass(frozen=True, kw_only=True)
class OpChoice:
    """The strategy chosen for one op: what it reads (and in which layout) and produces."""

    name: str
    module: str                   # relative to the block ("attention.wq")
    strategy: str                 # "colwise", "rowwise", "replicate", "sequence", "heads", ...
    sources: tuple[str, ...]      # activation inputs (op names, or the block input)
    inputs: tuple[str, ...]       # the layout each source is read in
    output: str                   # the layout produced

    def __post_init__(self) -> None:
        if self.output not in LAYOUTS or any(x not in LAYOUTS for x in self.inputs):
            raise ConfigError(f"op {self.name!r}: layouts must be among {LAYOUTS}")
        if len(self.sources) != len(self.inputs):
            raise ConfigError(f"op {self.name!r}: one input layout per source")


@dataclass(frozen=True, kw_only=True)
class Reshard:
    """One collective the assignment implies (forward, or the backward of a gradient)."""

    tensor: str
    direction: str                # "forward" | "backward"
    src: str
    dst: str
    collective: str               # all_gather, reduce_scatter, all_reduce, all_to_all
    seconds: float


@dataclass(frozen=True, kw_only=True)
class BlockSharding:
    """The ILP's answer for one unique block at one TP degree (treat the dict as read-only)."""

    signature: str
    tp: int
    tokens: int
    placements: dict[str, str]    # module FQN relative to the block -> one of PLACEMENTS
    io_layout: str                # block input and output: "replicate" | "sequence"
    time_s: float                 # compute + comm + gradient traffic, per micro-batch
    compute_s: float
    comm_s: float
    grad_sync_s: float
    state_bytes: float            # per-GPU parameter state of one block instance
    status: str                   # "optimal" | "feasible" (stopped at the time limit)
    solver: str
    solve_s: float
    ops: tuple[OpChoice, ...] = field(default=(), repr=False)
    reshards: tuple[Reshard, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.tokens < 1:
            raise ConfigError(f"tp and tokens must be >= 1, got tp={self.tp}, tokens={self.tokens}")
        bad = {m: p for m, p in self.placements.items() if p not in PLACEMENTS}
        if bad:
            raise ConfigError(f"unknown placements {bad}; known: {PLACEMENTS}")
        if self.io_layout not in ("replicate", "sequence"):
            raise ConfigError(f"io_layout must be 'replicate' or 'sequence', got {self.io_layout!r}")
