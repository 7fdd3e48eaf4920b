"""The training loop as an API: `train(model, plan, TrainConfig(...))` inside a process group.

Per step: learning rate from warm-up + cosine (schedule.py) -> `forward_backward` on the global
batch (the ParallelModel slices its data-parallel share and micro-batches as planned) -> global
gradient-norm clipping across every shard -> AdamW step -> metrics (loss, grad norm, tokens/s,
measured vs predicted step time, MFU against the cluster's peak, peak memory) on rank 0 ->
a checkpoint every `checkpoint_every` steps (checkpoint.py). If the output directory already
holds a checkpoint, training resumes from the newest one: model, optimizer, data position, RNG.

Exact resume: the data order is a pure function of (seed, step), the optimizer state and every
weight are restored bit for bit, and the computation after resume runs the same kernels in the
same order, so on CPU the losses after a resume equal those of an uninterrupted run exactly
(the tests allow 1e-6 for safety, not because differences are expected).

Checkpoints may be written in the background (`async_checkpoint`, see checkpoint.py): the loop
goes on while a checkpoint is written, completes it once every rank has finished writing, and
waits for it before the next one and at the end.

A rank that stops responding: every rank records the step it is in (in the rendezvous store
the process group was built on). When a collective times out (the process group's timeout),
the rank that saw it marks itself as timed out, gives the others a moment to do the same, and
raises `RankHangError` naming the ranks that never did, with the step each last reported; the
process exits non-zero and the launcher (torchrun) stops the job.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from meshplan.errors import ConfigError
from meshplan.runtime import checkpoint as ckpt
from meshplan.runtime.schedule import lr_at, set_lr

__all__ = ["TrainConfig", "TrainResult", "RankHangError", "train"]

# After its own collective timed out, a rank waits this long (at most; never longer than the
# timeout itself) for the other healthy ranks to time out too, so that the ranks that never do
# can be named. Healthy ranks block in the same step's collectives, so they time out within
# about one timeout of each other; 10 s bounds the extra delay for long (300 s) timeouts.
HANG_GRACE_S = 10.0
_HEARTBEAT = "meshplan/heartbeat"


class RankHangError(RuntimeError):
    """A collective timed out because a rank stopped responding; the message names the rank."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 100
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 10
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0
    seed: int = 0
    data: str | None = None                 # None: the embedded corpus
    out_dir: str = "meshplan-run"
    checkpoint_every: int = 50              # 0: only at the end
    keep_checkpoints: int = 2
    resume: bool = True
    progress: bool = True
    async_checkpoint: bool = False          # write checkpoints in the background while training goes on
    stop_at: int | None = None              # stop (with a checkpoint) after this step, as a job time limit would
    fail_at_step: int | None = None         # testing aid: rank 1 exits at this step on the first attempt
    collective_timeout_s: float | None = None   # bound on every collective while training (None: the
                                                #   default group's timeout, which the launcher set)
    hang_at_step: int | None = None         # testing aid: rank `hang_rank` stops responding at this step
    hang_rank: int = 1                      #   (first attempt only; it sleeps until the launcher kills it)

    def __post_init__(self) -> None:
        for name in ("steps", "warmup", "checkpoint_every", "keep_checkpoints", "hang_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be a whole number >= 0, got {v!r}")
        if self.steps < 1:
            raise ConfigError("steps must be >= 1")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr!r}")
        if self.collective_timeout_s is not None and not self.collective_timeout_s > 0:
            raise ConfigError(f"collective_timeout_s must be > 0 seconds, got {self.collective_timeout_s!r}")
        if not isinstance(self.async_checkpoint, bool):
            raise ConfigError(f"async_checkpoint must be True or False, got {self.async_checkpoint!r}")


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    losses: dict[int, float]                # step -> global mean loss (steps run in this call)
    start_step: int                         # 0, or the step resumed from
    final_step: int
    checkpoint: str | None                  # the last checkpoint written


def train(model: torch.nn.Module, plan, config: TrainConfig, *, pm=None, dataset=None) -> TrainResult:
    """Train `model` as `plan` says, in an initialised process group. See the module docstring."""
    from meshplan.runtime.data import TokenDataset
    from meshplan.runtime.metrics import MetricsLog, Progress, StepMetrics, peak_memory_gb
    from meshplan.runtime.parallel import parallelize
    rank = dist.get_rank()
    out = Path(config.out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        plan.save(out / "plan.json")
    torch.manual_seed(config.seed)
    pm = pm or parallelize(model, plan)
    vocab = _vocab(model)
    if dataset is None:
        # rank 0 tokenises (and caches) text first, so the others only read the cache
        if rank == 0:
            dataset = TokenDataset.open(config.data)
        dist.barrier()
        if rank != 0:
            dataset = TokenDataset.open(config.data)
    if vocab:
        dataset.check_vocab(vocab)
    sampler = dataset.sampler(global_batch=plan.global_batch, seq_len=plan.seq_len, seed=config.seed)
    opt = torch.optim.AdamW(pm.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    start = 0
    checkpoints = ckpt.Checkpointer(out, keep=config.keep_checkpoints, async_save=config.async_checkpoint)
    last = checkpoints.last if config.resume else None
    if last is not None:
        meta = ckpt.load(last, pm, opt)
        start = int(meta["step"])
        sampler.load_state_dict(meta["data"])
        torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))
        if rank == 0:
            print(f"resumed from {last} (step {start})", flush=True)
    predicted = plan.estimate.get("step_time_s")
    est_mfu = plan.estimate.get("mfu")
    tokens_per_step = plan.global_batch * plan.seq_len
    log = MetricsLog(out / "metrics.jsonl") if rank == 0 else None
    bar = Progress(total_steps=config.steps) if rank == 0 and config.progress else None
    losses: dict[int, float] = {}
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _bound_collectives(pm, config.collective_timeout_s)     # from here on: set-up (tokenising, loading) is done
    heartbeat = _Heartbeat()
    step = start
    try:
        for step in range(start, config.steps):
            heartbeat.beat(step + 1)
            if config.fail_at_step is not None and step == config.fail_at_step and rank == 1 and restart == 0:
                os._exit(17)                      # simulated crash of one rank (tests only)
            if config.hang_at_step is not None and step == config.hang_at_step and rank == config.hang_rank \
                    and restart == 0:
                while True:                       # simulated hang of one rank (tests only)
                    time.sleep(1.0)
            lr = lr_at(step, base_lr=config.lr, warmup=config.warmup, total=config.steps,
                       min_lr=config.lr * config.min_lr_ratio)
            set_lr(opt, lr)
            x, y = sampler.batch(step)
            t0 = time.perf_counter()
            loss = pm.forward_backward(x, y)
            norm = pm.clip_grad_norm(config.grad_clip)
            opt.step()
            pm.zero_grad()
            dt = time.perf_counter() - t0
            losses[step + 1] = loss
            if rank == 0:
                m = StepMetrics(step=step + 1, loss=loss, grad_norm=norm, lr=lr, tokens_per_s=tokens_per_step / dt,
                                step_time_s=dt, predicted_step_time_s=predicted,
                                # MFU scales inversely with step time from the plan's own prediction
                                mfu=(est_mfu * predicted / dt) if est_mfu and predicted else None,
                                peak_memory_gb=peak_memory_gb(pm.device))
                log.write(m)
                if bar:
                    bar.update(m)
            done = step + 1
            checkpoints.poll()                    # completes a background checkpoint once all ranks wrote it
            stopping = config.stop_at is not None and done >= config.stop_at
            if (config.checkpoint_every and done % config.checkpoint_every == 0) or done == config.steps or stopping:
                sampler_state = {**sampler.state_dict(), "step": done}
                checkpoints.save(done, pm, opt, {
                    "data": sampler_state, "rng": torch.get_rng_state().tolist(),
                    "layout": plan.layout, "config": asdict(config)})
            if stopping:
                break
        written = checkpoints.close()             # waits for a checkpoint still being written
    except RuntimeError as e:
        if _is_timeout(e):
            raise heartbeat.diagnose(step + 1, e) from e
        raise
    finally:
        if bar:
            bar.close()
        if log:
            log.close()
    return TrainResult(losses=losses, start_step=start, final_step=start + len(losses),
                       checkpoint=str(written) if written else None)


def _is_timeout(error: BaseException) -> bool:
    # gloo: "Timed out waiting 3000ms for recv operation to complete"; NCCL's watchdog and the
    # store say "timed out" / "Timeout" too
    return isinstance(error, RuntimeError) and re.search(r"timed out|timeout", str(error), re.IGNORECASE) is not None


def _group_timeout_s(group=None) -> float | None:
    """A process group's collective timeout in seconds (best effort: private API), or None."""
    group = group or dist.distributed_c10d._get_default_group()
    for device in group._device_types:
        try:
            return group._get_backend(device).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - a backend without readable options
            continue
    return None


def _timeout_s(error: BaseException) -> float | None:
    """The collective timeout that expired, for the message."""
    m = re.search(r"waiting (\d+)ms", str(error))          # gloo names it
    return int(m.group(1)) / 1000 if m else _group_timeout_s()


def _bound_collectives(pm, timeout_s: float | None) -> None:
    """Give the default group and every group of the plan's mesh the same timeout. DeviceMesh
    creates its sub-groups (tp, pp, dp of a multi-dimensional mesh) with torch's default timeout
    (30 min with gloo, 10 with NCCL), whatever the default group has: without this, a rank that
    hangs in a TP or PP collective would block the others for that long."""
    import datetime
    timeout_s = timeout_s or _group_timeout_s()
    mesh = getattr(pm, "mesh", None)
    if not timeout_s:
        return
    groups = [dist.distributed_c10d._get_default_group(), *(mesh.get_all_groups() if mesh is not None else [])]
    # private API (torch 2.13: distributed_c10d._set_pg_timeout; gloo and NCCL both honour it);
    # were it gone, the groups would keep torch's defaults
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    for group in groups if set_timeout else []:
        set_timeout(datetime.timedelta(seconds=timeout_s), group)


class _Heartbeat:
    """Each rank's current step, kept in the store the default process group was built on (the
    launcher's rendezvous store under torchrun, so it stays readable when a rank hangs)."""

    def __init__(self) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        try:        # private API; without it a timeout is still reported, without naming the rank
            self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001
            self.store = None

    def beat(self, step: int) -> None:
        if self.store is not None:
            self.store.set(f"{_HEARTBEAT}/step/{self.rank}", str(step))

    def _read(self, kind: str) -> dict[int, int]:
        keys = {r: f"{_HEARTBEAT}/{kind}/{r}" for r in range(self.world)}
        return {r: int(self.store.get(k)) for r, k in keys.items() if self.store.check([k])}

    def diagnose(self, step: int, error: BaseException) -> RankHangError:
        """Called by a rank whose collective timed out: name the ranks that stopped responding."""
        timeout = _timeout_s(error)
        within = f"no collective completed within {timeout:g} s" if timeout else "a collective timed out"
        if self.store is None:
            return RankHangError(f"rank {self.rank} timed out in step {step} ({within}): another rank stopped "
                                 f"responding. Check the other ranks' logs; raise --timeout if steps take longer")
        try:
            self.store.set(f"{_HEARTBEAT}/timeout/{self.rank}", str(step))
            deadline = time.monotonic() + min(timeout or HANG_GRACE_S, HANG_GRACE_S)
            while len(waiting := self._read("timeout")) < self.world and time.monotonic() < deadline:
                time.sleep(0.1)
            steps = self._read("step")
        except Exception as e:  # noqa: BLE001 - the store itself is gone: report what we know
            return RankHangError(f"rank {self.rank} timed out in step {step} ({within}) and the rendezvous "
                                 f"store is unreachable ({e}); the launcher or another host failed")
        silent = [r for r in range(self.world) if r not in waiting]
        waited = ", ".join(f"{r} (step {s})" for r, s in sorted(waiting.items()))
        if not silent:
            return RankHangError(f"every rank timed out waiting in a collective ({within}); ranks and steps: "
                                 f"{waited}. The ranks are waiting in different collectives (a step that "
                                 "differs between ranks) or the network between them failed")
        names = ", ".join(f"rank {r}" for r in silent)
        where = ", ".join(f"rank {r} in step {steps[r]}" if r in steps else f"rank {r} before step 1"
                          for r in silent)
        return RankHangError(
            f"{names} stopped responding ({where}; {within}, set by --timeout). Rank(s) {waited} timed out "
            f"waiting for it. Look at what {names} was doing (its output; py-spy dump --pid): a stuck data "
            "read, a deadlock, an overloaded host. If steps legitimately take longer, raise --timeout")


def _vocab(model) -> int | None:
    cfg = getattr(model, "config", None)
    for attr in ("vocab", "vocab_size"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int):
            return v
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None
