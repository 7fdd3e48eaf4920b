"""torch.compile of the blocks inside parallelize (runtime/compile.py), in this process (one
gloo rank): the compiled model computes the single-device loss and gradients, with recompute
wrapping the blocks too, and "auto" leaves CPU eager."""

from __future__ import annotations

import pytest
import torch

import meshplan as mp
from meshplan.errors import ConfigError
from meshplan.runtime.compile import compile_wanted

pytestmark = pytest.mark.usefixtures("one_process_group")     # tests/conftest.py

SEQ, BATCH = 16, 4


def _run(plan, compile_mode):
    torch.manual_seed(0)
    model = mp.models.build("tiny-llama", seq_len=SEQ, device="cpu")
    pm = mp.parallelize(model, plan, compute_dtype=None, fused_kernels=False, compile=compile_mode)
    ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loss = pm.forward_backward(ids[:, :-1], ids[:, 1:])
    return pm, loss, {n: p.grad.detach().clone() for n, p in pm.named_parameters()}


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_compiled_blocks_match_eager(recompute):
    model = mp.models.build("tiny-llama", seq_len=SEQ, device="meta")
    plan = mp.plan(model, mp.Cluster.preset("local-cpu", nproc=1), seq_len=SEQ, global_batch=BATCH,
                   fixed={"recompute": recompute})
    eager_pm, eager_loss, eager_grads = _run(plan, False)
    pm, loss, grads = _run(plan, True)
    assert eager_pm.compiled == [] and pm.compiled == list(plan.blocks)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_auto_compiles_on_cuda_only():
    assert compile_wanted("auto", "cuda") and not compile_wanted("auto", "cpu")
    assert compile_wanted(True, "cpu") and not compile_wanted(False, "cuda")
    assert not compile_wanted("auto", "cuda", "zbv", pp=2) and compile_wanted("auto", "cuda", "1f1b", pp=2)
    with pytest.raises(ConfigError, match="compile='sometimes'"):
        compile_wanted("sometimes", "cpu")
