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
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from meshplan.errors import ConfigError
from meshplan.runtime import checkpoint as ckpt
from meshplan.runtime.schedule import lr_at, set_lr

__all__ = ["TrainConfig", "TrainResult", "train"]


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
    stop_at: int | None = None              # stop (with a checkpoint) after this step, as a job time limit would
    fail_at_step: int | None = None         # testing aid: rank 1 exits at this step on the first attempt

    def __post_init__(self) -> None:
        for name in ("steps", "warmup", "checkpoint_every", "keep_checkpoints"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be a whole number >= 0, got {v!r}")
        if self.steps < 1:
            raise ConfigError("steps must be >= 1")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr!r}")


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
    last = ckpt.latest(out) if config.resume else None
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
    written = str(last) if last else None
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    try:
        for step in range(start, config.steps):
            if config.fail_at_step is not None and step == config.fail_at_step and rank == 1 and restart == 0:
                os._exit(17)                      # simulated crash of one rank (tests only)
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
            stopping = config.stop_at is not None and done >= config.stop_at
            if (config.checkpoint_every and done % config.checkpoint_every == 0) or done == config.steps or stopping:
                sampler_state = {**sampler.state_dict(), "step": done}
                written = str(ckpt.save(out, done, pm, opt, {
                    "data": sampler_state, "rng": torch.get_rng_state().tolist(),
                    "layout": plan.layout, "config": asdict(config)}, keep=config.keep_checkpoints))
            if stopping:
                break
    finally:
        if bar:
            bar.close()
        if log:
            log.close()
    return TrainResult(losses=losses, start_step=start, final_step=start + len(losses), checkpoint=written)


def _vocab(model) -> int | None:
    cfg = getattr(model, "config", None)
    for attr in ("vocab", "vocab_size"):
        v = getattr(cfg, attr, None)
        if isinstance(v, int):
            return v
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None
