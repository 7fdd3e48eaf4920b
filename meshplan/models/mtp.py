"""Multi-token prediction (MTP): DeepSeek-V3's sequential extra prediction depths.

DeepSeek-V3 (arXiv 2412.19437, Sec. 2.2) trains with D sequential MTP modules. Module k takes
the representation h^{k-1}_i of token i from the depth before it (the main model's last block
for k = 1) and the embedding of token i+k, normalises each, and projects their concatenation
back to the model width (eq. 21), then runs one transformer block (eq. 22):

    h'^k_i = M_k [RMSNorm(h^{k-1}_i); RMSNorm(Emb(t_{i+k}))]       M_k: (h, 2h), no bias
    h^k    = Block_k(h'^k)

The output head, shared with the main model, predicts token i+k+1 from h^k (after the module's
own final norm, as DeepSeek's released weights and Megatron-Core keep one per depth), and the
training loss becomes

    L = L_main + lambda / D * sum_k L_MTP^k       (eq. 24-25; lambda = mtp_loss_weight)

with each L_MTP^k the mean cross entropy over the positions whose target exists (the last k
positions of a sequence have none). The embedding is the main model's too.

How the model hands the MTP logits to a loss it does not compute (the runtime computes the
loss from the logits, `runtime/model.py`): in training mode `Transformer.forward` returns the
main logits followed by each depth's along the sequence dimension, (B, (1 + D) T, vocab). One
tensor crosses pipeline stages, stays vocabulary-sharded under TP and feeds the fused
linear + cross-entropy as hidden states unchanged; `split_logits` undoes it, `mtp_targets`
shifts the labels. In eval mode the model returns (B, T, vocab) alone: MTP is a training
objective and is dropped at inference (its modules may later serve speculative decoding).

The block of each depth is of the kind of the main model's last layer (an MoE block for
DeepSeek-V3), kept out of the model's `layers` so the planner does not count it as a layer of
the main stack; the container is a plain module, not a ModuleList, for the same reason (a list
of two identical modules would be taken for repeated layers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshplan.errors import ConfigError
from meshplan.models.config import ModelConfig
from meshplan.models.layers import make_norm

__all__ = ["MTPModule", "MultiTokenPrediction", "mtp_input_ids", "mtp_targets", "split_logits",
           "mtp_causal_lm_loss"]

IGNORE_INDEX = -100


class MTPModule(nn.Module):
    """One prediction depth: norms, the concatenation projection, one block, the output norm."""

    def __init__(self, config: ModelConfig, block: nn.Module):
        super().__init__()
        self.hnorm = make_norm(config)          # the previous depth's representation
        self.enorm = make_norm(config)          # the embedding of token i + k
        self.proj = nn.Linear(2 * config.hidden, config.hidden, bias=False)
        self.block = block
        self.norm = make_norm(config)           # before the shared output layer

    def forward(self, h: Tensor, emb: Tensor, rope: tuple[Tensor, Tensor] | None = None,
                mask: Tensor | None = None) -> Tensor:
        """h, emb (B, T, hidden) -> this depth's representation (B, T, hidden), before `norm`."""
        x = self.proj(torch.cat([self.hnorm(h), self.enorm(emb)], dim=-1))     # (B, T, h)
        return self.block(x, rope) if mask is None else self.block(x, rope, mask)


class MultiTokenPrediction(nn.Module):
    """The D depths, children "0" .. "D-1" (a plain module, see the module docstring)."""

    def __init__(self, config: ModelConfig, make_block: Callable[[int], nn.Module]):
        """make_block(index): the block of layer `index` (the depths continue the layer count, so
        each block is of the kind a layer after the last one would be)."""
        super().__init__()
        for k in range(config.mtp_depth):
            self.add_module(str(k), MTPModule(config, make_block(config.layers + k)))

    @property
    def depth(self) -> int:
        return len(self._modules)

    def forward(self, h: Tensor, embeddings: list[Tensor], rope=None, mask=None) -> list[Tensor]:
        """h (B, T, hidden): the main model's last block output; embeddings[k-1]: Emb(t_{i+k}).
        Returns each depth's normed representation (B, T, hidden), depth 1 first."""
        out = []
        for module, emb in zip(self._modules.values(), embeddings):
            h = module(h, emb, rope, mask)
            out.append(module.norm(h))
        return out


def mtp_input_ids(input_ids: Tensor, k: int) -> Tensor:
    """Token i + k at position i, (B, T); the last k positions, past the sequence, get token 0
    (their predictions have no target, and causal attention keeps them from earlier positions)."""
    return F.pad(input_ids[:, k:], (0, k), value=0)


def mtp_targets(labels: Tensor, k: int, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Depth k's targets from next-token labels (B, T) aligned with the logits: token i + k + 1 at
    position i is labels[:, i + k]; the last k positions have none (ignore_index)."""
    return F.pad(labels[:, k:], (0, k), value=ignore_index)


def split_logits(logits: Tensor, depth: int, seq_len: int) -> list[Tensor]:
    """Training-mode output (B, (1 + depth) seq_len, ...) -> [main, depth 1, ..., depth D] of
    (B, seq_len, ...) each; an output of seq_len positions (eval mode) -> [it]."""
    if logits.shape[1] == seq_len:
        return [logits]
    if logits.shape[1] != (1 + depth) * seq_len:
        raise ConfigError(f"the model returned {logits.shape[1]} positions for sequences of {seq_len} tokens; "
                          f"with mtp_depth={depth} a training forward returns {(1 + depth) * seq_len} "
                          f"(the main logits, then each depth's)")
    return list(logits.split(seq_len, dim=1))


def mtp_causal_lm_loss(logits: Tensor, labels: Tensor, config: ModelConfig) -> Tensor:
    """The training objective of a model with MTP on one device: the main mean cross entropy plus
    mtp_loss_weight times the mean over depths of each depth's mean cross entropy. `logits` is
    the training-mode output, `labels` (B, T) next-token labels (-100: skipped)."""
    parts = split_logits(logits, config.mtp_depth, labels.shape[1])

    def ce(z: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(z.flatten(0, -2).float(), y.flatten(), ignore_index=IGNORE_INDEX)

    loss = ce(parts[0], labels)
    if len(parts) > 1:
        extra = sum(ce(z, mtp_targets(labels, k)) for k, z in enumerate(parts[1:], 1))
        loss = loss + config.mtp_loss_weight / config.mtp_depth * extra
    return loss
