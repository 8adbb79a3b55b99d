"""Plain records handed out by the store: manifest entries and decoded samples."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """One sample's manifest entry.

    Attributes:
        sample_id: the sample's id, unique within the store.
        shard: shard directory, relative to the store (``shards/<writer>/<seq>.zarr``).
        offset: first token row of the sample in the shard.
        length: number of tokens.
        checksum: ``"bsum64:<16 hex>"`` over the sample's stored bytes (see ``docs/format.md``).
    """

    sample_id: str
    shard: str
    offset: int
    length: int
    checksum: str


@dataclass
class Sample:
    """One sample's arrays.

    Attributes:
        sample_id: the sample's id.
        hidden_states: ``[T, n_layers, H]`` in the STORAGE dtype: uint16 for bfloat16 (view it as
            bfloat16, e.g. ``torch.from_numpy(a).view(torch.bfloat16)``), float16 or float32.
        token_ids: ``[T]`` int64.
        loss_mask: ``[T]`` uint8, 1 = train on this token's prediction.
        dtype: logical dtype of ``hidden_states``.
        target_ids: ``[T]`` int32, the verifier's greedy next token after each position, in a
            store of ``targets = "argmax"`` (None otherwise: the last layer holds the targets).
    """

    sample_id: str
    hidden_states: np.ndarray
    token_ids: np.ndarray
    loss_mask: np.ndarray
    dtype: str
    target_ids: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        """Number of tokens T."""
        return int(self.token_ids.shape[0])
