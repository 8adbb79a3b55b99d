"""Where the landing path's time goes: seconds per phase, summed over the threads doing them.

``hsgen generate`` reports them in its summary (``phases``) and ``scripts/bench_generate.py``
accounts its ingest time with them (``docs/benchmarks.md``). Each phase is timed where it runs,
with two clock reads, so the accounting costs nothing next to the work it times.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimes:
    """Seconds per phase name; safe to add to from any thread."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self._seconds[phase] += seconds

    @contextmanager
    def time(self, phase: str) -> Iterator[None]:
        """Time the block as ``phase``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t0)

    def snapshot(self) -> dict[str, float]:
        """``{phase: seconds}``, rounded to the millisecond, largest first."""
        with self._lock:
            items = sorted(self._seconds.items(), key=lambda kv: -kv[1])
        return {k: round(v, 3) for k, v in items}


def timer(phases: PhaseTimes | None, phase: str):
    """``phases.time(phase)``, or a block that times nothing when there is no ``phases``."""
    return phases.time(phase) if phases is not None else _NOTHING


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_NOTHING = _Nothing()

__all__ = ["PhaseTimes", "timer"]
