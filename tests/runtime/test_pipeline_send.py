"""What a pipeline stage hands torch's p2p send: a plain tensor whose value is in place. A DTensor's
`to_local()` right after a redistribution is an AsyncCollectiveTensor whose collective may still be
writing it; sent as it is, the next stage can receive the buffer's old contents (seen as NaN router
logits in the MTP x SP pipeline case under load)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_reduce

from meshplan.runtime.pipeline import _sendable


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

