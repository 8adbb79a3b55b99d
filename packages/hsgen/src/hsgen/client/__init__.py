"""The request and file step: one prompt's hidden states fetched from vLLM servers
(:mod:`~hsgen.client.fetch`), validated, and the server's files removed; retries, the circuit
breaker, saturation and the shared directory behind it.

The names of the module this folder was (``hsgen.client``) stay importable from it.
"""

from __future__ import annotations

from hsgen._moved import forward

__all__ = [
    "STORAGE_DTYPES",
    "CircuitBreaker",
    "ClientConfig",
    "FatalError",
    "FetchError",
    "FetchStopped",
    "FetchedSample",
    "HiddenStateClient",
    "all_finite",
    "normalize_endpoint",
    "read_hidden_states_file",
]

__getattr__ = forward("hsgen.client.fetch", __all__)
