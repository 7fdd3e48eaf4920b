"""What every benchmark script does last: print its table and, with --out, write it to a file."""

from __future__ import annotations

from pathlib import Path


def emit(lines: list[str], out: str | Path | None) -> int:
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return 0
