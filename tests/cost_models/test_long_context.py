"""Long-context rows: which attention kernel each published run's software ran, and that the choice
reaches the estimate only through attention, by the kernel rates of constants.ATTN_KERNEL_RATE."""

from __future__ import annotations

import pytest

from meshplan.cluster import Cluster
from meshplan.cost_models import constants as K
from meshplan.cost_models import validation as V
from meshplan.cost_models.compute import attention_time
from meshplan.cost_models.context import Context
from meshplan.cost_models.cp import attention_shape
from meshplan.cost_models.estimate import estimate_profile
from meshplan.ir.layout import Layout
from meshplan.ir.precision import Precision
from meshplan.ir.stack import Stack
from meshplan.models import config as preset
from meshplan.profiling.analytic import profile_from_config


@pytest.fixture(scope="module")
def rows():
    return {r.id: r for r in V.load_rows()}


def _layout(row) -> dict:
    cfg = V.model_config(row, preset)
    lay = V._layout(row, cfg, row.num("num_gpus"))
    assert isinstance(lay, dict), lay
    return lay


def _kernel(row) -> str:
    """The attention kernel the row's estimate runs on its GPU (Context.attn_kernel)."""
    lay = Layout(**_layout(row))
    n = row.num("num_gpus")
    cluster = Cluster(gpu=V._gpu(row), num_gpus=n, gpus_per_node=min(n, 8))   # as validation.run_row
    return Context.build(cluster, lay, row.num("seq"), False, stack=V.stack_of(row)).attn_kernel


def test_nemo_launcher_runs_flash_attention_2_and_megatron_runs_cudnn(rows):
    """NeMo-Framework-Launcher 24.01-24.07 set NVTE_FUSED_ATTN=0, so the NeMo 24.03.01 long-sequence
    and NeMo 24.07 performance rows ran flash-attn 2 under Transformer Engine; the Model Zoo's
    long-context runs (Megatron-LM, --attention-backend auto) and Megatron-LM's README runs leave
    TE's Hopper choice, cuDNN."""
    nemo = [r for r in rows.values() if r.family in ("nemo-longseq", "nemo2407")]
    assert len(nemo) >= 15
    assert {_kernel(r) for r in nemo} == {"fa2"}
    cudnn = [r for r in rows.values() if r.id.startswith(("modelzoo-qwen3-235b-h100-lc", "mcore-readme-h100"))
             and "strong" not in r.id]          # the README's strong-scaling rows give no layout
    assert len(cudnn) >= 8
    assert {_kernel(r) for r in cudnn} == {"cudnn"}


@pytest.fixture(scope="module")
def llama_128k():
    """Llama 2 7B at 128k tokens as the NeMo long-sequence page ran it (tp4 cp4, FP8 linears)."""
    prof = profile_from_config(dict(family="llama", layers=4, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008,
                                    vocab=32000, seq_len=131072))
    return prof, Cluster.preset("dgx-h100", nodes=2)


def test_the_kernel_changes_only_attention_by_its_rate(llama_128k):
    """At 128k tokens attention dominates the step; FlashAttention-2 and cuDNN differ there only in
    the attention time, by ATTN_KERNEL_RATE's ratio (same memory, same communication)."""
    prof, cl = llama_128k
    kw = dict(seq_len=131072, global_batch=8, precision=Precision.FP8, stack="megatron-core")
    base = dict(tp=4, cp=4, dp=1, sp=True, zero=1, mbs=1, recompute="none")
    fa2 = estimate_profile(prof, cl, Layout(**base, attn_kernel="fa2"), **kw)
    cudnn = estimate_profile(prof, cl, Layout(**base), **kw)
    stack = Stack.preset("megatron-core")
    assert Context.build(cl, Layout(**base), 131072, True, stack=stack).attn_kernel == "cudnn"   # TE's Hopper choice
    assert fa2.peak_memory_gb == cudnn.peak_memory_gb
    assert fa2.comm_s == cudnn.comm_s
    assert fa2.step_time_s > 1.3 * cudnn.step_time_s       # attention-bound: most of the 1.61x shows
    # the attention calls themselves: the same shape, priced at the two kernels' rates
    ctx = Context.build(cl, Layout(**base), 131072, True)
    block = next(b for b in prof.blocks if b.heads)
    shape = attention_shape(block, ctx)
    for bwd, idx in ((False, 0), (True, 1)):
        t_fa2 = attention_time(1e13, cl, backward=bwd, kernel="fa2", shape=shape)
        t_cudnn = attention_time(1e13, cl, backward=bwd, kernel="cudnn", shape=shape)
        launches = shape.kernels * (K.ATTN_BWD_KERNELS if bwd else 1) * K.ATTN_KERNEL_FIXED_S
        ratio = (t_fa2 - launches) / (t_cudnn - launches)
        assert ratio == pytest.approx(K.ATTN_KERNEL_RATE["cudnn"][idx] / K.ATTN_KERNEL_RATE["fa2"][idx], rel=1e-9)
