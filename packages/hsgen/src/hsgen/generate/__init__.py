"""The offline pipeline: prompt -> request -> file -> shard -> manifest (:mod:`~hsgen.generate.pipeline`),
its sink into the store, the run's report, and the other ways a store is filled.

The names of the module this folder was (``hsgen.generate``) stay importable from it.
"""

from __future__ import annotations

from hsgen._moved import forward

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PARTIAL",
    "GenerateConfig",
    "GenerateSummary",
    "LazyStore",
    "Skipped",
    "default_failures_path",
    "generate",
    "rank_of",
]

__getattr__ = forward("hsgen.generate.pipeline", __all__)
