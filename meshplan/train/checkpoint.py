"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, resharding, last good kept.

Layout of an output directory:

    out/checkpoints/step_000050/        a complete checkpoint (DCP files + meta.json)
    out/checkpoints/step_000100.tmp/    being written: never loaded, removed on the next save

A checkpoint is written into `step_N.tmp`. Once every rank has written its part (the ranks
agree on that with one small collective), rank 0 writes `meta.json` and renames the directory to
`step_N`: a rename within one file system is atomic, so a crash at any point leaves either the
previous checkpoints or the new one, never a half-written directory under a final name.

Retention (`retained`): the newest `keep` complete checkpoints are kept, and in addition every
checkpoint whose step is a multiple of `keep_every` (milestones, e.g. for evaluations later);
the others are deleted, only after the new one is complete, so the newest good checkpoint is
never deleted whatever `keep` says (`keep=0` keeps every checkpoint).

Async saving (`Checkpointer(async_save=True)`): `save` copies the state to host memory (DCP's
stager, so training may change the weights at once) and writes it on a background thread over a
process group of its own (gloo), so the background collectives never interleave with the
training loop's. The checkpoint is completed (meta.json, rename, pruning) only by `poll` (once
every rank's write has finished) or `wait`, both called by every rank from the training loop;
the next `save` and the end of training wait for a pending one. A crash while a save is pending
leaves only the `.tmp` directory, which is never loaded.

A failed write (full disk, lost permission, ...) on any rank: every rank learns of it, rank 0
removes the partial `.tmp`, and every rank raises `CheckpointWriteError`, which says where and
what to do; complete checkpoints are never touched before a new one is complete.

What is saved: the model's sharded state (keyed by original FQN), the optimizer state keyed by
parameter FQN (so it reshards like the model; the state of a packed projection kept in TP order
is saved in the model's row order, as its weight is, so it reshards to another tp), and `extra` (step, data position, RNG state, the
plan's layout, the optimizer). The optimizer state is AdamW's (step, exp_avg, exp_avg_sq) or Muon's
(momentum_buffer for the matrices, AdamW's for the rest: train/muon.py), each shaped and sharded
like its parameter; loading a checkpoint into the other optimizer is refused, naming both. meta.json also records every parameter's global shape, so that loading a
checkpoint of another model fails with a list of the differences instead of a DCP traceback.
DCP stores each shard with its global offsets, so a run saved under one plan (TP2 x DP2) loads
under another (PP2 x DP2, DP4): every rank reads the pieces its new shards need.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshplan.errors import ConfigError
from meshplan.train.muon import finish_pending

__all__ = ["Checkpointer", "CheckpointWriteError", "save", "load", "latest", "optimizer_state",
           "retained", "load_weights", "CHECKPOINT_DIR"]

CHECKPOINT_DIR = "checkpoints"
_META = "meta.json"
_SHOWN_DIFFERENCES = 4                      # parameter differences named in an incompatibility error
_DETAIL_CHARS = 400                         # of DCP's (long, multi-part) reason for a failed read


class CheckpointWriteError(ConfigError):
    """A checkpoint could not be written (full disk, no permission); the partial one was removed."""


def _dir(out: Path) -> Path:
    return Path(out) / CHECKPOINT_DIR


def _complete(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp") and (p / _META).exists())


def latest(out: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `out` (a `step_N` directory with meta.json), or None."""
    done = _complete(_dir(Path(out)))
    return done[-1] if done else None


def _step_of(path: Path) -> int | None:
    try:
        return int(path.name.removeprefix("step_"))
    except ValueError:
        return None


def retained(checkpoints: list[Path], *, keep: int, keep_every: int = 0) -> list[Path]:
    """The complete checkpoints (sorted oldest first) that retention keeps: the newest `keep`
    (0: all), every one whose step is a multiple of `keep_every` (0: none), and always the newest."""
    if not checkpoints:
        return []
    if not keep:
        return list(checkpoints)
    newest = set(checkpoints[-keep:]) | {checkpoints[-1]}
    return [c for c in checkpoints if c in newest or (keep_every and (_step_of(c) or 0) % keep_every == 0
                                                        and _step_of(c))]


def optimizer_state(pm, optimizer: torch.optim.Optimizer, *, init: bool = False) -> dict[str, dict[str, Any]]:
    """{parameter FQN: {state name: tensor}} for the parameters this rank holds.

    With `init`, missing state (an optimizer that has not stepped) is created as zeros, so DCP
    has tensors to load into.
    """
    out: dict[str, dict[str, Any]] = {}
    orders = pm.tp_orders()
    for name, st in _named_state(pm, optimizer, init=init):
        # a packed projection's moments are rows in TP order, whose meaning depends on tp: save
        # them as the weight is saved (runtime/packed_projections.py), whole, in the model's order
        out[name] = {k: _model_order(v, orders[name]) for k, v in st.items()} if name in orders else st
    return out


def _named_state(pm, optimizer: torch.optim.Optimizer, *, init: bool = False):
    """(parameter FQN, its optimizer state dict) for the parameters this rank holds."""
    names = {id(p): pm._canonical(n) for n, p in pm.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if init and not optimizer.state.get(p):
                optimizer.state[p] = _zero_state(optimizer, p)
            st = optimizer.state.get(p)
            if st and id(p) in names:
                yield names[id(p)], st


def _model_order(t, spec: tuple):
    from meshplan.runtime.packed_projections import from_tp_order
    if not isinstance(t, DTensor) or t.dim() == 0:
        return t                                        # e.g. Adam's step count
    return from_tp_order(t.full_tensor(), *spec)


def _restore_tp_order(pm, optimizer: torch.optim.Optimizer, loaded: dict[str, dict[str, Any]]) -> None:
    """After a load into `optimizer_state`'s whole, model-order copies: put them back into the
    optimizer's TP-order shards."""
    from torch.distributed.tensor import distribute_tensor

    from meshplan.runtime.packed_projections import to_tp_order
    orders = pm.tp_orders()
    for name, st in _named_state(pm, optimizer):
        if name not in orders:
            continue
        for k, v in st.items():
            if isinstance(v, DTensor) and v.dim() > 0:
                whole = to_tp_order(loaded[name][k].to(v.dtype), *orders[name])
                st[k] = distribute_tensor(whole, v.device_mesh, v.placements)


def _zero_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, Any]:
    initial = getattr(optimizer, "initial_state", None)     # Muon: momentum, or AdamW's for the rest
    if initial is not None:
        return initial(p)
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ConfigError(f"checkpoint resume supports Adam/AdamW and Muon optimizer state, not "
                          f"{type(optimizer).__name__}")
    return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def _param_shapes(pm) -> dict[str, list[int]]:
    """{parameter FQN: global shape} of the parameters this rank holds (a DTensor's shape is global)."""
    return {pm._canonical(n): list(p.shape) for n, p in pm.named_parameters()}


def _all_shapes(pm) -> dict[str, list[int]]:
    """Every rank's `_param_shapes`, merged (collective): under PP each rank holds only its stage."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, _param_shapes(pm))
    return {k: v for part in parts for k, v in part.items()}


def _save_errors() -> tuple[type[BaseException], ...]:
    # DCP reports failures on any rank as CheckpointException, a BaseException (not Exception)
    from torch.distributed.checkpoint.api import CheckpointException
    return (Exception, CheckpointException)


def _describe(error: BaseException | None, rank: int) -> str | None:
    """A failed write as text naming the failing rank(s), or None."""
    if error is None:
        return None
    from torch.distributed.checkpoint.api import CheckpointException
    if isinstance(error, CheckpointException):
        causes = [(r, exc) for r, (exc, _tb) in sorted(error.failures.items())]
    else:
        causes = [(rank, error)]
    return "; ".join(f"rank {r}: {type(exc).__name__}: {str(exc).strip()}" for r, exc in causes)


def _free_space(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**20:,.0f} MiB free there now"
    except OSError:
        return "free space unknown"


@dataclass
class _Pending:
    step: int
    tmp: Path
    final: Path
    meta: dict[str, Any]
    shapes: dict[str, list[int]]
    future: Future | None = None


class Checkpointer:
    """Writes checkpoints `out/checkpoints/step_N`, synchronously or in the background.

    Every method is collective: every rank calls it at the same point of the training loop.
    `last` is the newest complete checkpoint (initially the one found in `out`, if any).
    """

    def __init__(self, out: str | os.PathLike, *, keep: int = 2, async_save: bool = False, keep_every: int = 0):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ConfigError(f"keep must be a whole number >= 0 (0 keeps every checkpoint), got {keep!r}")
        if isinstance(keep_every, bool) or not isinstance(keep_every, int) or keep_every < 0:
            raise ConfigError(f"keep_every must be a whole number of steps >= 0 (0: no milestones), e.g. 1000; "
                              f"got {keep_every!r}")
        self.root = _dir(Path(out))
        self.keep = keep
        self.keep_every = keep_every
        self.async_save = bool(async_save)
        self.last: Path | None = latest(out)
        # async saves talk over their own gloo group: DCP needs a CPU backend, and collectives
        # from the background thread must not interleave with the training loop's on the default group
        self._group = dist.new_group(backend="gloo") if self.async_save else None
        self._pending: _Pending | None = None

    @property
    def pending(self) -> bool:
        """A background save has started and is not yet complete."""
        return self._pending is not None

    def save(self, step: int, pm, optimizer, extra: dict[str, Any]) -> Path:
        """Start writing checkpoint `step`; returns the directory it has once complete.

        Synchronous: returns when the checkpoint is complete. Async: returns once the state is
        copied to host memory; `poll`/`wait`/`close` complete it. A pending save is waited for first.
        """
        import torch.distributed.checkpoint as dcp
        self.wait()
        finish_pending(optimizer)       # Muon's update slices still in flight belong to these weights
        final, tmp = self.root / f"step_{step:06d}", self.root / f"step_{step:06d}.tmp"
        if dist.get_rank() == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CheckpointWriteError(f"cannot create the checkpoint directory {self.root}: {e}; "
                                           "choose another output directory (--out)") from None
            for stale in self.root.glob("*.tmp"):          # left by a crash or a failed save
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()
        state = {"model": pm.state_dict(), "optim": optimizer_state(pm, optimizer)}
        job = _Pending(step=step, tmp=tmp, final=final, shapes=_param_shapes(pm),
                       meta={"step": step, "world_size": dist.get_world_size(), **extra})
        error = None
        try:
            if self.async_save:
                job.future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group)
            else:
                dcp.save(state, checkpoint_id=str(tmp))
        except _save_errors() as e:
            error = e
        if job.future is not None:
            self._pending = job
        else:
            self._finish(job, error)
        return final

    def poll(self) -> Path | None:
        """Complete a background save if it has finished on every rank (cheap: one tiny
        all-reduce while a save is pending, nothing otherwise). Returns the completed directory."""
        if self._pending is None:
            return None
        done = torch.tensor([1 if self._pending.future.done() else 0])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return self.wait() if done.item() else None

    def wait(self) -> Path | None:
        """Wait for a pending background save and complete it; returns its directory (None if none)."""
        if self._pending is None:
            return None
        job, self._pending = self._pending, None
        error = None
        try:
            job.future.result()
        except _save_errors() as e:
            error = e
        self._finish(job, error)
        return job.final

    def close(self) -> Path | None:
        """`wait`, then release the background group. Returns the newest complete checkpoint."""
        try:
            self.wait()
        finally:
            if self._group is not None:
                dist.destroy_process_group(self._group)
                self._group = None
        return self.last

    def _finish(self, job: _Pending, error: BaseException | None) -> None:
        """Every rank reports how its write went; if all succeeded rank 0 publishes the checkpoint
        (meta.json, atomic rename, pruning), otherwise removes the partial one; all raise alike."""
        rank = dist.get_rank()
        reports: list = [None] * dist.get_world_size()
        dist.all_gather_object(reports, (_describe(error, rank), job.shapes))
        failure = next((r for r, _ in reports if r is not None), None)
        if rank == 0:
            if failure is None:
                try:
                    meta = {**job.meta, "params": {k: v for _, shapes in reports for k, v in shapes.items()}}
                    _publish(job.tmp, job.final, meta)
                except OSError as e:
                    failure = f"rank 0: {type(e).__name__}: {e}"
            if failure is not None:
                shutil.rmtree(job.tmp, ignore_errors=True)
            else:
                done = _complete(self.root)
                keep = set(retained(done, keep=self.keep, keep_every=self.keep_every))
                for old in done:
                    if old not in keep and old != job.final:
                        shutil.rmtree(old, ignore_errors=True)
        box = [failure]
        dist.broadcast_object_list(box, src=0)      # also orders the rename before anyone goes on
        failure = box[0]
        if failure is None:
            self.last = job.final
            return
        previous = (f"the last good checkpoint {self.last} is intact (re-running with the same output "
                    "directory resumes from it)" if self.last else "there is no earlier checkpoint")
        # a full disk shows up as OSError (ENOSPC) or, inside torch.save's zip writer, as a
        # RuntimeError about a short write: the advice covers both, the free space tells which
        raise CheckpointWriteError(
            f"could not write checkpoint step {job.step} to {self.root} ({failure}; "
            f"{_free_space(self.root)}). The partial checkpoint {job.tmp.name} was removed; {previous}. "
            f"If the disk is full: free space on it, write to another directory (--out), or keep fewer "
            f"checkpoints (--keep, now {self.keep})")


def _publish(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    (tmp / _META).write_text(json.dumps(meta, indent=1, default=str))
    if final.exists():                              # the same step written again (e.g. --no-resume)
        old = final.with_name(final.name + ".old.tmp")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)                      # atomic: complete or absent


def save(out: str | os.PathLike, step: int, pm, optimizer, extra: dict[str, Any], *, keep: int = 2) -> Path:
    """Write checkpoint `step` synchronously (collective: every rank calls). Returns its directory."""
    return Checkpointer(out, keep=keep).save(step, pm, optimizer, extra)


def load(path: str | os.PathLike, pm, optimizer) -> dict[str, Any]:
    """Load a checkpoint into `pm` and `optimizer` (collective; reshards as needed); returns its meta."""
    import torch.distributed.checkpoint as dcp
    path = Path(path)
    meta_file = path / _META
    fix = (f"move {path} aside (the newest complete checkpoint before it is then used), or start "
           "afresh (--no-resume, or another --out)")
    if not meta_file.exists():
        raise ConfigError(f"{path} is not a complete meshplan checkpoint (no {_META}); it may have been "
                          f"interrupted while saving — use an earlier step_* directory")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{meta_file} is corrupt ({e}); {fix}") from None
    if not isinstance(meta, dict) or isinstance(meta.get("step"), bool) or not isinstance(meta.get("step"), int):
        raise ConfigError(f"{meta_file} is corrupt (no whole-number 'step'); {fix}")
    if isinstance(meta.get("params"), dict):
        _check_same_model(path, meta["params"], _all_shapes(pm))
    _check_same_optimizer(path, meta, optimizer)
    finish_pending(optimizer)           # an update still in flight must not land on the loaded weights
    state = {"model": pm.state_dict(), "optim": optimizer_state(pm, optimizer, init=True)}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except _save_errors() as e:
        detail = _describe(e, dist.get_rank()).splitlines()[-1]
        detail = detail if len(detail) <= _DETAIL_CHARS else detail[:_DETAIL_CHARS] + " ..."
        raise ConfigError(f"could not read checkpoint {path} ({detail}): its files are damaged (truncated "
                          f"or overwritten) or do not belong to this model; {fix}") from None
    pm.load_state_dict(state["model"])
    _restore_tp_order(pm, optimizer, state["optim"])
    return meta


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """"muon" or "adamw": the algorithm whose state a checkpoint holds."""
    from meshplan.train.muon import Muon
    return "muon" if isinstance(optimizer, Muon) else "adamw"


def _check_same_optimizer(path: Path, meta: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    saved = meta.get("optimizer", "adamw")          # checkpoints from before Muon hold AdamW state
    here = optimizer_name(optimizer)
    if saved != here:
        raise ConfigError(f"checkpoint {path} holds {saved} optimizer state, but this run uses {here}: "
                          f"resume with --optimizer {saved}, or start {here} from its weights only "
                          f"(--init-from {path} with another --out)")


def _shape_differences(saved: dict[str, list[int]], here: dict[str, list[int]], *, there: str, here_name: str,
                       missing: str, extra: str, ignore_missing: set[str] = frozenset()) -> tuple[int, str]:
    """(how many names differ, the first few described) between two {name: shape} maps."""
    diffs = [f"{k}: {saved[k]} {there}, {here[k]} {here_name}" for k in sorted(saved.keys() & here.keys())
             if list(saved[k]) != list(here[k])]
    diffs += [f"{k}: {missing}" for k in sorted(here.keys() - saved.keys() - ignore_missing)]
    diffs += [f"{k}: {extra}" for k in sorted(saved.keys() - here.keys())]
    more = f" (and {len(diffs) - _SHOWN_DIFFERENCES} more)" if len(diffs) > _SHOWN_DIFFERENCES else ""
    return len(diffs), "; ".join(diffs[:_SHOWN_DIFFERENCES]) + more


def _check_same_model(path: Path, saved: dict[str, list[int]], here: dict[str, list[int]]) -> None:
    n, shown = _shape_differences(saved, here, there="in the checkpoint", here_name="here",
                                  missing="not in the checkpoint", extra="only in the checkpoint")
    if n:
        raise ConfigError(f"checkpoint {path} was saved from a different model: {n} parameter(s) "
                          f"differ, e.g. {shown}. Resume with the model "
                          "it was written for, or start afresh (--no-resume, or another --out)")


# ---- fine-tuning start: weights only -----------------------------------------------------------

def load_weights(source: str | os.PathLike, pm) -> str:
    """Load only the model weights into `pm` (collective): from a meshplan checkpoint (a `step_N`
    directory, or an output directory whose newest checkpoint is used) or from a directory of
    transformers `*.safetensors` files (names as the model's own state dict). No optimizer, data
    position or step is read: training starts at step 0. Returns what was loaded.

    Mismatched shapes, missing or unexpected weights raise a ConfigError listing them. Persistent
    buffers the source lacks (e.g. an MoE expert bias) keep their initial values.
    """
    path = Path(source)
    if path.is_dir() and not (path / _META).exists() and latest(path) is not None:
        path = latest(path)
    if (path / _META).exists():
        return _load_checkpoint_weights(path, pm)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else (
        [path] if path.suffix == ".safetensors" else [])
    if not files:
        raise ConfigError(f"--init-from {source}: not a meshplan checkpoint (a step_N directory with {_META}, or an "
                          "output directory holding one) nor a directory of .safetensors files")
    return _load_safetensors(files, pm, source)


def _load_checkpoint_weights(path: Path, pm) -> str:
    import torch.distributed.checkpoint as dcp
    meta = json.loads((path / _META).read_text())
    if isinstance(meta.get("params"), dict):
        _check_weights(f"checkpoint {path}", meta["params"], _all_shapes(pm))
    model = pm.state_dict()
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    # buffers a checkpoint may lack (saved before they existed) keep their values
    state = {"model": {k: v for k, v in model.items() if f"model.{k}" in saved}}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except _save_errors() as e:
        detail = _describe(e, dist.get_rank()).splitlines()[-1][:_DETAIL_CHARS]
        raise ConfigError(f"could not read the weights of checkpoint {path} ({detail})") from None
    pm.load_state_dict({**model, **state["model"]})
    return str(path)


def _safe_open():
    try:
        from safetensors import safe_open
    except ImportError:
        raise ConfigError("reading .safetensors files needs the safetensors package: pip install safetensors "
                          "(it comes with transformers)") from None
    return safe_open


def read_local_slice(sf, key: str, t) -> torch.Tensor:
    """This rank's part of `key` from an open safetensors file, for the model tensor `t` (a DTensor
    or a plain replicated tensor): only the rows/columns the rank holds are read from disk, so no
    rank ever holds a whole sharded tensor, let alone the whole model."""
    if not isinstance(t, DTensor):
        return sf.get_tensor(key)
    shape = tuple(sf.get_slice(key).get_shape())
    local_shape, offset = compute_local_shape_and_global_offset(shape, t.device_mesh, t.placements)
    if 0 in local_shape:
        return torch.empty(local_shape)
    return sf.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]


def _load_safetensors(files: list[Path], pm, source) -> str:
    safe_open = _safe_open()
    model = pm.state_dict()
    params = {pm._canonical(n) for n, _ in pm.named_parameters()}
    found: dict[str, Path] = {}
    shapes: dict[str, list[int]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                found[k] = f
                shapes[k] = list(sf.get_slice(k).get_shape())
    here = {k: list(v.shape) for k, v in model.items()}
    # weights of this rank's stage only (pipeline stages hold part of the model); the output
    # projection tied to the embedding may be absent from the file
    pp = pm.plan.mesh.get("pp", 1)
    _check_weights(f"{source}", shapes if pp == 1 else {k: v for k, v in shapes.items() if k in here},
                   {k: v for k, v in here.items() if k in params}, only_here_ok=_tied_names(pm))
    state = dict(model)
    by_file: dict[Path, list[str]] = {}
    for k in model:
        if k in found:
            by_file.setdefault(found[k], []).append(k)
    for f, keys in by_file.items():         # each file opened once (memory-mapped), read slice by slice
        with safe_open(str(f), framework="pt") as sf:
            for k in keys:
                t = model[k]
                local = t.to_local() if isinstance(t, DTensor) else t
                part = read_local_slice(sf, k, t).to(dtype=local.dtype, device=local.device)
                state[k] = (DTensor.from_local(part, t.device_mesh, t.placements, run_check=False,
                                               shape=t.shape, stride=t.stride())
                            if isinstance(t, DTensor) else part)
    pm.load_state_dict(state)
    return str(source)


def _tied_names(pm) -> set[str]:
    return {n for names in getattr(pm, "tied", []) for n in names[1:]}


def _check_weights(what: str, saved: dict[str, list[int]], here: dict[str, list[int]], *,
                   only_here_ok: set[str] = frozenset()) -> None:
    n, shown = _shape_differences(saved, here, there=f"in {what}", here_name="in the model",
                                  missing=f"missing from {what}", extra=f"in {what} but not in the model",
                                  ignore_missing=set(only_here_ok))
    if n:
        raise ConfigError(f"cannot initialise the model from {what}: {n} weight(s) do not match, e.g. "
                          f"{shown}. Fine-tuning needs the same "
                          "architecture (same sizes and weight names); build the model with the source's config")
