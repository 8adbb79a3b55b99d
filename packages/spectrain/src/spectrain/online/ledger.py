"""Where each sample of an online run is, and what it costs against the scratch bound.

One :class:`SampleLedger` per source holds, under one lock, every sample's state for the active
epoch: *ready* (in the user's store, the scratch store, or held in memory), *in flight* (requested),
*buffered* (in a writer, not committed), *failed*, *consumed*, *skipped*; the bytes each holds; the
trainer's cursor and the samples it waits for. The fetcher asks it what to request next
(:meth:`SampleLedger.schedule`), the trainer's reads wait on its condition
(:meth:`SampleLedger.wait_located`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spectrain.online.config import OnlineConfig
from spectrain.online.logs import FailureLog
from spectrain.online.metrics import OnlineMetrics
from spectrain.online.stores import OnlineStores

log = logging.getLogger(__name__)


@dataclass
class EpochState:
    """The active epoch: its plan, where the trainer is in it, and what became of its samples."""

    epoch: int
    ids: list[str]
    pos: dict[str, int]
    started: bool = False
    start_pos: int = 0
    cursor: int = 0
    consumed: set[str] = field(default_factory=set)
    skipped: set[str] = field(default_factory=set)  # left untrained this epoch (see skipped())
    failed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, epoch: int, ids: Sequence[str]) -> EpochState:
        ids = list(ids)
        return cls(epoch, ids, {sid: i for i, sid in enumerate(ids)})


class SampleLedger:
    """The state of every sample (see the module docstring); ``lock`` guards all of it.

    Args:
        config: the run's settings (bound, window, modes).
        stores: the stores (a sample the user's store holds is ready there).
        metrics: the run's counters.
        failures: where unproducible samples are reported.
        source_of: prompt id -> where it came from, for failure reports.
    """

    def __init__(self, config: OnlineConfig, stores: OnlineStores, metrics: OnlineMetrics, failures: FailureLog,
                 source_of: Callable[[str], str]):  # fmt: skip
        self.config = config
        self.stores = stores
        self.metrics = metrics
        self.failures = failures
        self.source_of = source_of
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.epoch: EpochState | None = None
        self.ready: dict[str, str] = {}  # id -> "store" | "scratch" | "memory"
        self.sizes: dict[str, int] = {}  # committed scratch sample -> bytes
        self.held: dict[str, tuple[Any, int]] = {}  # id -> (fetched sample, bytes) read once from memory
        self.inflight: dict[str, int] = {}  # id -> reserved bytes
        self.buffered: dict[str, int] = {}  # id -> bytes, added to a writer, not committed
        self.buffered_since: float | None = None
        self.waiting: set[str] = set()
        self.fresh: set[str] = set()  # generated this epoch (not counted as read from a store)
        self.store_bad: set[str] = set()  # unreadable in the user's store: fetched instead
        self.scratch_overhead = 0
        self.fatal: BaseException | None = None
        self.closed = False
        self.last_consumed = time.monotonic()
        self.step_interval = 0.0
        self._warned_bound = False
        self.wake: Callable[[], None] = lambda: None
        """Wakes the fetch loop (set by the fetcher)."""

    # ------------------------------------------------------------------ run state

    def set_fatal(self, error: BaseException) -> None:
        """Stop the run: every waiting and later read raises ``error`` (no retry can fix it)."""
        with self.cond:
            self.fatal = error
            self.cond.notify_all()

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def fail(self, sample_id: str, reason: str) -> None:
        """The sample cannot be produced this epoch: report it (log, failures file) and skip it."""
        with self.cond:
            ep = self.epoch
            epoch = ep.epoch if ep is not None else -1
            if ep is not None:
                ep.failed[sample_id] = reason
            self.metrics.samples_failed += 1
            source = self.source_of(sample_id)
            log.warning("sample %r (%s) cannot be produced and is skipped: %s", sample_id, source, reason)
            self.failures.write(sample_id, source, epoch, reason)
            self.cond.notify_all()

    def begin_epoch(self, epoch: int, ids: Sequence[str]) -> bool:
        """Make ``epoch`` (planned as ``ids``) the active one; False if it already was."""
        with self.cond:
            if self.epoch is not None and self.epoch.epoch == epoch:
                return False
            if self.epoch is not None and self.epoch.started:
                self.fresh = set()
            self.epoch = EpochState.of(epoch, ids)
            return True

    # ------------------------------------------------------------------ trainer side

    def note_position(self, sample_id: str) -> bool:
        """The trainer asks for ``sample_id`` (caller holds the lock); True when that starts the epoch."""
        ep = self.epoch
        if ep is None:
            raise RuntimeError("OnlineSource.get called before plan(epoch)")
        started = False
        pos = ep.pos.get(sample_id)
        if pos is not None:
            if not ep.started:
                ep.started = started = True
                ep.start_pos = ep.cursor = pos
                if pos:
                    log.info("epoch %d resumes at plan position %d", ep.epoch, pos)
            ep.cursor = max(ep.cursor, pos)
        self.waiting.add(sample_id)
        self.wake()
        return started

    def wait_located(self, sample_id: str, t0: float) -> str | None:
        """Under the lock: wait until the sample is ready somewhere (its place), or failed (None)."""
        warned = False
        try:
            while True:
                if self.fatal is not None:
                    raise RuntimeError(f"online data source failed: {self.fatal}") from self.fatal
                ep = self.epoch
                if ep is not None and sample_id in ep.failed:
                    return None
                loc = self.ready.get(sample_id)
                if loc is None and sample_id not in self.inflight and sample_id not in self.buffered:
                    loc = self._main_has(sample_id)
                if loc is not None:
                    return loc
                if self.closed:
                    raise RuntimeError("OnlineSource is closed")
                self.cond.wait(0.5)
                if not warned and time.perf_counter() - t0 > 120:
                    warned = True
                    log.warning(
                        "still waiting for sample %r after 120 s (servers down or too slow?)", sample_id
                    )
        finally:
            self.waiting.discard(sample_id)

    def _main_has(self, sample_id: str) -> str | None:
        if sample_id not in self.store_bad and self.stores.in_main(sample_id):
            self.ready[sample_id] = "store"
            return "store"
        return None

    def unready(self, sample_id: str, loc: str) -> None:
        """A ready sample could not be read from ``loc``: forget it there, so it is fetched again."""
        with self.cond:
            if self.ready.get(sample_id) == loc:
                del self.ready[sample_id]
            if loc == "store":
                self.store_bad.add(sample_id)
            self.wake()

    def mark_consumed(self, sample_ids: Sequence[str]) -> tuple[int, int, list[int]]:
        """The samples' optimizer step completed; returns (epoch, its start position, their positions)."""
        with self.cond:
            ep = self.epoch
            for sid in sample_ids:
                if ep is not None:
                    ep.consumed.add(sid)
                self.metrics.samples_consumed += 1
                self.release_held(sid)
            now = time.monotonic()
            gap = now - self.last_consumed
            self.step_interval = gap if not self.step_interval else 0.8 * self.step_interval + 0.2 * gap
            self.last_consumed = now
            if ep is None:
                return -1, 0, []
            return ep.epoch, ep.start_pos, [ep.pos.get(i, -1) for i in sample_ids]

    def mark_skipped(self, sample_ids: Sequence[str]) -> None:
        """Planned samples this epoch leaves untrained (deletable like consumed ones when generated)."""
        with self.cond:
            if self.epoch is not None:
                self.epoch.skipped.update(sample_ids)
            for sid in sample_ids:
                self.release_held(sid)
            self.metrics.samples_skipped += len(sample_ids)

    def hold(self, sample_id: str, fetched: Any, size: int) -> None:
        """Keep a fetched sample in memory until its step completes (read once into its batch)."""
        with self.cond:
            self.inflight.pop(sample_id, None)
            self.held[sample_id] = (fetched, size)
            self.ready[sample_id] = "memory"
            self.fresh.add(sample_id)
            self.metrics.samples_generated += 1
            self.metrics.held_bytes += size
            self.metrics.held_peak_bytes = max(self.metrics.held_peak_bytes, self.metrics.held_bytes)
            self.cond.notify_all()

    def release_held(self, sample_id: str | None = None) -> None:
        """Drop a sample held in memory (None: all of them); caller holds the lock."""
        for sid in list(self.held) if sample_id is None else [sample_id]:
            entry = self.held.pop(sid, None)
            if entry is not None:
                self.metrics.held_bytes -= entry[1]
                close = getattr(entry[0].hidden_states, "close", None)
                if close is not None:  # rows left in the server's file: free its pages now
                    close()
                if self.ready.get(sid) == "memory":
                    del self.ready[sid]

    # ------------------------------------------------------------------ fetch side

    def window_missing(self) -> list[str]:
        """Ids in the prefetch window that are neither ready, in flight nor failed."""
        with self.lock:
            ep = self.epoch
            if ep is None or not ep.started:
                return []
            end = min(len(ep.ids), ep.cursor + self.config.prefetch_samples)
            waiting = [w for w in self.waiting if w not in ep.pos]
            return [sid for sid in waiting + ep.ids[ep.cursor : end] if self.is_missing(sid, ep)]

    def is_missing(self, sid: str, ep: EpochState) -> bool:
        """Whether the sample must be fetched (caller holds the lock); notes where it is otherwise."""
        if sid in self.ready or sid in self.inflight or sid in self.buffered or sid in ep.failed:
            return False
        if sid in ep.consumed or sid in ep.skipped:
            return False
        if sid not in self.store_bad and self.stores.in_main(sid):
            self.ready[sid] = "store"
            return False
        if sid in self.sizes:
            self.ready[sid] = "scratch"
            return False
        return True

    def in_use(self) -> int:
        """Bytes the scratch bound applies to (caller holds the lock)."""
        pending = sum(self.inflight.values()) + sum(self.buffered.values())
        if self.config.cache_generated:
            return pending
        if self.config.delete_consumed:
            held = sum(size for _, size in self.held.values())
            return pending + held + sum(self.sizes.values()) + self.scratch_overhead
        ep = self.epoch
        if ep is None:
            return pending
        ahead = sum(b for i, b in self.sizes.items() if ep.pos.get(i, -1) >= ep.cursor)
        return pending + ahead

    def schedule(
        self, rendered: dict[str, Any], bytes_for: Callable[[int], int]
    ) -> list[tuple[str, int, bool]]:
        """Pick the next samples to request, in plan order, within the window and the byte bound.

        Returns ``(sample id, reserved bytes, past the bound)`` for each; they are in flight now.
        """
        out: list[tuple[str, int, bool]] = []
        with self.lock:
            ep = self.epoch
            if ep is None or not ep.started:
                return out
            in_use = self.in_use()
            end = min(len(ep.ids), ep.cursor + self.config.prefetch_samples)
            waiting = [w for w in self.waiting if w not in ep.pos]
            for sid in waiting + ep.ids[ep.cursor : end]:
                if len(self.inflight) >= self.config.max_in_flight:
                    break
                if sid not in rendered or not self.is_missing(sid, ep):
                    continue
                est = bytes_for(len(rendered[sid].token_ids))
                over = in_use + est > self.config.scratch_bytes
                if over and self.config.cache_generated:
                    over = False
                if over and not self._stalled(sid):
                    break
                self.inflight[sid] = est
                in_use += est
                out.append((sid, est, over))
        return out

    def _stalled(self, sid: str) -> bool:
        """Whether only a fetch past the bound can unblock the trainer (caller holds the lock).

        True when the trainer waits for ``sid``, nothing is in flight or buffered, and no step
        completed for well over the usual step interval: the bound is smaller than the trainer's
        working set (its read-ahead plus one step), so refusing would deadlock.
        """
        if sid not in self.waiting or self.inflight or self.buffered:
            return False
        idle = time.monotonic() - self.last_consumed
        if idle < max(5.0, 5 * self.step_interval):
            return False
        if not self._warned_bound:
            self._warned_bound = True
            log.warning(
                "scratch bound %d bytes is smaller than the trainer's working set (read-ahead + one step): "
                "fetching past it to avoid a deadlock; raise --scratch-bytes",
                self.config.scratch_bytes,
            )
        return True

    def drop_inflight(self, sample_id: str) -> None:
        with self.cond:
            self.inflight.pop(sample_id, None)
            self.buffered.pop(sample_id, None)
