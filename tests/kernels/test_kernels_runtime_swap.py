"""The runtime swaps the plan's fused kernels into a user's model: same loss and gradients.

Runs the Triton kernels through the interpreter (conftest sets TRITON_INTERPRET=1) and the
reference backend; the models are tiny so the interpreter stays fast.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from meshplan.errors import ConfigError
from meshplan.profiling.fusions import find_fusions
from meshplan.profiling.trace import trace
from meshplan.runtime.fused import apply_fused_kernels
import dataclasses

from tests.profiling.test_fusions import UserLM

SEQ, VOCAB = 8, 96


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg)
    m.config.use_cache = False
    return m


def _user_lm():
    torch.manual_seed(0)
    m = UserLM(vocab=VOCAB, d=40)
    with torch.no_grad():     # non-trivial norm weights, so a wrong weight name would show
        for n, p in m.named_parameters():
            if n.endswith("scale"):
                p.uniform_(0.5, 1.5)
    return m


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _compare(model, backend_fixture_name, request):
    request.getfixturevalue(backend_fixture_name)
    entries = find_fusions(trace(model, seq_len=SEQ, dtype=torch.float32)).modules
    assert entries
    ref = copy.deepcopy(model)
    swapped = apply_fused_kernels(model, entries)
    head = swapped.head
    assert head is not None and len(swapped.modules) == len(entries)     # one record per module instance
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels[0, :3] = -100
    loss = head.loss(_logits(model(ids)), labels, ignore_index=-100)
    ref_loss = F.cross_entropy(_logits(ref(ids)).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    return entries


@pytest.mark.parametrize("backend", ["triton_backend", "reference_backend"])
def test_users_own_modules_swapped(backend, request):
    entries = _compare(_user_lm(), backend, request)
    assert sum(e.kernel == "rms_norm" for e in entries) == 5      # two per block (2 blocks) + the final norm


@pytest.mark.parametrize("backend", ["triton_backend", "reference_backend"])
def test_hf_llama_swapped(backend, request):
    entries = _compare(_hf_llama(), backend, request)
    assert {e.kernel for e in entries} == {"rms_norm", "swiglu", "linear_cross_entropy"}


def test_module_that_computes_something_else_is_refused(reference_backend):
    model = _user_lm()
    entries = [dataclasses.replace(e, options=tuple((k, "0.5" if k == "eps" else v) for k, v in e.options))
               for e in find_fusions(trace(model, seq_len=SEQ)).modules]
    before = model.blocks[0].n1.forward
    with pytest.raises(ConfigError, match=r"swaps blocks\.0\.n1 for the fused rms_norm kernel.*computes something"):
        apply_fused_kernels(model, entries)
    assert model.blocks[0].n1.forward == before       # left as it was


def test_plan_entry_with_missing_children(reference_backend):
    model = _user_lm()
    entries = [dataclasses.replace(e, options=tuple((k, "nope" if k == "up" else v) for k, v in e.options))
               for e in find_fusions(trace(model, seq_len=SEQ)).modules]
    with pytest.raises(ConfigError, match="needs children"):
        apply_fused_kernels(model, entries)
