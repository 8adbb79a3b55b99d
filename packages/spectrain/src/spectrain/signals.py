"""Stop signals: SIGINT / SIGTERM end training after the current step, with a checkpoint."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)


class StopSignals:
    """SIGINT and SIGTERM ask training to stop after the current step and save a checkpoint.

    A second signal of the same kind acts as it would without this (SIGINT raises
    ``KeyboardInterrupt``, SIGTERM kills). Handlers are installed only from the main thread.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
            log.warning("%s: stopping after this step and saving a checkpoint (send it again to abort)",
                        signal.Signals(signum).name)  # fmt: skip
        signal.signal(signum, self._previous[signum])

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
