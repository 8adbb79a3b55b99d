"""Fetched samples into the store: one writer thread, shards by size and by time, bounded memory.

:class:`StoreSink` takes validated samples from the fetch tasks and hands them, in order, to one
``ShardWriter`` running on its own thread. A sample is in the store only once its shard is
committed; :meth:`StoreSink.close` commits what is buffered. Memory is bounded by the bytes
fetched but not yet written: :meth:`StoreSink.wait_for_room` holds new requests back while they
exceed ``max_buffer_bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hsgen.client.fetch import ClientConfig, FetchedSample
from hsgen.client.hidden_file import ExpectedStates
from hsgen.client.phases import PhaseTimes
from hsgen.generate.report import RunReport
from hsgen.store.backend import is_remote
from hsgen.store.errors import SampleRejected

log = logging.getLogger(__name__)


class LazyStore:
    """A store that does not exist yet: created from the first sample (its header needs the shape).

    Args:
        path: where the store will be.
        create: ``sample -> HiddenStateStore``.
        expected: what the first sample must hold (the layers asked for, the model's hidden
            size), checked on each file's header: a server's fake shape never becomes the header.
    """

    def __init__(
        self, path: str | Path, create: Callable[[FetchedSample], Any], expected: ExpectedStates | None = None
    ):
        self.path = path if is_remote(path) else Path(path)
        self._create = create
        self.expected = expected or ExpectedStates()

    def __call__(self, sample: FetchedSample) -> Any:
        return self._create(sample)


def expected_of(store: Any) -> ExpectedStates:
    """What the server's files must hold to go into ``store``: an open store's header, or what a
    store not created yet (:class:`LazyStore`, :class:`hsgen.generate.store_shape.NewStore`) expects."""
    header = getattr(store, "header", None)
    if header is not None:
        return ExpectedStates(len(header.layer_ids), header.hidden_size, header.dtype, store=str(store.path))
    return getattr(store, "expected", None) or ExpectedStates()


def with_expected(client: ClientConfig, store: Any) -> ClientConfig:
    """``client`` checking every file against what ``store`` expects (see :func:`expected_of`),
    the figures the client's config states outright winning."""
    return dataclasses.replace(client, expected=expected_of(store))


def check_header(header: Any, sample: FetchedSample) -> None:
    """Raise ``ValueError`` when ``sample``'s dtype, layer count or hidden size do not fit ``header``."""
    shape = sample.hidden_states.shape
    if sample.dtype != header.dtype:
        raise ValueError(f"the server sends {sample.dtype} hidden states, the store holds {header.dtype}")
    if shape[1] != len(header.layer_ids):
        raise ValueError(
            f"the server sends {shape[1]} layers, the store holds {len(header.layer_ids)} "
            f"(layer ids {list(header.layer_ids)}): check the server's eagle_aux_hidden_state_layer_ids"
        )
    if (sample.target_ids is not None) != header.target_ids_stored:
        raise ValueError(
            f"the store holds {'target ids' if header.target_ids_stored else 'final-layer states'} "
            f"(targets {header.targets}), the run fetches {'target ids' if sample.target_ids is not None else 'states'}: "
            "use the store's --targets"
        )
    if shape[2] != header.hidden_size:
        raise ValueError(f"the server sends hidden size {shape[2]}, the store holds {header.hidden_size}")


def describe_os_error(e: BaseException) -> str:
    """``strerror: path`` for an ``OSError`` (disk full, permission denied), else ``Type: message``."""
    if isinstance(e, OSError) and e.strerror:
        where = e.filename if e.filename is not None else ""
        return f"{e.strerror}: {where}" if where else e.strerror
    return f"{type(e).__name__}: {e}"


class StoreSink:
    """The writer side of a run (single event loop; the writes run on one thread).

    Args:
        store: an open ``HiddenStateStore`` or a :class:`LazyStore` (or any callable) creating it.
        writer_id: the ``ShardWriter`` id (None = a fresh one).
        shard_bytes: commit a shard at this size.
        commit_interval_s: also commit at least this often.
        max_buffer_bytes: the memory bound (see :meth:`wait_for_room`).
        report: the run's report (``summary.stored``, ``store``; failures).
        on_fatal: called with a message when the store cannot take more samples.
        on_created: called with the store once a :class:`LazyStore` created it (the run then
            checks every further file against its header).
        check_finite: refuse (as a failed sample) one whose hidden states hold NaN or inf,
            checked by the writer piece by piece as the rows are written.
        phases: where the seconds of each phase are added (the queue, the writer's).
    """

    def __init__(
        self,
        store: Any,
        *,
        writer_id: str | None,
        shard_bytes: int,
        commit_interval_s: float,
        max_buffer_bytes: int,
        report: RunReport,
        on_fatal: Callable[[str], None],
        on_created: Callable[[Any], None] | None = None,
        check_finite: bool = False,
        phases: PhaseTimes | None = None,
    ):
        self._factory: Callable[[FetchedSample], Any] | None = None
        self.store = None
        if callable(store) and not hasattr(store, "writer"):
            self._factory = store
        else:
            self.store = store
            store.refresh()
            report.summary.store = str(store.path)
        where = getattr(store, "path", None)
        # a store on object storage has no lease directory (leases and claims use file locks)
        self.path: Path | None = None if where is None or is_remote(where) else Path(where)
        self.writer_id = writer_id
        self.shard_bytes = shard_bytes
        self.commit_interval_s = commit_interval_s
        self.max_buffer_bytes = max_buffer_bytes
        self.report = report
        self.on_fatal = on_fatal
        self.on_created = on_created
        self.check_finite = check_finite
        self.phases = phases
        self._queue: asyncio.Queue[tuple[FetchedSample, float] | asyncio.Future | None] = asyncio.Queue()
        self._buffered = 0
        self._room = asyncio.Condition()
        self._added = 0
        self._writer = None
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="hsgen-store")
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the writer task."""
        self.task = asyncio.create_task(self._run(), name="hsgen-writer")

    @property
    def failed(self) -> bool:
        """Whether the writer task ended (it only ends early on an error)."""
        return self.task is not None and self.task.done()

    def __contains__(self, sample_id: str) -> bool:
        return self.store is not None and sample_id in self.store

    async def wait_for_room(self, stop: asyncio.Event) -> None:
        """Return once fetched-but-unwritten bytes are below the bound (or ``stop`` is set)."""
        async with self._room:
            await self._room.wait_for(lambda: self._buffered < self.max_buffer_bytes or stop.is_set())

    async def put(self, sample: FetchedSample) -> None:
        """Queue a validated sample for the writer."""
        async with self._room:
            self._buffered += sample.nbytes
        await self._queue.put((sample, time.perf_counter()))

    def refresh(self) -> None:
        """See samples other writers committed (opens the store if another writer created it)."""
        if self.store is None and self.path is not None:
            from hsgen.store import HiddenStateStore, StoreError

            with contextlib.suppress(StoreError):
                self.store = HiddenStateStore.open(self.path)
        elif self.store is not None:
            self.store.refresh()

    async def flush(self) -> None:
        """Return once every sample queued so far is committed (or the writer has failed)."""
        if self.task is None or self.task.done():
            return
        done = asyncio.get_running_loop().create_future()
        await self._queue.put(done)  # type: ignore[arg-type]
        await asyncio.wait({done, self.task}, return_when=asyncio.FIRST_COMPLETED)

    async def wake(self) -> None:
        """Wake tasks waiting for room (after ``stop`` was set)."""
        async with self._room:
            self._room.notify_all()

    async def close(self) -> None:
        """Commit everything queued, release the writer; ``report.summary.stored`` is final after it."""
        if self.task is not None and not self.task.done():
            await self._queue.put(None)
            await asyncio.shield(self.task)
        self._exec.shutdown(wait=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last_commit = time.monotonic()
        try:
            while True:
                try:
                    sample = await asyncio.wait_for(
                        self._queue.get(), timeout=max(0.05, self.commit_interval_s)
                    )
                except TimeoutError:
                    sample = False  # type: ignore[assignment]
                if sample is None:
                    break
                if isinstance(sample, asyncio.Future):
                    if self._writer is not None and self._writer.pending:
                        await loop.run_in_executor(self._exec, self._writer.flush)
                        last_commit = time.monotonic()
                    sample.set_result(None)
                    continue
                if sample is not False:
                    sample, queued = sample
                    if self.phases is not None:
                        self.phases.add("queue", time.perf_counter() - queued)
                    await self._add(sample)
                w = self._writer
                if w is not None and w.pending and time.monotonic() - last_commit > self.commit_interval_s:
                    await loop.run_in_executor(self._exec, w.flush)
                    last_commit = time.monotonic()
        except Exception as e:
            log.debug("store write failed", exc_info=True)
            self.on_fatal(f"store write failed: {describe_os_error(e)}")
        finally:
            await self._close_writer()

    async def _add(self, sample: FetchedSample) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self.store is None:
                assert self._factory is not None
                self.store = await loop.run_in_executor(self._exec, self._factory, sample)
                self.report.summary.store = str(self.store.path)
                if self.on_created is not None:
                    self.on_created(self.store)
            if self._writer is None:
                make = functools.partial(self.store.writer, self.writer_id, shard_bytes=self.shard_bytes,
                                         phases=self.phases)  # fmt: skip
                self._writer = await loop.run_in_executor(self._exec, make)
            check_header(self.store.header, sample)
            add = functools.partial(
                self._writer.add, target_ids=sample.target_ids, check_finite=self.check_finite
            )
            await loop.run_in_executor(
                self._exec, add, sample.sample_id, sample.hidden_states, sample.token_ids, sample.loss_mask
            )
            self._added += 1
        except SampleRejected as e:  # this sample's values or file, not the store: the run goes on
            self.report.summary.failed += 1
            self.report.record(sample.sample_id, e.reason, f"{sample.endpoint}: {e}", endpoint=sample.endpoint,
                               source=sample.source or None)  # fmt: skip
        except ValueError as e:
            self.report.record(sample.sample_id, "store_mismatch", str(e))
            self.on_fatal(f"the server's hidden states do not fit the store: {e}")
        finally:
            release = getattr(sample.hidden_states, "close", None)
            if release is not None:  # rows left in the server's file: its pages are freed now
                release()
            async with self._room:
                self._buffered -= sample.nbytes
                self._room.notify_all()

    async def _close_writer(self) -> None:
        loop = asyncio.get_running_loop()
        w = self._writer
        try:
            if w is not None:
                await loop.run_in_executor(self._exec, w.close)
        except Exception as e:
            log.debug("store commit failed", exc_info=True)
            self.on_fatal(f"store commit failed: {describe_os_error(e)}")
        self.report.summary.stored = self._added - (w.pending + w.lost if w is not None else 0)
        async with self._room:
            self._room.notify_all()


__all__ = ["LazyStore", "StoreSink", "check_header", "describe_os_error", "expected_of", "with_expected"]
