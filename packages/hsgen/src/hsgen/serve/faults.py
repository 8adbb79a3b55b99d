"""Fault injection for the reference server: the ways a real vLLM deployment fails.

A :class:`FaultPlan` draws at most one fault per request, deterministically from its seed
and the order requests arrive. Kinds:

- ``http_500``: the request fails with HTTP 500 and vLLM's error body; no file.
- ``hang``: the handler sleeps ``hang_s`` before answering (past any sane client timeout).
- ``missing_file``: the response names a file that is never written (the lock is released).
- ``truncated_file``: the file is written, then cut to half its size.
- ``nan``: some hidden-state values are NaN.
- ``token_mismatch``: the file's ``token_ids`` differ from the prompt's.
- ``stale_lock``: the file is written but its ``.lock`` is never released (until shutdown).
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from dataclasses import dataclass, field

FAULT_KINDS = ("http_500", "hang", "missing_file", "truncated_file", "nan", "token_mismatch", "stale_lock")


@dataclass
class FaultPlan:
    """Which faults to inject and how often.

    Attributes:
        rates: fault kind -> probability per request (1.0 = every request).
        limits: fault kind -> the most times it is injected (absent = unlimited).
        seed: seed of the draw; the same plan and request order inject the same faults.
        hang_s: how long a ``hang`` lasts, seconds.
    """

    rates: dict[str, float] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)
    seed: int = 0
    hang_s: float = 3600.0
    injected: Counter = field(default_factory=Counter, init=False, repr=False)

    def __post_init__(self) -> None:
        for kind in (*self.rates, *self.limits):
            if kind not in FAULT_KINDS:
                raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
        for kind, rate in self.rates.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"fault {kind}: rate {rate} is not within 0..1")
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    def draw(self) -> str | None:
        """The fault for the next request, or None. Thread-safe."""
        with self._lock:
            chosen = None
            for kind in FAULT_KINDS:
                rate = self.rates.get(kind, 0.0)
                if rate <= 0.0:
                    continue
                hit = self._rng.random() < rate
                if chosen is None and hit and self.injected[kind] < self.limits.get(kind, 1 << 62):
                    chosen = kind
            if chosen is not None:
                self.injected[chosen] += 1
            return chosen

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        """Parse ``"http_500=0.1,hang=1.0:2,seed=3,hang_s=30"`` (``kind=rate[:limit]``)."""
        rates: dict[str, float] = {}
        limits: dict[str, int] = {}
        seed, hang_s = 0, 3600.0
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(
                    f"fault setting {part!r}: expected KIND=RATE[:LIMIT], seed=N or hang_s=SECONDS"
                )
            try:
                if key == "seed":
                    seed = int(value)
                elif key == "hang_s":
                    hang_s = float(value)
                else:
                    rate, _, limit = value.partition(":")
                    rates[key] = float(rate)
                    if limit:
                        limits[key] = int(limit)
            except ValueError:
                raise ValueError(f"fault setting {part!r}: {value!r} is not a number") from None
        return cls(rates=rates, limits=limits, seed=seed, hang_s=hang_s)

    def to_text(self) -> str:
        """The inverse of :meth:`parse` (without the injection counts)."""
        parts = []
        for kind, rate in self.rates.items():
            limit = self.limits.get(kind)
            parts.append(f"{kind}={rate}" + (f":{limit}" if limit is not None else ""))
        parts += [f"seed={self.seed}", f"hang_s={self.hang_s}"]
        return ",".join(parts)
