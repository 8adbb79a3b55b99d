"""Per-server state for the client: a circuit breaker and the counters ``stats()`` reports."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class CircuitBreaker:
    """Closed -> open after ``threshold`` consecutive failures -> one probe after ``cooldown``."""

    threshold: int
    cooldown_s: float
    failures: int = 0
    open_until: float = 0.0
    probing: bool = False
    opened: int = 0

    def state(self, now: float) -> str:
        """``closed`` (requests flow), ``open`` (cooling down) or ``half_open`` (one probe allowed)."""
        if self.failures < self.threshold:
            return "closed"
        return "open" if now < self.open_until or self.probing else "half_open"

    def allows(self, now: float) -> bool:
        """Whether a request may be sent to this server now."""
        return self.state(now) != "open"

    def on_start(self, now: float) -> None:
        """Record that a request starts; in the half-open state it becomes the probe."""
        if self.state(now) == "half_open":
            self.probing = True

    def on_success(self) -> None:
        """Record a success: the breaker closes."""
        self.failures = 0
        self.probing = False

    def on_failure(self, now: float) -> None:
        """Record a failure; at the threshold the breaker opens (cooldown doubles, at most 16x)."""
        self.failures += 1
        if self.failures >= self.threshold:
            doubling = min(self.failures - self.threshold, 4)
            self.open_until = now + self.cooldown_s * (2**doubling)
            if not self.probing:
                self.opened += 1
                log.warning("circuit breaker open (%d consecutive failures)", self.failures)
        self.probing = False


@dataclass
class Endpoint:
    """Live state of one server."""

    url: str
    breaker: CircuitBreaker
    model: str | None = None
    in_flight: int = 0
    completed: int = 0
    failed: int = 0
    tokens: int = 0
    bytes: int = 0
    latency_ewma_s: float = 0.0
    model_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


__all__ = ["CircuitBreaker", "Endpoint"]
