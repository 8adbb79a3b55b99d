"""The loader: packed sequences prepared off the training thread, read straight into their buffers.

:class:`PackedLoader` reads an epoch plan from a cursor position and packs consecutive samples
greedily into sequences of ``total_seq_len`` tokens. Each packed :class:`~spectrain.data.batch.Batch`
covers a contiguous range of plan positions, so the data cursor ``(epoch, position)`` after a
step is exact and a resumed run packs the rest of the epoch exactly as an uninterrupted one.

How a sequence is made (thread reader, the default):

- a *packer* thread walks the plan, asks the source to ``locate`` each sample (its length and a
  :class:`~spectrain.data.sample_reads.SampleRead`), places it in the open sequence and hands the read
  to a pool of *reader* threads, which land its bytes in the sequence's (pinned) buffer and
  check them there (checksum, finite values) while they are in cache;
- up to ``ahead`` finished sequences wait in a queue, so step ``n + 1``'s reads and packing run
  while step ``n`` computes;
- on CUDA a *copy* thread moves each finished sequence to the device on its own stream; the
  training thread only waits for that copy's event.

A sample whose read is refused becomes padding inside its sequence (the packing does not depend
on the check, so a resumed run packs identically). Sources without ``locate`` are read through
``get``; with ``num_workers > 0`` DataLoader processes read samples and the packer copies them.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from spectrain.data.batch import BATCH_TENSORS, Batch, empty_batch, storage_to_torch, zero_rows
from spectrain.data.sample_reads import ArrayRead, SampleRead, SampleRefused, fill_slot

if TYPE_CHECKING:
    from hsgen.store import Sample

log = logging.getLogger(__name__)

_END = object()


@dataclass
class _Item:
    """One plan position read by a DataLoader worker: tensors, or ``None`` for a failed sample."""

    position: int
    sample_id: str
    hidden: torch.Tensor | None = None  # [T, n_sel, H]
    token_ids: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    target_ids: torch.Tensor | None = None
    refused: str | None = None  # why the sample's read was refused (the main process counts and warns)


class _PlanReader(torch.utils.data.Dataset):
    """Map-style view of ``plan[start:]`` for DataLoader workers: index ``i`` reads position ``start + i``."""

    def __init__(self, source: Any, plan: Sequence[str], start: int, layers: Sequence[int] | None,
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
        try:
            sample = self.source.get(sid)
        except SampleRefused as e:  # its rows cannot be read, or fail their checksum: not the run's end
            return _Item(pos, sid, refused=str(e))
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
    targets = getattr(sample, "target_ids", None)
    return _Item(
        position,
        sample.sample_id,
        hs,
        torch.from_numpy(np.asarray(sample.token_ids[:n], dtype=np.int64)),
        torch.from_numpy(np.asarray(mask[:n]).astype(bool)),
        None if targets is None else torch.from_numpy(np.asarray(targets[:n], dtype=np.int32)),
    )


def _item_read(item: _Item) -> ArrayRead:
    """A worker's item (already truncated and layer-selected) as a read of its arrays."""
    h = item.hidden
    dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[h.dtype]  # type: ignore[union-attr]
    raw = h.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else h.numpy()  # type: ignore[union-attr]
    targets = None if item.target_ids is None else item.target_ids.numpy()
    return ArrayRead(item.sample_id, raw, item.token_ids.numpy(), item.loss_mask.numpy(), dtype,  # type: ignore[union-attr]
                     target_ids=targets)  # fmt: skip


def _identity(x):
    return x


def locate(source: Any, sample_id: str) -> SampleRead | None:
    """The source's :class:`SampleRead` for ``sample_id`` (``locate``, or ``get`` wrapped), None if failed."""
    fn = getattr(source, "locate", None)
    if fn is not None:
        return fn(sample_id)
    sample = source.get(sample_id)
    return None if sample is None else ArrayRead.of(sample)


class BufferPool:
    """Reusable CPU hidden-state buffers (pinned ones come from CUDA's caching host allocator).

    Fresh multi-megabyte CPU allocations cost a page fault per 4 KiB on first touch, several
    times the copy itself, so buffers no batch references any more are handed out again. The
    pool also remembers how many leading rows of each buffer may hold data (its *dirty* rows:
    rows past them are zero), so a sequence's padding is zeroed only where an earlier sequence
    wrote, and hands out the buffer that needs the least zeroing.

    Args:
        size: buffers kept per shape and dtype; more are allocated (and dropped) when all are busy.
    """

    def __init__(self, size: int = 5):
        self.size = size
        self._kept: list[torch.Tensor] = []
        self._dirty: dict[int, int] = {}  # data_ptr of a kept buffer -> rows that may be non-zero
        self._lock = threading.Lock()

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, used: int | None = None
    ) -> tuple[torch.Tensor, int]:
        """A buffer of ``shape`` that no batch uses, and how many of its leading rows may be non-zero.

        The free buffer needing the least zeroing past ``used`` (the rows the caller will fill)
        is chosen: the dirtiest one not dirtier than ``used``, else the cleanest; the cleanest
        when ``used`` is not known yet. Rows below the returned count hold stale data; rows from
        it on are zero.
        """
        with self._lock:
            same = [b for b in self._kept if tuple(b.shape) == shape and b.dtype == dtype]
            free = [b for b in same if b._use_count() == 1]  # no view of it (no batch) is alive
            if free:
                dirty = [self._dirty.get(b.data_ptr(), shape[0]) for b in free]
                fits = [] if used is None else [k for k, d in enumerate(dirty) if d <= used]
                k = max(fits, key=dirty.__getitem__) if fits else min(range(len(free)), key=dirty.__getitem__)
                return free[k].view(shape), dirty[k]
            buf = torch.empty(shape, dtype=dtype)
            if len(same) < self.size:
                self._kept.append(buf)
                self._dirty[buf.data_ptr()] = shape[0]
                return buf.view(shape), shape[0]
            return buf, shape[0]

    def settle(self, buf: torch.Tensor, used: int) -> None:
        """Record that rows of ``buf`` from ``used`` on are zero (its padding was cleared)."""
        with self._lock:
            if buf.data_ptr() in self._dirty:
                self._dirty[buf.data_ptr()] = used


class PackedLoader:
    """Iterate packed :class:`~spectrain.data.batch.Batch` es over ``plan[start:]``.

    Args:
        source: the sample source (``locate``/``get`` run on the packer thread; ``get`` in
            DataLoader workers if ``worker_safe`` and ``num_workers > 0``).
        plan: this rank's ordered ids for the epoch.
        start: first plan position to read (the data cursor).
        total_seq_len: slots per packed sequence; a longer sample is truncated.
        layers: indices into the stored layers to keep, auxiliary first, target layer last (no
            target layer from a store of target ids).
        target_ids: fill each batch's ``target_ids`` from the samples' (None: when the source's
            header says its samples carry them, ``targets = "argmax"``).
        hidden_dtype: dtype of the batch's hidden states.
        num_workers: DataLoader reader processes (0 = reader threads of this process).
        pin_memory: pack into page-locked memory (when CUDA is available).
        prefetch: samples read ahead by DataLoader workers.
        read_threads: threads that read samples into the sequence buffers.
        ahead: finished sequences held ready ahead of the consumer.
        device: a CUDA device to move each sequence to on a copy stream (None: host batches).
        buffers: where CPU sequence buffers come from; pass one pool to every loader of a run
            (epochs, validation) so buffers are reused across them.
    """

    def __init__(
        self,
        source: Any,
        plan: Sequence[str],
        *,
        start: int = 0,
        total_seq_len: int,
        layers: Sequence[int] | None,
        hidden_dtype: torch.dtype,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch: int = 8,
        read_threads: int = 2,
        ahead: int = 2,
        device: torch.device | str | None = None,
        buffers: BufferPool | None = None,
        target_ids: bool | None = None,
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
        self.pin = pin_memory and torch.cuda.is_available()
        self.prefetch = max(1, prefetch)
        self.read_threads = max(1, read_threads)
        self.ahead = max(1, ahead)
        dev = None if device is None else torch.device(device)
        self.device = dev if dev is not None and dev.type == "cuda" else None
        self.refused: list[str] = []
        """Samples whose reads were refused (trained on nothing), in the order met."""
        self._warned_truncate = False
        self.buffers = buffers if buffers is not None else BufferPool(self.ahead + 3)
        if target_ids is None:
            target_ids = bool(getattr(getattr(source, "header", None), "target_ids_stored", False))
        self.target_ids = target_ids
        self.eager = bool(getattr(source, "locate_waits", False))
        """Start each read as soon as its sample is placed (see :class:`_OpenSequence`)."""

    def __iter__(self) -> LoaderRun:
        return LoaderRun(self)

    def _items(self) -> Iterator[tuple[int, str, SampleRead | None]]:
        """(position, sample id, read or None) in plan order, from the source or DataLoader workers."""
        if self.num_workers > 0:
            reader = _PlanReader(self.source, self.plan, self.start, self.layers, self.total_seq_len)
            if len(reader) == 0:
                return
            dl = torch.utils.data.DataLoader(
                reader, batch_size=None, shuffle=False, num_workers=self.num_workers, collate_fn=_identity,
                prefetch_factor=max(2, self.prefetch // self.num_workers),
                multiprocessing_context="fork" if torch.multiprocessing.get_start_method() == "fork" else None,
            )  # fmt: skip
            for item in dl:
                if item.refused is not None:
                    self._refuse(item.sample_id, item.refused)
                yield item.position, item.sample_id, None if item.token_ids is None else _item_read(item)
            return
        for pos in range(self.start, len(self.plan)):
            sid = self.plan[pos]
            yield pos, sid, locate(self.source, sid)

    def _buffer(self, shape: tuple[int, ...], used: int | None) -> tuple[torch.Tensor, int]:
        """A sequence buffer for ``used`` rows of data (None: not known yet) and the rows from
        which on it is already zero."""
        if self.pin:  # CUDA's caching host allocator reuses pinned blocks once their copies are done
            return torch.empty(shape, dtype=self.hidden_dtype, pin_memory=True), shape[0]
        return self.buffers.take(shape, self.hidden_dtype, used)

    def _refuse(self, sample_id: str, reason: str) -> None:
        self.refused.append(sample_id)
        log.warning("%s: skipped, not trained", reason)
        hook = getattr(self.source, "refused", None)
        if hook is not None:
            hook(sample_id, reason)


@dataclass
class _Pending:
    """A packed sequence whose reads were handed to the reader threads."""

    batch: Batch
    reads: list[tuple[Future, str, int, int]] = field(default_factory=list)  # (job, sample id, start, end)
    others: list[Future] = field(default_factory=list)

    def finish(self, refuse: Callable[[str, str], None]) -> Batch:
        """Wait for the reads; a refused sample's slots become padding."""
        for fut in self.others:
            fut.result()
        for fut, sid, start, end in self.reads:
            reason = fut.result()
            if reason is not None:
                self.batch.drop(start, end)
                refuse(sid, reason)
        return self.batch


class _OpenSequence:
    """The sequence the packer is filling: slots handed out in plan order.

    By default its buffer is taken, and its reads start, when it closes: its length is known
    then, so the buffer needing the least zeroing of padding is chosen, and the reads go to
    the threads largest first (the threads finish a pass together). For a source whose
    ``locate`` waits (an online source waiting for fetches: ``locate_waits``), each read starts
    as soon as its sample is placed instead, so the copies overlap the waits.
    """

    def __init__(self, loader: PackedLoader, plan_start: int):
        self.loader = loader
        self.plan_start = plan_start
        self.used = 0
        self.sample_ids: list[str] = []
        self.placed: list[tuple[str, SampleRead, int, int]] = []  # (sample id, read, start slot, tokens)
        self.pending: _Pending | None = None
        self.dirty = 0
        self.jobs: dict[int, Future] = {}  # start slot -> its read

    def add(self, sample_id: str, read: SampleRead | None, n: int, pool: ThreadPoolExecutor) -> None:
        self.sample_ids.append(sample_id)
        if read is None or n == 0:
            return
        self.placed.append((sample_id, read, self.used, n))
        if self.loader.eager:
            if self.pending is None:
                self._allocate(read, None)
            self._submit(pool, read, self.used, n)
        self.used += n

    def _allocate(self, read: SampleRead, used: int | None) -> None:
        L = self.loader
        S = L.total_seq_len
        n_layers, H = read.row_shape
        n_sel = n_layers if L.layers is None or L.num_workers > 0 else len(L.layers)
        pin = L.pin
        hidden, self.dirty = L._buffer((S, n_sel, H), used)
        self.pending = _Pending(
            Batch(
                torch.zeros(S, dtype=torch.int64, pin_memory=pin),
                torch.zeros(S, dtype=torch.bool, pin_memory=pin),
                torch.zeros(S, dtype=torch.int64, pin_memory=pin),
                torch.full((S,), -1, dtype=torch.int64, pin_memory=pin),
                torch.arange(1, S + 1, dtype=torch.int64).pin_memory() if pin else torch.arange(1, S + 1),
                hidden,
                torch.full((S,), -1, dtype=torch.int64, pin_memory=pin) if L.target_ids else None,
            )
        )

    def _submit(self, pool: ThreadPoolExecutor, read: SampleRead, lo: int, n: int) -> None:
        b = self.pending.batch  # type: ignore[union-attr]
        layers = None if self.loader.num_workers > 0 else self.loader.layers
        hi = lo + n
        targets = None if b.target_ids is None else b.target_ids[lo:hi]
        self.jobs[lo] = pool.submit(
            _Job(
                _read_job,
                read,
                b.hidden_states[lo:hi],
                b.input_ids[lo:hi],
                b.loss_mask[lo:hi],
                layers,
                targets,
            )
        )

    def close(self, plan_end: int, pool: ThreadPoolExecutor) -> _Pending:
        L = self.loader
        if not self.placed:
            batch = empty_batch(L.total_seq_len, self.plan_start, plan_end, self.sample_ids, L.hidden_dtype,
                                L.target_ids)  # fmt: skip
            return _Pending(batch)
        if self.pending is None:
            self._allocate(self.placed[0][1], self.used)
        pending = self.pending
        assert pending is not None
        b = pending.batch
        # the padding's states: zero where an earlier sequence wrote (a device copy zeroes them there)
        if self.dirty > self.used and L.device is None:
            pending.others.append(pool.submit(_Job(zero_rows, b.hidden_states[self.used : self.dirty])))
        if not L.pin:
            L.buffers.settle(b.hidden_states, self.used)
        for _, read, lo, n in sorted(self.placed, key=lambda p: -p[3]):
            if lo not in self.jobs:
                self._submit(pool, read, lo, n)
        for d, (sid, _, lo, n) in enumerate(self.placed):
            b.position_ids[lo : lo + n] = torch.arange(n)
            b.doc_ids[lo : lo + n] = d
            b.doc_ends[lo : lo + n] = lo + n
            pending.reads.append((self.jobs[lo], sid, lo, lo + n))
        b.sample_ids = self.sample_ids
        b.plan_start, b.plan_end, b.num_tokens = self.plan_start, plan_end, self.used
        return pending


class _Job:
    """A reader-thread task that drops its arguments as it finishes.

    The executor keeps a finished task alive for a moment after its result is posted; a task
    holding views of a sequence buffer would keep that buffer "in use" after the consumer
    released the batch, and the pool would allocate another one.
    """

    def __init__(self, fn: Callable[..., Any], *args: Any):
        self._call: tuple[Callable[..., Any], tuple[Any, ...]] | None = (fn, args)

    def __call__(self) -> Any:
        fn, args = self._call  # type: ignore[misc]
        self._call = None
        return fn(*args)


def _read_job(read: SampleRead, hidden, input_ids, loss_mask, layers, target_ids=None) -> str | None:
    """Reader thread: fill one slot; the refusal message, or None when the sample is good."""
    try:
        fill_slot(read, hidden, input_ids, loss_mask, layers, target_ids)
    except SampleRefused as e:
        return str(e)
    finally:
        release = getattr(read, "release", None)
        if release is not None:
            release()
    return None


def _to_device(host: Batch, device: torch.device) -> Batch:
    """Copy a finished host sequence to ``device`` (on the current stream): the hidden rows that
    hold data only, the padding's states zeroed there (its host rows are stale)."""
    n = host.num_tokens
    hs = torch.empty(host.hidden_states.shape, dtype=host.hidden_states.dtype, device=device)
    hs[:n].copy_(host.hidden_states[:n], non_blocking=True)
    hs[n:].zero_()
    moved = {k: getattr(host, k).to(device, non_blocking=True) for k in BATCH_TENSORS if k != "hidden_states"}
    targets = None if host.target_ids is None else host.target_ids.to(device, non_blocking=True)
    return Batch(**moved, hidden_states=hs, target_ids=targets, sample_ids=host.sample_ids,
                 plan_start=host.plan_start, plan_end=host.plan_end, num_tokens=n)  # fmt: skip


JOIN_TIMEOUT_S = 60.0
"""How long closing a loader waits for each of its threads (one read or one copy) before it warns."""


class LoaderRun:
    """One pass of a :class:`PackedLoader`: an iterator of batches fed by background threads.

    Call :meth:`close` (or drop it) when stopping early; the threads stop after their current read.
    """

    def __init__(self, loader: PackedLoader):
        self.loader = loader
        self._stop = threading.Event()
        self._ready: queue.Queue = queue.Queue(maxsize=loader.ahead)
        self._pool = ThreadPoolExecutor(loader.read_threads, thread_name_prefix="spectrain-read")
        self._done = False
        self._threads = [threading.Thread(target=self._pack_loop, name="spectrain-pack", daemon=True)]
        self._out: queue.Queue = self._ready
        if loader.device is not None:
            self._out = queue.Queue(maxsize=1)
            self._threads.append(threading.Thread(target=self._copy_loop, name="spectrain-h2d", daemon=True))
        for t in self._threads:
            t.start()

    def __iter__(self) -> LoaderRun:
        return self

    def __next__(self) -> Batch:
        if self._done:
            raise StopIteration
        item = self._out.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        if self.loader.device is None:
            return item.finish(self.loader._refuse)
        batch, event = item
        stream = torch.cuda.current_stream(self.loader.device)
        stream.wait_event(event)
        for t in batch.tensors():
            t.record_stream(stream)
        return batch

    def _put(self, q: queue.Queue, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _pack_loop(self) -> None:
        L = self.loader
        S = L.total_seq_len
        try:
            seq: _OpenSequence | None = None
            last = L.start - 1
            for pos, sid, read in L._items():
                if self._stop.is_set():
                    return
                last = pos
                n = 0 if read is None else min(read.length, S)
                if seq is not None and n and seq.used + n > S and seq.used > 0:
                    if not self._put(self._ready, seq.close(pos, self._pool)):
                        return
                    seq = None
                if seq is None:
                    seq = _OpenSequence(L, pos)
                if read is not None and read.length > S and not L._warned_truncate:
                    log.warning("sample %r truncated to --total-seq-len %d tokens", sid, S)
                    L._warned_truncate = True
                seq.add(sid, read, n, self._pool)
            if seq is not None and not self._put(self._ready, seq.close(last + 1, self._pool)):
                return
            self._put(self._ready, _END)
        except BaseException as e:  # surfaced by __next__ on the training thread
            self._put(self._ready, e)

    def _copy_loop(self) -> None:
        device = self.loader.device
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        try:
            while not self._stop.is_set():
                try:
                    item = self._ready.get(timeout=0.1)
                except queue.Empty:
                    continue
                if item is _END or isinstance(item, BaseException):
                    self._put(self._out, item)
                    return
                host = item.finish(self.loader._refuse)
                with torch.cuda.stream(stream):
                    dev = _to_device(host, device)
                    event = torch.cuda.Event()
                    event.record(stream)
                if not self._put(self._out, (dev, event)):
                    return
        except BaseException as e:
            self._put(self._out, e)

    def close(self) -> None:
        """Stop the background threads and wait for them (idempotent): the queued reads are
        cancelled, the ones under way finish. No thread of the run is left to hold tensors while
        the interpreter exits."""
        if self._done:
            return
        self._done = True
        self._stop.set()
        for q in (self._ready, self._out):
            with contextlib.suppress(queue.Empty):
                while True:
                    q.get_nowait()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=JOIN_TIMEOUT_S)
                if t.is_alive():
                    log.warning("loader thread %s still busy %.0f s after the stop", t.name, JOIN_TIMEOUT_S)
        self._pool.shutdown(wait=True)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
