"""Stop signals: SIGINT / SIGTERM end training after the current step, with a checkpoint."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

REPEAT_WINDOW_S = 5.0
"""A repeat of the stop signal this soon after the first is the same request delivered twice, not a
second one: a scheduler (SLURM, a terminal's Ctrl-C) signals every process of the job, and torchrun
forwards the signal it got to its workers as well, so a worker receives it twice within
milliseconds."""


class StopSignals:
    """SIGINT and SIGTERM ask training to stop after the current step and save a checkpoint.

    A second signal of the same kind, more than :data:`REPEAT_WINDOW_S` after the first, acts as it
    would without this (SIGINT raises ``KeyboardInterrupt``, SIGTERM kills); one sooner is the same
    request delivered twice and is ignored. Handlers are installed only from the main thread.
    """

    def __init__(self, repeat_window_s: float = REPEAT_WINDOW_S) -> None:
        self.signum: int | None = None
        self.repeat_window_s = repeat_window_s
        self._first: dict[int, float] = {}
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum = signum
            self._first[signum] = now
            log.warning("%s: stopping after this step and saving a checkpoint (send it again to abort)",
                        signal.Signals(signum).name)  # fmt: skip
            return
        if now - self._first.setdefault(signum, now) < self.repeat_window_s:
            return  # the same request delivered twice, or another kind while the stop is under way
        previous = self._previous.get(signum)
        previous = signal.SIG_DFL if previous is None else previous
        signal.signal(signum, previous)
        if callable(previous):
            previous(signum, frame)
        else:
            signal.raise_signal(signum)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
