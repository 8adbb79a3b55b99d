"""Synthetic samples for tests and benchmarks (deterministic from a seed)."""

from __future__ import annotations

import numpy as np

from hsgen.store.header import LOGICAL_DTYPES, StoreHeader
from hsgen.store.records import Sample


def make_sample(
    header: StoreHeader, sample_id: str, tokens: int, seed: int = 0, *, vocab: int = 1000
) -> Sample:
    """A random sample fitting ``header``: normal hidden states, random token ids, a 0/1 loss mask."""
    rng = np.random.default_rng([seed, tokens, len(sample_id), *sample_id.encode()[:16]])
    x = rng.standard_normal((tokens, header.num_layers, header.hidden_size), dtype=np.float32)
    hidden = x.astype(LOGICAL_DTYPES[header.dtype]).view(header.storage_dtype)
    token_ids = rng.integers(0, vocab, tokens, dtype=np.int64)
    loss_mask = (rng.random(tokens) < 0.6).astype(np.uint8)
    return Sample(sample_id, hidden, token_ids, loss_mask, header.dtype)
