"""Reference decoder-only transformer: GPT-3 and Llama from one code path, MoE blocks optional.

A plain single-device model, written the way users write them (nanoGPT / torchtitan style):
no parallelism inside. Module names are the contract other tools see:

    Transformer
      tok_embeddings  nn.Embedding(vocab, h)
      pos_embeddings  nn.Embedding(seq_len, h)            (position="learned" only, else None;
                                                          reads the non-persistent `positions` buffer)
      layers          nn.ModuleList of Block
        attention_norm, attention (wq, wk, wv, wo; MLA: wq_a, q_norm, wq_b, wkv_a, kv_norm,
                        wkv_b, wo, models/mla.py), ffn_norm,
        feed_forward    FeedForward (w1, w2[, w3])  or  MoE (router, experts, shared_experts)
      norm
      output          nn.Linear(h, vocab, bias=False)     (weight tied to tok_embeddings if asked)
      mtp             MultiTokenPrediction (config.mtp_depth > 0 only, else None): "0", "1", ...
                      each hnorm, enorm, proj, block (a Block), norm       (models/mtp.py)

Attention reshapes with -1 for the head count, so a tensor-parallel runtime can shard wq/wk/wv
column-wise and wo row-wise without touching this code. `tok_embeddings`, `norm` and `output`
may be set to None by a pipeline-parallel runtime; forward then passes hidden states through.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshplan.errors import ConfigError
from meshplan.models.banded import banded_attention
from meshplan.models.config import ModelConfig
from meshplan.models.layers import FeedForward, apply_rope, document_layout, make_norm, rope_tables
from meshplan.models.mla import MLAttention
from meshplan.models.moe import MoE
from meshplan.models.mtp import MultiTokenPrediction, mtp_input_ids

__all__ = ["Transformer", "Block", "Attention", "FeedForward", "causal_lm_loss", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # label value skipped by the loss (PyTorch / Hugging Face convention)
INIT_STD = 0.02      # GPT-2 / GPT-3 / Megatron init_method_std


class Attention(nn.Module):
    """Causal self-attention with grouped key/value heads (MHA when kv_heads == heads).

    `window` > 0: sliding-window attention, query i sees keys i-window+1..i (models/banded.py).
    `config.attention_sinks`: a learned logit per query head (`sinks`) joins the softmax denominator.
    """

    def __init__(self, config: ModelConfig, window: int = 0):
        super().__init__()
        self.head_dim = config.head_dim
        self.use_rope = config.position == "rope"
        q_dim, kv_dim = config.heads * config.head_dim, config.kv_heads * config.head_dim
        self.wq = nn.Linear(config.hidden, q_dim, bias=config.bias)
        self.wk = nn.Linear(config.hidden, kv_dim, bias=config.bias)
        self.wv = nn.Linear(config.hidden, kv_dim, bias=config.bias)
        self.wo = nn.Linear(q_dim, config.hidden, bias=config.bias)
        # transformers' names (GptOss): the tracer reads `sliding_window` as the block's window, and
        # the string `attention_type` makes windowed layers block signatures of their own (set only
        # there, so the signatures of models without windows stay what they were)
        self.sliding_window = window
        if window:
            self.attention_type = "sliding_attention"
        self.sinks = nn.Parameter(torch.zeros(config.heads)) if config.attention_sinks else None

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, mask: Tensor | None = None) -> Tensor:
        """mask: None for plain causal attention, else (B, 1, T, T) bool, True where a query may
        attend (packed documents: block-diagonal causal, see layers.document_layout)."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)                 # (B, T, heads, hd)
        k = self.wk(x).view(B, T, -1, self.head_dim)                 # (B, T, kv_heads, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.use_rope and rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # (B, n, T, hd)
        if self.sliding_window or self.sinks is not None:
            y = banded_attention(q, k, v, window=self.sliding_window, sinks=self.sinks, mask=mask)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))          # (B, T, h)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, index: int):
        super().__init__()
        self.attention_norm = make_norm(config)
        self.attention: nn.Module = (MLAttention(config) if config.attention == "mla"
                                     else Attention(config, config.layer_window(index)))
        self.ffn_norm = make_norm(config)
        if config.is_moe_layer(index):
            self.feed_forward: nn.Module = MoE(config)
        else:
            self.feed_forward = FeedForward(
                config.hidden, config.ffn_hidden, activation=config.activation, bias=config.bias)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None, mask: Tensor | None = None) -> Tensor:
        x = x + (self.attention(self.attention_norm(x), rope) if mask is None
                 else self.attention(self.attention_norm(x), rope, mask))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only language model: forward(input_ids (B, T)) -> logits (B, T, vocab).

    With `document_ids` (B, T) (packed documents), attention stays inside each document and
    positions restart at 0 with each one: every document's logits are those of running it alone.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab, config.hidden)
        self.pos_embeddings = nn.Embedding(config.seq_len, config.hidden) if config.position == "learned" else None
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.layers))
        self.norm: nn.Module | None = make_norm(config)
        self.output: nn.Linear | None = nn.Linear(config.hidden, config.vocab, bias=False)
        # after `output` in registration order: named_modules (initialisation order) of the main
        # model is the same with and without MTP
        self.mtp = MultiTokenPrediction(config, lambda i: Block(config, i)) if config.mtp_depth else None
        self.tie_weights()
        if config.position == "rope":
            cos, sin = rope_tables(config)
            # Derived from the config, so not saved in checkpoints (recomputed by init_weights).
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        if config.position == "learned":
            # token positions as a per-position buffer (not torch.arange in forward), so a runtime
            # that reorders the sequence (context parallelism) reorders these rows with it;
            # derived from the config like the rotary tables: not saved, recomputed by init_weights
            self.register_buffer("positions", torch.arange(config.seq_len), persistent=False)
        else:
            self.positions = None

    def forward(self, input_ids: Tensor, document_ids: Tensor | None = None) -> Tensor:
        """logits (B, T, vocab); with MTP in training mode, each depth's follow the main logits
        along the sequence: (B, (1 + mtp_depth) T, vocab) (models/mtp.py)."""
        T = input_ids.shape[1]
        if T > self.config.seq_len:
            raise ConfigError(
                f"sequence of {T} tokens is longer than the model's seq_len={self.config.seq_len}; "
                f"build the model with seq_len>={T}")
        h = self.tok_embeddings(input_ids) if self.tok_embeddings is not None else input_ids  # (B, T, h)
        use_mtp = self.mtp is not None and self.training
        # the shifted tokens' embeddings are looked up with the main one, before the blocks
        mtp_emb = ([self.tok_embeddings(mtp_input_ids(input_ids, k)) for k in range(1, self.config.mtp_depth + 1)]
                   if use_mtp else [])                                                   # (B, T, h) each
        mask = None
        if document_ids is None:
            positions = self.positions[:T] if self.positions is not None else None
            rope = (self.rope_cos[:T], self.rope_sin[:T]) if self.rope_cos is not None else None
        else:
            mask, positions = document_layout(document_ids)                  # (B, 1, T, T), (B, T)
            rope = (self.rope_cos[positions], self.rope_sin[positions]) if self.rope_cos is not None else None
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(positions)
        for layer in self.layers:
            h = layer(h, rope) if mask is None else layer(h, rope, mask)
        extra = self.mtp(h, mtp_emb, rope, mask) if use_mtp else []      # (B, T, h) per depth
        if self.norm is not None:
            h = self.norm(h)
        if extra:
            # one output-layer call over every depth's positions (B, (1 + D) T, h)
            h = torch.cat([h, *extra], dim=1)
        return self.output(h) if self.output is not None else h     # (B, T, vocab)

    def tie_weights(self) -> None:
        """Share the output projection with the token embedding when the config says so.

        Called again by `init_weights` because `Module.to_empty()` unties shared parameters.
        """
        if self.config.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Initialise every weight in place (deterministic for a given torch seed / generator).

        Normal(0, 0.02) for embeddings and linears; the projections that write into the residual
        stream (wo, w2) use 0.02 / sqrt(2 * layers), as GPT-2 and Megatron-LM do, so the
        residual's variance does not grow with depth. Also recomputes the rotary tables and the
        learned-position `positions` buffer, so a model built on the meta device and materialised
        with `to_empty()` becomes usable (and re-ties the embedding, which `to_empty()` unties).
        One `init_module` step per module, in `named_modules` order: deferred initialisation
        (meshplan.runtime.materialize) replays the same steps module by module.
        """
        self.tie_weights()
        for name, module in self.named_modules():
            self.init_module(name, module, generator)
        self.init_buffers()

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module, generator: torch.Generator | None = None, *,
                    dry: bool = False) -> bool:
        """Initialise `module` (named `name` in this model) as `init_weights` does; True when it
        has such a step (with `dry`, only say so)."""
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, (nn.Linear, nn.Embedding)):
            if not dry:
                std = INIT_STD / math.sqrt(2 * self.config.layers) if leaf in ("wo", "w2") else INIT_STD
                module.weight.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            return True
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            if not dry:
                module.reset_parameters()
            return True
        if isinstance(module, MoE):
            if not dry:
                module.init_weights(INIT_STD, INIT_STD / math.sqrt(2 * self.config.layers), generator=generator)
            return True
        if isinstance(module, Attention) and module.sinks is not None:
            if not dry:     # a sink logit of 0 starts every head as a plain softmax plus one null slot
                module.sinks.zero_()
            return True
        return False

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Rotary tables and learned-position indices: computed, not drawn."""
        if self.rope_cos is not None:
            cos, sin = rope_tables(self.config, device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        if self.positions is not None:
            self.positions.copy_(torch.arange(self.config.seq_len, device=self.positions.device))


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross entropy over labels != -100; labels are already aligned with logits (B, T)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
