"""Training data: sample sources, the epoch plan and the train/validation split.

A :class:`SampleSource` hands out samples by id; the loop asks it for an epoch *plan* (this
rank's ordered ids) and reads the plan from a cursor position through
:class:`spectrain.data.loader.PackedLoader` (re-exported here with :class:`spectrain.data.batch.Batch`),
which packs consecutive samples into sequences of ``total_seq_len`` tokens.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from spectrain.data.batch import TORCH_DTYPES, Batch, storage_to_torch
from spectrain.data.loader import PackedLoader, sample_to_item
from spectrain.data.sample_reads import SampleRead, SampleRefused, StoreRead

if TYPE_CHECKING:
    from hsgen.store import HiddenStateStore, Sample

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

log = logging.getLogger(__name__)

REMOTE_READS_IN_FLIGHT = 16
"""Reader threads for a store on object storage (``s3://``), unless ``--read-threads`` asks more."""

SPLITS = ("train", "validation")


@runtime_checkable
class SampleSource(Protocol):
    """Where the loop gets samples (see docs/design.md).

    Optional extras the loop uses when present: ``worker_safe: bool`` (``get`` may run in
    DataLoader worker processes; the source must pickle), ``lengths(ids) -> list[int]``
    (token counts, for the LR schedule; ``lengths_exact = False`` says each costs a rendering,
    so a long plan's count is estimated from a sample), ``use_plan(epoch, ids)`` (called on resume with the
    checkpointed plan when it differs from ``plan(epoch)``), ``skipped(ids)`` (called at the end
    of an epoch with the planned samples it left untrained: the tail a rank drops to keep ranks
    in step).
    """

    def plan(self, epoch: int) -> list[str]:
        """Sample ids of this rank for ``epoch``, in training order (deterministic per epoch)."""
        ...

    def get(self, sample_id: str) -> Sample | None:
        """The sample (blocking until available), or None when it cannot be produced (reported)."""
        ...

    def consumed(self, sample_ids: Sequence[str]) -> None:
        """Called after the optimizer step that used ``sample_ids`` completed."""
        ...

    def close(self) -> None:
        """Release readers, threads and (where the source owns it) scratch space."""
        ...


def split_of(sample_id: str, val_fraction: float) -> str:
    """``"validation"`` or ``"train"`` from a hash of the id alone (stable as the store grows)."""
    h = int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=8).digest(), "big")
    return "validation" if h / 2**64 < val_fraction else "train"


def epoch_plan(ids: Sequence[str], epoch: int, seed: int, rank: int = 0, world_size: int = 1) -> list[str]:
    """Seeded shuffle of the sorted ``ids`` for ``epoch``, then this rank's slice ``[rank::world_size]``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    order = sorted(ids)
    random.Random(f"spectrain:{seed}:{epoch}").shuffle(order)
    return order[rank::world_size]


def plan_digest(ids: Sequence[str]) -> str:
    """Short hash of an ordered id list (detects a plan that changed between runs)."""
    h = hashlib.blake2b(digest_size=12)
    for i in ids:
        h.update(i.encode())
        h.update(b"\0")
    return h.hexdigest()


class StoreSource:
    """The offline source: samples of one split of a :class:`hsgen.store.HiddenStateStore`.

    Args:
        store: store directory or an open store.
        split: ``"train"`` or ``"validation"`` (by :func:`split_of`).
        val_fraction: share of sample ids in the validation split.
        seed: shuffle seed of the epoch plan.
        rank, world_size: this process's slice of each epoch plan.
        verify: check each sample's checksum as the loader reads it (a bad sample is skipped
            with a warning naming store, shard and sample).
    """

    worker_safe = True

    def __init__(
        self,
        store: str | Path | HiddenStateStore,
        *,
        split: str = "train",
        val_fraction: float = 0.01,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        verify: bool = True,
    ):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        from hsgen.store.backend import is_remote

        if isinstance(store, str | Path):
            self.path = store if is_remote(store) else Path(store)  # s3://bucket/prefix stays a URL
            self._store = None
        else:
            self.path = store.path if is_remote(str(store.path)) else Path(store.path)
            self._store = store
        self.split = split
        self.val_fraction = val_fraction
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.verify = verify

    @property
    def reads_in_flight(self) -> int:
        """Reads the loader should keep in flight at least: many on object storage, where each
        read waits a round trip (``docs/benchmarks.md``: the figure that reaches the local rate)."""
        from hsgen.store.backend import is_remote

        return REMOTE_READS_IN_FLIGHT if is_remote(str(self.path)) else 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"] = None
        return state

    @property
    def store(self) -> HiddenStateStore:
        if self._store is None:
            from hsgen.store import HiddenStateStore

            self._store = HiddenStateStore.open(self.path)
        return self._store

    @property
    def header(self):
        return self.store.header

    def ids(self) -> list[str]:
        """Sorted live sample ids of this split (re-reads the manifest)."""
        self.store.refresh()
        return sorted(i for i in self.store.sample_ids() if split_of(i, self.val_fraction) == self.split)

    def plan(self, epoch: int) -> list[str]:
        return epoch_plan(self.ids(), epoch, self.seed, self.rank, self.world_size)

    def _gone(self, sample_id: str) -> None:
        log.warning("store %s: sample %r is no longer in it (its shard was deleted): skipped, not trained",
                    self.path, sample_id)  # fmt: skip

    def get(self, sample_id: str) -> Sample | None:
        """The sample read whole (a DataLoader worker's read), None when it is no longer in the store.

        Raises:
            SampleRefused: its rows cannot be read or (``verify``) fail their checksum; the
                message names the store, the shard and the sample.
        """
        from hsgen.store import StoreError

        try:
            return self.store.read(sample_id, verify=self.verify)
        except StoreError as e:
            raise SampleRefused(str(e)) from e
        except KeyError:
            self._gone(sample_id)
            return None

    def locate(self, sample_id: str) -> SampleRead | None:
        """The sample's read (straight into the loader's buffer, checksum checked when ``verify``)."""
        try:
            length = self.store.record(sample_id).length
        except KeyError:
            self._gone(sample_id)
            return None
        return StoreRead(self.store, sample_id, length, verify=self.verify)

    def lengths(self, sample_ids: Sequence[str]) -> list[int]:
        return [self.store.record(i).length for i in sample_ids]

    def token_ids(self, sample_id: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(token_ids, loss_mask)`` of a sample (token-only read when the store offers one)."""
        reader = getattr(self.store, "read_tokens", None)
        if reader is not None:
            return reader(sample_id)
        s = self.get(sample_id)
        return None if s is None else (s.token_ids, s.loss_mask)

    def consumed(self, sample_ids: Sequence[str]) -> None:
        """Offline data stays in the store."""

    def samples_hidden(self) -> int:
        """Stored samples that damaged manifest lines keep out of every plan (lost to this run)."""
        return self.store.samples_hidden()

    def close(self) -> None:
        self._store = None


def count_packed_sequences(lengths: Sequence[int], total_seq_len: int) -> int:
    """How many sequences :class:`PackedLoader` makes from samples of these lengths, in order."""
    count, used = 0, 0
    for n in lengths:
        n = min(int(n), total_seq_len)
        if n == 0:
            continue
        if used + n > total_seq_len and used > 0:
            count += 1
            used = 0
        used += n
    return count + (1 if used > 0 else 0)


LENGTH_SAMPLE = 4096
"""Samples whose lengths estimate a plan's packed sequences when lengths cost a rendering each."""


def estimate_packed_sequences(
    plan: Sequence[str],
    lengths: Callable[[Sequence[str]], list[int]],
    total_seq_len: int,
    *,
    exact: bool = True,
) -> int:
    """Packed sequences the plan makes: counted exactly, or (``exact=False``, a long plan)
    extrapolated from its first :data:`LENGTH_SAMPLE` ids (a plan is shuffled, so its head is a
    uniform sample; the count is within a few percent for thousands of samples)."""
    if exact or len(plan) <= LENGTH_SAMPLE:
        return count_packed_sequences(lengths(plan), total_seq_len)
    head = plan[:LENGTH_SAMPLE]
    return max(1, round(count_packed_sequences(lengths(head), total_seq_len) * len(plan) / len(head)))


def token_frequencies(source: SampleSource, sample_ids: Sequence[str], vocab_size: int,
                      *, loss_masked_only: bool = True) -> np.ndarray:  # fmt: skip
    """Counts ``[vocab_size]`` of token ids in the samples (those with loss mask 1, when any)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    masked_total = 0
    all_counts = np.zeros(vocab_size, dtype=np.int64)
    reader = getattr(source, "token_ids", None)
    for sid in sample_ids:
        if reader is not None:
            got = reader(sid)
            if got is None:
                continue
            toks, mask = got
        else:
            s = source.get(sid)
            if s is None:
                continue
            toks, mask = s.token_ids, s.loss_mask
        toks = np.asarray(toks, dtype=np.int64)
        if toks.size and (toks.max() >= vocab_size or toks.min() < 0):
            raise ValueError(
                f"sample {sid!r}: token id {int(toks.max())} outside the vocabulary of {vocab_size}"
            )
        all_counts += np.bincount(toks, minlength=vocab_size)
        if mask is not None and loss_masked_only:
            sel = toks[np.asarray(mask).astype(bool)]
            masked_total += sel.size
            counts += np.bincount(sel, minlength=vocab_size)
    return counts if masked_total > 0 else all_counts
