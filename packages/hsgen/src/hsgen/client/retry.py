"""The client's retry policy, on tenacity: what is tried again, how often, after how long.

Only transient failures are retried: a :class:`~hsgen.client.errors.FetchError` marked ``transient``
(transport errors, timeouts, HTTP 408/429/5xx, a file missing, truncated or still locked after
the wait, a response that is not JSON). A :class:`~hsgen.client.errors.FatalError`, a permanent
``FetchError`` (HTTP 400, token mismatch, NaN states, an unsafe path) and any other exception
(a bug, a cancellation, :class:`~hsgen.client.errors.FetchStopped`) end the fetch at once.

The ``n``-th retry waits ``min(backoff_max_s, backoff_s * 2 ** (n - 1))`` times a uniform
factor in ``[0.5, 1.5)`` (jitter spreads the retries of prompts that failed together). After
``max_retries`` retries the last error is raised as it is, its ``attempts`` set.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential

from hsgen.client.errors import FatalError, FetchError

log = logging.getLogger(__name__)


def is_transient(error: BaseException) -> bool:
    """Whether another attempt may succeed where ``error`` ended this one."""
    return isinstance(error, FetchError) and error.transient and not isinstance(error, FatalError)


def backoff(backoff_s: float, backoff_max_s: float) -> Callable[[RetryCallState], float]:
    """tenacity ``wait``: exponential from ``backoff_s``, capped at ``backoff_max_s``, times 0.5-1.5."""
    exponential = wait_exponential(multiplier=backoff_s, max=backoff_max_s, exp_base=2)

    def wait(state: RetryCallState) -> float:
        return exponential(state) * (0.5 + random.random())

    return wait


def retrying(
    max_retries: int,
    backoff_s: float,
    backoff_max_s: float,
    *,
    sleep: Callable[[float], Awaitable[None]],
    label: str = "",
) -> AsyncRetrying:
    """The retry loop of one fetch: ``async for attempt in retrying(...): with attempt: ...``.

    Args:
        max_retries: attempts after the first (0 = none).
        backoff_s, backoff_max_s: first and longest delay (see the module docstring).
        sleep: awaited with each delay; it may raise to end the fetch (the client's stops early
            when told to stop sending requests).
        label: named in the log line of each retry (the prompt's id).
    """

    def before_sleep(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        log.info("retrying %s in %.2fs after %s", label, state.upcoming_sleep, error)

    return AsyncRetrying(
        retry=retry_if_exception(is_transient),
        stop=stop_after_attempt(max_retries + 1),
        wait=backoff(backoff_s, backoff_max_s),
        sleep=sleep,
        before_sleep=before_sleep,
        reraise=True,
    )


__all__ = ["backoff", "is_transient", "retrying"]
