"""Concurrency policies against a simulated batching server (steps of at most C sequences).

Saturation is measured as the server sees it, not against the wall clock: the share of its
capacity that its steps used, idle time counted as empty steps. A loaded machine stretches every
step (and the client's turns) alike, so the figure holds at any load; a policy that keeps too few
requests queued still shows as part-empty steps."""

from __future__ import annotations

import asyncio
import collections
import time

import pytest
from _batch_sim import simulate

from hsgen.client.saturate import RUNNING, WAITING, SaturationConfig, Saturator


class SimServer:
    """Runs steps of at most ``capacity`` queued requests, each step lasting ``step_s``."""

    def __init__(self, capacity: int, step_s: float):
        self.capacity = capacity
        self.step_s = step_s
        self.queue: collections.deque = collections.deque()
        self.running = 0
        self.steps: list[tuple[float, float, int]] = []  # (start, end, sequences) of each step
        self.idle: list[tuple[float, float]] = []  # (start, end) of each wait for work
        self.wake = asyncio.Event()

    async def run(self) -> None:
        while True:
            if not self.queue:
                self.wake.clear()
                t0 = time.monotonic()
                await self.wake.wait()
                self.idle.append((t0, time.monotonic()))
                continue
            batch = [self.queue.popleft() for _ in range(min(self.capacity, len(self.queue)))]
            self.running = len(batch)
            t0 = time.monotonic()
            await asyncio.sleep(self.step_s)
            self.running = 0
            self.steps.append((t0, time.monotonic(), len(batch)))
            for f in batch:
                f.set_result(None)

    async def request(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.queue.append(fut)
        self.wake.set()
        await fut

    async def metrics(self) -> dict[str, float]:
        return {WAITING: float(len(self.queue)), RUNNING: float(self.running)}

    def utilisation(self, since: float) -> float:
        """Share of capacity used from ``since`` on: sequences run over what full steps would have
        run, in the server's busy time plus its idle time (idle time counted in steps of the mean
        length the steps took); NaN (which fails any bound) when under 5 steps ran."""
        steps = [(a, b, n) for a, b, n in self.steps if a >= since]
        if len(steps) < 5:
            return float("nan")
        mean_step = sum(b - a for a, b, _ in steps) / len(steps)
        idle = sum(b - max(a, since) for a, b in self.idle if b > since)
        slots = len(steps) + idle / mean_step
        return sum(n for _, _, n in steps) / (self.capacity * slots)


async def drive(servers: dict[str, SimServer], sat: Saturator, seconds: float, overhead_s: float = 0.002):
    """Dispatch requests as the saturator allows, like the generate pipeline does."""
    tasks: set[asyncio.Task] = set()

    async def one(url: str) -> None:
        t0 = time.monotonic()
        await servers[url].request()
        await asyncio.sleep(overhead_s)  # response transfer + reading the file
        await sat.release(url, latency_s=time.monotonic() - t0, tokens=100, ok=True)

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        url = await sat.acquire()
        t = asyncio.create_task(one(url))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run_policy(
    capacity: int, step_s: float, config: SaturationConfig, with_metrics: bool, seconds: float
):
    server = SimServer(capacity, step_s)
    runner = asyncio.create_task(server.run())

    async def metrics(url):
        return await server.metrics() if with_metrics else None

    sat = Saturator(config, ["http://sim"], metrics)
    await sat.start()
    try:
        measure_from = time.monotonic() + seconds * 0.5
        await drive({"http://sim": server}, sat, seconds)
        return server.utilisation(measure_from), sat.controls["http://sim"]
    finally:
        await sat.stop()
        runner.cancel()


@pytest.mark.parametrize("capacity", [4, 48])
async def test_metrics_policy_saturates(capacity):
    frac, ctrl = await run_policy(capacity, 0.04, SaturationConfig(), True, 4.0)
    assert ctrl.mode == "metrics"
    assert frac >= 0.85, f"reached {frac:.2f} of capacity {capacity} (limit {ctrl.slots})"
    assert ctrl.slots <= 4 * capacity + 16, f"limit {ctrl.slots} floods a server of capacity {capacity}"


async def test_latency_policy_saturates_without_metrics():
    frac, ctrl = await run_policy(16, 0.04, SaturationConfig(), False, 4.0)
    assert ctrl.mode == "latency"
    assert frac >= 0.8, f"reached {frac:.2f} of capacity (limit {ctrl.slots})"
    assert ctrl.slots <= 6 * 16


async def test_metrics_unavailable_falls_back_to_latency():
    frac, ctrl = await run_policy(8, 0.03, SaturationConfig(poll_s=0.01), True, 0.1)
    server_down = Saturator(SaturationConfig(poll_s=0.01), ["http://x"], lambda url: asyncio.sleep(0, None))
    await server_down.start()
    await asyncio.sleep(0.2)
    await server_down.stop()
    assert server_down.controls["http://x"].mode == "latency"


async def test_fixed_concurrency_is_a_hard_limit():
    frac, ctrl = await run_policy(32, 0.03, SaturationConfig(concurrency=4), True, 1.0)
    assert ctrl.mode == "fixed" and ctrl.slots == 4
    assert frac < 0.2, "4 in flight cannot fill a 32-sequence server"


async def test_acquire_prefers_least_loaded_and_healthy():
    healthy = {"http://a": True, "http://b": True}
    sat = Saturator(SaturationConfig(concurrency=2), list(healthy), healthy=lambda u: healthy[u])
    got = [await sat.acquire() for _ in range(4)]
    assert sorted(got) == ["http://a", "http://a", "http://b", "http://b"]
    waiter = asyncio.create_task(sat.acquire())
    await asyncio.sleep(0.05)
    assert not waiter.done(), "no free slot: acquire waits"
    healthy["http://a"] = False
    await sat.release("http://a", latency_s=0.1, tokens=1, ok=True)
    await asyncio.sleep(0.05)
    assert not waiter.done(), "a free slot on an unhealthy server is not used"
    await sat.release("http://b", latency_s=0.1, tokens=1, ok=True)
    assert await asyncio.wait_for(waiter, 1) == "http://b"


# ---------------------------------------------------------------- deterministic simulation
# The same policy against a simulated batching server on a fake clock (tests/hsgen/_batch_sim.py):
# no wall clock, so the figures are exact on any machine at any load.


def _margin(capacity: int) -> float:
    cfg = SaturationConfig()
    return max(cfg.min_waiting, cfg.waiting_frac * capacity)


@pytest.mark.parametrize("stall_every", [0, 7], ids=["steady-client", "client-stalls"])
@pytest.mark.parametrize("capacity", [4, 16, 64, 256])
def test_default_policy_fills_every_step_without_flooding(capacity, stall_every):
    """The default keeps a C-sequence server's steps full at small and large C, also when the
    client stalls for 60% of a step every 7 steps, with at most four batches in flight at any
    time and about three once settled (the policy of 5ffa781 peaked at 8 C and settled at 5 C)."""
    step_s = capacity / 150
    r = simulate(capacity, step_s, seconds=60, measure_from=30, stall_every=stall_every, stall_s=0.6 * step_s)
    m = _margin(capacity)
    assert r.utilisation >= 0.97, f"steps {r.utilisation:.1%} full (limits {r.limits})"
    assert r.peak_limit <= 4 * capacity + 2 * m, f"limit peaked at {r.peak_limit} (limits {r.limits})"
    in_window = [limit for t, limit in r.limits if t >= 30] + [r.limit_at(30)]
    assert max(in_window) <= 3.5 * capacity + 2 * m, f"settled at {in_window} (limits {r.limits})"


def test_default_policy_raises_the_limit_for_a_slow_client():
    """Responses that take 1.8 steps to come back need more than three batches in flight: the
    starved steps raise the limit until they are full, and no further than four batches."""
    step_s = 64 / 150
    r = simulate(64, step_s, seconds=60, measure_from=30, return_s=1.8 * step_s)
    assert r.utilisation >= 0.97, f"steps {r.utilisation:.1%} full (limits {r.limits})"
    assert 3 * 64 < r.final_limit <= 4 * 64 + 2 * _margin(64), r.limits


def test_fixed_concurrency_stays_fixed_in_simulation():
    r = simulate(64, 64 / 150, SaturationConfig(concurrency=8), seconds=20, measure_from=10)
    assert r.peak_limit == r.final_limit == 8 and len(r.limits) == 1
    assert r.utilisation < 0.15, "8 in flight cannot fill 64-sequence steps"
