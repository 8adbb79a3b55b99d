"""The store header: what the stored hidden states mean, and how they are encoded."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import ml_dtypes
import numpy as np

from hsgen.protocol.dtypes import STORAGE

FORMAT_VERSION = 3
"""The newest store format this code reads. 1: sample checksums ``bsum64``; 2: ``xxh3`` (older
hsgen refuse to open a version 2 store); 3: the verifier's targets may be stored as token ids
(``targets = "argmax"``). A new store is written at the lowest version that holds its data
(:func:`format_version_for`), so a store of final-layer states stays readable by hsgen that
knows version 2."""

LOGICAL_DTYPES: dict[str, np.dtype] = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}
"""Logical dtype name -> the numpy dtype with that meaning."""

STORAGE_DTYPES: dict[str, np.dtype] = STORAGE
"""Logical dtype name -> the dtype hidden states have in zarr and in :class:`Sample` (bf16 as uint16)."""

CODECS = ("raw", "lz4", "fp8")
"""``raw``: uncompressed; ``lz4``: blosc lz4 + bitshuffle (lossless); ``fp8``: e4m3 + per-token scale (lossy)."""

TARGETS = ("states", "argmax")
"""``states``: the last stored layer is the verifier's final layer (the trainer forms its targets
from it); ``argmax``: every stored layer is a draft input, and the shard's ``target_ids`` hold the
verifier's greedy next token at every position (from vLLM's ``prompt_logprobs``)."""

MEANING_FIELDS = ("verifier", "layer_ids", "hidden_size", "dtype", "tokenizer_fingerprint", "targets")
"""Header fields that change what the data means; stores refuse samples that differ in any of them."""


@dataclass(frozen=True)
class StoreHeader:
    """What a store's hidden states mean.

    Attributes:
        verifier: model name or path the states come from.
        layer_ids: sorted vLLM layer ids, one per stored layer; the last one feeds the targets.
        hidden_size: width of each hidden-state vector.
        dtype: logical dtype, ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        tokenizer_fingerprint: sha256 of tokenizer and chat template (``""`` = unknown).
        codec: ``"raw"`` (default), ``"lz4"`` (lossless) or ``"fp8"`` (lossy e4m3, per-token scale).
        format_version: store format version (see ``docs/format.md``); 0 (the default) = the
            lowest version that holds this data (:func:`format_version_for`).
        targets: ``"states"`` (default: the last stored layer feeds the targets) or ``"argmax"``
            (the verifier's greedy next-token ids are stored per token instead; format version 3).
    """

    verifier: str
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str
    tokenizer_fingerprint: str = ""
    codec: str = "raw"
    format_version: int = 0
    targets: str = "states"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        if self.targets not in TARGETS:
            raise ValueError(f"StoreHeader.targets must be one of {list(TARGETS)}, got {self.targets!r}")
        if self.format_version == 0:
            object.__setattr__(self, "format_version", format_version_for(self.targets))
        if not isinstance(self.verifier, str) or not self.verifier:
            raise ValueError(f"StoreHeader.verifier must be a non-empty string, got {self.verifier!r}")
        ids = self.layer_ids
        if not ids or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
            raise ValueError(f"StoreHeader.layer_ids must be non-negative ints, got {ids!r}")
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"StoreHeader.layer_ids must be sorted and unique, got {ids!r}")
        if (
            not isinstance(self.hidden_size, int)
            or isinstance(self.hidden_size, bool)
            or self.hidden_size <= 0
        ):
            raise ValueError(f"StoreHeader.hidden_size must be a positive int, got {self.hidden_size!r}")
        if self.dtype not in LOGICAL_DTYPES:
            raise ValueError(f"StoreHeader.dtype must be one of {sorted(LOGICAL_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.tokenizer_fingerprint, str):
            raise ValueError("StoreHeader.tokenizer_fingerprint must be a string")
        if self.codec not in CODECS:
            raise ValueError(f"StoreHeader.codec must be one of {list(CODECS)}, got {self.codec!r}")
        if not isinstance(self.format_version, int) or self.format_version < 1:
            raise ValueError(
                f"StoreHeader.format_version must be a positive int, got {self.format_version!r}"
            )
        if self.target_ids_stored and self.format_version < 3:
            raise ValueError(
                f"StoreHeader: targets {self.targets!r} need format version >= 3, got {self.format_version}"
            )

    @property
    def num_layers(self) -> int:
        """Number of stored layers."""
        return len(self.layer_ids)

    @property
    def target_ids_stored(self) -> bool:
        """Whether shards hold the verifier's greedy next-token ids (``target_ids``) per token."""
        return self.targets == "argmax"

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The stored layers that are draft inputs: all of them in an ``argmax`` store, all but
        the last (the verifier's final layer, the targets' source) in a ``states`` store."""
        return self.layer_ids if self.target_ids_stored else self.layer_ids[:-1]

    @property
    def storage_dtype(self) -> np.dtype:
        """Dtype of hidden states as held in :class:`Sample` (uint16 for bfloat16)."""
        return STORAGE_DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's hidden states in the storage dtype."""
        return self.num_layers * self.hidden_size * self.storage_dtype.itemsize

    def to_dict(self) -> dict:
        """JSON-ready dict (``layer_ids`` as a list; ``targets`` only when not ``"states"``, so a
        version-2 header reads as before)."""
        d = asdict(self)
        d["layer_ids"] = list(self.layer_ids)
        if self.targets == "states":
            del d["targets"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoreHeader:
        """Build a header from :meth:`to_dict` output; unknown or missing fields raise ``ValueError``."""
        if not isinstance(d, dict):
            raise ValueError(f"store header must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"store header has unknown fields {unknown}")
        missing = [name for name in ("verifier", "layer_ids", "hidden_size", "dtype") if name not in d]
        if missing:
            raise ValueError(f"store header lacks fields {missing}")
        return cls(**{k: (tuple(v) if k == "layer_ids" else v) for k, v in d.items()})

    def compatible_with(self, other: StoreHeader) -> list[str]:
        """Human-readable differences in data meaning between two headers; ``[]`` if the same.

        The codec and format version change only the encoding, so they are not compared.
        """
        problems = []
        for name in MEANING_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                problems.append(f"{name}: store has {_show(mine)}, got {_show(theirs)}")
        return problems


def format_version_for(targets: str) -> int:
    """The lowest store format version that holds a store of ``targets``: 2, or 3 for ``argmax``."""
    return 3 if targets == "argmax" else 2


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return repr(value)
