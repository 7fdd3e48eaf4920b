"""Small JSON files next to token data (manifests, indexes, shard metadata): read leniently or
strictly, written atomically (a reader never sees half a file)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from meshplan.errors import ConfigError

__all__ = ["read_json", "write_json"]


def read_json(path: Path, *, strict: bool = True) -> dict | None:
    """The JSON object in `path`; None when absent (or unreadable and not strict: a cache to rebuild)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        if not strict:
            return None
        raise ConfigError(f"{str(path)!r} is not readable JSON ({e}); fix or delete it") from None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: dict) -> None:
    """Write `data` to `path` through a temporary file in the same folder and an atomic rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".json.tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
