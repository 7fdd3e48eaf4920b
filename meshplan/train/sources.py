"""Where training text comes from: the files named by `--data` / `meshplan data prepare`, read as
documents (one string each).

- text files (``*.txt``, ``*.md``, ``*.text``): one document per file, as `TokenDataset` has
  always read them;
- JSON Lines (``*.jsonl``): one document per line, its text in
  a field (``text`` unless `text_field` says otherwise); blank lines are skipped;
- Parquet (``*.parquet``, read with pyarrow): one document per row of the text column, read a
  row group at a time so a large file is never in memory whole.

A directory stands for every such file under it (recursively, hidden files skipped, in sorted
order, so the document order never depends on the file system).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from meshplan.errors import ConfigError

__all__ = [
    "JSONL_SUFFIXES",
    "PARQUET_SUFFIXES",
    "SOURCE_SUFFIXES",
    "TEXT_SUFFIXES",
    "read_documents",
    "require_pyarrow",
    "source_files",
]

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
SOURCE_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
_DOCS_PER_BATCH = 1024      # documents handed to the tokenizer at once (batch encoding is faster)


def source_files(path: str | Path, suffixes: tuple[str, ...] = SOURCE_SUFFIXES) -> list[Path]:
    """The files `path` stands for (itself, or the matching files under a directory)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"data source {str(path)!r} does not exist; give a text/JSONL/Parquet file or a "
                          "directory of them")
    if path.is_file():
        if path.suffix not in suffixes:
            raise ConfigError(f"{path.name}: not a data source this reader knows ({', '.join(suffixes)}); "
                              "rename it or convert it to JSON Lines with a 'text' field")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise ConfigError(f"no data files ({', '.join('*' + s for s in suffixes)}) under {str(path)!r}")
    return files


def require_pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("reading Parquet files needs pyarrow: pip install pyarrow (or pip install "
                          "'meshplan[data]'), or convert the files to JSON Lines") from None
    return pq


def read_documents(path: Path, *, text_field: str = "text") -> Iterator[list[str]]:
    """Batches of documents (lists of strings) from one source file, in file order."""
    if path.suffix in TEXT_SUFFIXES:
        yield [path.read_bytes().decode("utf-8", errors="replace")]
    elif path.suffix in JSONL_SUFFIXES:
        yield from _jsonl(path, text_field)
    elif path.suffix in PARQUET_SUFFIXES:
        yield from _parquet(path, text_field)
    else:
        raise ConfigError(f"{path.name}: unknown data file type; use one of {', '.join(SOURCE_SUFFIXES)}")


def _jsonl(path: Path, field: str) -> Iterator[list[str]]:
    batch: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path.name} line {lineno} is not JSON ({e.msg}); JSON Lines hold one "
                                  "object per line") from None
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
                raise ConfigError(f"{path.name} line {lineno} has no {field!r} field (it has {keys}); "
                                  "name the text field with --text-field")
            text = record[field]
            if not isinstance(text, str):
                raise ConfigError(f"{path.name} line {lineno}: field {field!r} is {type(text).__name__}, not text")
            batch.append(text)
            if len(batch) >= _DOCS_PER_BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def _parquet(path: Path, field: str) -> Iterator[list[str]]:
    pq = require_pyarrow()
    f = pq.ParquetFile(path)
    names = f.schema_arrow.names
    if field not in names:
        raise ConfigError(f"{path.name} has no column {field!r} (columns: {names[:8]}); name the text column "
                          "with --text-field")
    for i in range(f.num_row_groups):
        column = f.read_row_group(i, columns=[field]).column(0)
        yield [t if t is not None else "" for t in column.to_pylist()]
