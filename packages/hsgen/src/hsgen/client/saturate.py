"""How many requests to keep in flight per server.

A prefill-only workload (``max_tokens=1``) finishes whole batches at each step boundary, so
a server stays busy only if the next batch is already queued when a step ends. The default
policy keeps the next batch queued at each server, with a little slack:

- **metrics** (used when the server exposes ``/metrics``): poll ``vllm:num_requests_waiting``
  and ``vllm:num_requests_running`` a few times per step. The largest ``running`` seen is the
  server's batch C. A step is full when C requests wait as it starts, while the batch before
  it comes back through the client: so the limit doubles in slow start (while the server ran
  half of it at once), then sits at three batches plus a margin (one step of slack), plus
  what the server completes during the longest stall of the client seen lately; a step that
  starved raises it by the room left empty, at most one batch more.
- **latency** (no usable metrics): a gradient policy on the time per token of completed
  requests. The limit grows while latency stays near the best seen, and shrinks in
  proportion once queueing inflates latency beyond ``latency_tolerance`` x the best.
- **fixed**: ``--concurrency N`` requests in flight per server, no adaptation.

The generate pipeline asks :meth:`Saturator.acquire` for a server with a free slot (the
least loaded healthy one relative to its limit) and calls :meth:`Saturator.release` when
the request is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"


@dataclass(frozen=True)
class SaturationConfig:
    """Concurrency policy.

    Attributes:
        concurrency: fixed requests in flight per server (None = adaptive).
        initial: starting limit per server for the adaptive policies.
        min_limit: lowest limit per server.
        max_limit: highest limit per server (a guard against flooding).
        use_metrics: read ``/metrics`` when the server has it (else latency policy only).
        poll_s: seconds between ``/metrics`` polls.
        min_waiting: the smallest margin of queued requests the metrics policy keeps.
        waiting_frac: with ``min_waiting``, the margin is ``max(min_waiting, waiting_frac * C)``
            where C is the largest ``running`` seen (the server's batch).
        latency_tolerance: latency policy: accepted latency growth over the best seen. A
            prefill-only server finishes whole batches per step, so a request needs about
            two steps once the next batch is queued (vs. one when idle): hence about 2.
    """

    concurrency: int | None = None
    initial: int = 8
    min_limit: int = 1
    max_limit: int = 4096
    use_metrics: bool = True
    poll_s: float = 0.05
    min_waiting: int = 2
    waiting_frac: float = 0.1
    latency_tolerance: float = 2.2

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if not 1 <= self.min_limit <= self.initial <= self.max_limit:
            raise ValueError("need 1 <= min_limit <= initial <= max_limit")


@dataclass
class EndpointControl:
    """The limit of one server and the observations it is derived from."""

    url: str
    limit: float
    mode: str  # "fixed" | "metrics" | "latency"
    in_flight: int = 0
    peak_in_flight: int = 0
    metrics_failures: int = 0
    peak_running: float = 0.0
    phase: str = "slow_start"  # "slow_start" | "steady" (metrics policy)
    window_completed: int = 0
    window_starved: float = 0.0  # the most room a step left empty in this window
    calm_windows: int = 0  # windows in a row without a starved step
    needed: float = 0.0  # the limit the last starvation called for (fading)
    last_sample: float | None = None  # when the last /metrics sample came
    window_gap: float = 0.0  # the longest wait between two samples beyond poll_s, this window
    stall_s: float = 0.0  # the longest such wait lately (fading by 10% a window)
    peak_seen: float = 0.0
    window_start: float = field(default_factory=time.monotonic)
    window_waiting: list[float] = field(default_factory=list)
    window_running: list[float] = field(default_factory=list)
    slow_start: bool = True
    lat_sum: float = 0.0
    tok_sum: int = 0
    lat_count: int = 0
    best_per_token: float = math.inf
    latency_ewma_s: float = 0.0
    completed: int = 0
    adjustments: int = 0

    @property
    def slots(self) -> int:
        return max(1, int(self.limit))

    def reset_window(self, now: float) -> None:
        self.window_start = now
        self.window_waiting.clear()
        self.window_running.clear()
        self.window_completed = 0
        self.window_starved = 0.0
        self.window_gap = 0.0
        self.peak_seen = 0.0
        self.peak_in_flight = self.in_flight


class Saturator:
    """Per-server concurrency limits and slot accounting (single event loop).

    Args:
        config: the policy.
        endpoints: server URLs.
        metrics: ``async (url) -> dict | None`` reading a server's ``/metrics``.
        healthy: ``(url) -> bool``; unhealthy servers get no new requests.
        clock: seconds, monotonic (a simulation passes its own).
    """

    def __init__(
        self,
        config: SaturationConfig,
        endpoints: Sequence[str],
        metrics: Callable[[str], Awaitable[dict[str, float] | None]] | None = None,
        healthy: Callable[[str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self._clock = clock
        if config.concurrency is not None:
            mode, start = "fixed", float(config.concurrency)
        elif config.use_metrics and metrics is not None:
            mode, start = "metrics", float(config.initial)
        else:
            mode, start = "latency", float(config.initial)
        self.controls = {url: EndpointControl(url, start, mode, window_start=clock()) for url in endpoints}
        self._metrics = metrics
        self._healthy = healthy or (lambda url: True)
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start polling metrics (adaptive metrics mode only)."""
        if any(c.mode == "metrics" for c in self.controls.values()):
            self._task = asyncio.create_task(self._poll_loop(), name="hsgen-saturate")

    async def stop(self) -> None:
        """Stop polling the servers' metrics (no-op when not polling)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # ---------------------------------------------------------------- slots

    def _pick(self) -> EndpointControl | None:
        best, best_load = None, math.inf
        for c in self.controls.values():
            if c.in_flight >= c.slots or not self._healthy(c.url):
                continue
            load = c.in_flight / c.slots
            if load < best_load:
                best, best_load = c, load
        return best

    async def acquire(self) -> str:
        """Wait for a free slot; returns the server to send the next request to."""
        async with self._changed:
            while True:
                c = self._pick()
                if c is not None:
                    c.in_flight += 1
                    c.peak_in_flight = max(c.peak_in_flight, c.in_flight)
                    return c.url
                with contextlib.suppress(TimeoutError):  # breakers may have closed meanwhile
                    await asyncio.wait_for(self._changed.wait(), timeout=0.5)

    async def release(self, url: str, *, latency_s: float, tokens: int, ok: bool) -> None:
        """Give a slot back, with what the request took."""
        c = self.controls[url]
        c.in_flight -= 1
        if ok:
            c.completed += 1
            c.window_completed += 1
            c.latency_ewma_s = latency_s if c.completed == 1 else 0.9 * c.latency_ewma_s + 0.1 * latency_s
            if c.mode == "latency":
                self._observe_latency(c, latency_s, tokens)
        async with self._changed:
            self._changed.notify_all()

    def total_in_flight(self) -> int:
        """Requests in flight over all servers."""
        return sum(c.in_flight for c in self.controls.values())

    def limits(self) -> dict[str, int]:
        """Current concurrency limit per server URL."""
        return {url: c.slots for url, c in self.controls.items()}

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per-server mode, limit, in flight, adjustments (for the summary)."""
        return {
            url: {"mode": c.mode, "limit": c.slots, "in_flight": c.in_flight, "adjustments": c.adjustments}
            for url, c in self.controls.items()
        }

    async def _set_limit(self, c: EndpointControl, value: float) -> None:
        cfg = self.config
        new = min(float(cfg.max_limit), max(float(cfg.min_limit), value))
        if int(new) != int(c.limit):
            c.adjustments += 1
            log.debug("%s: limit %d -> %d (%s)", c.url, int(c.limit), int(new), c.mode)
        grew = new > c.limit
        c.limit = new
        if grew:
            async with self._changed:
                self._changed.notify_all()

    # ---------------------------------------------------------------- metrics policy

    async def _poll_loop(self) -> None:
        assert self._metrics is not None
        while True:
            ctrls = [c for c in self.controls.values() if c.mode == "metrics"]
            if not ctrls:
                return
            results = await asyncio.gather(*(self._metrics(c.url) for c in ctrls))
            now = self._clock()
            for c, m in zip(ctrls, results, strict=True):
                if m is None or WAITING not in m or RUNNING not in m:
                    c.metrics_failures += 1
                    if c.metrics_failures >= 5:
                        log.info("%s: no usable /metrics; adapting to latency instead", c.url)
                        c.mode = "latency"
                    continue
                c.metrics_failures = 0
                await self.observe_metrics(c, m[WAITING], m[RUNNING], now)
            await asyncio.sleep(self.config.poll_s)

    async def observe_metrics(self, c: EndpointControl, waiting: float, running: float, now: float) -> None:
        """Feed one ``/metrics`` sample; adjusts the limit at the end of each window.

        The largest ``running`` seen is the server's batch C. A step is full when C requests
        wait as it starts while the batch before it comes back through the client, so:

        - slow start doubles the limit while the server ran at least half of it at once; once
          two batches ran without that, the limit drops to the floor;
        - the floor is three batches plus the margin (one running, one queued, one coming
          back: a step of slack), plus what the server completes during the longest stall of
          this client seen lately (the gap between two of these samples beyond ``poll_s``:
          a busy event loop, a slow disk; at most two batches);
        - a sample where even the queue cannot fill the room a step has ("starved") raises the
          limit by that room when the client used its whole limit, up to the ceiling: one
          batch plus the margin above the floor;
        - a queue that never drained below twice the margin for a calm spell lowers the limit
          by half the surplus, not below the floor nor a limit that ended a starvation lately.
        """
        cfg = self.config
        if c.last_sample is not None:
            c.window_gap = max(c.window_gap, now - c.last_sample - cfg.poll_s)
        c.last_sample = now
        c.window_waiting.append(waiting)
        c.window_running.append(running)
        c.peak_running = max(c.peak_running, running)
        c.peak_seen = max(c.peak_seen, waiting + running)
        batch = c.peak_running
        if waiting + running < batch:  # this step has room that even the queue cannot fill
            c.window_starved = max(c.window_starved, batch - running - waiting)
        elapsed = now - c.window_start
        if len(c.window_waiting) < 3 or elapsed < 0.25:
            return
        binding = c.peak_in_flight >= c.slots - 1
        margin = max(cfg.min_waiting, cfg.waiting_frac * batch)
        if c.phase == "slow_start":
            # double once the server holds (most of) our requests and ran half of them at once
            arrived = c.peak_seen >= 0.8 * c.slots
            if arrived and binding and c.slots <= 2 * batch:
                await self._set_limit(c, max(c.limit * 2.0, c.limit + cfg.min_waiting))
                c.reset_window(now)
            elif c.window_completed >= min(c.slots, 2 * batch) or elapsed >= 30.0:
                # two batches ran since the last doubling and the server never took half of
                # the limit at once: batch is its capacity, so drop the overshoot at once
                c.phase = "steady"
                await self._set_limit(c, min(c.limit, 3 * batch + margin))
                c.reset_window(now)
            return
        c.stall_s = max(0.9 * c.stall_s, c.window_gap)
        # a window spans two batches of completions, so per-step bursts average out
        if c.window_completed < 2 * max(1.0, batch) and elapsed < 30.0:
            return
        lo = min(c.window_waiting)
        slack = min(2 * batch, c.stall_s * c.window_completed / elapsed)
        floor = 3 * batch + margin + slack
        ceiling = floor + batch + margin
        if c.limit < floor:
            await self._set_limit(c, floor)
        if c.window_starved:
            c.calm_windows = 0
            if binding and c.limit < ceiling:
                await self._set_limit(c, min(ceiling, c.limit + max(cfg.min_waiting, c.window_starved)))
            c.needed = max(c.needed, c.limit)
        else:
            # a sampled minimum can miss the moment a step starts: shrink only after a calm
            # spell, and not below a limit that ended a starvation (that memory fades by 1% a window)
            c.calm_windows += 1
            c.needed *= 0.99
            if lo > 2 * margin and c.calm_windows >= 4:
                await self._set_limit(c, max(floor, c.needed, c.limit - (lo - margin) / 2))
        c.reset_window(now)

    # ---------------------------------------------------------------- latency policy

    def _observe_latency(self, c: EndpointControl, latency_s: float, tokens: int) -> None:
        c.lat_sum += latency_s
        c.tok_sum += max(1, tokens)
        c.lat_count += 1
        now = self._clock()
        if c.lat_count < max(8, c.slots // 2) or now - c.window_start < 0.1:
            return
        per_token = c.lat_sum / c.tok_sum
        binding = c.peak_in_flight >= c.slots - 1
        c.best_per_token = min(per_token, c.best_per_token * 1.01)
        ratio = per_token / c.best_per_token
        cfg = self.config
        if c.slow_start and ratio < 1.1:
            new = c.limit * 2.0 if binding else c.limit
        else:
            c.slow_start = False
            gradient = max(0.5, min(1.0, cfg.latency_tolerance / ratio))
            new = c.limit * gradient + (math.sqrt(c.limit) if binding or gradient < 1.0 else 0.0)
            new = 0.8 * c.limit + 0.2 * new
        c.lat_sum, c.tok_sum, c.lat_count = 0.0, 0, 0
        c.reset_window(now)
        cfg_new = min(float(cfg.max_limit), max(float(cfg.min_limit), new))
        if int(cfg_new) != int(c.limit):
            c.adjustments += 1
        c.limit = cfg_new


__all__ = ["EndpointControl", "SaturationConfig", "Saturator"]
