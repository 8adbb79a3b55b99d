"""Judging a draft: speculative decoding with greedy verification (:mod:`~spectrain.eval.decode`),
acceptance where vLLM serves it, and a run's report.

The names of the module this folder was (``spectrain.eval``) stay importable from it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "COUNTINGS",
    "DTYPES",
    "Proposer",
    "Verifier",
    "SpeculativeOutput",
    "speculative_generate",
    "EvalPrompt",
    "EvalReport",
    "max_tokens",
    "summarize",
    "evaluate",
    "load_prompts",
    "load_verifier",
    "DraftProposer",
    "load_exported_draft",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("spectrain.eval.decode"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
