"""The training loop's failure paths in this process (world size 1, gloo; no spawning): full
disk, corrupt or foreign checkpoints, a background save that has not completed, and the bound
put on every collective of the plan's mesh. The state is compared bit for bit: a checkpoint
round trip copies tensors, it computes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os

import pytest
import torch
import torch.distributed as dist

from meshplan.errors import ConfigError
from meshplan.train import checkpoint
from meshplan.train.checkpoint import Checkpointer, CheckpointWriteError

SEQ = 16


pytestmark = pytest.mark.usefixtures("one_process_group")     # tests/conftest.py


@functools.lru_cache(maxsize=None)
def _plan(**dims):
    import meshplan as mp
    from meshplan.cluster import Cluster
    model = mp.models.build("tiny-llama", seq_len=SEQ, device="meta", **dims)
    return mp.plan(model, Cluster(gpu="cpu", num_gpus=1, gpus_per_node=1), seq_len=SEQ, global_batch=2)


def _trained(seed: int = 0, **dims):
    """A parallelised tiny Llama and its AdamW after one step (so the optimizer has state)."""
    from meshplan import models
    from meshplan.runtime.parallel import parallelize
    torch.manual_seed(seed)
    model = models.build("tiny-llama", seq_len=SEQ, device="cpu", **dims)
    model.init_weights()
    pm = parallelize(model, _plan(**dims), compute_dtype=None)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, SEQ + 1))
    pm.forward_backward(ids[:, :-1], ids[:, 1:])
    opt.step()
    pm.zero_grad()
    return pm, opt


def _weights(pm):
    return {k: v.clone() for k, v in pm.full_state_dict().items()}


class _ShortWrites:
    """A file that takes `room` bytes, then fails like a full disk (the partial bytes stay)."""

    def __init__(self, f, room: int):
        self._f, self._room = f, room

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self._room:
            self._f.write(data[:self._room])
            self._room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._f.name)
        self._room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


@pytest.fixture
def full_disk(monkeypatch):
    """`full_disk(how)` makes every DCP data file fail: "close" as a buffered file does when
    its flush finds the disk full (OSError ENOSPC), "write" on a write after 100 bytes (which
    torch.save's zip writer reports as a RuntimeError about the short write)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    def arm(how: str):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            with open(path, mode) as f:
                yield _ShortWrites(f, room=100) if how == "write" and "w" in mode else f
                if how == "close" and "w" in mode:
                    os.truncate(path, 100)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    return arm


@pytest.mark.parametrize("background, how", [(False, "close"), (False, "write"), (True, "close")],
                         ids=["sync-enospc", "sync-short-write", "async-enospc"])
def test_full_disk_keeps_the_last_good_checkpoint(tmp_path, full_disk, background, how):
    pm, opt = _trained()
    saved = _weights(pm)
    ck = Checkpointer(tmp_path, keep=1, async_save=background)
    ck.save(1, pm, opt, {"note": "good"})
    ck.wait()
    good = tmp_path / "checkpoints" / "step_000001"
    assert ck.last == good and (good / "meta.json").exists()
    full_disk(how)
    with pytest.raises(CheckpointWriteError) as err:
        ck.save(2, pm, opt, {})
        ck.close()                                  # async: the failure surfaces when the write is awaited
    msg = str(err.value)
    assert f"could not write checkpoint step 2 to {tmp_path / 'checkpoints'} (rank 0: " in msg, msg
    assert ("No space left on device" if how == "close" else "unexpected pos") in msg, msg
    assert "MiB free there now" in msg and "step_000002.tmp was removed" in msg, msg
    assert f"last good checkpoint {good} is intact" in msg and "--keep, now 1" in msg, msg
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
    assert checkpoint.latest(tmp_path) == good
    fresh, fresh_opt = _trained(seed=1)
    assert not torch.equal(_weights(fresh)["tok_embeddings.weight"], saved["tok_embeddings.weight"])
    assert checkpoint.load(good, fresh, fresh_opt)["note"] == "good"
    for k, v in _weights(fresh).items():
        assert torch.equal(v, saved[k]), k


def test_background_save_is_loaded_only_once_complete(tmp_path):
    pm, opt = _trained()
    ck = Checkpointer(tmp_path, keep=0, async_save=True)
    ck.save(1, pm, opt, {})
    assert ck.pending and checkpoint.latest(tmp_path) is None
    ck.wait()
    ck.save(2, pm, opt, {})
    ck._pending.future.result()                     # every file written, not yet completed:
    tmp = tmp_path / "checkpoints" / "step_000002.tmp"
    assert any(tmp.glob("*.distcp")) and not (tmp / "meta.json").exists()
    assert checkpoint.latest(tmp_path).name == "step_000001"     # a crash now would resume from step 1
    assert ck.poll() == tmp_path / "checkpoints" / "step_000002"
    assert not ck.pending and checkpoint.latest(tmp_path).name == "step_000002" and not tmp.exists()
    assert ck.close().name == "step_000002"


def _saved(tmp_path):
    pm, opt = _trained()
    return checkpoint.save(tmp_path, 1, pm, opt, {}), pm, opt


def test_corrupt_checkpoint_is_refused(tmp_path):
    path, pm, opt = _saved(tmp_path)
    meta = (path / "meta.json").read_text()
    (path / "meta.json").write_text(meta[:len(meta) // 2])
    with pytest.raises(ConfigError, match=r"meta\.json is corrupt .*move .*step_000001 aside"):
        checkpoint.load(path, pm, opt)
    (path / "meta.json").write_text(meta)
    data = next(path.glob("*.distcp"))
    blob = data.read_bytes()
    data.write_bytes(blob[:len(blob) // 3])         # truncated, as by a full disk outside meshplan
    with pytest.raises(ConfigError, match=r"could not read checkpoint .*step_000001.*damaged"):
        checkpoint.load(path, pm, opt)
    data.write_bytes(blob)
    (path / ".metadata").write_bytes(b"\x80garbage")
    with pytest.raises(ConfigError, match=r"could not read checkpoint .*step_000001.*damaged"):
        checkpoint.load(path, pm, opt)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    path, _, _ = _saved(tmp_path)
    other, other_opt = _trained(hidden=64, ffn_hidden=192)
    with pytest.raises(ConfigError, match=r"saved from a different model: 39 parameter\(s\) differ, e\.g\. .*"
                                          r"layers\.0\.attention\.wq\.weight: \[128, 128\] in the checkpoint, "
                                          r"\[64, 64\] here.*\(and 35 more\)"):
        checkpoint.load(path, other, other_opt)
    fewer, fewer_opt = _trained(layers=2)
    with pytest.raises(ConfigError, match=r"layers\.2\.\S+: only in the checkpoint"):
        checkpoint.load(path, fewer, fewer_opt)
    meta = json.loads((path / "meta.json").read_text())
    del meta["params"]                              # a checkpoint without the shape record: DCP's check
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="could not read checkpoint .*do not belong to this model"):
        checkpoint.load(path, other, other_opt)


def test_every_mesh_group_gets_the_training_timeout():
    """DeviceMesh makes its sub-groups with torch's default timeout (30 min); training bounds them
    all by the same timeout. With one rank every mesh dimension is the default group, so the
    mesh here is a stand-in holding a real sub-group."""
    from types import SimpleNamespace

    from meshplan.train.loop import _bound_collectives, _group_timeout_s
    sub = dist.new_group([0], backend="gloo")
    assert _group_timeout_s(sub) == 1800
    pm = SimpleNamespace(mesh=SimpleNamespace(get_all_groups=lambda: [sub, sub]))
    _bound_collectives(pm, 7.0)
    assert _group_timeout_s(sub) == 7.0 and _group_timeout_s() == 7.0
    _bound_collectives(pm, 60.0)                    # back to the fixture's, for the other tests
    assert _group_timeout_s() == 60.0
    dist.destroy_process_group(sub)


def test_profiled_steps_write_a_trace_and_an_operator_table(tmp_path):
    """--profile FIRST:LAST: torch.profiler over those steps only, a Chrome trace and an operator
    table per rank; every step's metrics carry the process CPU time beside the wall time."""
    from meshplan import models
    from meshplan.train.loop import TrainConfig, train
    model = models.build("tiny-llama", seq_len=SEQ, device="cpu")
    model.init_weights()
    train(model, _plan(), TrainConfig(steps=3, warmup=1, out_dir=str(tmp_path), profile_steps=(2, 3), progress=False,
                                      resume=False, checkpoint_every=0))
    prof = tmp_path / "profile"
    assert json.loads((prof / "rank0.json").read_text())["traceEvents"]
    table = (prof / "rank0.txt").read_text()
    assert table.startswith("steps 2..3 (2 steps), rank 0") and "aten::mm" in table
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(recs) == 3 and all(0 < r["cpu_update_s"] < r["cpu_time_s"] for r in recs)


@pytest.mark.parametrize("bad", [(3, 2), (0, 1), (2,), "2:3"])
def test_bad_profile_steps_are_refused(bad):
    from meshplan.train.loop import TrainConfig
    with pytest.raises(ConfigError, match="profile_steps"):
        TrainConfig(profile_steps=bad)
