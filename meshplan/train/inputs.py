"""The training loop's data: which data sets `TrainConfig` names, opened on every rank, the
sampler over them (one data set or a weighted blend), document masking, and the validation
batches with their schedule.

Document masking (`document_mask`): None (the default) turns it on exactly when every training
data set records document boundaries (prepared data: `meshplan data prepare`, or JSONL/Parquet/
tokenizer sources, which are prepared into the cache) and the layout and model can run it; the
byte-tokenised text folders, token files and the built-in corpus keep their plain stream, so
their batches and losses are what they always were. True requires it (an error says what is
missing); False turns it off.

Validation: every `eval_every` steps (and after the last step), the loss over `eval_batches`
fixed batches - the same batches every time, so the numbers compare - of `eval_data`, or of the
last `eval_fraction` of each training data set, which is then held out of training. The loss is
the token-weighted mean over those batches, computed forward-only under the training layout.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch.distributed as dist

from meshplan.errors import ConfigError
from meshplan.train.blend import BlendedSampler, parse_data_spec
from meshplan.train.data import TokenDataset
from meshplan.train.sampler import IGNORE_INDEX, SamplerBase

__all__ = ["TrainingData", "build_training_data", "check_options", "open_datasets"]


def check_options(config) -> None:
    """TrainConfig's data options (ConfigError names the option and what would work)."""
    for name in ("eval_every", "eval_batches"):
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "eval_every" else 1):
            raise ConfigError(f"{name} must be a whole number >= {0 if name == 'eval_every' else 1}, got {v!r}")
    if config.document_mask not in (None, True, False):
        raise ConfigError(f"document_mask must be True, False or None (automatic), got {config.document_mask!r}")
    if not isinstance(config.text_field, str) or not config.text_field:
        raise ConfigError(f"text_field must name the JSONL/Parquet text field, got {config.text_field!r}")
    f = config.eval_fraction
    if f is not None and not (isinstance(f, (int, float)) and 0 < f < 1):
        raise ConfigError(f"eval_fraction must lie strictly between 0 and 1 (e.g. 0.01), got {f!r}")
    if f is not None and config.eval_data is not None:
        raise ConfigError("give either eval_data (a separate validation set) or eval_fraction (held out of the "
                          "training data), not both")
    if config.eval_every and f is None and config.eval_data is None:
        raise ConfigError(f"eval_every={config.eval_every} needs validation data: --eval-data PATH, or "
                          "--eval-fraction F to hold out the last F of the training data")
    parse_data_spec(config.data)
    parse_data_spec(config.eval_data)


def open_datasets(spec: str | None, *, tokenizer: str | None, text_field: str) -> tuple[list[TokenDataset], list[float]]:
    """The data sets of a --data value (one, or a blend's components) and their weights. Rank 0
    opens them first (tokenising text into the cache), the other ranks then read the cache."""
    parts = parse_data_spec(spec) or [(spec, 1.0)]

    def open_all():
        return [TokenDataset.open(src, tokenizer=tokenizer, text_field=text_field) for src, _ in parts]

    if not dist.is_initialized():
        return open_all(), [w for _, w in parts]
    rank = dist.get_rank()
    if rank == 0:
        datasets = open_all()
    dist.barrier()
    if rank != 0:
        datasets = open_all()
    return datasets, [w for _, w in parts]


@dataclass
class TrainingData:
    sampler: SamplerBase
    eval_sampler: SamplerBase | None
    document_mask: bool
    eval_every: int
    eval_batches: int

    def eval_due(self, step: int, last_step: int) -> bool:
        """Whether to validate after step `step` (1-based)."""
        return self.eval_sampler is not None and self.eval_every > 0 and (
            step % self.eval_every == 0 or step == last_step)

    def evaluate(self, pm) -> float:
        """Token-weighted mean validation loss over the fixed eval batches (collective)."""
        saved = pm.microbatches_override
        pm.set_microbatches(None)               # eval batches are full global batches
        try:
            total, count = 0.0, 0
            for k in range(self.eval_batches):
                b = self.eval_sampler.sample(k)
                n = int((b.labels != IGNORE_INDEX).sum())
                loss = pm.evaluate(b.input_ids, b.labels) if b.document_ids is None else \
                    pm.evaluate(b.input_ids, b.labels, b.document_ids)
                total, count = total + loss * n, count + n
        finally:
            pm.set_microbatches(saved)
        return total / max(count, 1)


def _takes_document_ids(model) -> bool:
    try:
        return "document_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _document_mask(config, plan, model, datasets: list[TokenDataset]) -> bool:
    have = all(ds.doc_starts is not None for ds in datasets)
    cp = plan.mesh.get("cp", 1)
    why_not = None
    if not _takes_document_ids(model):
        why_not = (f"the model ({type(model).__name__}) takes no document_ids in its forward, so its attention "
                   "cannot be kept inside documents (meshplan's models can)")
    elif cp > 1:
        why_not = (f"context parallelism (cp={cp}) runs plain causal ring attention; re-plan with "
                   "fixed={'cp': 1} to mask documents")
    if config.document_mask is False:
        return False
    if config.document_mask is True:
        if not have:
            missing = next(ds.source for ds in datasets if ds.doc_starts is None)
            raise ConfigError(f"--document-mask needs document boundaries, which {missing} does not record; "
                              "prepare it with `meshplan data prepare`, or train without --document-mask")
        if why_not:
            raise ConfigError(f"--document-mask cannot run here: {why_not}; or train with --no-document-mask")
        return True
    if have and why_not and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"note: training without document masking: {why_not}", file=sys.stderr, flush=True)
    return have and why_not is None


def build_training_data(config, plan, model, *, rampup=None, dataset: TokenDataset | None = None,
                        vocab: int | None = None) -> TrainingData:
    """The samplers for `config` under `plan` (every rank the same; collective when it opens data)."""
    from meshplan.train import tokenizer as tokenizers
    if config.tokenizer is not None:
        tokenizers.check_model_vocab(tokenizers.load(config.tokenizer), vocab)
    if dataset is not None:
        datasets, weights = [dataset], [1.0]
    else:
        datasets, weights = open_datasets(config.data, tokenizer=config.tokenizer, text_field=config.text_field)
    eval_sets, eval_weights = [], weights
    if config.eval_fraction is not None:
        pairs = [ds.split(config.eval_fraction) for ds in datasets]
        datasets, eval_sets = [p[0] for p in pairs], [p[1] for p in pairs]
    elif config.eval_data is not None:
        eval_sets, eval_weights = open_datasets(config.eval_data, tokenizer=config.tokenizer,
                                                text_field=config.text_field)
    if vocab:
        for ds in datasets + eval_sets:
            ds.check_vocab(vocab)
    mask = _document_mask(config, plan, model, datasets)
    eval_mask = mask and all(ds.doc_starts is not None for ds in eval_sets)
    common = dict(global_batch=plan.global_batch, seq_len=plan.seq_len, seed=config.seed)
    sampler = _sampler(datasets, weights, rampup=rampup, document_mask=mask, **common)
    eval_sampler = _sampler(eval_sets, eval_weights, document_mask=eval_mask, **common) if eval_sets else None
    if (mask or eval_sampler is not None or len(datasets) > 1) and (not dist.is_initialized() or dist.get_rank() == 0):
        parts = ", ".join(f"{ds.source} ({len(ds):,} tokens" + (f", weight {w:g})" if len(datasets) > 1 else ")")
                          for ds, w in zip(datasets, weights))
        print(f"data: {parts}; document masking {'on' if mask else 'off'}", file=sys.stderr, flush=True)
        if eval_sampler is not None:
            print(f"validation: every {config.eval_every} steps, {config.eval_batches} batch(es) of "
                  f"{', '.join(ds.source for ds in eval_sets)}", file=sys.stderr, flush=True)
    return TrainingData(sampler=sampler, eval_sampler=eval_sampler, document_mask=mask,
                        eval_every=config.eval_every, eval_batches=config.eval_batches)


def _sampler(datasets, weights, **kw) -> SamplerBase:
    if len(datasets) == 1 and len(weights) == 1:
        return datasets[0].sampler(**kw)
    return BlendedSampler(datasets, weights, **kw)
