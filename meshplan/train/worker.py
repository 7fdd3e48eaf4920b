"""What each rank of a `meshplan train` job runs: process group, plan, model, `parallelize`, the
training loop, and a clean one-line reason when the job stops.

`run_worker(job, build_model, plan=None)` is called on every torchrun rank (by cli/train.py, which
reads the JobConfig the launching command wrote). `build_model(device)` builds the job's model on
"meta" or "cpu" (the CLI's loader: presets, model files, transformers configs); `plan` is the plan
when this rank made it itself (torchrun started `meshplan train` directly), else the job's plan
file is read. torch is imported here, not at module level, so `meshplan --help` starts without it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from meshplan.errors import ConfigError, MeshplanError
from meshplan.ir.plan import Plan
from meshplan.ir.precision import AUTO, Precision
from meshplan.train.job import JobConfig

__all__ = ["run_worker", "parallel_options", "run_precision", "FAILURE_PREFIX", "SETUP_TIMEOUT_S"]

# Start-up (rendezvous, rank 0 tokenising the data while the others wait, model set-up) may take
# longer than a step's collectives; JobConfig.timeout bounds the collectives of the training loop.
SETUP_TIMEOUT_S = 300.0
FAILURE_PREFIX = "failure-rank"             # out/failure-rank<N>.txt: why a worker stopped the job


def run_precision(plan, requested: Precision | str | None) -> dict:
    """parallelize() keywords for running `plan` at `requested` precision (None: the plan's own).
    A precision other than the plan's is the explicit override (logged by parallelize/train)."""
    import torch
    if requested in (None, AUTO, plan.precision):
        return {"compute_dtype": "plan", "fp8": True}
    if requested == Precision.FP8:
        raise ConfigError(f"this plan was made for {plan.precision}, not fp8: re-plan with --precision fp8 "
                          "(the planner chooses which modules run in FP8)")
    dtype = {Precision.FP32: None, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}[requested]
    return {"compute_dtype": dtype, "fp8": False}


def parallel_options(job: JobConfig, plan):
    """The ParallelOptions the job's flags ask for (--precision, --fp8-*, --compile, --fp32-grads)."""
    from meshplan.runtime.options import ParallelOptions
    return ParallelOptions(**run_precision(plan, job.precision), fp8_backend=job.fp8_backend,
                           fp8_recipe=job.fp8_recipe,
                           compile={"on": True, "off": False}.get(job.compile, "auto"),
                           fp32_grads=job.fp32_grads or ())


def starts_on_meta(model, job: JobConfig) -> bool:
    """Whether `model` is parallelised from the meta device (each rank allocates only its shards):
    meshplan's models always (their initialisation replays exactly, runtime/materialize.py), and
    transformers models when --init-from gives their weights (a fine-tuning start: the weights come
    from the files, read slice by slice, so no rank builds the whole model). A transformers model
    initialised from scratch is built whole on the CPU, so its initial weights are exactly
    transformers' own."""
    return hasattr(model, "init_module") or bool(job.init_from and hasattr(model, "_init_weights"))


def run_worker(job: JobConfig, build_model: Callable[[str], object], plan=None) -> int:
    """One rank of the job; returns its exit code (0 done, 1 a hung rank, 2 another clean reason)."""
    import torch
    import torch.distributed as dist
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    _init_process_group(job)
    try:
        return _train(job, build_model, plan if plan is not None else Plan.load(job.plan))
    finally:
        dist.destroy_process_group()


def _init_process_group(job: JobConfig) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=max(job.timeout, SETUP_TIMEOUT_S))
    # A private key space per restart attempt: after a restart, gloo must not find the previous
    # attempt's addresses in torchrun's store (seen as "connectFullMesh ... Connection refused").
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"meshplan/attempt_{attempt}", base),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def _train(job: JobConfig, build_model, plan) -> int:
    import torch
    import torch.distributed as dist

    from meshplan.runtime.parallel import parallelize
    from meshplan.train.loop import RankHangError, train
    torch.manual_seed(job.seed)
    # meshplan's models start on the meta device: parallelize allocates and initialises only
    # this rank's shards (runtime/materialize.py), so a model larger than one rank can start
    model = build_model("meta")
    if not starts_on_meta(model, job):
        model = build_model("cpu")          # other models: built whole, on every rank
    pm = parallelize(model, plan, parallel_options(job, plan))
    if job.fp32_grads and dist.get_rank() == 0:
        kept = ", ".join(pm.fp32_grads[:6]) + (" ..." if len(pm.fp32_grads) > 6 else "")
        print(f"--fp32-grads {job.fp32_grads}: " + (f"gradients of {len(pm.fp32_grads)} modules reduce in fp32 "
              f"({kept})" if pm.fp32_grads else f"nothing to change (the plan reduces gradients in "
              f"{plan.layout.grad_dtype}, or no parameter matches, or one data-parallel rank)"), flush=True)
    cfg = job.train_config()
    try:
        res = train(model, plan, cfg, pm=pm)
    except (RankHangError, MeshplanError) as e:
        # a clean reason (a hung rank, a full disk, a damaged checkpoint, ...); the non-zero
        # exit makes torchrun stop the remaining ranks; the CLI repeats it after torchrun's report
        print(f"meshplan: error: {e}", file=sys.stderr, flush=True)
        try:
            (Path(job.out) / f"{FAILURE_PREFIX}{dist.get_rank()}.txt").write_text(str(e))
        except OSError:
            pass                        # e.g. the full disk itself: the line above is still there
        return 1 if isinstance(e, RankHangError) else 2
    if dist.get_rank() == 0 and res.losses:
        first, last = res.losses[min(res.losses)], res.losses[max(res.losses)]
        print(f"\ntrained steps {res.start_step + 1}..{res.final_step}: loss {first:.3f} -> {last:.3f}; "
              f"checkpoint {res.checkpoint}", flush=True)
    return 0
