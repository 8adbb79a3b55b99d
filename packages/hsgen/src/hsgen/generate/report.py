"""What a ``generate`` run reports: the one-line summary, the failures file and the progress bar.

:class:`RunReport` is the only place that counts: the pipeline tells it what happened to each
prompt (skipped, fetched, failed) and :meth:`RunReport.finish` turns the counts into the
:class:`GenerateSummary` that ``hsgen generate`` prints and whose ``exit_code`` it exits with.
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_PARTIAL = 3
EXIT_INTERRUPTED = 130

NOT_FETCH_FAILURES = ("bad_input", "too_long", "store_mismatch", "duplicate_id")
"""Failure-file reasons that are not failed requests (they do not count in ``failed``)."""


@dataclass
class GenerateSummary:
    """What a run did; ``to_json`` is the one-line summary ``hsgen generate`` prints."""

    status: str = "ok"
    stored: int = 0
    already_done: int = 0
    other_rank: int = 0
    other_writer: int = 0
    duplicates: int = 0
    duplicate_conflicts: int = 0
    failed: int = 0
    bad_input: int = 0
    too_long: int = 0
    truncated: int = 0
    no_assistant_turn: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    gb_per_s: float = 0.0
    retries: int = 0
    orphans_removed: int = 0
    failure_reasons: dict[str, int] = field(default_factory=dict)
    first_failure: str | None = None
    """``<input file:line>: <sample id>: <reason>: <message>`` of the first failed request."""
    fatal: str | None = None
    store: str = ""
    failures_file: str | None = None
    endpoints: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per phase of the landing path, summed over threads (:mod:`hsgen.client.phases`)."""

    @property
    def exit_code(self) -> int:
        if self.fatal:
            return EXIT_FAILURE
        if self.status == "interrupted":
            return EXIT_INTERRUPTED
        if self.failed == 0:
            return EXIT_OK
        return EXIT_PARTIAL if self.stored + self.already_done > 0 else EXIT_FAILURE

    def to_json(self) -> str:
        """The summary as one JSON line, ``exit_code`` included."""
        d = asdict(self)
        d["exit_code"] = self.exit_code
        return json.dumps(d, sort_keys=False)


class FailureLog:
    """The JSONL failures file, opened on the first record and flushed after each."""

    def __init__(self, path: str | None):
        self.path = path
        self._f = None

    def check_writable(self) -> None:
        """Raise ``OSError`` (naming the file) now if the file cannot be appended to; creates nothing."""
        if self.path is None:
            return
        p = Path(self.path)
        existed = p.exists()
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a", encoding="utf-8"):
            pass
        if not existed:
            p.unlink(missing_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        if self._f is None:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run
        record = {"time": round(time.time(), 3), **record}
        try:
            self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._f.flush()
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.path) from None

    def close(self) -> None:
        if self._f is not None:
            f, self._f = self._f, None
            with contextlib.suppress(OSError):  # a full disk already reported at write
                f.close()


class Progress:
    """A tqdm bar on stderr (or nothing): prompts settled out of the input's total, with its ETA,
    then tokens/s, GB/s, in flight, errors."""

    def __init__(self, enabled: bool):
        self.bar = None
        self._last = 0.0
        if enabled:
            from hsgen.progress import progress_bar

            self.bar = progress_bar(unit="prompt", dynamic_ncols=True, smoothing=0.1, desc="generate")

    def set_total(self, total: int | None) -> None:
        """Show ``total`` (None: no total, no ETA) from now on."""
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def update(
        self, n: int, summary: GenerateSummary, t0: float, in_flight: int, force: bool = False
    ) -> None:
        if self.bar is None:
            return
        self.bar.update(n)
        now = time.monotonic()
        if force or now - self._last > 0.5:
            self._last = now
            dt = max(1e-9, now - t0)
            self.bar.set_postfix_str(
                f"{summary.tokens / dt:,.0f} tok/s, {summary.bytes / dt / 1e9:.3f} GB/s, "
                f"in flight {in_flight}, errors {summary.failed}",
                refresh=False,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RunReport:
    """Counts of one run, its failures file and its progress bar."""

    def __init__(self, failures_path: str | None, progress: bool):
        self.t0 = time.monotonic()
        self.summary = GenerateSummary(failures_file=failures_path)
        self.failures = FailureLog(failures_path)
        self.reasons: collections.Counter[str] = collections.Counter()
        self._bar = Progress(progress)
        self.count_passed = True
        """Whether prompts not requested (stored already, another rank's, skipped) advance the bar:
        they do when its total is the input's records, not when it is ``--max-samples``."""
        self.on_write_error: Callable[[OSError], None] | None = None

    def set_total(self, total: int | None) -> None:
        """The bar's total: the input's records (or the samples a ``--max-samples`` run requests)."""
        self._bar.set_total(total)

    def passed(self) -> None:
        """A prompt of the input that is not requested (stored already, another rank's, skipped)."""
        if self.count_passed:
            self._bar.update(1, self.summary, self.t0, 0)

    def record(self, sample_id: str | None, reason: str, message: str, **extra: Any) -> None:
        """Count ``reason`` and write a failures-file line for ``sample_id``.

        A failures file that cannot be written (disk full) goes to ``on_write_error`` once.
        """
        self.reasons[reason] += 1
        if reason not in NOT_FETCH_FAILURES and self.summary.first_failure is None:
            where = f"{extra['source']}: " if extra.get("source") else ""
            self.summary.first_failure = f"{where}{sample_id}: {reason}: {message}"
        try:
            self.failures.write({"sample_id": sample_id, "reason": reason, "error": message, **extra})
        except OSError as e:
            if self.on_write_error is None:
                raise
            self.failures.path = None
            self.on_write_error(e)

    def fetched(self, tokens: int, nbytes: int, attempts: int, in_flight: int) -> None:
        """A sample arrived validated (not yet durable)."""
        s = self.summary
        s.retries += attempts - 1
        s.tokens += tokens
        s.bytes += nbytes
        self._bar.update(1, s, self.t0, in_flight)

    def tick(self, in_flight: int, settled: bool = True) -> None:
        """A request ended without a sample: failed (``settled``: it advances the bar) or stopped."""
        self._bar.update(int(settled), self.summary, self.t0, in_flight)

    def finish(self, interrupted: bool) -> GenerateSummary:
        """Close the failures file and the bar; fill the summary's totals and status."""
        s = self.summary
        self.failures.close()
        self._bar.update(0, s, self.t0, 0, force=True)
        self._bar.close()
        s.failed = sum(v for k, v in self.reasons.items() if k not in NOT_FETCH_FAILURES)
        s.failure_reasons = dict(self.reasons)
        s.seconds = round(time.monotonic() - self.t0, 3)
        dt = max(s.seconds, 1e-9)
        s.samples_per_s = round(s.stored / dt, 2)
        s.tokens_per_s = round(s.tokens / dt, 1)
        s.gb_per_s = round(s.bytes / dt / 1e9, 4)
        if interrupted and not s.fatal:
            s.status = "interrupted"
        else:
            s.status = {EXIT_OK: "ok", EXIT_PARTIAL: "partial"}.get(s.exit_code, "failed")
        return s


def failures_line(s: GenerateSummary) -> str | None:
    """The one stderr line of a run whose requests failed (None when none did, or when a fatal
    error already said why): how many, by reason, the first one, and where the rest are listed."""
    if not s.failed or s.fatal:
        return None
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(s.failure_reasons.items(), key=lambda kv: -kv[1])
                        if r not in NOT_FETCH_FAILURES)  # fmt: skip
    where = f"; every one is listed in {s.failures_file}" if s.failures_file else ""
    return f"{s.failed} prompts failed ({reasons}); the first: {s.first_failure}{where}"


__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PARTIAL",
    "FailureLog",
    "GenerateSummary",
    "Progress",
    "RunReport",
]
