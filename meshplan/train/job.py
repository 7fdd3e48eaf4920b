"""`JobConfig`: one `meshplan train` job as every rank runs it.

The CLI (cli/train.py) fills it once from the command line, after resolving the plan (the
plan file, the model it names, its batch and sequence length), writes it as JSON next to the
plan and launches the ranks, which read it back (train/worker.py). The fields are the command's
options, named as the flags are (`--global-batch` is `global_batch`), so a message about a value
names the flag the user typed. The workers read it from a file rather than their command line:
on torchrun's command line, options such as --nproc or --max-restarts would be taken by
torchrun's own parser (prefix matching).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from meshplan.errors import ConfigError

__all__ = ["JobConfig", "MOE_FIELDS"]

# MoE options: ModelConfig fields set only when given, so a dense model is refused only when the
# user asked for balancing
MOE_FIELDS = ("moe_aux_loss_coeff", "moe_aux_loss_scope", "moe_z_loss_coeff", "moe_expert_bias",
              "moe_bias_update_rate", "moe_capacity_factor", "moe_force_balance")
# whole-number options and their least value (named as flags in messages)
_WHOLE = (("steps", 1), ("global_batch", 1), ("seq_len", 1), ("warmup", 0), ("checkpoint_every", 0),
          ("keep", 0), ("keep_every", 0), ("max_restarts", 0))


@dataclass(frozen=True)
class JobConfig:
    """A `meshplan train` job: the model, the plan, the data and the training loop's options.
    `docs/training.md` documents each flag; the defaults are the command's."""

    # the model and its plan
    model: str | None = None                # preset, path/to/file.py:factory, or a transformers config JSON
    plan: str | None = None                 # the plan file (the CLI writes the job's plan next to this file)
    seq_len: int | None = None
    global_batch: int | None = None
    precision: str | None = None            # None: the plan's; another value is an explicit override
    fp8_backend: str = "auto"
    fp8_recipe: str | None = None
    compile: str = "auto"                   # "auto" | "on" | "off"
    optimizer_dtype: str | None = None
    optimizer: str | None = None
    fp32_grads: str | None = None           # parameter-name patterns whose gradients reduce in fp32
    fix: str = ""
    cluster: str = "local-cpu"
    # processes and machines
    nproc: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_timeout: float = 300.0
    max_restarts: int = 0
    timeout: float = 300.0                  # seconds a collective may wait while training
    # the training loop
    steps: int = 100
    lr: float = 3e-3
    warmup: int = 10
    seed: int = 0
    lr_schedule: str = "cosine"
    wsd_decay_steps: int | None = None
    wsd_decay_style: str = "linear"
    rampup_batch_size: tuple[int, int, int] | None = None
    batch_schedule: str | None = None
    init_from: str | None = None
    profile: str | None = None              # "FIRST:LAST"
    log: str = ""                           # "tensorboard,wandb"
    loss_scaling: str = "auto"
    # data
    data: str | None = None
    tokenizer: str | None = None
    text_field: str = "text"
    document_mask: bool | None = None
    eval_every: int = 0
    eval_batches: int = 1
    eval_data: str | None = None
    eval_fraction: float | None = None
    # output and checkpoints
    out: str = "meshplan-run"
    checkpoint_every: int = 50
    keep: int = 2
    keep_every: int = 0
    async_checkpoint: bool = False
    no_resume: bool = False
    # MoE model options (MOE_FIELDS)
    moe_aux_loss_coeff: float | None = None
    moe_aux_loss_scope: str | None = None
    moe_z_loss_coeff: float | None = None
    moe_expert_bias: bool | None = None
    moe_bias_update_rate: float | None = None
    moe_capacity_factor: float | None = None
    moe_force_balance: bool | None = None
    # testing aids: one rank crashes (fail_at_step) or stops responding (hang_at_step)
    fail_at_step: int | None = None
    hang_at_step: int | None = None
    hang_rank: int = 1

    def __post_init__(self) -> None:
        if self.rampup_batch_size is not None:     # JSON and argparse give lists
            object.__setattr__(self, "rampup_batch_size", tuple(self.rampup_batch_size))

    # ---- filling and reading back ---------------------------------------------------------------
    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_options(cls, options) -> JobConfig:
        """From the parsed command line (an argparse.Namespace or any object with the options as
        attributes); attributes that are not job options (the subcommand, its function) are left out."""
        values = vars(options) if not isinstance(options, dict) else options
        return cls(**{k: values[k] for k in cls.fields() if k in values})

    @classmethod
    def from_dict(cls, data: dict) -> JobConfig:
        """From `to_dict`'s output. Keys a newer meshplan wrote are refused; keys an older one did
        not write take their defaults."""
        unknown = sorted(set(data) - set(cls.fields()))
        if unknown:
            raise ConfigError(f"job config has unknown option(s) {', '.join(unknown)}: it was written by another "
                              "meshplan version; rerun `meshplan train` to write it again")
        return cls(**data)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if self.rampup_batch_size is not None:
            out["rampup_batch_size"] = list(self.rampup_batch_size)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path) -> None:
        """Write atomically: nodes sharing a file system write the same file, and a reader must
        never see half of it."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path) -> JobConfig:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read the job config {str(path)!r}: {e.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"job config {str(path)!r} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"job config {str(path)!r} is not a JSON object of options")
        return cls.from_dict(data)

    # ---- what the job's parts read --------------------------------------------------------------
    @property
    def moe_overrides(self) -> dict:
        """The MoE model options given (ModelConfig fields)."""
        return {k: getattr(self, k) for k in MOE_FIELDS if getattr(self, k) is not None}

    def train_config(self):
        """The training loop's config, every option checked (ConfigError names the flag and a value
        that works). The CLI calls it before planning; each worker again."""
        from meshplan.train.loop import TrainConfig
        for name, low in _WHOLE:
            v = getattr(self, name)
            if v is not None and v < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {v}")
        for name in ("lr", "timeout", "rdzv_timeout"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {v}")
        if self.init_from and not Path(self.init_from).exists():
            raise ConfigError(f"--init-from {self.init_from!r} does not exist; give a checkpoint's step_N directory "
                              "or a directory of safetensors files")
        return TrainConfig(steps=self.steps, lr=self.lr, warmup=min(self.warmup, self.steps), seed=self.seed,
                           data=self.data, tokenizer=self.tokenizer, text_field=self.text_field,
                           document_mask=self.document_mask, eval_every=self.eval_every,
                           eval_batches=self.eval_batches, eval_data=self.eval_data,
                           eval_fraction=self.eval_fraction,
                           out_dir=self.out, checkpoint_every=self.checkpoint_every, keep_checkpoints=self.keep,
                           async_checkpoint=self.async_checkpoint, resume=not self.no_resume,
                           collective_timeout_s=self.timeout, fail_at_step=self.fail_at_step,
                           hang_at_step=self.hang_at_step, hang_rank=self.hang_rank,
                           lr_schedule=self.lr_schedule, wsd_decay_steps=self.wsd_decay_steps,
                           wsd_decay_style=self.wsd_decay_style, keep_every=self.keep_every,
                           rampup_batch_size=self.rampup_batch_size, init_from=self.init_from,
                           profile_steps=profile_steps(self.profile), batch_schedule=self.batch_schedule or None,
                           log=self.log or (), loss_scaling=self.loss_scaling)


def profile_steps(text: str | None) -> tuple[int, int] | None:
    """--profile FIRST:LAST (or one step N) -> (first, last)."""
    if not text:
        return None
    parts = text.split(":")
    try:
        first, last = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        first, last = 0, -1
    if not 1 <= first <= last:
        raise ConfigError(f"--profile {text!r}: give the steps to profile as FIRST:LAST with 1 <= FIRST <= LAST, "
                          "e.g. --profile 6:8 (after the first steps' warm-up)")
    return first, last
