"""The format vLLM serves: a draft written (:mod:`~spectrain.export.write`) and read back
(:mod:`~spectrain.export.read`).

The names of the module this folder was (``spectrain.export``) stay importable from it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "WEIGHTS_NAME",
    "CONFIG_NAME",
    "ExportError",
    "Adapter",
    "ADAPTERS",
    "register_adapter",
    "vllm_weights",
    "vllm_refusal",
    "speculative_config_for",
    "serve_hint",
    "export_draft",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("spectrain.export.write"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
