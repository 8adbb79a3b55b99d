"""The offline pipeline: prompts -> servers -> validated hidden states -> a store, resumably.

``generate`` keeps every server saturated (``hsgen.saturate``), hands each validated sample
to one ``ShardWriter`` running in its own thread, and bounds memory: no new request starts
while the samples fetched but not yet written exceed ``max_buffer_bytes``. A sample is in
the store only once its shard is committed; nothing partial is ever stored, so a run killed
at any point (even ``kill -9``) leaves a store that the next run resumes, skipping the ids
already present. Prompts that still fail after the retries are written with their reason
to a JSONL failures file.

Exit codes (``GenerateSummary.exit_code``): 0 every prompt is in the store, 3 partial
success (some prompts failed, others were stored), 1 failure (nothing stored despite
failures, or a fatal error such as a rejected API key or a server/store mismatch),
130 interrupted (what was complete is committed; re-run to resume).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hsgen.client import ClientConfig, FatalError, FetchedSample, FetchError, HiddenStateClient
from hsgen.render import RenderedPrompt
from hsgen.saturate import SaturationConfig, Saturator

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_PARTIAL = 3
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class Skipped:
    """An input that never became a request (bad record, too long), passed through for the report.

    Attributes:
        reason: ``bad_input`` or ``too_long``.
        message: what was wrong, naming the file and line.
        sample_id: the id, when known.
        source: ``file:line``.
    """

    reason: str
    message: str
    sample_id: str | None = None
    source: str = ""


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
        stop_grace_s: after a stop request, how long in-flight requests may finish.
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

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"--rank must be in 0..{self.world_size - 1} (got rank {self.rank})")
        if self.max_buffer_bytes < 1:
            raise ValueError("max_buffer_bytes must be positive")


@dataclass
class GenerateSummary:
    """What a run did; ``to_json`` is the one-line summary ``hsgen generate`` prints."""

    status: str = "ok"
    stored: int = 0
    already_done: int = 0
    other_rank: int = 0
    duplicates: int = 0
    failed: int = 0
    bad_input: int = 0
    too_long: int = 0
    truncated: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    gb_per_s: float = 0.0
    retries: int = 0
    failure_reasons: dict[str, int] = field(default_factory=dict)
    fatal: str | None = None
    store: str = ""
    failures_file: str | None = None
    endpoints: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        if self.fatal:
            return EXIT_FAILURE
        if self.status == "interrupted":
            return EXIT_INTERRUPTED
        if self.failed == 0:
            return EXIT_OK
        return EXIT_PARTIAL if self.stored + self.already_done > 0 else EXIT_FAILURE

    def to_json(self) -> str:
        """The summary as one JSON line, ``exit_code`` included."""
        d = asdict(self)
        d["exit_code"] = self.exit_code
        return json.dumps(d, sort_keys=False)


def rank_of(sample_id: str, world_size: int) -> int:
    """The rank that owns ``sample_id``: a stable hash of the id, mod ``world_size``."""
    digest = hashlib.sha256(sample_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % world_size


async def _aiter(items: Iterable[Any] | AsyncIterable[Any], batch: int = 32) -> AsyncIterator[Any]:
    """Iterate ``items``; a plain iterable is pulled in a worker thread (rendering costs CPU)."""
    if hasattr(items, "__aiter__"):
        async for x in items:  # type: ignore[union-attr]
            yield x
        return
    it = iter(items)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1, thread_name_prefix="hsgen-input") as pool:
        deferred: list[BaseException] = []

        def pull() -> list[Any]:
            out: list[Any] = []
            try:
                for x in it:
                    out.append(x)
                    if len(out) >= batch:
                        break
            except Exception as e:  # deliver the items read before the error first
                if not out:
                    raise
                deferred.append(e)
            return out

        while True:
            if deferred:
                raise deferred.pop()
            chunk = await loop.run_in_executor(pool, pull)
            if not chunk:
                return
            for x in chunk:
                yield x


class _FailureLog:
    def __init__(self, path: str | None):
        self.path = path
        self._f = None

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._f is None:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run
        record = {"time": round(time.time(), 3), **record}
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class _Progress:
    def __init__(self, enabled: bool):
        self.bar = None
        self._last = 0.0
        if enabled:
            from hsgen.progress import progress_bar

            self.bar = progress_bar(unit="sample", dynamic_ncols=True, smoothing=0.1, desc="generate")

    def update(
        self, n: int, summary: GenerateSummary, t0: float, in_flight: int, force: bool = False
    ) -> None:
        if self.bar is None:
            return
        self.bar.update(n)
        now = time.monotonic()
        if force or now - self._last > 0.5:
            self._last = now
            dt = max(1e-9, now - t0)
            self.bar.set_postfix_str(
                f"{summary.tokens / dt:,.0f} tok/s, {summary.bytes / dt / 1e9:.3f} GB/s, "
                f"in flight {in_flight}, errors {summary.failed}",
                refresh=False,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


StoreOrFactory = Any  # HiddenStateStore | Callable[[FetchedSample], HiddenStateStore]


async def generate(
    config: GenerateConfig,
    prompts: AsyncIterable[RenderedPrompt | Skipped] | Iterable[RenderedPrompt | Skipped],
    store: StoreOrFactory,
    *,
    progress: bool = True,
    stop: asyncio.Event | None = None,
) -> GenerateSummary:
    """Fetch the hidden states of ``prompts`` into ``store``; returns the run's summary.

    Args:
        config: servers, concurrency, sharding, limits.
        prompts: rendered prompts (``Skipped`` items are only counted and logged).
        store: an open ``HiddenStateStore``, or a callable creating it from the first fetched
            sample (used when the store does not exist yet and its header needs the shape).
        progress: show a tqdm bar on stderr.
        stop: set it to stop starting requests; in-flight ones finish within
            ``config.stop_grace_s`` (then are cancelled) and completed samples are committed.
    """
    t0 = time.monotonic()
    stop = stop or asyncio.Event()
    summary = GenerateSummary(failures_file=config.failures_path)
    failures = _FailureLog(config.failures_path)
    bar = _Progress(progress)
    factory: Callable[[FetchedSample], Any] | None = None
    store_obj = None
    if callable(store) and not hasattr(store, "writer"):
        factory = store
    else:
        store_obj = store
        store_obj.refresh()
        summary.store = str(store_obj.path)
    wexec = ThreadPoolExecutor(1, thread_name_prefix="hsgen-store")
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[FetchedSample | None] = asyncio.Queue()
    buffered = {"bytes": 0}
    buffer_cond = asyncio.Condition()
    reasons: collections.Counter[str] = collections.Counter()
    state = {"consecutive_failures": 0, "writer": None, "added": 0}
    tasks: set[asyncio.Task] = set()

    def fail(item_id: str | None, reason: str, message: str, **extra: Any) -> None:
        reasons[reason] += 1
        failures.write({"sample_id": item_id, "reason": reason, "error": message, **extra})

    def abort(message: str) -> None:
        if summary.fatal is None:
            summary.fatal = message
            log.error("aborting: %s", message)
        stop.set()

    async def writer_loop() -> None:
        nonlocal store_obj
        last_commit = time.monotonic()
        writer = None
        try:
            while True:
                try:
                    sample = await asyncio.wait_for(queue.get(), timeout=max(0.05, config.commit_interval_s))
                except TimeoutError:
                    sample = False  # type: ignore[assignment]
                if sample is None:
                    break
                if sample is not False:
                    try:
                        if store_obj is None:
                            assert factory is not None
                            store_obj = await loop.run_in_executor(wexec, factory, sample)
                            summary.store = str(store_obj.path)
                        if writer is None:
                            writer = await loop.run_in_executor(
                                wexec,
                                functools.partial(
                                    store_obj.writer, config.writer_id, shard_bytes=config.shard_bytes
                                ),
                            )
                            state["writer"] = writer
                        _check_header(store_obj.header, sample)
                        await loop.run_in_executor(
                            wexec,
                            writer.add,
                            sample.sample_id,
                            sample.hidden_states,
                            sample.token_ids,
                            sample.loss_mask,
                        )
                        state["added"] += 1
                    except ValueError as e:
                        fail(sample.sample_id, "store_mismatch", str(e))
                        abort(f"the server's hidden states do not fit the store: {e}")
                    finally:
                        async with buffer_cond:
                            buffered["bytes"] -= sample.nbytes
                            buffer_cond.notify_all()
                        del sample
                if (
                    writer is not None
                    and writer.pending
                    and time.monotonic() - last_commit > config.commit_interval_s
                ):
                    await loop.run_in_executor(wexec, writer.flush)
                    last_commit = time.monotonic()
        except Exception as e:
            log.error("store write failed", exc_info=True)
            abort(f"store write failed: {type(e).__name__}: {e}")
        finally:
            try:
                if writer is not None:
                    await loop.run_in_executor(wexec, writer.close)
            except Exception as e:
                log.error("store commit failed", exc_info=True)
                abort(f"store commit failed: {type(e).__name__}: {e}")
            summary.stored = state["added"] - (writer.pending if writer is not None else 0)
            async with buffer_cond:
                buffer_cond.notify_all()

    async def one(prompt: RenderedPrompt, url: str) -> None:
        started = time.monotonic()
        sample = None
        try:
            sample = await client.fetch(prompt, endpoint=url)
        except FatalError as e:
            summary.failed += 1
            fail(prompt.sample_id, e.reason, e.message, endpoint=e.endpoint, source=prompt.source)
            abort(str(e))
        except FetchError as e:
            summary.failed += 1
            summary.retries += max(0, e.attempts - 1)
            fail(
                prompt.sample_id,
                e.reason,
                e.message,
                endpoint=e.endpoint,
                attempts=e.attempts,
                source=prompt.source,
            )
            state["consecutive_failures"] += 1
            n = config.max_consecutive_failures
            if n and state["consecutive_failures"] >= n:
                abort(f"{n} prompts failed in a row (last: {e}); are the servers up?")
        finally:
            await sat.release(
                url, latency_s=time.monotonic() - started, tokens=len(prompt.token_ids), ok=sample is not None
            )
        if sample is None:
            bar.update(0, summary, t0, sat.total_in_flight())
            return
        state["consecutive_failures"] = 0
        summary.retries += sample.attempts - 1
        summary.tokens += sample.num_tokens
        summary.bytes += sample.nbytes
        async with buffer_cond:
            buffered["bytes"] += sample.nbytes
        await queue.put(sample)
        bar.update(1, summary, t0, sat.total_in_flight())

    seen: set[str] = set()
    launched = 0

    async def dispatch() -> None:
        nonlocal launched
        async for item in _aiter(prompts):
            if stop.is_set():
                return
            if isinstance(item, Skipped):
                if item.reason == "too_long":
                    summary.too_long += 1
                else:
                    summary.bad_input += 1
                fail(item.sample_id, item.reason, item.message, source=item.source)
                continue
            sid = item.sample_id
            if config.world_size > 1 and rank_of(sid, config.world_size) != config.rank:
                summary.other_rank += 1
                continue
            if sid in seen:
                summary.duplicates += 1
                continue
            seen.add(sid)
            if store_obj is not None and sid in store_obj:
                summary.already_done += 1
                continue
            if config.max_samples is not None and launched >= config.max_samples:
                return
            if item.truncated:
                summary.truncated += 1
            async with buffer_cond:
                await buffer_cond.wait_for(
                    lambda: buffered["bytes"] < config.max_buffer_bytes or stop.is_set()
                )
            if writer_task.done():
                return
            url = await _acquire_or_stop(sat, stop)
            if url is None:
                return
            launched += 1
            t = asyncio.create_task(one(item, url))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    client = HiddenStateClient(config.client)
    sat = Saturator(config.saturation, list(client.endpoints), client.metrics, client.healthy)
    writer_task: asyncio.Task | None = None
    interrupted = False
    try:
        async with client:
            await sat.start()
            try:
                writer_task = asyncio.create_task(writer_loop(), name="hsgen-writer")
                try:
                    await dispatch()
                except Exception as e:  # a bad input with --on-bad-input fail, an unreadable file, ...
                    abort(str(e))
                interrupted = stop.is_set() and summary.fatal is None
                if tasks:
                    if stop.is_set():
                        done, pending = await asyncio.wait(set(tasks), timeout=config.stop_grace_s)
                        for t in pending:
                            t.cancel()
                        await asyncio.gather(*pending, return_exceptions=True)
                    else:
                        await asyncio.gather(*list(tasks))
                await queue.put(None)
                await writer_task
                summary.endpoints = {
                    url: {**stats, **sat.snapshot()[url]} for url, stats in client.stats().items()
                }
            finally:
                await sat.stop()  # before the session closes: the metrics poller uses it
    except (asyncio.CancelledError, KeyboardInterrupt):
        interrupted = True
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if writer_task is not None and not writer_task.done():
            await queue.put(None)
            await asyncio.shield(writer_task)
    finally:
        await sat.stop()
        wexec.shutdown(wait=True)
        failures.close()
        bar.update(0, summary, t0, 0, force=True)
        bar.close()
    summary.failed = sum(
        v for k, v in reasons.items() if k not in ("bad_input", "too_long", "store_mismatch")
    )
    summary.failure_reasons = dict(reasons)
    if interrupted:
        summary.status = "interrupted"
    summary.seconds = round(time.monotonic() - t0, 3)
    dt = max(summary.seconds, 1e-9)
    summary.samples_per_s = round(summary.stored / dt, 2)
    summary.tokens_per_s = round(summary.tokens / dt, 1)
    summary.gb_per_s = round(summary.bytes / dt / 1e9, 4)
    if summary.status != "interrupted":
        summary.status = {EXIT_OK: "ok", EXIT_PARTIAL: "partial"}.get(summary.exit_code, "failed")
    return summary


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


def _check_header(header: Any, sample: FetchedSample) -> None:
    shape = sample.hidden_states.shape
    if sample.dtype != header.dtype:
        raise ValueError(f"the server sends {sample.dtype} hidden states, the store holds {header.dtype}")
    if shape[1] != len(header.layer_ids):
        raise ValueError(
            f"the server sends {shape[1]} layers, the store holds {len(header.layer_ids)} "
            f"(layer ids {list(header.layer_ids)}): check the server's eagle_aux_hidden_state_layer_ids"
        )
    if shape[2] != header.hidden_size:
        raise ValueError(f"the server sends hidden size {shape[2]}, the store holds {header.hidden_size}")


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
    "Skipped",
    "default_failures_path",
    "generate",
    "rank_of",
]
