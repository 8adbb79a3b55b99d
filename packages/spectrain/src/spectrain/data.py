"""Training data: sample sources, the epoch plan, the train/validation split and packing.

A :class:`SampleSource` hands out :class:`hsgen.store.Sample` objects by id; the loop asks it
for an epoch *plan* (this rank's ordered ids) and reads the plan from a cursor position.
:class:`PackedLoader` reads the plan in order (DataLoader workers for sources that allow it,
a prefetch thread otherwise) and packs consecutive samples greedily into sequences of
``total_seq_len`` tokens. Each packed :class:`Batch` covers a contiguous range of plan
positions, so the data cursor ``(epoch, position)`` after a step is exact and a resumed run
packs the rest of the epoch exactly as an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:
    from hsgen.store import HiddenStateStore, Sample

log = logging.getLogger(__name__)

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
    ):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if isinstance(store, str | Path):
            self.path = Path(store)
            self._store = None
        else:
            self.path = Path(store.path)
            self._store = store
        self.split = split
        self.val_fraction = val_fraction
        self.seed = seed
        self.rank = rank
        self.world_size = world_size

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

    def get(self, sample_id: str) -> Sample | None:
        try:
            return self.store.read(sample_id)
        except KeyError:
            log.warning("sample %r is no longer in store %s; skipped", sample_id, self.path)
            return None

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

    def close(self) -> None:
        self._store = None


# --------------------------------------------------------------------------- batches


@dataclass
class Batch:
    """One packed sequence of ``S`` token slots (no batch dimension).

    ``hidden_states[:, :-1]`` are the auxiliary layers (draft input), ``hidden_states[:, -1]``
    the last layer (targets). Slots past ``num_tokens`` are padding: ``doc_ids == -1``,
    ``loss_mask == 0``, zero states. Token ``t`` of a document is predicted from the verifier's
    state at ``t - 1``; ``loss_mask[t] == 1`` trains that prediction.
    """

    input_ids: torch.Tensor  # [S] int64
    loss_mask: torch.Tensor  # [S] bool
    position_ids: torch.Tensor  # [S] int64, restart at 0 per document
    doc_ids: torch.Tensor  # [S] int64, 0.. per document, -1 padding
    doc_ends: torch.Tensor  # [S] int64, exclusive end slot of the token's document (own slot + 1 for padding)
    hidden_states: torch.Tensor  # [S, n_aux + 1, H] in the store's dtype
    sample_ids: list[str] = field(default_factory=list)
    plan_start: int = 0
    plan_end: int = 0
    num_tokens: int = 0

    @property
    def aux_hidden(self) -> torch.Tensor:
        return self.hidden_states[:, :-1]

    @property
    def last_hidden(self) -> torch.Tensor:
        return self.hidden_states[:, -1]

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        move = {
            k: getattr(self, k).to(device, non_blocking=non_blocking)
            for k in ("input_ids", "loss_mask", "position_ids", "doc_ids", "doc_ends", "hidden_states")
        }
        return Batch(**move, sample_ids=self.sample_ids, plan_start=self.plan_start, plan_end=self.plan_end,
                     num_tokens=self.num_tokens)  # fmt: skip


def storage_to_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    """Zero-copy torch view of stored hidden states (``uint16`` storage -> ``bfloat16``)."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if dtype == "bfloat16":
        if t.dtype not in (torch.uint16, torch.int16):
            if t.dtype == torch.bfloat16:
                return t
            raise ValueError(f"bfloat16 states must be stored as uint16, got {array.dtype}")
        return t.view(torch.bfloat16)
    want = {"float16": torch.float16, "float32": torch.float32}.get(dtype)
    if want is None:
        raise ValueError(f"unsupported hidden-state dtype {dtype!r}")
    return t if t.dtype == want else t.to(want)


TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class _Item:
    """One plan position read by a worker: tensors or ``None`` for a failed sample."""

    position: int
    sample_id: str
    hidden: torch.Tensor | None = None  # [T, n_sel, H]
    token_ids: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None


class _PlanReader(torch.utils.data.Dataset):
    """Map-style view of ``plan[start:]``: index ``i`` reads plan position ``start + i``."""

    def __init__(self, source: SampleSource, plan: Sequence[str], start: int, layers: Sequence[int] | None,
                 max_tokens: int):  # fmt: skip
        self.source = source
        self.plan = list(plan)
        self.start = start
        self.layers = None if layers is None else list(layers)
        self.max_tokens = max_tokens

    def __len__(self) -> int:
        return len(self.plan) - self.start

    def __getitem__(self, i: int) -> _Item:
        pos = self.start + i
        sid = self.plan[pos]
        sample = self.source.get(sid)
        if sample is None:
            return _Item(pos, sid)
        return sample_to_item(sample, pos, self.layers, self.max_tokens)


def sample_to_item(sample: Sample, position: int, layers: Sequence[int] | None, max_tokens: int) -> _Item:
    """Convert a :class:`Sample` to tensors: truncate to ``max_tokens``, keep ``layers`` (in that order)."""
    n = min(int(sample.token_ids.shape[0]), max_tokens)
    hs = storage_to_torch(sample.hidden_states, sample.dtype)
    if hs.ndim != 3 or hs.shape[0] < n:
        raise ValueError(
            f"sample {sample.sample_id!r}: hidden states {tuple(hs.shape)} do not match {n} tokens"
        )
    hs = hs[:n]
    if layers is not None and list(layers) != list(range(hs.shape[1])):
        hs = hs[:, list(layers)]
    mask = sample.loss_mask if sample.loss_mask is not None else np.ones(n, np.uint8)
    return _Item(
        position,
        sample.sample_id,
        hs,
        torch.from_numpy(np.asarray(sample.token_ids[:n], dtype=np.int64)),
        torch.from_numpy(np.asarray(mask[:n]).astype(bool)),
    )


def _identity(x):
    return x


class PackedLoader:
    """Iterate packed :class:`Batch` es over ``plan[start:]``.

    Args:
        source: the sample source (its ``get`` runs in DataLoader workers if ``worker_safe``).
        plan: this rank's ordered ids for the epoch.
        start: first plan position to read (the data cursor).
        total_seq_len: slots per packed sequence; a longer sample is truncated.
        layers: indices into the stored layers to keep, auxiliary first, target layer last.
        num_workers: reader processes (0 = read in a thread of this process).
        pin_memory: pack into page-locked memory (for fast, asynchronous copies to CUDA).
        prefetch: samples read ahead of packing.
    """

    def __init__(
        self,
        source: SampleSource,
        plan: Sequence[str],
        *,
        start: int = 0,
        total_seq_len: int,
        layers: Sequence[int] | None,
        hidden_dtype: torch.dtype,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch: int = 8,
    ):
        if total_seq_len < 2:
            raise ValueError(f"total_seq_len must be >= 2, got {total_seq_len}")
        self.source = source
        self.plan = list(plan)
        self.start = start
        self.total_seq_len = total_seq_len
        self.layers = None if layers is None else list(layers)
        self.hidden_dtype = hidden_dtype
        self.num_workers = num_workers if getattr(source, "worker_safe", False) else 0
        self.pin_memory = pin_memory
        self.prefetch = max(1, prefetch)
        self._warned_truncate = False
        self._pool: list[torch.Tensor] = []
        self.pool_size = 4

    def _items(self) -> Iterator[_Item]:
        reader = _PlanReader(self.source, self.plan, self.start, self.layers, self.total_seq_len)
        if len(reader) == 0:
            return
        if self.num_workers > 0:
            dl = torch.utils.data.DataLoader(
                reader,
                batch_size=None,
                shuffle=False,
                num_workers=self.num_workers,
                collate_fn=_identity,
                prefetch_factor=max(2, self.prefetch // self.num_workers),
                multiprocessing_context="fork"
                if torch.multiprocessing.get_start_method() == "fork"
                else None,
            )
            yield from dl
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="spectrain-read") as pool:
            window = []
            nxt = 0
            while nxt < len(reader) and len(window) < self.prefetch:
                window.append(pool.submit(reader.__getitem__, nxt))
                nxt += 1
            while window:
                item = window.pop(0).result()
                if nxt < len(reader):
                    window.append(pool.submit(reader.__getitem__, nxt))
                    nxt += 1
                yield item

    def __iter__(self) -> Iterator[Batch]:
        bin_items: list[_Item] = []
        used = 0
        first = self.start
        for item in self._items():
            n = 0 if item.token_ids is None else int(item.token_ids.shape[0])
            if n and used + n > self.total_seq_len and used > 0:
                yield self._pack(bin_items, first, item.position)
                bin_items, used, first = [], 0, item.position
            if n >= self.total_seq_len and not self._warned_truncate:
                log.warning(
                    "sample %r truncated to --total-seq-len %d tokens", item.sample_id, self.total_seq_len
                )
                self._warned_truncate = True
            bin_items.append(item)
            used += n
        if bin_items:
            yield self._pack(bin_items, first, bin_items[-1].position + 1)

    def _buffer(self, shape: tuple[int, ...], pin: bool) -> torch.Tensor:
        """A hidden-state buffer: pinned (CUDA's host allocator caches those), or a pooled CPU one.

        Fresh multi-megabyte CPU allocations cost a page fault per 4 KiB on first touch, several
        times the copy itself, so buffers no batch references any more are reused.
        """
        if pin:
            return torch.empty(shape, dtype=self.hidden_dtype, pin_memory=True)
        for buf in self._pool:  # a buffer is free when no view of it (no batch) is alive
            if tuple(buf.shape) == shape and buf._use_count() == 1:
                return buf.view(shape)
        buf = torch.empty(shape, dtype=self.hidden_dtype)
        if len(self._pool) < self.pool_size:
            self._pool.append(buf)
            return buf.view(shape)
        return buf

    def _pack(self, items: list[_Item], plan_start: int, plan_end: int) -> Batch:
        S = self.total_seq_len
        real = [it for it in items if it.token_ids is not None]
        if not real:
            return _empty_batch(S, plan_start, plan_end, [it.sample_id for it in items], self.hidden_dtype)
        n_sel, H = real[0].hidden.shape[1:]
        pin = self.pin_memory and torch.cuda.is_available()
        hidden = self._buffer((S, n_sel, H), pin)
        input_ids = torch.zeros(S, dtype=torch.int64, pin_memory=pin)
        loss_mask = torch.zeros(S, dtype=torch.bool, pin_memory=pin)
        position_ids = torch.zeros(S, dtype=torch.int64, pin_memory=pin)
        doc_ids = torch.full((S,), -1, dtype=torch.int64, pin_memory=pin)
        doc_ends = torch.arange(1, S + 1, dtype=torch.int64).pin_memory() if pin else torch.arange(1, S + 1)
        off = 0
        for d, it in enumerate(real):
            n = int(it.token_ids.shape[0])
            if tuple(it.hidden.shape[1:]) != (n_sel, H):
                raise ValueError(
                    f"sample {it.sample_id!r}: hidden states {tuple(it.hidden.shape)} differ from batch"
                )
            hidden[off : off + n].copy_(it.hidden)
            input_ids[off : off + n] = it.token_ids
            loss_mask[off : off + n] = it.loss_mask
            position_ids[off : off + n] = torch.arange(n)
            doc_ids[off : off + n] = d
            doc_ends[off : off + n] = off + n
            off += n
        hidden[off:].zero_()
        return Batch(input_ids, loss_mask, position_ids, doc_ids, doc_ends, hidden,
                     sample_ids=[it.sample_id for it in items], plan_start=plan_start, plan_end=plan_end,
                     num_tokens=off)  # fmt: skip


def _empty_batch(S: int, plan_start: int, plan_end: int, ids: list[str], dtype: torch.dtype) -> Batch:
    return Batch(
        torch.zeros(S, dtype=torch.int64),
        torch.zeros(S, dtype=torch.bool),
        torch.zeros(S, dtype=torch.int64),
        torch.full((S,), -1, dtype=torch.int64),
        torch.arange(1, S + 1, dtype=torch.int64),
        torch.zeros((S, 1, 1), dtype=dtype),
        sample_ids=ids,
        plan_start=plan_start,
        plan_end=plan_end,
        num_tokens=0,
    )


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
