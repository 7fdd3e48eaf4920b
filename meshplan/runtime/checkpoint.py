"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, resharding, last good kept.

Layout of an output directory:

    out/checkpoints/step_000050/        a complete checkpoint (DCP files + meta.json)
    out/checkpoints/step_000100.tmp/    being written: never loaded, removed on the next save

A checkpoint is written into `step_N.tmp`, every rank waits for the others (barrier), then rank
0 writes `meta.json` and renames the directory to `step_N`: a rename within one file system is
atomic, so a crash at any point leaves either the previous checkpoints or the new one, never a
half-written directory under a final name. Only the newest `keep` checkpoints are kept; older ones
are deleted after the new one is complete.

What is saved: the model's sharded state (keyed by original FQN), the optimizer state keyed by
parameter FQN (so it reshards like the model), and `extra` (step, data position, RNG state, the
plan's layout). DCP stores each shard with its global offsets, so a run saved under one plan
(TP2 x DP2) loads under another (PP2 x DP2, DP4): every rank reads the pieces its new shards need.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshplan.errors import ConfigError

__all__ = ["save", "load", "latest", "optimizer_state", "CHECKPOINT_DIR"]

CHECKPOINT_DIR = "checkpoints"
_META = "meta.json"


def _dir(out: Path) -> Path:
    return Path(out) / CHECKPOINT_DIR


def latest(out: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `out` (a `step_N` directory with meta.json), or None."""
    root = _dir(Path(out))
    if not root.is_dir():
        return None
    done = sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp") and (p / _META).exists())
    return done[-1] if done else None


def optimizer_state(pm, optimizer: torch.optim.Optimizer, *, init: bool = False) -> dict[str, dict[str, Any]]:
    """{parameter FQN: {state name: tensor}} for the parameters this rank holds.

    With `init`, missing state (an optimizer that has not stepped) is created as zeros, so DCP
    has tensors to load into.
    """
    names = {id(p): pm._canonical(n) for n, p in pm.named_parameters()}
    out: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if init and not optimizer.state.get(p):
                optimizer.state[p] = _zero_state(optimizer, p)
            st = optimizer.state.get(p)
            if st and id(p) in names:
                out[names[id(p)]] = st
    return out


def _zero_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ConfigError(f"checkpoint resume supports Adam/AdamW optimizer state, not {type(optimizer).__name__}")
    return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def save(out: str | os.PathLike, step: int, pm, optimizer, extra: dict[str, Any], *, keep: int = 2) -> Path:
    """Write checkpoint `step` (collective: every rank calls). Returns its final directory."""
    import torch.distributed.checkpoint as dcp
    root = _dir(Path(out))
    final, tmp = root / f"step_{step:06d}", root / f"step_{step:06d}.tmp"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    state = {"model": pm.state_dict(), "optim": optimizer_state(pm, optimizer)}
    try:
        dcp.save(state, checkpoint_id=str(tmp))
    except OSError as e:
        raise ConfigError(f"could not write checkpoint {tmp}: {e} (disk full?); the previous checkpoint "
                          f"{latest(out)} is intact") from e
    dist.barrier()
    if dist.get_rank() == 0:
        meta = {"step": step, "world_size": dist.get_world_size(), **extra}
        (tmp / _META).write_text(json.dumps(meta, indent=1, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)                      # atomic: complete or absent
        done = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load(path: str | os.PathLike, pm, optimizer) -> dict[str, Any]:
    """Load a checkpoint into `pm` and `optimizer` (resharding as needed); returns its meta."""
    import torch.distributed.checkpoint as dcp
    path = Path(path)
    meta_file = path / _META
    if not meta_file.exists():
        raise ConfigError(f"{path} is not a complete meshplan checkpoint (no {_META}); it may have been "
                          f"interrupted while saving — use an earlier step_* directory")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{meta_file} is corrupt ({e}); use an earlier checkpoint") from None
    state = {"model": pm.state_dict(), "optim": optimizer_state(pm, optimizer, init=True)}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # noqa: BLE001 - DCP raises several types for missing/mismatched entries
        raise ConfigError(f"checkpoint {path} does not match this model or optimizer: {e}") from e
    pm.load_state_dict(state["model"])
    return meta
