"""A deterministic simulation of a batching server and the generate pipeline, on a fake clock.

The server runs steps of at most ``capacity`` sequences, each ``step_s`` long, admitting what is
waiting when a step starts (as vLLM's scheduler does for prefill-only requests). The client is one
CPU: sending a request costs ``send_s`` and handling a response (reading its file) ``handle_s``,
one after the other, so a batch's requests reach the server spread out and its responses come
back in a burst that takes time to work through; a response reaches the client ``return_s``
after its step (transfer, the file landing), and every ``stall_every`` steps the client stalls for
``stall_s`` (a shard flush, a garbage collection). ``/metrics`` is sampled every ``poll_s``. No
wall clock is involved: the same inputs give the same trace on any machine at any load.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

from hsgen.client.saturate import SaturationConfig, Saturator

URL = "http://sim"


@dataclass
class SimResult:
    utilisation: float  # sequences run / what full steps would have run, from ``measure_from``
    peak_limit: int  # the highest limit the policy set
    final_limit: int
    limits: list[tuple[float, int]] = field(default_factory=list)  # (time, limit) on each change

    def limit_at(self, t: float) -> int:
        """The limit in force at simulated time ``t``."""
        return [limit for when, limit in self.limits if when <= t][-1]


def simulate(capacity: int, step_s: float, config: SaturationConfig | None = None, **options) -> SimResult:
    """Run the saturator against the simulated server (``options``: :func:`run_sim`'s keywords)."""
    return asyncio.run(run_sim(capacity, step_s, config or SaturationConfig(), **options))


async def run_sim(
    capacity: int,
    step_s: float,
    config: SaturationConfig,
    *,
    seconds: float = 40.0,
    measure_from: float = 20.0,
    send_s: float = 0.0005,
    handle_s: float = 0.002,
    return_s: float = 0.0,
    stall_every: int = 0,
    stall_s: float = 0.0,
    with_metrics: bool = True,
) -> SimResult:
    """``seconds`` of simulated time; utilisation counted from ``measure_from`` on."""
    now = [0.0]
    sat = Saturator(config, [URL], (lambda url: _none()) if with_metrics else None, clock=lambda: now[0])
    ctrl = sat.controls[URL]
    events: list = []
    seq = itertools.count()

    def at(t: float, kind: str, payload=None) -> None:
        heapq.heappush(events, (t, next(seq), kind, payload))

    waiting: list[float] = []  # send times of requests queued at the server
    running = 0
    busy_until = 0.0  # the client's CPU
    server_busy = False
    used = slots = 0.0  # sequences run and capacity offered from measure_from on
    idle_since: float | None = 0.0
    limits: list[tuple[float, int]] = [(0.0, ctrl.slots)]
    peak = ctrl.slots
    steps_done = 0
    stall_until = 0.0

    def start_step(t: float) -> None:
        nonlocal running, server_busy, idle_since, used, slots
        if idle_since is not None and t > measure_from:
            slots += (t - max(idle_since, measure_from)) / step_s
        idle_since = None
        batch = waiting[:capacity]
        del waiting[: len(batch)]
        running = len(batch)
        server_busy = True
        if t >= measure_from:
            used += running
            slots += 1
        at(t + step_s, "step_end", batch)

    def fill(t: float) -> None:
        nonlocal busy_until
        while ctrl.in_flight < ctrl.slots:
            ctrl.in_flight += 1
            ctrl.peak_in_flight = max(ctrl.peak_in_flight, ctrl.in_flight)
            busy_until = max(busy_until, t) + send_s
            at(busy_until, "arrive", busy_until)

    fill(0.0)
    if with_metrics:
        at(config.poll_s, "poll")
    while events:
        t, _, kind, payload = heapq.heappop(events)
        if t > seconds:
            break
        now[0] = t
        if kind == "arrive":
            waiting.append(payload)
            if not server_busy:
                start_step(t)
        elif kind == "step_end":
            running, server_busy = 0, False
            steps_done += 1
            if stall_every and steps_done % stall_every == 0:  # the client stalls (a flush, a GC pause)
                busy_until = stall_until = max(busy_until, t) + stall_s
            for sent in payload:
                at(t + return_s, "returned", sent)
            if waiting:
                start_step(t)
            else:
                idle_since = t
        elif kind == "returned":
            busy_until = max(busy_until, t) + handle_s
            at(busy_until, "done", payload)
        elif kind == "done":
            await sat.release(URL, latency_s=t - payload, tokens=16, ok=True)
            fill(t)
        elif kind == "poll":
            if ctrl.mode == "metrics":  # as the saturator's poll loop
                await sat.observe_metrics(ctrl, float(len(waiting)), float(running), t)
            fill(t)
            at(max(t + config.poll_s, stall_until), "poll")  # the poll loop stalls with the client
        if ctrl.slots != limits[-1][1]:
            limits.append((t, ctrl.slots))
            peak = max(peak, ctrl.slots)
    if idle_since is not None:
        slots += (seconds - max(idle_since, measure_from)) / step_s
    return SimResult(used / (capacity * slots) if slots else float("nan"), peak, ctrl.slots, limits)


async def _none():
    return None
