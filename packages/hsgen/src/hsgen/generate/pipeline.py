"""The offline pipeline: prompt -> request -> file -> shard -> manifest, resumably.

``generate`` reads the prompt stream, lets :class:`~hsgen.generate.prompt_filter.PromptFilter` pick the
ones to request, keeps every server saturated (``hsgen.client.saturate``) through one
:class:`~hsgen.client.fetch.HiddenStateClient` (request, then the server's file, validated and
removed), and hands each sample to :class:`~hsgen.generate.sink.StoreSink`, which writes shards
and their manifest records. A sample is in the store only once its shard is committed; a run
killed at any point (even ``kill -9``) leaves a store that the next run resumes, skipping the
ids already present. Prompts that still fail after the retries are written with their reason
to a JSONL failures file (:class:`~hsgen.generate.report.RunReport`).

Exit codes (``GenerateSummary.exit_code``): 0 every prompt is in the store, 3 partial
success (some prompts failed, others were stored), 1 failure (nothing stored despite
failures, or a fatal error such as a rejected API key or a server/store mismatch),
130 interrupted (what was complete is committed; re-run to resume).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsgen.client.fetch import ClientConfig, FatalError, FetchError, FetchStopped, HiddenStateClient
from hsgen.client.phases import PhaseTimes
from hsgen.client.saturate import SaturationConfig, Saturator
from hsgen.generate.prompt_filter import PromptFilter, iterate, rank_of
from hsgen.generate.report import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PARTIAL,
    GenerateSummary,
    RunReport,
)
from hsgen.generate.sink import LazyStore, StoreSink, describe_os_error, expected_of, with_expected
from hsgen.inputs.render import Skipped
from hsgen.protocol.prompt import RenderedPrompt
from hsgen.store.claims import WorkClaims
from hsgen.store.leases import (
    HEARTBEAT_S,
    Lease,
    LeaseConflict,
    acquire_lease,
    read_leases,
    sweep_dead_leases,
)

log = logging.getLogger(__name__)


@dataclass
class GenerateConfig:
    """Everything :func:`generate` needs besides the prompts and the store.

    Attributes:
        client: servers, shared directory, timeouts, retries (see ``ClientConfig``).
        saturation: concurrency policy (see ``SaturationConfig``).
        world_size: number of ranks splitting the input.
        rank: this rank (0-based); it takes the ids whose hash mod ``world_size`` equals it.
        writer_id: the store writer's id (default: host-pid-random).
        shard_bytes: commit a shard when buffered hidden states reach this size.
        commit_interval_s: also commit at least this often when samples trickle in.
        max_buffer_bytes: fetched-but-unwritten bytes above which no new request starts.
        failures_path: JSONL file for prompts that failed or were skipped (None = none).
        max_samples: stop after this many new samples are requested (None = all).
        max_consecutive_failures: abort when this many prompts fail in a row (0 = never).
        stop_grace_s: after a stop request, how long requests already sent may finish (those
            waiting to be retried or for a server end at once).
        on_bad_input: ``"fail"`` stops at an id repeated with different content; ``"skip"``
            reports it and keeps the first.
        join: share the store with other joined generators (``--join``): the input is cut into
            chunks of ``join_chunk`` prompts, each requested by the one that claims it
            (:mod:`hsgen.store.claims`); needs ``world_size == 1``. With a prompt factory
            (a callable returning a fresh stream), the chunks of generators that died are done
            again in further passes.
    """

    client: ClientConfig
    saturation: SaturationConfig = field(default_factory=SaturationConfig)
    world_size: int = 1
    rank: int = 0
    writer_id: str | None = None
    shard_bytes: int = 32 << 20
    commit_interval_s: float = 60.0
    max_buffer_bytes: int = 1 << 30
    failures_path: str | None = None
    max_samples: int | None = None
    max_consecutive_failures: int = 200
    stop_grace_s: float = 30.0
    on_bad_input: str = "skip"
    join: bool = False
    join_chunk: int = 64

    def __post_init__(self) -> None:
        if self.join and self.world_size > 1:
            raise ValueError("--join shares the store by claims: it does not go with --world-size > 1")
        if self.join_chunk < 1:
            raise ValueError("join_chunk must be >= 1")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"--rank must be in 0..{self.world_size - 1} (got rank {self.rank})")
        if self.max_buffer_bytes < 1:
            raise ValueError("max_buffer_bytes must be positive")
        if self.on_bad_input not in ("skip", "fail"):
            raise ValueError(f"on_bad_input must be 'skip' or 'fail', got {self.on_bad_input!r}")


async def generate(
    config: GenerateConfig,
    prompts: AsyncIterable[RenderedPrompt | Skipped] | Iterable[RenderedPrompt | Skipped],
    store: Any,
    *,
    progress: bool = True,
    stop: asyncio.Event | None = None,
    count: Callable[[], int | None] | None = None,
) -> GenerateSummary:
    """Fetch the hidden states of ``prompts`` into ``store``; returns the run's summary.

    Args:
        config: servers, concurrency, sharding, limits.
        prompts: rendered prompts (``Skipped`` items are only counted and logged), or a callable
            returning a fresh stream of them each call (a joined run reads the input again to
            do the chunks of generators that died).
        store: an open ``HiddenStateStore``, or a :class:`~hsgen.generate.sink.LazyStore` (or any
            callable) creating it from the first fetched sample, for a store that does not
            exist yet (its header needs the shape).
        progress: show a tqdm bar on stderr.
        stop: set it to stop starting requests; those already sent finish within
            ``config.stop_grace_s`` (then are cancelled), those waiting to be retried or for a
            server end at once, and completed samples are committed.
        count: returns the number of prompts of the input (None: unknown), for the bar's total
            and ETA; called in a thread while the run starts (e.g. counting a large file's lines).
    """
    return await _Run(config, store, progress, stop or asyncio.Event()).execute(prompts, count)


class _Run:
    """One ``generate`` call: owns the report, the client, the saturator and the sink."""

    def __init__(self, config: GenerateConfig, store: Any, progress: bool, stop: asyncio.Event):
        self.config = config
        self.stop = stop
        self.report = RunReport(config.failures_path, progress)
        self.report.on_write_error = lambda e: self.abort(
            f"cannot write the failures file: {describe_os_error(e)}"
        )
        self.phases = PhaseTimes()
        client, check_finite = _landing_client(config.client)
        self.sink = StoreSink(
            store,
            writer_id=config.writer_id,
            shard_bytes=config.shard_bytes,
            commit_interval_s=config.commit_interval_s,
            max_buffer_bytes=config.max_buffer_bytes,
            report=self.report,
            on_fatal=self.abort,
            on_created=lambda created: self.client.expect(expected_of(created)),
            check_finite=check_finite,
            phases=self.phases,
        )
        self.new_store = store if self.sink.store is None else None
        self.filter = PromptFilter(
            world_size=config.world_size,
            rank=config.rank,
            max_samples=config.max_samples,
            on_bad_input=config.on_bad_input,
            report=self.report,
        )
        self.client = HiddenStateClient(with_expected(client, store))
        self.client.phases = self.phases
        self.sat = Saturator(
            config.saturation, list(self.client.endpoints), self.client.metrics, self.client.healthy
        )
        self.tasks: set[asyncio.Task] = set()
        self.consecutive_failures = 0

    def abort(self, message: str) -> None:
        """Stop starting requests because of a fatal error (the first message is kept)."""
        summary = self.report.summary
        if summary.fatal is None:
            summary.fatal = message
            log.error("%s", message)
        self.stop.set()
        with contextlib.suppress(RuntimeError):  # wake a dispatch waiting for buffer room
            asyncio.get_running_loop().create_task(self.sink.wake())

    async def execute(self, prompts, count: Callable[[], int | None] | None = None) -> GenerateSummary:
        interrupted = False
        lease = self._prepare()
        counting = asyncio.create_task(self._count(count)) if count is not None else None
        try:
            if self.report.summary.fatal is None:
                interrupted = await self._pipeline(prompts, lease)
        except (asyncio.CancelledError, KeyboardInterrupt):
            interrupted = True
            for t in list(self.tasks):
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await self.sink.close()
        finally:
            if counting is not None:
                counting.cancel()
            await self.sat.stop()
            if lease is not None:
                lease.release()
        self.report.summary.phases = self.phases.snapshot()
        return self.report.finish(interrupted)

    async def _count(self, count: Callable[[], int | None]) -> None:
        """The bar's total: ``--max-samples`` when set (then only requested prompts count),
        else the input's records as ``count`` finds them."""
        if self.config.max_samples is not None:
            self.report.count_passed = False
            self.report.set_total(self.config.max_samples)
            return
        try:
            total = await asyncio.to_thread(count)
        except Exception as e:  # a bar without a total; the run reports the input's own errors
            log.debug("cannot count the input: %s", e)
            return
        if total is not None:
            self.report.set_total(total)

    def _prepare(self) -> Lease | None:
        """Check the failures file, take the store's lease, sweep dead clients' server files.

        Returns None (and sets the fatal error) when the run must not start, or when the store
        has no path to hold a lease.
        """
        try:
            self.report.failures.check_writable()
        except OSError as e:
            self.abort(f"cannot write the failures file: {describe_os_error(e)}")
            return None
        if self.sink.path is None:
            return None
        cfg = self.config
        try:
            lease = acquire_lease(
                self.sink.path,
                world_size=cfg.world_size,
                rank=cfg.rank,
                request_prefix=self.client.request_prefix,
                shared_dir=cfg.client.shared_dir,
                join=cfg.join,
            )
            if cfg.join:
                self.filter.claims = WorkClaims(self.sink.path, lease, cfg.join_chunk)
        except LeaseConflict as e:
            self.abort(str(e))
            return None
        except OSError as e:
            self.abort(f"cannot use the store: {describe_os_error(e)}")
            return None
        if cfg.client.delete_files:
            dirs = [cfg.client.shared_dir] + [
                i.shared_dir for i in read_leases(self.sink.path) if i.shared_dir
            ]
            swept = sweep_dead_leases(self.sink.path, dirs)
            self.report.summary.orphans_removed += swept["orphans_removed"]
        return lease

    async def _pipeline(self, prompts, lease: Lease | None) -> bool:
        """Probe the servers, then prompts -> requests -> sink; returns whether it was interrupted."""
        interrupted = False
        async with self.client:
            try:
                served = await self.client.probe()
            except FatalError as e:
                self.abort(str(e))
                return False
            learn = getattr(self.new_store, "learn_served", None)
            if learn is not None and await asyncio.to_thread(
                learn, served
            ):  # a new store's shape from the served model
                self.client.expect(expected_of(self.new_store))
            await self.sat.start()
            heartbeat = asyncio.create_task(_heartbeat(lease)) if lease is not None else None
            try:
                self.sink.start()
                await self._passes(prompts)
                interrupted = self.stop.is_set() and self.report.summary.fatal is None
                await self.sink.close()
                if self.config.client.delete_files:
                    self.report.summary.orphans_removed += self.client.remove_own_files()
                snapshot = self.sat.snapshot()
                self.report.summary.endpoints = {
                    url: {**stats, **snapshot[url]} for url, stats in self.client.stats().items()
                }
            finally:
                if heartbeat is not None:
                    heartbeat.cancel()
                await self.sat.stop()  # before the session closes: the metrics poller uses it
        if not self.filter.seen_any and not self.report.summary.fatal:
            log.warning("the input holds no prompts: nothing to do")
        return interrupted

    async def _passes(self, prompts) -> None:
        """Request the admitted prompts; a joined run then waits for the other generators and
        does again the chunks of those that died (another pass over a fresh prompt stream)."""
        claims = self.filter.claims
        factory = prompts if callable(prompts) else None
        stream = factory() if factory is not None else prompts
        while True:
            try:
                await self._dispatch(stream)
            except Exception as e:  # a bad input with --on-bad-input fail, an unreadable file, ...
                self.abort(str(e))
            await self._drain()
            if claims is None or self.stop.is_set():
                return
            await self.sink.flush()
            if self.sink.failed:
                return
            claims.mark_done()
            redo = await self._wait_for_others(claims)
            if not redo:
                return
            if factory is None:
                log.warning("%d chunks of generators that died are left: run again with --join", len(redo))
                return
            log.info("doing again %d chunks of generators that died", len(redo))
            self.report.set_total(None)  # another pass over the input: the first total is spent
            self.sink.refresh()
            self.filter.restart(redo)
            stream = factory()

    async def _wait_for_others(self, claims: WorkClaims) -> set[int]:
        """Wait while live joined generators hold chunks; returns the chunks of dead ones."""
        while not self.stop.is_set():
            dead, held = claims.unfinished()
            if dead or not held:
                return dead
            await asyncio.sleep(0.5)
        return set()

    async def _dispatch(self, prompts) -> None:
        """Start one request task per admitted prompt, within the memory bound and free server slots."""
        async for item in iterate(prompts):
            if self.stop.is_set():
                return
            prompt = self.filter.admit(item, self.sink)
            if prompt is None:
                if self.filter.done:
                    return
                self.report.passed()
                continue
            await self.sink.wait_for_room(self.stop)
            if self.sink.failed:
                return
            url = await _acquire_or_stop(self.sat, self.stop)
            if url is None:
                return
            t = asyncio.create_task(self._request(prompt, url))
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

    async def _request(self, prompt: RenderedPrompt, url: str) -> None:
        """One prompt: request, the server's file validated, the sample handed to the sink."""
        started = time.monotonic()
        summary = self.report.summary
        failed_before = summary.failed
        sample = None
        try:
            sample = await self.client.fetch(prompt, endpoint=url)
        except FetchStopped:
            pass  # stopping: not a failure, the next run fetches it
        except FatalError as e:
            summary.failed += 1
            self.report.record(
                prompt.sample_id, e.reason, e.message, endpoint=e.endpoint, source=prompt.source
            )
            self.abort(str(e))
        except FetchError as e:
            summary.failed += 1
            summary.retries += max(0, e.attempts - 1)
            self.report.record(
                prompt.sample_id,
                e.reason,
                e.message,
                endpoint=e.endpoint,
                attempts=e.attempts,
                source=prompt.source,
            )
            self.consecutive_failures += 1
            n = self.config.max_consecutive_failures
            if n and self.consecutive_failures >= n:
                self.abort(f"{n} prompts failed in a row (last: {e}); are the servers up?")
        finally:
            await self.sat.release(
                url, latency_s=time.monotonic() - started, tokens=len(prompt.token_ids), ok=sample is not None
            )
        if sample is None:
            self.report.tick(self.sat.total_in_flight(), settled=summary.failed > failed_before)
            return
        self.consecutive_failures = 0
        self.report.fetched(sample.num_tokens, sample.nbytes, sample.attempts, self.sat.total_in_flight())
        await self.sink.put(sample)

    async def _drain(self) -> None:
        """Wait for the requests in flight: all of them, or once a stop comes (before or during
        the wait) those sent, ``stop_grace_s`` at most from then."""
        pending = set(self.tasks)
        if pending and not self.stop.is_set():
            stopper = asyncio.ensure_future(self.stop.wait())
            try:
                while pending and not self.stop.is_set():
                    done, pending = await asyncio.wait(
                        pending | {stopper}, return_when=asyncio.FIRST_COMPLETED
                    )
                    pending.discard(stopper)
                    for t in done - {stopper}:
                        t.result()  # a task's own error surfaces, as it would from gather
            finally:
                stopper.cancel()
        if not pending:
            return
        self.client.stop_retrying()
        _done, pending = await asyncio.wait(pending, timeout=self.config.stop_grace_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _landing_client(client: ClientConfig) -> tuple[ClientConfig, bool]:
    """The client as the landing path wants it, and whether the writer checks finite values.

    By default the server's rows stay in its file (``rows_in_file``, the name already removed)
    until the writer copies them into the shard in pieces, checking and checksumming each piece
    as it passes (:mod:`hsgen.store.shard_builder`): no sample is ever held whole in this
    process's memory, so the finite check moves from the client to the writer. A client asked
    to map files or to leave rows in files already is left as it is.
    """
    if client.map_files or client.rows_in_file:
        return client, False
    return dataclasses.replace(client, rows_in_file=True, check_finite=False), client.check_finite


async def _heartbeat(lease: Lease) -> None:
    while True:
        await asyncio.sleep(HEARTBEAT_S)
        lease.heartbeat()


async def _acquire_or_stop(sat: Saturator, stop: asyncio.Event) -> str | None:
    acquire = asyncio.ensure_future(sat.acquire())
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({acquire, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if acquire.done() and not acquire.cancelled():
        url = acquire.result()
        if stop.is_set():
            await sat.release(url, latency_s=0.0, tokens=0, ok=False)
            return None
        return url
    acquire.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await acquire
    if acquire.done() and not acquire.cancelled() and acquire.exception() is None:
        await sat.release(acquire.result(), latency_s=0.0, tokens=0, ok=False)
    return None


def default_failures_path(store_path: str | os.PathLike[str], rank: int, world_size: int) -> str:
    """``<store>.failures.jsonl`` beside the store (``.rank<R>`` added when ``world_size > 1``)."""
    p = Path(store_path)
    suffix = f".rank{rank}" if world_size > 1 else ""
    return str(p.with_name(p.name + f".failures{suffix}.jsonl"))


__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PARTIAL",
    "GenerateConfig",
    "GenerateSummary",
    "LazyStore",
    "Skipped",
    "default_failures_path",
    "generate",
    "rank_of",
]
