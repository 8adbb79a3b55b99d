"""Where a fetched sample lands: a shard of a store, or memory for one read into its batch.

By default each validated sample from the servers is added to the scratch store's writer (the
user's store with ``cache_generated``) on the I/O thread and committed with others as a shard
(file -> shard -> manifest, exactly as ``hsgen generate`` stores it), so the trainer reads only
committed samples and a restarted run finds the ones it fetched but did not train. With
``persist_fetched`` off (only with ``delete_consumed``), the sample is instead held in memory as
the client left it (its rows still in the server's file), read once straight into its batch, and
released when its step completes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from typing import Any

from spectrain.online.config import OnlineConfig
from spectrain.online.ledger import SampleLedger
from spectrain.online.metrics import OnlineMetrics
from spectrain.online.retention import Retention
from spectrain.online.stores import OnlineStores

log = logging.getLogger(__name__)


class HeaderProblem(ValueError):
    """Fetched hidden states that do not match the store header (fatal: a configuration error)."""


class Lander:
    """Commits fetched samples (see the module docstring)."""

    def __init__(self, config: OnlineConfig, stores: OnlineStores, ledger: SampleLedger, metrics: OnlineMetrics,
                 retention: Retention, io: Executor):  # fmt: skip
        self.config = config
        self.stores = stores
        self.ledger = ledger
        self.metrics = metrics
        self.retention = retention
        self.io = io
        # Deletion is per shard, so a shard that holds consumed samples next to unconsumed ones
        # keeps them all: shards small against the bound keep that overhang small.
        self.shard_bytes = config.shard_bytes or max(256 << 10, min(8 << 20, config.scratch_bytes // 8))

    async def land(self, sample_id: str, fetched: Any) -> None:
        """Check the sample against the header, then hold it or add it to a writer.

        Raises:
            HeaderProblem: the servers return other states than the store holds.
        """
        h = self.stores.header
        assert h is not None
        hs = fetched.hidden_states
        if (
            hs.ndim != 3
            or hs.shape[1] != h.num_layers
            or hs.shape[2] != h.hidden_size
            or fetched.dtype != h.dtype
        ):
            raise HeaderProblem(
                f"the server returned hidden states {tuple(hs.shape)} {fetched.dtype} for {sample_id!r}, but the "
                f"store holds [T, {h.num_layers}, {h.hidden_size}] {h.dtype} (layers {list(h.layer_ids)}): the "
                "servers run other extraction settings than the store was built with"
            )
        size = self.stores.bytes_for(int(hs.shape[0]))
        if self.config.reads_once:
            self.ledger.hold(sample_id, fetched, size)
            return
        await asyncio.get_running_loop().run_in_executor(self.io, self._add, sample_id, fetched, size)

    def _add(self, sample_id: str, fetched: Any, size: int) -> None:
        """Buffer one fetched sample in the writer (I/O thread); commit a shard once the buffer is full."""
        cache = self.config.cache_generated
        stores, ledger = self.stores, self.ledger
        writer = stores.main_writer if cache else stores.scratch_writer
        landed = False
        if cache:
            with stores.store_lock:
                stores.store.refresh()  # type: ignore[union-attr]
                landed = sample_id in stores.store  # type: ignore[operator]  # a concurrent hsgen generate landed it
        if not landed:  # writers and deletions all run on the I/O thread: no lock needed against them
            writer.add(sample_id, fetched.hidden_states, fetched.token_ids, fetched.loss_mask)
        with ledger.cond:
            ledger.inflight.pop(sample_id, None)
            ledger.buffered[sample_id] = size
            if ledger.buffered_since is None:
                ledger.buffered_since = time.monotonic()
            full = sum(ledger.buffered.values()) >= self.shard_bytes
        # Commit here, in the same I/O job: many fetches finishing together queue their adds
        # ahead of any flush job, which would then seal them all as one oversized shard.
        if full:
            try:
                self.flush_sync()
            except Exception as e:  # as a failing flush in the fetch loop: the store is unusable
                log.exception("committing a scratch shard failed")
                ledger.set_fatal(e)

    def should_flush(self) -> bool:
        """Whether the buffered samples should be committed now (someone waits, full, idle or old)."""
        ledger = self.ledger
        with ledger.lock:
            if not ledger.buffered:
                return False
            if any(w in ledger.buffered for w in ledger.waiting):
                return True
            if sum(ledger.buffered.values()) >= self.shard_bytes:
                return True
            if not ledger.inflight:
                return True
            return (
                ledger.buffered_since is not None
                and time.monotonic() - ledger.buffered_since >= self.config.flush_interval_s
            )

    async def flush(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.io, self.flush_sync)

    def flush_sync(self) -> None:
        """Commit the buffered samples as one shard (I/O thread) and mark them ready."""
        cache = self.config.cache_generated
        stores, ledger = self.stores, self.ledger
        writer = stores.main_writer if cache else stores.scratch_writer
        with ledger.lock:
            ids = list(ledger.buffered)
        if not ids:
            return
        records = writer.flush()  # the long part (the shard's bytes) holds no lock the trainer's reads need
        with stores.store_lock if cache else stores.scratch_lock:
            (stores.store if cache else stores.scratch).refresh()  # type: ignore[union-attr]
        with ledger.cond:
            for sid in ids:
                size = ledger.buffered.pop(sid, 0)
                ledger.ready[sid] = "store" if cache else "scratch"
                ledger.fresh.add(sid)
                if not cache:
                    ledger.sizes[sid] = size
            self.metrics.samples_generated += len(records)
            ledger.buffered_since = None
            ledger.cond.notify_all()
        if not cache:
            self.retention.update_scratch_usage(force=False)

    def close_writers(self) -> None:
        """Commit what is buffered and close the writers (I/O thread)."""
        for writer in (self.stores.scratch_writer, self.stores.main_writer):
            if writer is None:
                continue
            try:
                writer.close()
            except Exception as e:  # a failing flush at close loses only uncommitted (unconsumed) samples
                log.warning("closing a store writer failed: %s", e)
