"""Sliding-window attention and attention sinks (models/banded.py, ModelConfig.sliding_window*,
attention_sinks) against a direct einsum softmax; the config's checks; the GPT-OSS presets."""

from __future__ import annotations

import math

import pytest
import torch

from meshplan import models
from meshplan.errors import ConfigError
from meshplan.models.banded import banded_attention
from meshplan.models.layers import document_layout


def _reference(q, k, v, *, window, sinks, keep_docs):
    """softmax over the kept keys plus, per head, exp(sink) in the denominator; written out."""
    n, T, hd = q.shape[1], q.shape[2], q.shape[3]
    rep = n // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    logits = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(hd)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    keep = j <= i
    if window:
        keep = keep & (i - j < window)
    if keep_docs is not None:
        keep = keep & keep_docs
    logits = logits.masked_fill(~keep, float("-inf"))
    sink = (sinks if sinks is not None else torch.full((n,), float("-inf"), dtype=q.dtype)).view(1, n, 1, 1)
    top = torch.maximum(logits.amax(-1, keepdim=True), sink)
    e = torch.exp(logits - top)
    weights = e / (e.sum(-1, keepdim=True) + torch.exp(sink - top))
    return torch.einsum("bhij,bhjd->bhid", weights, v)


@pytest.mark.parametrize("window,with_sinks,docs", [(4, False, False), (4, True, False), (4, True, True),
                                                    (0, True, False), (4, False, True)])
def test_banded_attention_matches_einsum(window, with_sinks, docs):
    torch.manual_seed(0)
    B, n, n_kv, T, hd = 2, 4, 2, 12, 8
    q = torch.randn(B, n, T, hd, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, n_kv, T, hd, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, n_kv, T, hd, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(n, dtype=torch.float64, requires_grad=True) if with_sinks else None
    mask = None
    if docs:   # two packed documents per row, split at different places
        ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
        mask, _ = document_layout(ids)
    out = banded_attention(q, k, v, window=window, sinks=sinks, mask=mask)
    ref = _reference(q, k, v, window=window, sinks=sinks, keep_docs=None if mask is None else mask)
    torch.testing.assert_close(out, ref)
    leaves = [t for t in (q, k, v, sinks) if t is not None]
    for got, want in zip(torch.autograd.grad(out.square().sum(), leaves),
                         torch.autograd.grad(ref.square().sum(), leaves)):
        torch.testing.assert_close(got, want)


def test_window_covering_the_sequence_is_plain_causal_attention():
    """A window as long as the sequence changes nothing: same weights, same logits."""
    torch.manual_seed(0)
    plain = models.build("tiny-llama", layers=2, seq_len=32, device="cpu")
    windowed = models.build("tiny-llama", layers=2, seq_len=32, sliding_window=32, sliding_window_pattern="all",
                            device="cpu")
    windowed.load_state_dict(plain.state_dict())
    x = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(windowed(x), plain(x))
    narrow = models.build("tiny-llama", layers=2, seq_len=32, sliding_window=4, device="cpu")
    narrow.load_state_dict(plain.state_dict())
    assert not torch.allclose(narrow(x), plain(x))      # the band does cut attention


def test_config_checks_and_layer_windows():
    cfg = models.config("tiny-llama", sliding_window=16)
    assert [cfg.layer_window(i) for i in range(4)] == [16, 0, 16, 0]
    cfg = models.config("tiny-llama", sliding_window=16, sliding_window_pattern="all")
    assert [cfg.layer_window(i) for i in range(4)] == [16] * 4
    assert models.config("tiny-llama").layer_window(0) == 0
    with pytest.raises(ConfigError, match="sliding_window_pattern='every'.*alternate, all"):
        models.config("tiny-llama", sliding_window=16, sliding_window_pattern="every")
    with pytest.raises(ConfigError, match="sliding_window must be >= 0"):
        models.config("tiny-llama", sliding_window=-1)
    with pytest.raises(ConfigError, match="attention='mla' has neither"):
        models.config("deepseek-v3", sliding_window=128)
    # one sink logit per query head per layer
    assert (models.config("tiny-llama", attention_sinks=True).num_params()
            == models.config("tiny-llama").num_params() + 4 * 4)


def test_gpt_oss_presets():
    big, small = models.config("gpt-oss-120b"), models.config("gpt-oss-20b")
    # the model card: 116.83B and 20.91B parameters, of which the expert / router biases
    # (meshplan does not model them) are about 0.04B and 0.003B
    assert abs(big.num_params() / 1e9 - 116.83) < 0.06
    assert abs(small.num_params() / 1e9 - 20.91) < 0.01
    assert [big.layer_window(i) for i in range(3)] == [128, 0, 128]
    assert big.attention_sinks and big.bias and big.head_dim * big.heads == 4096 != big.hidden
    m = models.build("gpt-oss-20b", device="meta")
    assert m.layers[0].attention.attention_type == "sliding_attention"
    assert m.layers[1].attention.sliding_window == 0
    assert m.layers[0].attention.sinks.shape == (64,)
