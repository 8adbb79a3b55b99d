"""Progress for long work: a tqdm bar on a terminal, periodic log lines elsewhere.

A bar redrawn with carriage returns is right on a terminal and wrong in a log file (kilobytes of
``\\r`` frames). :func:`progress_bar` therefore returns a tqdm bar when stderr is a terminal and a
:class:`LogProgress` otherwise, which logs one line (count, total, rate, ETA) every
``interval_s`` seconds and one at the end. ``--progress`` forces the bar, ``--no-progress``
silences both; every ``hsgen`` and ``spectrain`` command takes the two flags and calls
:func:`configure`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

log = logging.getLogger("hsgen.progress")

_forced: bool | None = None
LOG_INTERVAL_S = 30.0


def configure(progress: bool | None) -> None:
    """``True``: always a bar; ``False``: no progress output; ``None``: bar on a terminal, lines otherwise.

    Without a bar, the Hugging Face libraries' own bars (transformers' "Loading weights",
    datasets, downloads) are turned off too, through ``HF_HUB_DISABLE_PROGRESS_BARS`` (read when
    they are imported, which the commands do after this).
    """
    global _forced
    _forced = progress
    if mode() != "bar":
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def mode() -> str:
    """``"bar"``, ``"log"`` or ``"off"`` under the current configuration."""
    if _forced is not None:
        return "bar" if _forced else "off"
    return "bar" if sys.stderr.isatty() else "log"


class LogProgress:
    """The subset of tqdm's interface the code uses, reporting through ``logging`` now and then."""

    def __init__(self, iterable: Iterable | None = None, *, total: float | None = None, initial: float = 0,
                 desc: str = "", unit: str = "it", interval_s: float = LOG_INTERVAL_S, disable: bool = False,
                 **_: Any):  # fmt: skip
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total = total
        self.n = initial
        self.initial = initial
        self.desc = desc or "progress"
        self.unit = unit
        self.interval_s = interval_s
        self.disable = disable
        self.postfix = ""
        self.start = self.last = time.monotonic()
        self.closed = False

    def __iter__(self) -> Iterator:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def line(self) -> str:
        """``desc: n/total unit (pct), rate unit/s, ETA h:mm:ss, postfix``."""
        from tqdm import tqdm

        elapsed = time.monotonic() - self.start
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.desc}: {self.n:g}"]
        if self.total:
            parts[0] += f"/{self.total:g} {self.unit} ({100 * self.n / self.total:.0f}%)"
        else:
            parts[0] += f" {self.unit}"
        parts.append(f"{rate:.3g} {self.unit}/s")
        parts.append(f"elapsed {tqdm.format_interval(elapsed)}")
        if self.total and rate > 0:
            parts.append(f"ETA {tqdm.format_interval(max(0.0, (self.total - self.n) / rate))}")
        if self.postfix:
            parts.append(self.postfix)
        return ", ".join(parts)

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if not self.disable and now - self.last >= self.interval_s:
            self.last = now
            log.info("%s", self.line())

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = " ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or self.desc

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed and not self.disable and self.n > self.initial:
            log.info("%s", self.line())
        self.closed = True


def progress_bar(iterable: Iterable | None = None, *, disable: bool = False, **kwargs: Any):
    """A tqdm bar, a :class:`LogProgress` or a disabled tqdm, by :func:`mode` (``disable``: never show,
    e.g. on ranks other than 0)."""
    from tqdm import tqdm

    m = mode()
    if disable or m == "off":
        return tqdm(iterable, disable=True, **kwargs)
    if m == "bar":
        return tqdm(iterable, **kwargs)
    return LogProgress(
        iterable, **{k: v for k, v in kwargs.items() if k in ("total", "initial", "desc", "unit")}
    )
