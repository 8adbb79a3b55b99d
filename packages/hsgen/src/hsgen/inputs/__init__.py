"""Prompts in: dataset files and hub datasets read (:mod:`~hsgen.inputs.formats`), rendered to token
ids and loss masks (:mod:`~hsgen.inputs.render`), counted for a progress bar.

The names of the module this folder was (``hsgen.inputs``) stay importable from it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "InputError",
    "InputSample",
    "InputStats",
    "OnBadInput",
    "content_id",
    "iter_records",
    "parse_record",
    "read_inputs",
    "sample_to_json",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("hsgen.inputs.formats"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
