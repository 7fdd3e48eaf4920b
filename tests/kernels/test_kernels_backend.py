"""Backend selection: explicit, reported, never chosen by catching errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from meshplan.errors import ConfigError, UnknownNameError
from meshplan.kernels import backend, requested_backend, rms_norm, set_backend, use_backend
from meshplan.kernels.ops import OPS


def test_auto_picks_triton_under_the_interpreter(triton_backend):
    with use_backend("auto") as resolved:
        assert resolved == "triton" and backend() == "triton" and requested_backend() == "auto"


def interpreter_off(monkeypatch):
    # Patch the check rather than the variable: flipping TRITON_INTERPRET in this process
    # while triton is imported (torch's op dispatch imports it) would break later kernels.
    from meshplan.kernels import selection

    monkeypatch.setattr(selection, "interpreter_enabled", lambda: False)


def test_auto_falls_back_to_reference_without_interpreter_or_cuda(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: auto is triton")
    interpreter_off(monkeypatch)
    with use_backend("auto") as resolved:
        assert resolved == "reference"
        x, w = torch.randn(3, 8), torch.randn(8)
        assert torch.equal(rms_norm(x, w), __import__("meshplan.kernels.reference",
                                                      fromlist=["x"]).rms_norm(x, w))


def test_explicit_triton_without_a_way_to_run_it_says_why(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    interpreter_off(monkeypatch)
    with pytest.raises(ConfigError, match="no CUDA device.*TRITON_INTERPRET=1"):
        set_backend("triton")
    assert requested_backend() == "auto"  # a refused request changes nothing
    with pytest.raises(ConfigError, match="no CUDA device"):  # calling an op directly, too
        OPS["rms_norm"](torch.randn(2, 4), torch.ones(4), 1e-6)


def test_unknown_backend_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match="auto, reference, triton"):
        set_backend("cuda")


def test_use_backend_restores_the_previous_choice(reference_backend):
    assert backend() == "reference"
    with use_backend("auto"):
        pass
    assert requested_backend() == "reference"


def test_every_op_is_registered_under_its_own_namespace():
    for name in OPS:
        assert hasattr(torch.ops.meshplan_kernels, name), name


def test_package_imports_and_runs_without_triton():
    code = textwrap.dedent("""
        import importlib.abc, sys
        class NoTriton(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ModuleNotFoundError(name)
                return None
        sys.meta_path.insert(0, NoTriton())
        import importlib.util
        importlib.util.find_spec = (lambda f: (lambda n, *a: None if n.startswith("triton")
                                               else f(n, *a)))(importlib.util.find_spec)
        import torch
        import meshplan.kernels as k
        from meshplan.errors import ConfigError
        assert k.backend() == "reference", k.backend()
        x = torch.randn(4, 16, requires_grad=True)
        k.rms_norm(x, torch.ones(16)).sum().backward()
        try:
            k.set_backend("triton")
        except ConfigError as e:
            assert "not installed" in str(e), e
        else:
            raise AssertionError("set_backend('triton') should fail without triton")
        assert "triton" not in sys.modules
        print("ok")
    """)
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"})
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail("the fresh interpreter checking the backends without triton did not finish within 120 s "
                    f"(1-minute load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores); its stderr so "
                    f"far:\n{err[-3000:]}", pytrace=False)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
