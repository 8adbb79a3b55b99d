"""Judging a draft: speculative decoding with greedy verification (:mod:`~spectrain.eval.decode`),
acceptance where vLLM serves it, and a run's report.

The names of the module this folder was (``spectrain.eval``) stay importable from it.
"""

from __future__ import annotations

from hsgen._moved import forward

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

__getattr__ = forward("spectrain.eval.decode", __all__)
