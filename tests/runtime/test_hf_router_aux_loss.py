"""A transformers MoE model's own load-balancing loss is trained by meshplan's runtime (in this
process, world size 1): transformers adds router_aux_loss_coef x aux_loss only when the model is
called with labels, and the runtime computes the loss from the logits."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_process_group")     # tests/conftest.py

T = 16


def _mixtral(**cfg):
    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                        num_local_experts=4, num_experts_per_tok=2, **cfg)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def _run(model, layout=None):
    import meshplan as mp
    from meshplan.cluster import Cluster
    from meshplan.runtime.parallel import parallelize
    cl = Cluster(gpu="cpu", num_gpus=1, gpus_per_node=1)
    plan = mp.plan(copy.deepcopy(model).to("meta"), cl, seq_len=T, global_batch=2, fixed=layout or {})
    pm = parallelize(model, plan, compute_dtype=None)
    ids = torch.randint(0, 64, (2, T + 1), generator=torch.Generator().manual_seed(3))
    loss = pm.forward_backward(ids[:, :-1], ids[:, 1:])
    router = next(p.grad for n, p in pm.named_parameters() if n.endswith("layers.0.mlp.gate.weight"))
    return loss, router.clone(), ids


def _reference(model, ids, coef):
    out = model(ids[:, :-1], output_router_logits=True)
    loss = F.cross_entropy(out.logits.flatten(0, 1).float(), ids[:, 1:].flatten()) + coef * out.aux_loss
    loss.backward()
    return float(loss.detach()), model.model.layers[0].mlp.gate.weight.grad.clone()


def test_router_aux_loss_is_added_with_its_coefficient():
    model = _mixtral(output_router_logits=True, router_aux_loss_coef=0.5)
    ref_model = copy.deepcopy(model)
    loss, grad, ids = _run(model)
    ref_loss, ref_grad = _reference(ref_model, ids, 0.5)
    torch.testing.assert_close(torch.tensor(loss), torch.tensor(ref_loss), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    # and it is really there: without the aux term the router's gradient differs
    _, no_aux = _reference(copy.deepcopy(ref_model), ids, 0.0)
    assert not torch.allclose(grad, no_aux, atol=1e-6)


def test_without_router_logits_nothing_is_added():
    model = _mixtral()
    ref_model = copy.deepcopy(model)
    loss, grad, ids = _run(model)
    out = ref_model(ids[:, :-1])
    ref = F.cross_entropy(out.logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    torch.testing.assert_close(torch.tensor(loss), ref.detach(), rtol=1e-5, atol=1e-6)


def test_a_split_layout_warns_that_the_aux_loss_is_not_trained():
    from meshplan.ir.layout import Layout
    from meshplan.runtime.model import router_aux_loss_note
    model = _mixtral(output_router_logits=True, router_aux_loss_coef=0.02)
    assert router_aux_loss_note(model, Layout(tp=1, dp=2)) is None
    note = router_aux_loss_note(model, Layout(tp=2, dp=1))
    assert "tp=2" in note and "trains without it" in note
    assert router_aux_loss_note(_mixtral(), Layout(tp=2)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(_mixtral(output_router_logits=True, router_aux_loss_coef=0.02))    # world 1: no warning
