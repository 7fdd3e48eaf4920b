"""The training loop as an API: `train(model, plan, TrainConfig(...))` inside a process group.

Per step: learning rate from warm-up + cosine or WSD (schedule.py) -> `forward_backward` on the
global batch (the ParallelModel slices its data-parallel share and micro-batches as planned;
under a batch-size schedule or ramp-up only the number of micro-batches changes: batch_schedule.py)
-> fp16: unscale the gradients, skip the step on every rank if any saw inf/nan (loss_scale.py)
-> global gradient-norm clipping across every shard -> AdamW (or Muon: muon.py) step -> MoE expert-bias update
(expert_parallel.MoEBalancer, from the step's global routing counts) -> metrics (loss, grad and
parameter norm, tokens/s, measured vs predicted step time, MFU against the cluster's peak, the
step's peak memory as the max over ranks, MoE routing statistics) on rank 0, also to TensorBoard
/ wandb when asked (observe.py) -> a checkpoint every `checkpoint_every` steps
(checkpoint.py; the newest `keep_checkpoints` and every multiple of `keep_every` are kept). If
the output directory already holds a checkpoint, training resumes from the newest one: model
(with the MoE expert biases), optimizer, data position, RNG. Otherwise `init_from` may give the
starting weights (a fine-tuning start: weights only). At the end rank 0 prints a run summary and
writes it to <out_dir>/summary.json.

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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from meshplan.errors import ConfigError
from meshplan.runtime.expert_parallel import MoEBalancer
from meshplan.runtime.fp8 import precision_summary
from meshplan.runtime.parallel import parallelize
from meshplan.train import checkpoint as ckpt
from meshplan.train.batch_schedule import (
    batch_schedule_for,
    check_pipeline,
    parse_batch_schedule,
)
from meshplan.train.inputs import build_training_data
from meshplan.train.inputs import check_options as check_data_options
from meshplan.train.loss_scale import DynamicLossScaler, loss_scaler_for
from meshplan.train.lr_schedule import lr_at, set_lr
from meshplan.train.metrics import (
    MetricsLog,
    Progress,
    StepMetrics,
    moe_metrics,
)
from meshplan.train.muon import finish_pending, update_pending
from meshplan.train.observe import Loggers, RunSummary, StepMemory, check_loggers
from meshplan.train.optim import OPTIMIZERS, build_optimizer

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
    optimizer: str | None = None            # "adamw" | "muon" (optim.py, muon.py); None: the plan's layout.optimizer
    grad_clip: float | None = 1.0
    seed: int = 0
    data: str | None = None                 # None: the embedded corpus; "A:0.7,B:0.3": a blend (blend.py)
    tokenizer: str | None = None            # tokenizer directory for text sources (None: bytes; tokenizer.py)
    text_field: str = "text"                # JSONL / Parquet field holding the text (sources.py)
    document_mask: bool | None = None       # attention inside documents; None: on for data with boundaries
    eval_every: int = 0                     # validation loss every N steps (0: never; inputs.py)
    eval_batches: int = 1                   #   over this many fixed global batches
    eval_data: str | None = None            #   of this data, or of
    eval_fraction: float | None = None      #   the last fraction of the training data, held out
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
    lr_schedule: str = "cosine"             # "cosine" or "wsd" (warm-up, stable, decay: schedule.py)
    wsd_decay_steps: int | None = None      # WSD: steps of the final decay (None: the last 10% of steps)
    wsd_decay_style: str = "linear"         # WSD: "linear", "cosine" or "minus_sqrt"
    keep_every: int = 0                     # also keep every checkpoint whose step is a multiple (milestones)
    rampup_batch_size: tuple[int, int, int] | None = None   # (start, increment, samples), Megatron's ramp-up
    batch_schedule: tuple[tuple[int, int], ...] | None = None   # ((step, global batch), ...) from that step
                                            #   on, or "0:64,100:128" (batch_schedule.py)
    init_from: str | None = None            # fine-tune start: model weights only (a checkpoint step_N
                                            #   directory or a transformers safetensors directory)
    profile_steps: tuple[int, int] | None = None   # (first, last) step, 1-based: torch.profiler on every
                                            #   rank over those steps, written to <out_dir>/profile/
    log: tuple[str, ...] = ()               # also log to "tensorboard" (<out_dir>/tb) and/or "wandb" (observe.py)
    loss_scaling: str = "auto"              # fp16 dynamic loss scaling: "auto" (when computing in fp16),
                                            #   "dynamic" (always) or "off" (loss_scale.py)
    initial_loss_scale: float = 2.0 ** 16
    loss_scale_window: int = 1000           # clean steps before the loss scale doubles

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
        if isinstance(self.keep_every, bool) or not isinstance(self.keep_every, int) or self.keep_every < 0:
            raise ConfigError(f"keep_every must be a whole number of steps >= 0 (0: no milestones), got "
                              f"{self.keep_every!r}; e.g. keep_every=1000")
        # the schedule's own checks (names the option and a value that works)
        lr_at(0, base_lr=self.lr, warmup=self.warmup, total=self.steps, min_lr=self.lr * self.min_lr_ratio,
              style=self.lr_schedule, decay_steps=self.wsd_decay_steps, decay_style=self.wsd_decay_style)
        r = self.rampup_batch_size
        if r is not None:
            if not isinstance(r, (tuple, list)) or len(r) != 3 or any(
                    isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in r):
                raise ConfigError(f"rampup_batch_size must be three whole numbers >= 1 (start, increment, "
                                  f"samples), e.g. (16, 16, 100000); got {r!r}")
            object.__setattr__(self, "rampup_batch_size", tuple(r))
        if self.batch_schedule is not None:
            if r is not None:
                raise ConfigError("give either a batch schedule or a batch-size ramp-up (--rampup-batch-size), "
                                  "not both; a ramp-up is one kind of schedule")
            object.__setattr__(self, "batch_schedule", parse_batch_schedule(self.batch_schedule))
        log = (self.log,) if isinstance(self.log, str) else tuple(self.log or ())
        object.__setattr__(self, "log", tuple(k for part in log for k in part.split(",") if k))
        check_loggers(self.log)
        if self.loss_scaling not in ("auto", "dynamic", "off"):
            raise ConfigError(f"loss_scaling must be 'auto', 'dynamic' or 'off', got {self.loss_scaling!r}")
        DynamicLossScaler(scale=self.initial_loss_scale, growth_interval=self.loss_scale_window)   # its checks
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r}: use one of {OPTIMIZERS} (None: the plan's)")
        check_data_options(self)
        p = self.profile_steps
        if p is not None:
            if not isinstance(p, (tuple, list)) or len(p) != 2 or any(
                    isinstance(v, bool) or not isinstance(v, int) for v in p) or not 1 <= p[0] <= p[1]:
                raise ConfigError(f"profile_steps must be two step numbers 1 <= first <= last, e.g. (6, 8); got {p!r}")
            object.__setattr__(self, "profile_steps", tuple(p))


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    losses: dict[int, float]                # step -> global mean loss (steps run in this call)
    start_step: int                         # 0, or the step resumed from
    final_step: int
    checkpoint: str | None                  # the last checkpoint written
    skipped_steps: tuple[int, ...] = ()     # fp16: steps skipped on inf/nan gradients (this call)
    summary: dict | None = None             # rank 0: what <out_dir>/summary.json holds (observe.RunSummary)


def train(model: torch.nn.Module, plan, config: TrainConfig, *, pm=None, dataset=None) -> TrainResult:
    """Train `model` as `plan` says, in an initialised process group. See the module docstring."""
    rank = dist.get_rank()
    out = Path(config.out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        plan.save(out / "plan.json")
    torch.manual_seed(config.seed)
    pm = pm or parallelize(model, plan)
    vocab = _vocab(model)
    batches = batch_schedule_for(plan, config)     # None: the plan's global batch every step
    check_pipeline(pm, batches)
    # rank 0 tokenises (and caches) text first, so the others only read the cache (inputs.py)
    data = build_training_data(config, plan, model, rampup=batches, dataset=dataset, vocab=vocab)
    sampler = data.sampler
    # Adam moments in the layout's optimizer_dtype (fp32, or bf16 with fp32 master weights: optim.py);
    # Muon (muon.py) for the matrices when the config or the plan's layout asks for it
    optimizer = config.optimizer or getattr(plan.layout, "optimizer", "adamw")
    opt = build_optimizer(pm.named_parameters(), optimizer_dtype=plan.layout.optimizer_dtype, lr=config.lr,
                          betas=config.betas, weight_decay=config.weight_decay, device=pm.device,
                          optimizer=optimizer)
    if hasattr(opt, "attach"):      # Muon: its update exchange runs into the next forward (muon.py)
        opt.attach(pm.stages, blocks=getattr(plan, "blocks", ()))
    _report_precisions(pm, plan, out, rank)
    scaler = loss_scaler_for(pm, config.loss_scaling, initial=config.initial_loss_scale,
                             growth_interval=config.loss_scale_window)
    start = 0
    checkpoints = ckpt.Checkpointer(out, keep=config.keep_checkpoints, async_save=config.async_checkpoint,
                                    keep_every=config.keep_every)
    last = checkpoints.last if config.resume else None
    if last is None and config.init_from:
        ckpt.load_weights(config.init_from, pm)     # fine-tune start: weights only, step 0, fresh optimizer
        if rank == 0:
            print(f"initialised the model's weights from {config.init_from}", flush=True)
    if last is not None:
        meta = ckpt.load(last, pm, opt)
        start = int(meta["step"])
        sampler.load_state_dict(meta["data"])
        torch.set_rng_state(torch.tensor(meta["rng"], dtype=torch.uint8))
        if scaler is not None:
            scaler.load_state_dict(meta.get("loss_scale"))
        if rank == 0:
            print(f"resumed from {last} (step {start})", flush=True)
    predicted = plan.estimate.step_time_s
    est_mfu = plan.estimate.mfu
    balancer = _balancer(pm)
    log = MetricsLog(out / "metrics.jsonl") if rank == 0 else None
    bar = Progress(total_steps=config.steps) if rank == 0 and config.progress else None
    loggers = Loggers(config.log, out, config=asdict(config)) if rank == 0 and config.log else None
    summary = RunSummary(seq_len=plan.seq_len, start_step=start)
    memory = StepMemory(pm.device)
    skipped: list[int] = []
    losses: dict[int, float] = {}
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _bound_collectives(pm, config.collective_timeout_s)     # from here on: set-up (tokenising, loading) is done
    heartbeat = _Heartbeat()
    profiler = _StepProfiler(config.profile_steps, out, rank)
    step = start
    # Muon with an overlapped update: the weights of step k are complete only once step k+1's forward
    # has applied the last update slices, so step k's line waits for its parameter norm until then
    # (rank 0 writes it one step late); other optimizers log each step at its end
    waiting: tuple | None = None          # (StepMetrics, its step's memory peak) on rank 0
    deferred = False                      # on every rank: the last step's norm is still to be taken

    def emit(m, peak) -> None:
        log.write(m)
        summary.add(m, memory=peak)
        if loggers:
            loggers.log(m)
        if bar:
            bar.update(m)

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
                       min_lr=config.lr * config.min_lr_ratio, style=config.lr_schedule,
                       decay_steps=config.wsd_decay_steps, decay_style=config.wsd_decay_style)
            set_lr(opt, lr)
            batch = sampler.sample(step)
            x, y = batch.input_ids, batch.labels
            _set_microbatches(pm, balancer, x.shape[0])
            profiler.before(step + 1)
            memory.begin()
            c0 = time.process_time()
            t0 = time.perf_counter()
            if balancer is not None:
                balancer.begin_step()
            if scaler is not None:
                pm.set_loss_scale(scaler.scale)
            loss = pm.forward_backward(x, y) if batch.document_ids is None else \
                pm.forward_backward(x, y, batch.document_ids)
            if deferred:                        # the previous step's weights, all applied by this forward
                t_norm = time.perf_counter()
                finish_pending(opt)                         # a group no forward read (none, normally)
                norm_before = pm.global_norm("params")      # collective
                if rank == 0:
                    emit(replace(waiting[0], param_norm=norm_before), waiting[1])
                waiting = None
                t0 += time.perf_counter() - t_norm          # not this step's work
            c1 = time.process_time()
            # fp16: unscale; inf/nan on any rank skips the step on every rank
            skip = scaler.unscale_and_check(pm) if scaler is not None else False
            norm = float("nan") if skip else pm.clip_grad_norm(config.grad_clip)
            if not skip:
                opt.step()
            pm.zero_grad()
            deferred = update_pending(opt)      # Muon's update lands during the next forward
            routing = balancer.finish_step() if balancer is not None else {}   # expert-bias update
            dt = time.perf_counter() - t0
            cpu = time.process_time() - c0
            scale_used = pm.loss_scale if scaler is not None else None
            if scaler is not None:
                scaler.update(skip, step + 1)
                if skip:
                    skipped.append(step + 1)
            param_norm = None if deferred else pm.global_norm("params")   # collective, outside the timed step
            eval_loss = data.evaluate(pm) if data.eval_due(step + 1, config.steps) else None   # collective
            peak = memory.end()                     # collective: every rank's peak of this step
            profiler.after(step + 1)
            losses[step + 1] = loss
            if rank == 0:
                # with a ramp-up, the predicted time and MFU are the plan's, at the full batch
                full = x.shape[0] / plan.global_batch
                m = StepMetrics(step=step + 1, loss=loss, grad_norm=norm, lr=lr,
                                tokens_per_s=x.shape[0] * plan.seq_len / dt,
                                step_time_s=dt, predicted_step_time_s=predicted * full if predicted else None,
                                cpu_time_s=cpu, cpu_update_s=cpu - (c1 - c0),
                                # MFU scales inversely with step time from the plan's own prediction
                                mfu=(est_mfu * predicted * full / dt) if est_mfu and predicted else None,
                                peak_memory_gb=peak.peak_gb, peak_memory_rank=peak.rank,
                                peak_reserved_gb=peak.reserved_gb, param_norm=param_norm,
                                loss_scale=scale_used, skipped=skip if scaler is not None else None,
                                global_batch=x.shape[0], eval_loss=eval_loss, **moe_metrics(routing))
                if deferred:
                    waiting = (m, peak)
                else:
                    emit(m, peak)
            done = step + 1
            checkpoints.poll()                    # completes a background checkpoint once all ranks wrote it
            stopping = config.stop_at is not None and done >= config.stop_at
            if (config.checkpoint_every and done % config.checkpoint_every == 0) or done == config.steps or stopping:
                sampler_state = {**sampler.state_dict(), "step": done}
                checkpoints.save(done, pm, opt, {
                    "data": sampler_state, "rng": torch.get_rng_state().tolist(),
                    "loss_scale": scaler.state_dict() if scaler is not None else None,
                    "layout": plan.layout.to_dict(), "config": asdict(config), "optimizer": optimizer})
            if stopping:
                break
        finish_pending(opt)                       # the weights the caller gets are the last step's
        if deferred:
            last_norm = pm.global_norm("params")    # collective
            if rank == 0 and waiting is not None:
                emit(replace(waiting[0], param_norm=last_norm), waiting[1])
        written = checkpoints.close()             # waits for a checkpoint still being written
    except RuntimeError as e:
        if _is_timeout(e):
            raise heartbeat.diagnose(step + 1, e) from e
        raise
    finally:
        profiler.close()
        if bar:
            bar.close()
        if log:
            log.close()
        if loggers:
            loggers.close()
    checkpoint = str(written) if written else None
    report = summary.finish(out, checkpoint=checkpoint, loss_scale=scaler.scale if scaler else None) \
        if rank == 0 else None
    return TrainResult(losses=losses, start_step=start, final_step=start + len(losses), checkpoint=checkpoint,
                       skipped_steps=tuple(skipped), summary=report)


class _StepProfiler:
    """torch.profiler over steps first..last (1-based) on this rank: a Chrome trace
    (profile/rank<r>.json, open in chrome://tracing or Perfetto) and the operator table sorted by
    self CPU time (profile/rank<r>.txt). The profiler's own hooks slow each op, so the profiled
    steps' step_time_s in metrics.jsonl reads high."""

    def __init__(self, steps: tuple[int, int] | None, out: Path, rank: int) -> None:
        self.steps, self.out, self.rank, self.prof = steps, out, rank, None

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0] and self.prof is None:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts, record_shapes=False)
            self.prof.__enter__()

    def after(self, step: int) -> None:
        if self.prof is not None and step >= self.steps[1]:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        d = self.out / "profile"
        d.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(d / f"rank{self.rank}.json"))
        n = self.steps[1] - self.steps[0] + 1
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
        (d / f"rank{self.rank}.txt").write_text(f"steps {self.steps[0]}..{self.steps[1]} ({n} steps), rank {self.rank}\n{table}\n")


def _set_microbatches(pm, balancer, batch: int) -> None:
    """Keep the plan's layout (micro-batch size), change the number of micro-batches."""
    per_microbatch = pm.plan.mesh.get("dp", 1) * pm.plan.layout.mbs
    m = batch // per_microbatch
    pm.set_microbatches(m)
    if balancer is not None:
        balancer.set_microbatches(m)


def _balancer(pm):
    """MoE load balancing over dp x cp and micro-batches when the model has routed layers (collective)."""
    balancer = MoEBalancer(pm)
    return balancer if balancer.active else None


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


def _report_precisions(pm, plan, out: Path, rank: int) -> None:
    """Rank 0 prints one line per precision kind and writes every module's precision (all pipeline
    ranks gathered) to out/precisions.json: what runs, whatever the plan said (collective)."""
    import json

    mine = dict(getattr(pm, "precisions", {}) or {})
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    merged: dict[str, str] = {}
    for part in parts:
        merged.update(part or {})
    if rank != 0 or not merged:
        return
    lay = plan.layout
    print(f"precision (plan: {plan.precision}, {len(plan.fp8_modules)} FP8 modules; Adam moments "
          f"{lay.optimizer_dtype}):", flush=True)
    for line in precision_summary(merged):
        print(f"  {line}", flush=True)
    compiled = getattr(pm, "compiled", [])
    print(f"torch.compile: {f'{len(compiled)} blocks' if compiled else 'off (eager)'}", flush=True)
    (out / "precisions.json").write_text(json.dumps({"plan_precision": plan.precision,
                                                      "optimizer_dtype": lay.optimizer_dtype,
                                                      "modules": merged}, indent=1, sort_keys=True) + "\n")


def _vocab(model) -> int | None:
    cfg = getattr(model, "config", None)
    for attr in ("vocab", "vocab_size"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int):
            return v
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None
