"""Kernel tests run the Triton kernels on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before any @triton.jit kernel is defined; meshplan imports its
kernel modules lazily, so setting it here (collected before the test modules) is early enough.
Triton tests are skipped cleanly when the triton package is not installed.
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture
def triton_backend():
    """Run the test body with the Triton backend (interpreter on CPU)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton)")
    from meshplan.kernels import use_backend

    with use_backend("triton") as resolved:
        assert resolved == "triton"
        yield


@pytest.fixture
def reference_backend():
    from meshplan.kernels import use_backend

    with use_backend("reference"):
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
