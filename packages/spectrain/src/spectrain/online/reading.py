"""The trainer's side of an online run: wait until a sample is ready, then read it from where it is.

``get`` returns a :class:`hsgen.store.Sample`; ``locate`` returns a
:class:`~spectrain.data.sample_reads.SampleRead` that the loader's reader threads run straight into the
packed batch: a store read (the user's store, checksum checked; the scratch store, checked unless
this run committed the sample itself) or a read of a fetched sample held for it (still in the
server's file, or mapped; finite values checked piece by piece as it is copied).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from hsgen.protocol.dtypes import all_finite
from hsgen.store import Sample, StoreError
from spectrain.data.sample_reads import ArrayRead, SampleRead, StoreRead
from spectrain.online.ledger import SampleLedger
from spectrain.online.metrics import OnlineMetrics
from spectrain.online.retention import Retention
from spectrain.online.stores import OnlineStores

log = logging.getLogger(__name__)


class SampleReader:
    """Blocking reads for the trainer (see the module docstring)."""

    def __init__(
        self, stores: OnlineStores, ledger: SampleLedger, retention: Retention, metrics: OnlineMetrics
    ):
        self.stores = stores
        self.ledger = ledger
        self.retention = retention
        self.metrics = metrics

    def get(self, sample_id: str) -> Sample | None:
        """The sample, blocking until it is ready; None when it cannot be produced (reported)."""
        return self._wait_then(sample_id, self._read)

    def locate(self, sample_id: str) -> SampleRead | None:
        """The sample's read, blocking until it is ready; None when it cannot be produced (reported)."""
        return self._wait_then(sample_id, self._locate)

    def _wait_then(self, sample_id: str, take):
        ledger = self.ledger
        t0 = time.perf_counter()
        waited = 0.0
        try:
            while True:
                with ledger.cond:
                    started = ledger.note_position(sample_id)
                    loc = ledger.wait_located(sample_id, t0)
                    waited = time.perf_counter() - t0
                if started and self.ledger.config.delete_consumed:
                    self.retention.request()
                if loc is None:
                    return None
                got = take(sample_id, loc)
                if got is not None:
                    self._count(sample_id, loc)
                    return got
        finally:
            total = time.perf_counter() - t0
            with ledger.lock:
                self.metrics.wait_seconds += waited
                self.metrics.get_seconds += total

    def _count(self, sample_id: str, loc: str) -> None:
        with self.ledger.lock:
            if sample_id not in self.ledger.fresh and loc != "memory":
                kind = "samples_from_cache" if loc == "store" else "samples_from_scratch"
                setattr(self.metrics, kind, getattr(self.metrics, kind) + 1)

    def _held(self, sample_id: str):
        """The fetched sample held in memory (KeyError when it is not held any more)."""
        with self.ledger.lock:
            entry = self.ledger.held.get(sample_id)
        if entry is None:
            raise KeyError(f"sample {sample_id!r} is no longer held")
        return entry[0]

    def _read(self, sample_id: str, loc: str) -> Sample | None:
        stores = self.stores
        try:
            if loc == "memory":
                fetched = self._held(sample_id)
                hidden = np.asarray(fetched.hidden_states)  # rows left in the file are read here
                if not all_finite(hidden, fetched.dtype):
                    self.ledger.fail(sample_id, "non_finite: hidden states contain NaN or Inf")
                    return None
                return Sample(sample_id, hidden, fetched.token_ids, fetched.loss_mask, fetched.dtype)
            if loc == "store":
                with stores.store_lock:
                    return stores.store.read(sample_id)  # type: ignore[union-attr]
            with stores.scratch_lock:
                if sample_id not in stores.scratch:  # type: ignore[operator]
                    stores.scratch.refresh()  # type: ignore[union-attr]
                return stores.scratch.read(sample_id)  # type: ignore[union-attr]
        except (KeyError, StoreError, OSError, ValueError) as e:
            log.warning("sample %r could not be read from the %s (%s): fetching it again", sample_id, loc, e)
            self.ledger.unready(sample_id, loc)
            return None

    def _locate(self, sample_id: str, loc: str) -> SampleRead | None:
        stores = self.stores
        try:
            if loc == "memory":
                fetched = self._held(sample_id)
                return ArrayRead.of(fetched, check_finite=True, origin=fetched.endpoint or "the server")
            if loc == "store":
                with stores.store_lock:
                    length = stores.store.record(sample_id).length  # type: ignore[union-attr]
                return StoreRead(stores.store, sample_id, length, verify=True)  # type: ignore[arg-type]
            with stores.scratch_lock:
                if sample_id not in stores.scratch:  # type: ignore[operator]
                    stores.scratch.refresh()  # type: ignore[union-attr]
                length = stores.scratch.record(sample_id).length  # type: ignore[union-attr]
            with self.ledger.lock:
                verify = sample_id not in self.ledger.fresh  # committed by an earlier epoch or run
            return StoreRead(stores.scratch, sample_id, length, verify=verify)  # type: ignore[arg-type]
        except (KeyError, StoreError, OSError) as e:
            log.warning("sample %r could not be read from the %s (%s): fetching it again", sample_id, loc, e)
            self.ledger.unready(sample_id, loc)
            return None

    def refused(self, sample_id: str, reason: str) -> None:
        """A located sample failed its check while read into its batch: report it as failed."""
        with self.ledger.lock:
            if self.ledger.ready.get(sample_id) == "store":
                self.ledger.store_bad.add(sample_id)
        self.ledger.fail(sample_id, reason)
