"""What the client retries and what it does not, how long it waits, and how a stop ends the waits.

The policy (``hsgen.client.retry``, on tenacity) is tested alone with scripted failures, then through
``HiddenStateClient`` against the fake vLLM (statuses, a dead endpoint, the breaker, a stop).
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from fake_vllm import FakeConfig, FakeVLLM
from hypothesis import given
from hypothesis import strategies as st

from hsgen.client import retry
from hsgen.client.errors import FetchStopped
from hsgen.client.fetch import ClientConfig, FatalError, FetchError, HiddenStateClient
from hsgen.inputs.render import RenderedPrompt

PROMPT = RenderedPrompt("s1", [5, 6, 7, 8], [0, 0, 1, 1])


def transient(reason: str = "transport") -> FetchError:
    return FetchError(reason, "x", transient=True)


def permanent(reason: str = "http_400") -> FetchError:
    return FetchError(reason, "x", transient=False)


async def run_policy(outcomes: list, max_retries: int = 3) -> tuple[object, int, list[float]]:
    """Run the policy over ``outcomes`` (exceptions are raised, values returned), one per attempt.

    Returns (result or raised exception, attempts made, delays slept).
    """
    slept: list[float] = []
    calls = 0

    async def sleep(s: float) -> None:
        slept.append(s)

    result: object = None
    try:
        async for trial in retry.retrying(max_retries, 0.5, 30.0, sleep=sleep, label="p"):
            with trial:
                calls += 1
                out = outcomes[calls - 1]
                if isinstance(out, BaseException):
                    raise out
                result = out
    except BaseException as e:  # noqa: BLE001 - the test looks at what came out
        result = e
    return result, calls, slept


@pytest.mark.parametrize(
    "error,retried",
    [
        (transient("transport"), True),
        (transient("timeout"), True),
        (transient("http_503"), True),
        (transient("missing_file"), True),
        (permanent("http_400"), False),
        (permanent("token_mismatch"), False),
        (FatalError("unauthorized", "bad key"), False),
        (FetchStopped(), False),
        (RuntimeError("a bug"), False),
        (asyncio.CancelledError(), False),
        (KeyboardInterrupt(), False),
    ],
)
async def test_only_transient_fetch_errors_are_retried(error, retried):
    result, calls, slept = await run_policy([error, "ok"])
    if retried:
        assert (result, calls, len(slept)) == ("ok", 2, 1)
    else:
        assert result is error, "the error itself comes out, not a wrapper"
        assert (calls, slept) == (1, [])


async def test_retries_stop_after_max_retries_with_the_last_error():
    errors = [transient(f"e{i}") for i in range(10)]
    result, calls, slept = await run_policy(errors, max_retries=2)
    assert result is errors[2] and calls == 3 and len(slept) == 2
    result, calls, slept = await run_policy(errors, max_retries=0)
    assert result is errors[0] and calls == 1 and slept == []


@given(
    backoff_s=st.floats(0.001, 5.0),
    backoff_max_s=st.floats(0.001, 60.0),
    attempt=st.integers(1, 40),
    u=st.floats(0.0, 0.999999),
)
def test_backoff_is_exponential_capped_with_half_to_one_and_a_half_jitter(
    backoff_s, backoff_max_s, attempt, u
):
    from unittest import mock

    from tenacity import RetryCallState

    state = RetryCallState(None, None, (), {})  # type: ignore[arg-type]
    state.attempt_number = attempt
    with mock.patch("hsgen.client.retry.random.random", return_value=u):
        delay = retry.backoff(backoff_s, backoff_max_s)(state)
    want = min(backoff_max_s, backoff_s * 2 ** (attempt - 1)) * (0.5 + u)
    assert delay == pytest.approx(want, rel=1e-12)


async def test_delays_double_per_retry(monkeypatch):
    monkeypatch.setattr("hsgen.client.retry.random.random", lambda: 0.5)
    _, calls, slept = await run_policy([transient()] * 8, max_retries=7)
    assert calls == 8
    assert slept == pytest.approx([0.5, 1, 2, 4, 8, 16, 30])  # 0.5 s doubling, capped at 30 s


# ------------------------------------------------------------------ through the client


def client_cfg(urls, shared, **kw) -> ClientConfig:
    base = dict(
        shared_dir=str(shared), file_wait_s=2.0, lock_timeout_s=1.0, settle_s=0.2, backoff_s=0.01,
        backoff_max_s=0.05, request_timeout_s=5.0, max_retries=2, breaker_threshold=100,
    )  # fmt: skip
    base.update(kw)
    return ClientConfig(endpoints=urls if isinstance(urls, list) else [urls], **base)


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(
    "status,retried", [(408, True), (429, True), (502, True), (503, True), (404, False), (422, False)]
)
async def test_http_statuses(tmp_path, status, retried):
    shared = tmp_path / "shm"
    fake = FakeVLLM(FakeConfig(str(shared), faults=[f"http_{status}"]))
    async with fake as url, HiddenStateClient(client_cfg(url, shared)) as c:
        if retried:
            s = await c.fetch(PROMPT)
            assert s.attempts == 2 and fake.requests == 2
        else:
            with pytest.raises(FetchError) as ei:
                await c.fetch(PROMPT)
            assert ei.value.reason == f"http_{status}" and not ei.value.transient
            assert ei.value.attempts == 1 and fake.requests == 1


async def test_401_is_fatal_at_once(tmp_path):
    shared = tmp_path / "shm"
    fake = FakeVLLM(FakeConfig(str(shared), faults=["http_401"] * 5))
    async with fake as url, HiddenStateClient(client_cfg(url, shared, max_retries=3)) as c:
        with pytest.raises(FatalError):
            await c.fetch(PROMPT)
    assert fake.requests == 1


async def test_a_dead_endpoint_is_retried_on_the_live_one(tmp_path):
    """A refused connection is transient; the breaker sends the retry to the other server."""
    shared = tmp_path / "shm"
    dead = dead_url()
    fake = FakeVLLM(FakeConfig(str(shared)))
    async with fake as live, HiddenStateClient(client_cfg([dead, live], shared, breaker_threshold=1)) as c:
        s = await c.fetch(PROMPT, endpoint=dead)
        stats = c.stats()
    assert s.endpoint == live and s.attempts == 2 and fake.requests == 1
    assert stats[dead]["failed"] == 1 and stats[dead]["breaker"] == "open"


async def test_a_bug_in_an_attempt_is_not_retried(tmp_path, monkeypatch):
    shared = tmp_path / "shm"
    fake = FakeVLLM(FakeConfig(str(shared)))
    async with fake as url, HiddenStateClient(client_cfg(url, shared)) as c:
        calls = 0

        async def broken(ep, prompt):
            nonlocal calls
            calls += 1
            raise ZeroDivisionError("bug")

        monkeypatch.setattr(c, "_fetch_once", broken)
        with pytest.raises(ZeroDivisionError):
            await c.fetch(PROMPT)
        assert calls == 1
        assert c.endpoints[url].in_flight == 0


async def test_stop_ends_a_backoff_at_once_but_not_a_request(tmp_path):
    shared = tmp_path / "shm"
    fake = FakeVLLM(FakeConfig(str(shared), faults=["http_500"] * 3, latency_s=0.3))
    async with fake as url:
        cfg = client_cfg(url, shared, backoff_s=60, backoff_max_s=60, max_retries=3)
        async with HiddenStateClient(cfg) as c:
            task = asyncio.create_task(c.fetch(PROMPT))
            await asyncio.sleep(0.2)  # the first attempt failed; a 30-90 s backoff started
            assert not task.done()
            t0 = time.monotonic()
            c.stop_retrying()
            with pytest.raises(FetchStopped):
                await task
            assert time.monotonic() - t0 < 20  # not the 30-90 s backoff (slack for a loaded machine)
            assert fake.requests == 1
        fake.cfg.faults = []
        async with HiddenStateClient(client_cfg(url, shared)) as c:
            task = asyncio.create_task(c.fetch(PROMPT))
            await asyncio.sleep(0.1)  # the request is on the server (0.3 s)
            c.stop_retrying()
            s = await task
            assert s.attempts == 1, "a request already sent finishes"
    assert fake.requests == 2


async def test_stop_ends_a_wait_for_an_open_breaker(tmp_path):
    shared = tmp_path / "shm"
    dead = dead_url()
    cfg = client_cfg(dead, shared, breaker_threshold=1, breaker_cooldown_s=60, max_retries=5, max_down_s=0)
    async with HiddenStateClient(cfg) as c:
        task = asyncio.create_task(c.fetch(PROMPT))
        await asyncio.sleep(0.3)  # refused once; the breaker is open for 60 s
        assert c.stats()[dead]["breaker"] == "open" and not task.done()
        t0 = time.monotonic()
        c.stop_retrying()
        with pytest.raises(FetchStopped):
            await task
        assert time.monotonic() - t0 < 20  # not the 60 s cooldown (slack for a loaded machine)
