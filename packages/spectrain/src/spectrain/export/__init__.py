"""The format vLLM serves: a draft written (:mod:`~spectrain.export.write`) and read back
(:mod:`~spectrain.export.read`).

The names of the module this folder was (``spectrain.export``) stay importable from it.
"""

from __future__ import annotations

from hsgen._moved import forward

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

__getattr__ = forward("spectrain.export.write", __all__)
