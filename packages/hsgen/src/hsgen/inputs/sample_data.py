"""The sample dataset that ships with hsgen: chat conversations in OpenAI ``messages`` form.

Built by ``scripts/make_sample_data.py`` from the Python standard library's docstrings, so
the demo and the tests have real text without any download.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path


def sample_chats_path() -> Path:
    """Path of ``sample_chats.jsonl`` (one ``{"id", "messages"}`` object per line)."""
    return Path(str(resources.files("hsgen") / "data" / "sample_chats.jsonl"))


def iter_sample_chats(limit: int | None = None) -> Iterator[dict]:
    """Yield the sample conversations in file order, at most ``limit`` of them."""
    with sample_chats_path().open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            yield json.loads(line)
