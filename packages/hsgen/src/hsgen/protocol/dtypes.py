"""The one dtype table: the hidden-state dtypes vLLM sends and a store keeps, their spellings, how
their bytes are held in numpy, and the bit patterns where their non-finite values begin.

Everything that names a hidden-state dtype (the client's file reader, the store header, the server,
spectrain's reads and batches) takes it from here.
"""

from __future__ import annotations

import numpy as np

HIDDEN_DTYPES = ("bfloat16", "float16", "float32")
"""The logical dtypes of hidden states, as vLLM's files and the store header name them."""

ALIASES: dict[str, str] = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}  # fmt: skip
"""Every spelling a config or a flag uses (torch's, HF's, vLLM's) -> the logical name."""

STORAGE: dict[str, np.dtype] = {
    "bfloat16": np.dtype(np.uint16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}
"""Logical dtype -> the numpy dtype its bytes are held in (bfloat16 as raw uint16 bits)."""

NONFINITE_FROM: dict[str, tuple[type, int, type, int]] = {
    "bfloat16": (np.int16, 0x7F80, np.uint16, 0xFF80),
    "float16": (np.int16, 0x7C00, np.uint16, 0xFC00),
    "float32": (np.int32, 0x7F800000, np.uint32, 0xFF800000),
}
"""Bit patterns at or above which a value is inf or NaN, as (signed type, bound, unsigned type, bound)
of its width: positive non-finite values are the largest signed ones, negative ones the largest
unsigned ones, so two max reductions check a buffer with no temporary."""


def all_finite(a: np.ndarray, dtype: str, chunk: int = 1 << 20) -> bool:
    """Whether every value of ``a`` (storage dtype, logical ``dtype``) is finite: two max
    reductions over the bits per ``chunk`` values, no temporary array."""
    signed, pos, unsigned, neg = NONFINITE_FROM[dtype]
    flat = a.reshape(-1)
    for i in range(0, flat.size, chunk):
        part = flat[i : i + chunk]
        if int(part.view(signed).max()) >= pos or int(part.view(unsigned).max()) >= neg:
            return False
    return True


__all__ = ["ALIASES", "HIDDEN_DTYPES", "NONFINITE_FROM", "STORAGE", "all_finite"]
