"""Test-wide set-up.

Triton reads TRITON_INTERPRET when it is first imported, and torch may import triton on its
own, so the variable is set here, before any test module is collected. On a machine with an
NVIDIA GPU the real compiler is used instead.
"""

import os

if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def h100x8():
    """One DGX H100 node (8 GPUs)."""
    from meshplan.cluster import Cluster
    return Cluster.preset("dgx-h100", nodes=1)


@pytest.fixture(scope="module")
def h100x16():
    """Two DGX H100 nodes (16 GPUs)."""
    from meshplan.cluster import Cluster
    return Cluster.preset("dgx-h100", nodes=2)


@pytest.fixture(scope="module")
def one_process_group():
    """A one-rank gloo process group for the tests of a module that run the runtime in-process."""
    import torch.distributed as dist

    from meshplan.train.spawn import init_single_process_group
    if not init_single_process_group(120):
        pytest.skip("a process group is already initialised in this process")
    yield
    dist.destroy_process_group()
