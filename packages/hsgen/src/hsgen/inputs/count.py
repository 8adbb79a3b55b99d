"""How many records the inputs hold, for a progress bar's total and ETA.

Counted without parsing: a JSONL file's lines (blank lines excluded only when the file is small
enough to check line by line, so a total may exceed the records by the blank lines of a large
file), a Parquet file's row count from its footer. A ``.json`` file, a ``.gz``, stdin and
Hugging Face datasets have no cheap count: the bar then shows a rate and no total.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

_BLOCK = 1 << 20
_EXACT_BELOW = 64 << 20
"""Files under this size are counted line by line (blank lines left out); larger ones by newlines."""


def count_records(inputs: Iterable[Any]) -> int | None:
    """The number of records of all ``inputs`` (paths as ``hsgen generate`` takes them), or
    None when one of them cannot be counted cheaply or cannot be read."""
    total = 0
    for item in inputs:
        n = _count_one(item)
        if n is None:
            return None
        total += n
    return total


def _count_one(item: Any) -> int | None:
    if not isinstance(item, str | Path) or str(item) == "-":
        return None
    p = Path(item)
    try:
        if not p.is_file():
            return None
        suffix = p.suffix.lower()
        if suffix == ".parquet":
            return _parquet_rows(p)
        if suffix in (".jsonl", ".ndjson", ""):
            return _jsonl_lines(p)
    except OSError:
        return None  # the run itself reports an unreadable input, in its own words
    return None


def _jsonl_lines(p: Path) -> int:
    if p.stat().st_size < _EXACT_BELOW:
        with open(p, "rb") as f:
            return sum(1 for line in f if line.strip())
    n, last = 0, b"\n"
    with open(p, "rb") as f:
        while block := f.read(_BLOCK):
            n += block.count(b"\n")
            last = block[-1:]
    return n + (last != b"\n")


def _parquet_rows(p: Path) -> int | None:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        return None
    try:
        return int(pq.ParquetFile(p).metadata.num_rows)
    except Exception:  # pyarrow raises several types for a bad file; the run reports it
        return None


__all__ = ["count_records"]
