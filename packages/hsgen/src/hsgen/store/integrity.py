"""Checking a sample's bytes against its manifest checksum, wherever the bytes were read to.

``HiddenStateStore.read`` checks every sample it returns (``verify=False`` opts out); a loader
that reads a shard's bytes itself (straight into a pinned batch buffer, say) calls
:func:`check_sample` on the same arrays: the stored hidden rows (uint8 e4m3 for fp8), the fp8
scale, the token ids and the loss mask, as read from the shard. The ``bsum64`` checksum runs at
several GB/s per core (``scripts/bench_checksum.py``), so it belongs in the reader thread.
"""

from __future__ import annotations

import numpy as np

from hsgen.store import codecs as C
from hsgen.store.errors import CorruptSample
from hsgen.store.records import SampleRecord


def sample_matches(
    checksum: str,
    hidden: np.ndarray,
    token_ids: np.ndarray,
    loss_mask: np.ndarray,
    scale: np.ndarray | None = None,
    target_ids: np.ndarray | None = None,
) -> bool:
    """Whether the arrays (stored form) have the manifest ``checksum``."""
    arrays = C.sample_arrays(hidden, token_ids, loss_mask, scale, target_ids)
    return C.checksum_like(checksum, arrays) == checksum


def check_sample(
    record: SampleRecord,
    hidden: np.ndarray,
    token_ids: np.ndarray,
    loss_mask: np.ndarray,
    scale: np.ndarray | None = None,
    *,
    store: str = "",
    target_ids: np.ndarray | None = None,
) -> None:
    """Raise :class:`CorruptSample` (naming store, shard and sample) unless the bytes match ``record``
    (``target_ids``: the verifier's target ids of an ``argmax`` store, covered by its checksum)."""
    got = C.checksum_like(record.checksum, C.sample_arrays(hidden, token_ids, loss_mask, scale, target_ids))
    if got != record.checksum:
        where = f"{store}/{record.shard}" if store else record.shard
        raise CorruptSample(
            f"{where}: sample {record.sample_id!r} is corrupt (checksum {got} != manifest {record.checksum}); "
            "run hsgen verify",
            record.sample_id,
            record.shard,
        )


__all__ = ["CorruptSample", "check_sample", "sample_matches"]
