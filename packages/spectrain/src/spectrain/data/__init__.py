"""Training data: sample sources and the epoch plan (:mod:`~spectrain.data.sources`), the packed
:class:`~spectrain.data.batch.Batch`, the loader that fills it, and speculators' caches as sources.

The names of the module this folder was (``spectrain.data``) stay importable from it.
"""

from __future__ import annotations

from hsgen._moved import forward

__all__ = [
    "LENGTH_SAMPLE",
    "SPLITS",
    "TORCH_DTYPES",
    "Batch",
    "PackedLoader",
    "SampleSource",
    "StoreSource",
    "count_packed_sequences",
    "epoch_plan",
    "estimate_packed_sequences",
    "plan_digest",
    "sample_to_item",
    "split_of",
    "storage_to_torch",
    "token_frequencies",
]

__getattr__ = forward("spectrain.data.sources", __all__)
