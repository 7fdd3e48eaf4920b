"""What a pipeline stage hands torch's p2p send, and what it computes on while torch infers its
shapes.

- The send: a plain tensor whose value is in place. A DTensor's `to_local()` right after a
  redistribution is an AsyncCollectiveTensor whose collective may still be writing it; sent as it is,
  the next stage could receive the buffer's old contents.
- Shape inference: at the first step torch runs each later stage once on tensors made from the
  previous stage's metadata, uninitialised memory; the runtime's stages zero them, so no kernel sees
  whatever bits were there (on CPU the Triton interpreter raised on a NaN in the MoE router's top-k,
  failing the MTP x SP x EP pipeline case now and then under load)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_reduce

from meshplan.runtime.pipeline import StageSpec, _sendable, pipeline_stage


def test_a_collective_in_flight_is_waited_for_before_the_send(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        x = torch.randn(4, 3)
        pending = all_reduce(x * 2, "sum", dist.group.WORLD)
        assert isinstance(pending, AsyncCollectiveTensor)
        sent = _sendable(pending)
        assert type(sent) is torch.Tensor
        torch.testing.assert_close(sent, x * 2)
        plain = torch.ones(2)
        assert _sendable(plain) is plain             # nothing in flight: sent as it is, no copy
    finally:
        dist.destroy_process_group()



def test_shape_inference_runs_a_stage_on_zeros_not_on_uninitialised_memory(tmp_path, monkeypatch):
    from torch.distributed.pipelining import _utils

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        # what torch's metadata inference materialises: here made to hold NaN, as freed memory may
        monkeypatch.setattr(_utils, "_make_tensor_from_meta",
                            lambda meta, device: torch.full(meta.shape, float("nan") if meta.dtype.is_floating_point
                                                            else 7, dtype=meta.dtype, device=device))
        spec = StageSpec(index=1, num_stages=2, owned=("layers.1",), foreign=("layers.0",))
        stage = pipeline_stage(torch.nn.Linear(3, 3), spec, torch.device("cpu"), dist.group.WORLD)
        meta = _utils._TensorMeta.from_tensor(torch.randn(2, 3, requires_grad=True))
        x = stage._to_tensor(meta)
        assert x.shape == (2, 3) and x.requires_grad and x.is_leaf
        torch.testing.assert_close(x, torch.zeros(2, 3))
        ids = stage._to_tensor(_utils._TensorMeta.from_tensor(torch.ones(2, 3, dtype=torch.long)))
        assert ids.dtype == torch.long                  # integer inputs (token ids) are left as made
        real = torch.randn(2, 3)
        torch.testing.assert_close(stage._to_tensor(real), real)     # a real tensor passes through
    finally:
        dist.destroy_process_group()
