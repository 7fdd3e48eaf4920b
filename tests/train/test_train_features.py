"""Training-loop features in this process (world 1, gloo; no spawning): batch-size ramp-up with
a resume in the middle of the ramp, checkpoint retention (newest K + milestones) with resume,
the WSD schedule, a fine-tuning start from a checkpoint or safetensors, and the MoE routing
metrics in metrics.jsonl. Runs are a few steps of a 2-layer MoE on the embedded corpus.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from meshplan.errors import ConfigError

SEQ, BATCH = 16, 8
MOE = dict(layers=2, hidden=32, heads=2, kv_heads=1, ffn_hidden=64, moe_ffn_hidden=32, vocab=256, experts=4, topk=2)


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    from meshplan.train.spawn import init_single_process_group
    if not init_single_process_group(60):
        pytest.skip("a process group is already initialised in this process")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)       # tiny matmuls: more threads only contend (20x slower on a busy 2-core box)
    yield
    torch.set_num_threads(threads)
    dist.destroy_process_group()


@functools.lru_cache(maxsize=None)
def _plan(mbs: int = 2, **options):
    import meshplan as mp
    from meshplan.cluster import Cluster
    model = mp.models.build("moe", seq_len=SEQ, device="meta", **MOE, **options)
    return mp.plan(model, Cluster(gpu="cpu", num_gpus=1, gpus_per_node=1), seq_len=SEQ, global_batch=BATCH,
                   fixed={"mbs": mbs})


def _model(seed: int = 0, **options):
    from meshplan import models
    torch.manual_seed(seed)
    model = models.build("moe", seq_len=SEQ, device="cpu", **MOE, **options)
    model.init_weights()
    return model


def _train(out, *, steps: int, plan=None, options=None, **cfg):
    from meshplan.runtime.parallel import parallelize
    from meshplan.train.loop import TrainConfig, train
    options = options or {}
    plan = plan or _plan(**options)
    model = _model(**options)
    pm = parallelize(model, plan, compute_dtype=None)
    config = TrainConfig(steps=steps, lr=3e-3, warmup=2, out_dir=str(out), progress=False,
                         **{"checkpoint_every": 0, **cfg})
    return train(model, plan, config, pm=pm), pm


def _records(out):
    from meshplan.train.metrics import read_metrics
    return read_metrics(out / "metrics.jsonl")


def test_rampup_grows_the_batch_and_resumes_exactly_in_the_ramp(tmp_path):
    ramp = (2, 2, 24)                     # +2 sequences every 8 samples (Megatron's rule)
    full, _ = _train(tmp_path / "full", steps=9, rampup_batch_size=ramp)
    assert [r["global_batch"] for r in _records(tmp_path / "full")] == [2, 2, 2, 2, 4, 4, 6, 6, 8]
    first, _ = _train(tmp_path / "cut", steps=9, rampup_batch_size=ramp, stop_at=5)
    second, _ = _train(tmp_path / "cut", steps=9, rampup_batch_size=ramp)
    assert first.final_step == 5 and second.start_step == 5
    for step, loss in second.losses.items():
        assert loss == pytest.approx(full.losses[step], rel=1e-6, abs=1e-6), step
    # the checkpoint remembers the ramp: resuming without it would read other samples
    with pytest.raises(ConfigError, match="ramp-up"):
        _train(tmp_path / "cut", steps=12)


def test_rampup_batches_must_split_into_micro_batches(tmp_path):
    with pytest.raises(ConfigError, match=r"--rampup-batch-size start=3 .*multiple of dp x micro-batch size = 2.*start=2"):
        _train(tmp_path, steps=2, rampup_batch_size=(3, 1, 10))
    with pytest.raises(ConfigError, match="increment"):
        _train(tmp_path, steps=2, rampup_batch_size=(2, 4, 10))


def test_retention_keeps_newest_and_milestones_across_resume(tmp_path):
    from meshplan.train import checkpoint
    _train(tmp_path, steps=7, checkpoint_every=1, keep_checkpoints=2, keep_every=3)
    names = lambda: sorted(p.name for p in (tmp_path / "checkpoints").iterdir())   # noqa: E731
    assert names() == ["step_000003", "step_000006", "step_000007"]
    res, _ = _train(tmp_path, steps=8, checkpoint_every=1, keep_checkpoints=2, keep_every=3)
    assert res.start_step == 7
    assert names() == ["step_000003", "step_000006", "step_000007", "step_000008"]
    paths = [tmp_path / f"step_{s:06d}" for s in (1, 2, 4, 5)]
    assert checkpoint.retained(paths, keep=1, keep_every=0) == paths[-1:]
    assert checkpoint.retained(paths, keep=1, keep_every=2) == [paths[1], paths[2], paths[3]]
    assert checkpoint.retained(paths, keep=0, keep_every=5) == paths


def test_wsd_schedule():
    from meshplan.train.lr_schedule import lr_at
    lr = [lr_at(s, base_lr=1.0, warmup=2, total=10, min_lr=0.1, style="wsd", decay_steps=4) for s in range(11)]
    assert lr[:2] == [0.5, 1.0] and lr[2:6] == [1.0] * 4
    assert lr[6] == pytest.approx(1.0) and lr[8] == pytest.approx(0.55) and lr[10] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lr[1:], lr[2:]))
    sq = lr_at(8, base_lr=1.0, warmup=2, total=10, min_lr=0.0, style="wsd", decay_steps=4, decay_style="minus_sqrt")
    assert sq == pytest.approx(1 - 0.5 ** 0.5)
    with pytest.raises(ConfigError, match="--wsd-decay-steps at most 8"):
        lr_at(0, base_lr=1.0, warmup=2, total=10, style="wsd", decay_steps=9)


def test_moe_metrics_are_logged(tmp_path):
    from meshplan.train.metrics import StepMetrics, format_progress
    _train(tmp_path, steps=2, options=dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_capacity_factor=1.0))
    rec = _records(tmp_path)[-1]
    assert rec["moe_imbalance"] >= 1.0 and rec["moe_aux_loss"] > 0 and rec["moe_z_loss"] > 0
    assert 0 <= rec["moe_dropped"] < 1
    assert set(rec["moe_layers"]) == {"layers.0.feed_forward", "layers.1.feed_forward"}
    line = format_progress(StepMetrics(**{k: v for k, v in rec.items()}))
    assert "moe max/mean" in line and "aux" in line


def test_fine_tune_start_loads_only_weights(tmp_path):
    from safetensors.torch import save_file
    res, pm = _train(tmp_path / "pre", steps=2)
    want = pm.full_state_dict()
    tuned, _ = _train(tmp_path / "ft", steps=2, init_from=str(tmp_path / "pre"))
    assert tuned.start_step == 0 and min(tuned.losses) == 1
    from meshplan.train import checkpoint
    from meshplan.runtime.parallel import parallelize
    fresh = parallelize(_model(seed=5), _plan(), compute_dtype=None)
    checkpoint.load_weights(tmp_path / "pre", fresh)
    got = fresh.full_state_dict()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)
    # transformers-style safetensors directory
    (tmp_path / "st").mkdir()
    save_file({k: v.contiguous() for k, v in want.items()}, str(tmp_path / "st" / "model.safetensors"))
    other = parallelize(_model(seed=6), _plan(), compute_dtype=None)
    checkpoint.load_weights(tmp_path / "st", other)
    got = other.full_state_dict()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0)
    # a different architecture: refused with the differing shapes named
    wider = dict(MOE, moe_ffn_hidden=48)
    import meshplan as mp
    from meshplan.cluster import Cluster
    plan = mp.plan(mp.models.build("moe", seq_len=SEQ, device="meta", **wider), Cluster(gpu="cpu", num_gpus=1,
                   gpus_per_node=1), seq_len=SEQ, global_batch=BATCH, fixed={"mbs": 2})
    torch.manual_seed(0)
    wide = mp.models.build("moe", seq_len=SEQ, device="cpu", **wider)
    pm_wide = parallelize(wide, plan, compute_dtype=None)
    for source in (tmp_path / "pre", tmp_path / "st"):
        with pytest.raises(ConfigError, match=r"experts\.w1: \[4, 32, 32\] in .*\[4, 48, 32\] in the model"):
            checkpoint.load_weights(source, pm_wide)
    with pytest.raises(ConfigError, match="not a meshplan checkpoint"):
        checkpoint.load_weights(tmp_path / "nothing", pm_wide)
    assert res.final_step == 2


def test_expert_bias_is_checkpointed_and_resumes_exactly(tmp_path):
    options = dict(moe_expert_bias=True, moe_bias_update_rate=0.003, moe_aux_loss_coeff=1e-2)
    full, pm_full = _train(tmp_path / "full", steps=4, options=options)
    _train(tmp_path / "cut", steps=4, options=options, stop_at=2)
    resumed, pm_resumed = _train(tmp_path / "cut", steps=4, options=options)
    assert resumed.start_step == 2
    for step, loss in resumed.losses.items():
        assert loss == pytest.approx(full.losses[step], rel=1e-6, abs=1e-6)
    a, b = pm_full.full_state_dict(), pm_resumed.full_state_dict()
    biases = [n for n in a if n.endswith("expert_bias")]
    assert biases and any(float(a[n].abs().max()) > 0 for n in biases)
    for n in biases:
        assert b[n].dtype == torch.float32
        torch.testing.assert_close(b[n], a[n], rtol=0, atol=0)


def test_expert_bias_stays_fp32_under_bf16_compute(tmp_path):
    from meshplan.runtime.parallel import parallelize
    options = dict(moe_expert_bias=True, moe_aux_loss_coeff=1e-2)
    model = _model(**options)
    pm = parallelize(model, _plan(**options))         # the plan's precision: bf16 compute
    x = torch.randint(0, 256, (BATCH, SEQ + 1))
    from meshplan.runtime.expert_parallel import MoEBalancer
    balancer = MoEBalancer(pm)
    balancer.begin_step()
    pm.forward_backward(x[:, :-1], x[:, 1:])
    stats = balancer.finish_step()
    assert stats["aux_loss"] > 0
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):
            assert buf.dtype == torch.float32 and float(buf.abs().max()) > 0
