"""What an online run deletes, and when: after the optimizer step, never before.

A generated shard goes once every sample in it was consumed (or is not in this epoch's plan, or
was skipped); a shard of the user's store only with ``delete_cached``, once its samples were
consumed. Deletions run on their own thread (removing a shard's files, which frees its pages,
costs as much as writing them), beside the I/O thread that commits: the store's lock orders
their manifest updates, and a pass deletes only shards whose samples were all consumed, which a
shard being committed never is.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor

from spectrain.online.config import OnlineConfig
from spectrain.online.ledger import SampleLedger
from spectrain.online.metrics import OnlineMetrics
from spectrain.online.scratch import dir_bytes
from spectrain.online.stores import OnlineStores

log = logging.getLogger(__name__)


class Retention:
    """Deletes consumed shards and tracks the scratch directory's size (see the module docstring)."""

    MEASURE_EVERY_S = 0.1
    """Least time between two walks of the scratch directory (a walk lists every file)."""

    def __init__(self, config: OnlineConfig, stores: OnlineStores, ledger: SampleLedger, metrics: OnlineMetrics,
                 executor: Executor):  # fmt: skip
        self.config = config
        self.stores = stores
        self.ledger = ledger
        self.metrics = metrics
        self.executor = executor
        """The thread deletions run on."""
        self._pending = False
        self._measured = 0.0

    @property
    def active(self) -> bool:
        """Whether anything is ever deleted during the run."""
        return self.config.delete_consumed or self.config.delete_cached

    def request(self) -> None:
        """Queue one deletion pass (at most one waits at a time)."""
        with self.ledger.lock:
            if self._pending or self.ledger.closed:
                return
            self._pending = True
        self.executor.submit(self._job)

    def run_now(self, closing: bool = False) -> None:
        """Run a deletion pass after any queued one, and wait for it."""
        self.executor.submit(self.delete_consumed_shards, closing).result()

    def _job(self) -> None:
        with self.ledger.lock:
            self._pending = False
        try:
            self.delete_consumed_shards()
        except Exception as e:
            log.exception("deleting consumed shards failed")
            self.ledger.set_fatal(e)

    def delete_consumed_shards(self, closing: bool = False) -> None:
        """Delete generated shards whose samples were all consumed (or are not in this epoch's plan).

        Samples before the position the epoch started at (a resume) count as consumed; samples
        the epoch skips count for generated shards only. ``closing`` applies it also without
        ``delete_consumed`` (temporary scratch at the end). Runs on the deletion thread.
        """
        ledger = self.ledger
        with ledger.lock:
            ep = ledger.epoch
            if ep is None:
                return
            done = set(ep.consumed)
            if ep.started:
                done.update(ep.ids[: ep.start_pos])
            unused = done | ep.skipped
            plan = ep.pos
        deleted: list[str] = []
        scratch = self.stores.scratch
        if (self.config.delete_consumed or closing) and scratch is not None:
            with self.stores.scratch_lock:
                scratch.refresh()
                for shard, ids in scratch.shards().items():
                    if ids and all(i in unused or i not in plan for i in ids):
                        scratch.delete_shard(shard)
                        deleted.extend(ids)
                        self.metrics.shards_deleted += 1
            with ledger.cond:
                for i in deleted:
                    ledger.sizes.pop(i, None)
                    if ledger.ready.get(i) == "scratch":
                        del ledger.ready[i]
            self.update_scratch_usage(force=bool(deleted))
        store = self.stores.store
        if self.config.delete_cached and not closing and store is not None:
            gone: list[str] = []
            with self.stores.store_lock:
                store.refresh()
                for shard, ids in store.shards().items():
                    if ids and all(i in done for i in ids):
                        log.info("deleting consumed shard %s of the offline store (--delete-cached)", shard)
                        store.delete_shard(shard)
                        gone.extend(ids)
                        self.metrics.shards_deleted += 1
            with ledger.cond:
                for i in gone:
                    if ledger.ready.get(i) == "store":
                        del ledger.ready[i]
        ledger.wake()

    def update_scratch_usage(self, force: bool = True) -> None:
        """Measure the scratch directory (the bound's overhead term and the peak metric); without
        ``force`` at most every :attr:`MEASURE_EVERY_S` (after each commit: the files committed
        meanwhile are counted exactly in the bound, only the overhead term waits)."""
        path = self.stores.scratch_path
        now = time.monotonic()
        if path is None or (not force and now - self._measured < self.MEASURE_EVERY_S):
            return
        self._measured = now
        used = dir_bytes(path)
        with self.ledger.lock:
            self.ledger.scratch_overhead = max(0, used - sum(self.ledger.sizes.values()))
            self.metrics.scratch_bytes = used
            self.metrics.scratch_peak_bytes = max(self.metrics.scratch_peak_bytes, used)
