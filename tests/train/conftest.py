"""The training application's tests (meshplan/train) share their process fixtures and rank workers
with the runtime's tests (tests/runtime: procs.py, worlds.py, numerics.py, *_workers.py); spawned
ranks import those workers by module name, so that folder goes on the import path here too."""

import sys
from pathlib import Path

_RUNTIME_TESTS = str(Path(__file__).resolve().parents[1] / "runtime")
if _RUNTIME_TESTS not in sys.path:
    sys.path.insert(0, _RUNTIME_TESTS)
